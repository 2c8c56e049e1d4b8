"""The Triton backend (``cgist.stage.triton``, launching ``cgist.kernels``) against the dense float64 oracle.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), here in float32 and float64; every dtype pair the launcher picks (bf16, fp16, a
half student with an fp32 guide, fp32 as tf32x3 with an fp32 or a bf16 guide) runs at small sizes in
test_kernels_dtypes, with the interpreter's bf16 ``tl.dot`` fixed by the tests (interpreter_dot). The GPU-sized cases at the end need
a GPU, as tf32 does (the interpreter has none; see test_kernels_precision for its rounding).
Every case runs the backward; chunked budgets force it through several row and column chunks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, DEVICE, DTYPES, assert_close, make_inputs, shape_id, tolerance
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cgist
from cgist import GistOptions
from cgist.stage.budget import backward_chunks
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.reference import gist_loss_reference, gist_scores
from cgist.stage.ties import tie_ids
from cgist.stage.triton.dense import gist_forward

needs_cuda = pytest.mark.skipif(not CUDA, reason="GPU-sized problems, and tf32, which the interpreter lacks")


def _exact_norm_row(dim_g, seed):
    """A random row of +-1 and +-2 whose squared norm is a perfect square.

    Its norm is exact, so a copy scaled by 3 normalises to bitwise the same vector, in float32 and float64.
    """
    twos = next(a for a in range(dim_g + 1) if round((dim_g + 3 * a) ** 0.5) ** 2 == dim_g + 3 * a)
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor([2.0] * twos + [1.0] * (dim_g - twos), dtype=torch.float64)
    signs = torch.randint(0, 2, (dim_g,), generator=gen) * 2 - 1
    return values[torch.randperm(dim_g, generator=gen)] * signs


def _check(batch, n_cand, dim, dim_g, k, precision, *, offset=0, margin=0.1, strategy="absolute",
           anchors=True, positives=True, temperature=0.05, ties=(), scale=1.0, seed=0, block_bytes=None,
           guide_precision=None):
    """Loss and gradients (two runs, bitwise equal) match the float64 oracle.

    ``ties`` lists (column, row, anchor): that guide row becomes ``scale`` times the guide vector of
    anchor ``anchor``'s positive. With ``scale != 1`` those positives first get rows of exact norm, so
    that the copies equal them after normalisation while their products differ in rounding.
    """
    dtype = DTYPES[precision]
    student, guide = make_inputs(batch, n_cand, dim, dim_g, k, dtype, seed)
    if scale != 1.0:
        for anchor in sorted({anchor for *_, anchor in ties}):
            guide[1][offset + anchor] = _exact_norm_row(dim_g, seed + anchor).to(dtype)
    for column, row, anchor in ties:
        guide[column][row] = scale * guide[1][offset + anchor]
    if guide_precision is not None:  # a guide of another dtype (the oracle sees its values in float64)
        guide = [g.to(DTYPES[guide_precision]) for g in guide]
    options = GistOptions(temperature=temperature, margin=margin, margin_strategy=strategy, contrast_anchors=anchors,
                          contrast_positives=positives, offset=offset, block_bytes=block_bytes)

    leaves = [x.double().requires_grad_() for x in student]
    guide64 = [g.double() for g in guide]
    want = gist_loss_reference(leaves, guide64, options)
    want.backward()
    if ties:  # each copy is a tie for the oracle, kept exactly at margin <= 0, so the test exercises it
        ids = [tie_ids(columns, columns[0].dtype) for columns in (guide, guide64)]
        scores = gist_scores(leaves, guide64, options)
        negatives_start = n_cand + batch * anchors + n_cand * positives
        for column, row, anchor in ties:
            assert all(i[column][row] == i[1][offset + anchor] for i in ids), "the copy is not equal once normalised"
            start = {0: n_cand, 1: 0}.get(column, negatives_start + (column - 2) * n_cand)
            assert bool(torch.isfinite(scores[anchor, start + row])) == (margin <= 0), "the oracle mis-decided a tie"

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        runs = [loss_and_grads("triton", [x.to(DEVICE) for x in student], [g.to(DEVICE) for g in guide], options,
                               need_grads=True)[:2] for _ in range(2)]
    finally:
        torch.set_float32_matmul_precision(previous)

    (loss, grads), (loss2, grads2) = runs
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and loss.dim() == 0
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2)), "not deterministic"
    assert all(got.dtype == dtype and got.shape == leaf.shape for got, leaf in zip(grads, leaves))
    assert_close("triton", (want, [leaf.grad for leaf in leaves]), (loss, grads), tolerance("triton", precision))


def _id(batch, n_cand, dim, dim_g, k, precision, **kw):
    extra = "".join(f"-{key}{value}" for key, value in kw.items())
    return f"{shape_id(batch, n_cand, dim, dim_g, k)}-{precision}{extra}"


def _params(cases):
    return [pytest.param(*args, kw, id=_id(*args, **kw)) for *args, kw in cases]


SHAPES = _params([
    (13, 13, 40, 24, 0, "fp64", {}),
    (13, 26, 40, 24, 1, "fp64", dict(offset=13)),
    (13, 39, 40, 24, 2, "fp64", dict(offset=20)),
    (37, 37, 70, 33, 1, "fp64", {}),
    (5, 41, 17, 50, 2, "fp64", dict(offset=36)),
    (13, 26, 40, 24, 1, "fp32", dict(offset=13)),
    (37, 37, 70, 33, 0, "fp32", {}),
])

OPTIONS = _params([
    (13, 26, 40, 24, 1, "fp64", dict(offset=5, anchors=False, positives=False)),
    (13, 26, 40, 24, 1, "fp64", dict(offset=5, anchors=True, positives=False)),
    (13, 26, 40, 24, 1, "fp64", dict(offset=5, anchors=False, positives=True)),
    (13, 26, 40, 24, 2, "fp64", dict(offset=9, strategy="relative", margin=0.3)),
    (13, 26, 40, 24, 1, "fp64", dict(offset=13, temperature=0.01)),
    (13, 26, 40, 24, 1, "fp32", dict(offset=13, strategy="relative", margin=0.2, anchors=False)),
    # everything but the positive is masked: all-masked tiles must not produce NaN
    (21, 42, 40, 24, 2, "fp64", dict(offset=17, margin=3.0)),
    (21, 42, 40, 24, 1, "fp32", dict(offset=17, margin=3.0)),
    # nothing is masked, self-pairs AA[i, i] and PP[i, o + i] included
    (13, 26, 40, 24, 1, "fp64", dict(offset=11, margin=-2.5)),
    (13, 26, 40, 24, 1, "fp64", dict(offset=11, margin=-4.0, strategy="relative")),
])


# Budgets that split the backward into chunks (16 x 16 tiles under the interpreter): column chunks of one
# tile (block_bytes=2100 in fp64), chunks of 16 rows against whole blocks (2400 in fp32), and chunks of 16
# rows against two column tiles (5000 in fp64).
CHUNKS = _params([
    (13, 39, 40, 24, 2, "fp64", dict(offset=20, block_bytes=2100)),
    (37, 37, 70, 33, 1, "fp32", dict(block_bytes=2400)),
    (37, 45, 40, 24, 1, "fp64", dict(offset=3, block_bytes=5000)),
])


@pytest.mark.parametrize(("batch", "n_cand", "dim", "dim_g", "k", "precision", "kw"), SHAPES + OPTIONS + CHUNKS)
def test_matches_reference(batch, n_cand, dim, dim_g, k, precision, kw):
    _check(batch, n_cand, dim, dim_g, k, precision, **kw)


@pytest.mark.parametrize(("block_bytes", "rows", "cols"), [(2100, 16, 16), (4200, 16, 32), (5000, 16, 39), (10**6, 48, 39)])
def test_backward_chunks_follows_the_budget(block_bytes, rows, cols):
    """Chunks are whole tiles, hold no more than the budget (when one tile fits), and take whole blocks when they can."""
    student, guide = make_inputs(37, 39, 40, 24, 1, torch.float64, 0)
    options = GistOptions(offset=2, block_bytes=block_bytes)
    _, state = gist_forward([x.to(DEVICE) for x in student], [g.to(DEVICE) for g in guide], options)
    plan = backward_chunks(37, 39, state.tiles, 1, 8, 8, block_bytes, torch.device(DEVICE))
    assert (plan.rows, plan.cols) == (rows, cols)
    assert plan.bytes == rows * cols * 8 <= block_bytes


def test_backward_chunks_keeps_int32_offsets():
    """However large the budget, a chunk's buffer stays addressable with int32 offsets."""
    plan = backward_chunks(2**20, 2**20, {"BLOCK_M": 128, "BLOCK_N": 128}, 1, 2, 4, 2**40, torch.device("cpu"))
    assert plan.cols == 2**20 and plan.rows % 128 == 0 and plan.rows * plan.cols < 2**31


