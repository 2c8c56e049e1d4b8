"""The PyTorch streaming path against the dense float64 oracle."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cgist.reference import gist_loss_reference, gist_scores
from cgist.streaming import gist_loss_and_grads

# (loss, gradient) tolerances keyed by the input dtype; the oracle always runs in float64.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-4, 2e-4),
    # Half inputs are upcast and accumulated in float32, so the float32 loss meets the float32
    # tolerance; the gradients come back rounded to the input dtype (2 units of its rounding).
    torch.bfloat16: (2e-4, 2 * 2.0**-9),
    torch.float16: (2e-4, 2 * 2.0**-12),
}
OPTIONS = dict(temperature=0.01, margin=0.0, margin_strategy="absolute", contrast_anchors=True, contrast_positives=True)


def make_inputs(B, N, D, Dg, k, dtype=torch.float64, seed=0):
    """Random student columns [anchor, positive, *negatives] and guide columns of the same rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = [B] + [N] * (k + 1)
    student = [torch.randn(r, D, generator=gen, dtype=torch.float64).to(dtype) for r in rows]
    guide = [torch.randn(r, Dg, generator=gen, dtype=torch.float64).to(dtype) for r in rows]
    return student, guide


def _check(student, guide, block_bytes=None, **options):
    """Streaming loss and gradients equal the float64 oracle's on the same (upcast) inputs."""
    opts = {**OPTIONS, **options}
    offset = opts.pop("offset", 0)
    extra = {} if block_bytes is None else {"block_bytes": block_bytes}
    loss, grads = gist_loss_and_grads(student, guide, offset=offset, need_grads=True, **opts, **extra)

    leaves = [s.detach().double().requires_grad_() for s in student]
    expected = gist_loss_reference(leaves, [g.double() for g in guide], offset=offset, **opts)
    expected_grads = torch.autograd.grad(expected, leaves)

    loss_tol, grad_tol = TOL[student[0].dtype]
    assert loss.dtype == (torch.float64 if student[0].dtype == torch.float64 else torch.float32)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=loss_tol, atol=loss_tol)
    for got, want, s in zip(grads, expected_grads, student):
        assert got.dtype == s.dtype and got.shape == s.shape
        scale = want.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(got.double() / scale, want / scale, rtol=grad_tol, atol=grad_tol)
    # The no-grad call returns the same loss and no gradients.
    loss_only, none = gist_loss_and_grads(student, guide, offset=offset, need_grads=False, **opts, **extra)
    assert none is None and torch.equal(loss_only, loss)
    return expected


SHAPES = [  # B, world size (N = B * W), D, Dg, k
    (13, 1, 40, 24, 0),
    (13, 2, 40, 24, 2),
    (7, 3, 33, 65, 1),
    (1, 1, 8, 8, 1),
    (32, 1, 64, 16, 3),
]
OPTION_SETS = {
    "default": {},
    "abs-m0.1": dict(margin=0.1),
    "abs-m-0.2": dict(margin=-0.2),
    "rel-m0.3": dict(margin=0.3, margin_strategy="relative"),
    "rel-m-0.1": dict(margin=-0.1, margin_strategy="relative"),
    "noAA": dict(contrast_anchors=False, margin=0.05),
    "noPP": dict(contrast_positives=False, margin=0.05),
    "AP-only": dict(contrast_anchors=False, contrast_positives=False),
    "tau0.5": dict(temperature=0.5, margin=0.02),
}


def shape_id(shape):
    B, W, D, Dg, k = shape
    return f"B{B}-N{B * W}-D{D}-Dg{Dg}-k{k}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_matches_oracle(shape, name, dtype):
    B, W, D, Dg, k = shape
    student, guide = make_inputs(B, B * W, D, Dg, k, dtype=dtype, seed=B * 31 + k)
    for rank in range(W):
        _check(student, guide, offset=rank * B, **OPTION_SETS[name])


