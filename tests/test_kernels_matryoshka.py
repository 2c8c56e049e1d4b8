"""The Triton backend with Matryoshka dimensions: parity with the oracle applied per dimension, gradcheck, determinism.

The loss is ``sum_d w_d * L_d`` where ``L_d`` scores the student embeddings truncated to their first d
components and the guide is untouched. The kernels compute every dimension in one forward (the guide
tile and mask once) and one GEMM backward (one operand per segment between consecutive dimensions).
Runs under the Triton interpreter without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, DTYPES, Tol, assert_close, make_inputs, one_thread, shape_id, tolerance  # noqa: F401

import cgist
from cgist import GistOptions
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.reference import gist_loss_reference


def matryoshka_reference(student, guide, options: GistOptions) -> torch.Tensor:
    """``sum_d w_d * gist_loss_reference(student[:, :d], guide)``, differentiable by autograd."""
    single = options.replace(matryoshka_dims=None, matryoshka_weights=None)
    return sum(w * gist_loss_reference([x[:, :d] for x in student], guide, single) for d, w in options.dims(0))


CASES = [
    # (batch, n_cand, dim, dim_g, k, precision, dims, weights, options)
    (13, 26, 40, 24, 1, "fp64", (40, 24, 9), (1.0, 0.5, 2.0), dict(offset=13, margin=0.1)),
    (13, 39, 40, 24, 2, "fp64", (17, 33), (1.0, -0.5), dict(offset=20, margin=0.0, block_bytes=9000)),
    (13, 26, 40, 24, 1, "fp64", (24,), (1.5,), dict(offset=5, margin=0.1)),  # one dimension, below D
    (21, 42, 40, 24, 1, "fp64", (32, 16, 8, 4), None, dict(offset=17, margin=3.0, contrast_anchors=False)),
    (13, 26, 40, 24, 1, "fp64", (40, 20), (0.0, 1.0), dict(offset=11, margin=-2.5, margin_strategy="relative",
                                                           contrast_positives=False)),
    (13, 26, 40, 24, 1, "fp32", (40, 24, 9), (1.0, 0.5, 2.0), dict(offset=13, margin=0.1)),
]


def _case_id(case) -> str:
    batch, n_cand, dim, dim_g, k, precision, dims, weights, kw = case
    extra = "".join(f"-{key}{value}" for key, value in kw.items())
    return f"{shape_id(batch, n_cand, dim, dim_g, k)}-{precision}-dims{'.'.join(map(str, dims))}{extra}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_per_dimension_oracle(case):
    batch, n_cand, dim, dim_g, k, precision, dims, weights, kw = case
    dtype = DTYPES[precision]
    options = GistOptions(temperature=0.05, matryoshka_dims=dims, matryoshka_weights=weights, **kw)
    student, guide = make_inputs(batch, n_cand, dim, dim_g, k, dtype, seed=2)
    leaves = [x.double().requires_grad_() for x in student]
    want = matryoshka_reference(leaves, [g.double() for g in guide], options)
    want.backward()

    runs = [loss_and_grads("triton", [x.to(DEVICE) for x in student], [g.to(DEVICE) for g in guide], options,
                           need_grads=True) for _ in range(2)]
    (loss, grads, _), (loss2, grads2, _) = runs
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2)), "not deterministic"
    loss_tol, grad_tol = tolerance("triton", precision)
    loss_tol = Tol(loss_tol.rtol, loss_tol.atol * max(1.0, float(want.detach().abs())))  # the loss sums the dimensions'
    assert_close("triton", (want, [leaf.grad for leaf in leaves]), (loss, grads), (loss_tol, grad_tol))
    for got, leaf in zip(grads, leaves):
        assert got.dtype == dtype and got.shape == leaf.shape
        if max(dims) < dim:
            assert not got[:, max(dims):].any(), "components past the largest dimension get no gradient"


def test_gradcheck_through_gist_loss():
    student, guide = make_inputs(3, 5, 7, 5, 1, seed=1)
    leaves = [x.to(DEVICE).requires_grad_() for x in student]
    guide = [g.to(DEVICE) for g in guide]

    def loss(*xs):
        return cgist.gist_loss(list(xs), guide, temperature=0.5, margin=0.05, offset=2, matryoshka_dims=(7, 4, 2),
                               matryoshka_weights=(1.0, 0.7, 0.3), backend="triton")

    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-7, fast_mode=True)


def test_statistics_do_not_depend_on_the_dimensions():
    """The guide mask is the same for every dimension: the counters equal those without Matryoshka."""
    student, guide = make_inputs(13, 26, 40, 24, 1, torch.float64, seed=3)
    options = GistOptions(temperature=0.05, margin=0.1, offset=5)
    nested = options.replace(matryoshka_dims=(40, 16, 8))
    plain = loss_and_grads("triton", student, guide, options, need_grads=False, need_stats=True)[2]
    counters = loss_and_grads("triton", student, guide, nested, need_grads=False, need_stats=True)[2]
    assert all(torch.equal(a, b) for a, b in zip(plain, counters)) and plain[0][:4].sum() > 0