# (column, row, anchor): column 0 = anchors, 1 = positives, 2.. = negative sets. Copies of the positive
# of anchor 3 sit in other column tiles and at other positions within a tile than the label itself.
TIES = ((1, 2, 3), (1, 25, 3), (2, 19, 3), (3, 0, 7), (1, 30, 7))
# Anchor r copying the positive of anchor i ties in AA[i, r], and puts theta_r = ga_r . gp_{o+r} transposed
# into PP[r, o + i] = gp_{o+r} . gp_{o+i}: that tie holds only if the guide score is symmetric bitwise.
ANCHOR_TIES = ((0, 1, 6), (0, 4, 9), (0, 7, 0), (0, 10, 3), (0, 12, 5), (0, 2, 11), (0, 8, 4))


@pytest.mark.parametrize("ties", [TIES, ANCHOR_TIES], ids=["copies", "anchor-copies"])
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_ties_with_positive_are_kept_at_zero_margin(precision, ties):
    _check(13, 37, 40, 24, 2, precision, offset=9, margin=0.0, ties=ties)


# Copies of the positive scaled by 3 among the negatives and the anchors: equal to it once normalised
# (ties by identity), but their guide products round differently from theta.
SCALED_TIES = ((2, 4, 3), (3, 30, 3), (2, 19, 7), (3, 9, 6), (0, 1, 6), (0, 10, 3), (0, 12, 5))