@pytest.mark.parametrize("offset", [0, 5, 19], ids=lambda o: f"offset{o}")
def test_any_offset_and_tiny_budget(offset):
    """Offsets that are not a multiple of B, and a 1-byte budget that forces one row per block."""
    student, guide = make_inputs(11, 30, 20, 12, 1, seed=offset)
    _check(student, guide, block_bytes=1, offset=offset, margin=0.05)
    _check(student, guide, block_bytes=3000, offset=offset, margin=0.05, margin_strategy="relative")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_duplicate_of_positive_is_a_tie_not_masked(dtype):
    """A candidate whose guide vector equals the positive's compares equal to theta, so m=0 keeps it."""
    B, N, offset = 6, 12, 6
    student, guide = make_inputs(B, N, 16, 10, 1, dtype=dtype, seed=3)
    dup_cols = torch.arange(B)  # candidate j = i duplicates positive offset + i, in the guide and student
    guide[1][dup_cols] = guide[1][offset + dup_cols]
    student[1][dup_cols] = student[1][offset + dup_cols]
    guide[2][dup_cols] = guide[1][offset + dup_cols]  # and the negatives hold the same guide vectors
    expected = _check(student, guide, offset=offset)
    scores = gist_scores([s.double() for s in student], [g.double() for g in guide], offset=offset)
    rows = torch.arange(B)
    assert torch.isfinite(scores[rows, dup_cols]).all(), "duplicate of the positive was masked at m=0"
    negatives = 2 * N + B  # column of AN_1[., 0], after AP, AA and PP
    assert torch.isfinite(scores[rows, negatives + dup_cols]).all(), "duplicate among the negatives was masked"
    assert torch.isfinite(expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_ties_across_blocks_of_many_shapes(dtype):
    """Duplicates of the positive in every block, on shapes where matrix products of different shapes
    round the same pair differently: the tie must hold regardless (it is decided by identity)."""
    for seed, (B, W, D) in enumerate([(13, 2, 384), (64, 2, 384), (7, 3, 33), (100, 3, 1024)]):
        N = B * W
        student, guide = make_inputs(B, N, 8, D, 1, dtype=dtype, seed=seed)
        offset = N - B
        rows = torch.arange(B)
        guide[2][rows] = guide[1][offset + rows]  # AN: negative i is a copy of positive o + i
        guide[0][(rows + 1) % B] = guide[1][offset + rows]  # AA: anchor i + 1 is a copy of positive o + i
        scores = gist_scores(student, guide, offset=offset)
        kept = torch.isfinite(scores)
        assert kept[rows, 2 * N + B + rows].all() and kept[rows, N + (rows + 1) % B].all()
        _check(student, guide, offset=offset)
        # Positive margins mask them again, exactly like the positive would be if it were not protected.
        masked = gist_scores(student, guide, offset=offset, margin=1e-3)
        assert not torch.isfinite(masked[rows, 2 * N + B + rows]).any()


def test_negative_margin_keeps_self_pairs():
    """With m = -2.5 every T_i >= 1.5 exceeds the guide self-similarity (1), so AA[i,i] and PP[i,o+i] stay in the softmax."""
    B, N, offset = 5, 10, 5
    student, guide = make_inputs(B, N, 12, 12, 0, seed=4)
    _check(student, guide, offset=offset, margin=-2.5)
    scores = gist_scores(student, guide, offset=offset, margin=-2.5)
    rows = torch.arange(B)
    assert torch.isfinite(scores[rows, N + rows]).all()  # AA diagonal
    assert torch.isfinite(scores[rows, N + B + offset + rows]).all()  # PP at o + i


@pytest.mark.parametrize("strategy,margin", [("absolute", 3.0), ("relative", 5.0)])
def test_everything_masked_but_the_positive(strategy, margin):
    """Every row keeps only its label: the loss is exactly 0 and so are the gradients, with no NaN."""
    student, guide = make_inputs(9, 18, 14, 10, 2, seed=5)
    for g in guide:  # positive guide scores, so the relative threshold -4*theta is below them too
        g.abs_()
    loss, grads = gist_loss_and_grads(
        student, guide, **{**OPTIONS, "margin": margin, "margin_strategy": strategy}, offset=9, need_grads=True,
        block_bytes=1,
    )
    assert loss.item() == 0.0
    for g in grads:
        assert torch.isfinite(g).all() and g.abs().max().item() == 0.0
    _check(student, guide, offset=9, margin=margin, margin_strategy=strategy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_accumulates_in_fp32(dtype):
    student, guide = make_inputs(13, 26, 48, 32, 1, dtype=dtype, seed=6)
    # The oracle scores the same (rounded) half inputs in float64.
    _check(student, guide, offset=13, margin=0.05)


def test_zero_vector_row():
    """A zero embedding normalises to zero (eps clamp) and gets the clamped gradient g / eps."""
    student, guide = make_inputs(6, 6, 10, 8, 1, seed=7)
    student[2][3] = 0.0
    guide[2][4] = 0.0
    _check(student, guide, margin=0.1)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced by an op."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_allocates_batch_by_candidates():
    B, N, D = 64, 128, 8
    student, guide = make_inputs(B, N, D, D, 1, dtype=torch.float32, seed=8)
    with _LargestAllocation() as probe:
        gist_loss_and_grads(student, guide, **OPTIONS, offset=0, need_grads=True, block_bytes=64 * 1024)
    inputs = max(t.numel() for t in student + guide)
    assert probe.largest < B * N, f"largest intermediate has {probe.largest} elements, B*N = {B * N}"
    assert probe.largest >= inputs  # sanity: the probe saw the normalised copies
