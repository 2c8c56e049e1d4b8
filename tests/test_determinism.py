"""Determinism: two identical runs give bitwise identical losses and gradients.

Covers ``gist_loss`` on both backends (Triton under the interpreter without CUDA) and a full
``FusedCachedGISTLoss`` forward and backward on a tiny student with dropout on, guided by another tiny model
(a small guide dimension keeps the Triton interpreter quick).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import DEVICE, make_inputs, one_thread, precision, shape_id  # noqa: F401  (one_thread: autouse)

import cgist

BACKENDS = ["torch", "triton"]


def _check(run: Callable[[int], list[torch.Tensor]]) -> None:
    """``run(seed)`` twice with one seed returns bitwise equal tensors; another seed changes them (not vacuous)."""
    first, second, other = run(0), run(0), run(1)
    assert len(first) == len(second) and first, "nothing to compare"
    for i, (a, b) in enumerate(zip(first, second)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"output {i} differs between two identical runs: max |diff| {(a - b).abs().max()}"
    assert any(not torch.equal(a, c) for a, c in zip(first, other)), "a different seed gave the same outputs"


GIST_CASES = [(13, 2, 40, 24, 2, torch.float32), (13, 2, 40, 24, 2, torch.float64), (5, 3, 7, 11, 0, torch.float32)]


def _gist_case_id(case: tuple) -> str:
    batch, world, dim, guide_dim, k, dtype = case
    return f"{shape_id(batch, batch * world, dim, guide_dim, k)}-{precision(dtype)}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch, world, dim, guide_dim, k, dtype", GIST_CASES, ids=[_gist_case_id(c) for c in GIST_CASES])
def test_gist_loss_is_bitwise_deterministic(backend, batch, world, dim, guide_dim, k, dtype):
    def run(seed: int) -> list[torch.Tensor]:
        student, guide = make_inputs(batch, batch * world, dim, guide_dim, k, dtype, seed)
        student = [s.to(DEVICE).requires_grad_() for s in student]
        guide = [g.to(DEVICE) for g in guide]
        loss = cgist.gist_loss(student, guide, margin=0.05, offset=batch, backend=backend)
        return [loss.detach(), *torch.autograd.grad(loss, student)]

    _check(run)


KERNEL_VARIANTS = {
    "gemm-backward-chunked": dict(block_bytes=1100),  # 16-row chunks against 16-column chunks
    "matryoshka": dict(matryoshka_dims=(40, 24, 9), matryoshka_weights=(1.0, 0.5, 2.0), block_bytes=5000),
}


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_kernel_backwards_are_bitwise_deterministic(variant):
    """The Triton launcher's backward (GEMM over several chunks; Matryoshka segments) and counters."""
    from cgist.stage.triton.dense import gist_backward, gist_forward

    options = cgist.GistOptions(margin=0.05, offset=13, **KERNEL_VARIANTS[variant])

    def run(seed: int) -> list[torch.Tensor]:
        student, guide = make_inputs(13, 26, 40, 24, 1, torch.float32, seed)
        loss, state = gist_forward([s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide], options,
                                   need_stats=True)
        return [loss, *state.counters(), *gist_backward(state)]

    _check(run)


@pytest.fixture(scope="module")
def models(student32, tmp_path_factory):
    """(student, guide): this module's float32 student in training mode (dropout on), and a tiny guide of another
    width (48) than the student's."""
    from helpers_models import tiny_model

    guide = tiny_model(tmp_path_factory.mktemp("guide"), dtype=torch.float32, hidden_size=48, seed=1)
    return student32.train(), guide


TEXTS = [
    ["a cat sits on the mat", "the stock market fell", "rain is expected tomorrow", "a cat sits on the mat",
     "he plays the violin", "bread needs yeast", "the train was late"],
    ["a kitten rests on a rug", "shares dropped sharply", "showers are forecast", "a kitten rests on a rug",
     "she plays the cello", "dough rises with yeast", "the bus was delayed"],
    ["a dog runs in the park", "bonds rallied", "it will be sunny", "fish swim in the sea",
     "he sings in a choir", "cakes need sugar", "the plane was early"],
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_loss_forward_backward_is_bitwise_deterministic(models, backend):
    """Dropout on, uneven mini-batches (7 rows in 3s), a duplicated pair: same seed, same bits."""
    student, guide = models
    loss_fn = cgist.FusedCachedGISTLoss(student, guide, mini_batch_size=3, margin=0.05, backend=backend)

    def run(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        student.zero_grad(set_to_none=True)
        features = [student.tokenize(column) for column in TEXTS]
        loss = loss_fn(features, labels=None)
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in student.parameters() if p.grad is not None)]

    _check(run)