@pytest.mark.parametrize("margin", [0.0, 0.1], ids=["m0", "m0.1"])
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_scaled_copies_of_positive_tie_by_identity(precision, margin):
    _check(13, 37, 40, 24, 2, precision, offset=9, margin=margin, ties=SCALED_TIES, scale=3.0)


@pytest.mark.parametrize(
    ("batch", "n_cand", "k", "offset", "strategy"),
    [pytest.param(3, 5, 1, 2, "absolute", id="B3-N5-D6-k1-o2"), pytest.param(4, 4, 0, 0, "relative", id="B4-N4-D6-k0")],
)
def test_gradcheck_through_gist_loss(batch, n_cand, k, offset, strategy):
    student, guide = make_inputs(batch, n_cand, 6, 5, k, seed=1)
    leaves = [x.to(DEVICE).requires_grad_() for x in student]
    guide = [g.to(DEVICE) for g in guide]

    def loss(*xs):
        return cgist.gist_loss(list(xs), guide, temperature=0.5, margin=0.05, margin_strategy=strategy, offset=offset,
                               backend="triton")

    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-7, fast_mode=True)


class _HostReads(TorchDispatchMode):
    """Records the ops that make the host wait for the device: reading a value, or copying host memory to it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        reads = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                 torch.ops.aten.item.default)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        to_device = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and \
            {t.device.type for t in tensors} >= {"cpu", "cuda"}
        if func in reads or to_device:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_launcher_reads_no_value_on_the_host():
    """Once warm, a call with gradients, statistics and Matryoshka dimensions never waits for the device.

    The calls are built by the door outside the probe: its finiteness test is the one host sync of a call, before
    the launcher runs. (Host-to-device copies are seen on CUDA only; on the CPU the value reads are.)
    """
    from cgist.stage.spec.dense import dense_call
    from cgist.stage.triton import dense as triton_dense

    student, guide = make_inputs(13, 26, 40, 24, 1, torch.float32, 0)
    student, guide = [s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide]
    options = GistOptions(margin=0.1, offset=5, matryoshka_dims=(40, 20))
    loss_and_grads("triton", student, guide, options, need_grads=True, need_stats=True)
    nested, plain = (dense_call(student, guide, o) for o in (options, GistOptions(margin=0.1, offset=5)))
    with _HostReads() as probe:
        triton_dense.forward(nested, True, True)
        triton_dense.forward(plain, True)
    assert probe.ops == []


def _precise_loss(student, guide, options):
    """The loss in float64 as mean_i log1p(sum over unmasked j != label of exp(z_ij - z_pos)): exact however small."""
    scores = gist_scores([s.double() for s in student], [g.double() for g in guide], options) / options.temperature
    rows = torch.arange(scores.shape[0])
    positive = scores[rows, rows + options.offset]
    others = torch.exp(scores - positive.unsqueeze(1))
    others[rows, rows + options.offset] = 0.0
    return torch.log1p(others.sum(dim=1)).mean()


@pytest.mark.parametrize("closeness", [1e-1, 1e-2, 1e-3], ids=lambda c: f"closeness{c:g}")
def test_small_loss_keeps_relative_precision(closeness):
    """fp32 positives that are near copies of their anchors: a loss far below float32's rounding of 1/tau.

    Summing the label's term into the running sum would leave an absolute error of ~2^-24 in the loss,
    a relative error far above the bound at these losses.
    """
    batch, n_cand, offset = 7, 14, 7
    student, guide = make_inputs(batch, n_cand, 24, 12, 1, seed=3)
    student[1][offset : offset + batch] = student[0] + closeness * student[1][offset : offset + batch]
    student, guide = [s.float() for s in student], [g.float() for g in guide]
    options = GistOptions(temperature=0.05, margin=0.05, offset=offset)
    expected = float(_precise_loss(student, guide, options))
    assert 0.0 < expected < 1e-4
    loss, _, _ = loss_and_grads("triton", [s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide], options,
                                need_grads=False)
    bound = 64 * torch.finfo(torch.float32).eps * (1.0 + 1.0 / options.temperature)
    assert abs(float(loss) - expected) <= bound * expected, f"relative error {abs(float(loss) - expected) / expected:.3g}"


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32", "fp32"])
@pytest.mark.parametrize(("batch", "n_cand", "dim", "dim_g", "k", "offset"), [
    pytest.param(*shape, offset, id=shape_id(*shape))
    for *shape, offset in [(13, 26, 40, 24, 1, 13), (300, 600, 384, 384, 1, 300), (130, 130, 1024, 768, 2, 0)]
])
def test_gpu_precisions(batch, n_cand, dim, dim_g, k, offset, precision):
    _check(batch, n_cand, dim, dim_g, k, precision, offset=offset)


@needs_cuda
@pytest.mark.parametrize(("precision", "guide_precision"), [("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "fp32")])
def test_gpu_mixed_pairs(precision, guide_precision):
    """A half student with an fp32 guide (tf32x3 guide products), and the reverse."""
    _check(300, 600, 384, 384, 1, precision, offset=300, guide_precision=guide_precision)


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gpu_backward_chunks(precision):
    _check(300, 600, 384, 384, 1, precision, offset=300, block_bytes=2**20)
