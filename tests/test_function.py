"""``gist_loss`` as an autograd Function: gradcheck, grad_output scaling, no_grad, dispatch."""

from __future__ import annotations

import pytest
import torch

import cgist
from cgist import function, streaming
from cgist.reference import gist_loss_reference


def make_inputs(B, N, D, Dg, k, dtype=torch.float64, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    rows = [B] + [N] * (k + 1)
    student = [torch.randn(r, D, generator=gen, dtype=dtype).requires_grad_(requires_grad) for r in rows]
    guide = [torch.randn(r, Dg, generator=gen, dtype=dtype) for r in rows]
    return student, guide


def _check(B, W, D, Dg, k, **options):
    """gradcheck of gist_loss in float64 on every student column, for each rank's offset."""
    student, guide = make_inputs(B, B * W, D, Dg, k, seed=B + D + k)
    for rank in range(W):
        opts = {"temperature": 0.5, **options, "offset": rank * B, "backend": "torch"}
        assert torch.autograd.gradcheck(lambda *s: cgist.gist_loss(list(s), guide, **opts), tuple(student))


@pytest.mark.parametrize(
    "B,W,D,Dg,k,options",
    [
        (3, 1, 5, 4, 0, {}),
        (3, 2, 5, 7, 1, {"margin": 0.1}),
        (4, 2, 3, 3, 2, {"margin": 0.2, "margin_strategy": "relative", "contrast_anchors": False}),
        (2, 3, 6, 5, 1, {"margin": -0.3, "contrast_positives": False}),
    ],
    ids=["B3-N3-D5-k0", "B3-N6-D5-k1-m0.1", "B4-N8-D3-k2-rel-noAA", "B2-N6-D6-k1-mneg-noPP"],
)
def test_gradcheck(B, W, D, Dg, k, options):
    _check(B, W, D, Dg, k, **options)


def test_backward_scales_by_grad_output():
    student, guide = make_inputs(7, 14, 9, 6, 1, seed=1)
    loss = cgist.gist_loss(student, guide, offset=7, margin=0.05)
    upstream = torch.tensor(-2.75, dtype=torch.float64)
    grads = torch.autograd.grad(loss, student, grad_outputs=upstream)
    expected = torch.autograd.grad(gist_loss_reference(student, guide, offset=7, margin=0.05) * upstream, student)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_loss_in_a_larger_graph():
    """The loss composes with other autograd ops in one backward."""
    student, guide = make_inputs(5, 5, 8, 8, 1, seed=2)
    total = 3.0 * cgist.gist_loss(student, guide) + (student[0] ** 2).sum()
    total.backward()
    leaves = [s.detach().clone().requires_grad_() for s in student]
    (3.0 * gist_loss_reference(leaves, guide) + (leaves[0] ** 2).sum()).backward()
    for s, leaf in zip(student, leaves):
        torch.testing.assert_close(s.grad, leaf.grad, rtol=1e-12, atol=1e-12)


def test_no_grad_computes_only_the_loss(monkeypatch):
    student, guide = make_inputs(6, 6, 8, 5, 0, seed=3)
    calls = []
    real = streaming.gist_loss_and_grads

    def spy(*args, need_grads, **kwargs):
        calls.append(need_grads)
        return real(*args, need_grads=need_grads, **kwargs)

    monkeypatch.setattr(streaming, "gist_loss_and_grads", spy)
    with torch.no_grad():
        loss = cgist.gist_loss(student, guide)
    assert calls == [False] and not loss.requires_grad
    torch.testing.assert_close(loss, gist_loss_reference(student, guide).detach(), rtol=1e-12, atol=1e-12)
    loss = cgist.gist_loss([s.detach() for s in student], guide)  # nothing requires grad
    assert calls == [False, False] and not loss.requires_grad


def test_guide_gets_no_gradient():
    student, guide = make_inputs(4, 8, 6, 6, 1, seed=4)
    guide = [g.requires_grad_() for g in guide]
    cgist.gist_loss(student, guide, offset=4).backward()
    assert all(g.grad is None for g in guide)
    assert all(s.grad is not None and torch.isfinite(s.grad).all() for s in student)


def test_partial_requires_grad():
    """Only the columns that require grad receive one."""
    student, guide = make_inputs(4, 4, 6, 6, 1, seed=5, requires_grad=False)
    student[1].requires_grad_()
    cgist.gist_loss(student, guide).backward()
    assert student[0].grad is None and student[2].grad is None
    leaves = [s.detach().clone().requires_grad_() for s in student]
    gist_loss_reference(leaves, guide).backward()
    torch.testing.assert_close(student[1].grad, leaves[1].grad, rtol=1e-12, atol=1e-12)


def test_auto_backend_on_cpu_is_streaming():
    assert function.select_backend("auto", torch.device("cpu")) is streaming.gist_loss_and_grads


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    student, guide = make_inputs(4, 4, 6, 6, 0, seed=6)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        cgist.gist_loss(student, guide, backend="triton")
