"""cgist.stage.pytorch.dense: the PyTorch streaming path against the dense float64 oracle."""

from __future__ import annotations

import pytest
import torch
from helpers import Tol, assert_close, make_inputs, precision, shape_id, tolerance
from torch.utils._python_dispatch import TorchDispatchMode

from cgist import GistOptions
from cgist.stage import budget
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.pytorch import dense as pytorch_dense, workspace
from cgist.stage.reference import gist_loss_reference, gist_scores


def _check(student, guide, options=GistOptions(), *, block_bytes=None, products=(None, None), tol=None):
    """Streaming loss and gradients equal the float64 oracle's on the same (upcast) inputs.

    ``products`` forces the half products of the student and the guide (``cgist.stage.numerics.half_products``), whose
    results are ``tol`` close (``assert_close``'s (loss, gradients) tolerances; default: TOL["streaming"]).
    """
    options = options.replace(block_bytes=block_bytes)
    loss, grads, _ = loss_and_grads("torch", student, guide, options, need_grads=True, products=products)

    leaves = [s.detach().double().requires_grad_() for s in student]
    expected = gist_loss_reference(leaves, [g.double() for g in guide], options)
    expected_grads = torch.autograd.grad(expected, leaves)

    assert loss.dtype == (torch.float64 if student[0].dtype == torch.float64 else torch.float32)
    assert torch.isfinite(loss)
    assert all(got.dtype == s.dtype and got.shape == s.shape for got, s in zip(grads, student))
    assert_close("torch", (expected, expected_grads), (loss, grads),
                 tol or tolerance("streaming", precision(student[0].dtype)))
    # The no-grad call returns the same loss and no gradients.
    loss_only, none, no_stats = loss_and_grads("torch", student, guide, options, need_grads=False, products=products)
    assert none is None and no_stats is None and torch.equal(loss_only, loss)
    return expected


SHAPES = [  # B, world size (N = B * W), D, Dg, k
    (13, 1, 40, 24, 0),
    (13, 2, 40, 24, 2),
    (7, 3, 33, 65, 1),
    (1, 1, 8, 8, 1),
    (32, 1, 64, 16, 3),
]
OPTION_SETS = {
    "default": GistOptions(),
    "abs-m0.1": GistOptions(margin=0.1),
    "abs-m-0.2": GistOptions(margin=-0.2),
    "rel-m0.3": GistOptions(margin=0.3, margin_strategy="relative"),
    "rel-m-0.1": GistOptions(margin=-0.1, margin_strategy="relative"),
    "noAA": GistOptions(contrast_anchors=False, margin=0.05),
    "noPP": GistOptions(contrast_positives=False, margin=0.05),
    "AP-only": GistOptions(contrast_anchors=False, contrast_positives=False),
    "tau0.5": GistOptions(temperature=0.5, margin=0.02),
}
DTYPES = [torch.float64, torch.float32]


#: Each shape at every rank's offset.
RANKS = [pytest.param(shape, rank, id=f"{shape_id(shape[0], shape[0] * shape[1], *shape[2:])}-rank{rank}")
         for shape in SHAPES for rank in range(shape[1])]


@pytest.mark.parametrize("dtype", DTYPES, ids=precision)
@pytest.mark.parametrize("shape, rank", RANKS)
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_matches_oracle(shape, rank, name, dtype):
    B, W, D, Dg, k = shape
    student, guide = make_inputs(B, B * W, D, Dg, k, dtype=dtype, seed=B * 31 + k)
    _check(student, guide, OPTION_SETS[name].replace(offset=rank * B))


@pytest.mark.parametrize("offset", [0, 5, 19], ids=lambda o: f"offset{o}")
def test_any_offset_and_tiny_budget(offset):
    """Offsets that are not a multiple of B, on budgets of 1 and 3000 bytes: both too small for one pass, so two
    passes over one-column tiles. The batch stays one row block (below ``ROW_FLOOR`` rows a row block is the whole
    batch, whatever the budget); tests/test_blocks.py has several."""
    student, guide = make_inputs(11, 30, 20, 12, 1, seed=offset)
    _check(student, guide, GistOptions(offset=offset, margin=0.05), block_bytes=1)
    _check(student, guide, GistOptions(offset=offset, margin=0.05, margin_strategy="relative"), block_bytes=3000)


@pytest.mark.parametrize("dtype", DTYPES, ids=precision)
def test_duplicate_of_positive_is_a_tie_not_masked(dtype):
    """A candidate whose guide vector equals the positive's compares equal to theta, so m=0 keeps it."""
    B, N, offset = 6, 12, 6
    student, guide = make_inputs(B, N, 16, 10, 1, dtype=dtype, seed=3)
    dup_cols = torch.arange(B)  # candidate j = i duplicates positive offset + i, in the guide and student
    guide[1][dup_cols] = guide[1][offset + dup_cols]
    student[1][dup_cols] = student[1][offset + dup_cols]
    guide[2][dup_cols] = guide[1][offset + dup_cols]  # and the negatives hold the same guide vectors
    expected = _check(student, guide, GistOptions(offset=offset))
    scores = gist_scores([s.double() for s in student], [g.double() for g in guide], GistOptions(offset=offset))
    rows = torch.arange(B)
    assert torch.isfinite(scores[rows, dup_cols]).all(), "duplicate of the positive was masked at m=0"
    negatives = 2 * N + B  # column of AN_1[., 0], after AP, AA and PP
    assert torch.isfinite(scores[rows, negatives + dup_cols]).all(), "duplicate among the negatives was masked"
    assert torch.isfinite(expected)


TIE_SHAPES = [(13, 2, 384), (64, 2, 384), (7, 3, 33), (100, 3, 1024)]  # B, W, guide dimension


@pytest.mark.parametrize("dtype", DTYPES, ids=precision)
@pytest.mark.parametrize("seed, shape", list(enumerate(TIE_SHAPES)),
                         ids=[shape_id(B, B * W, 8, D, 1) for B, W, D in TIE_SHAPES])
def test_ties_across_blocks_of_many_shapes(seed, shape, dtype):
    """Duplicates of the positive in every block, on shapes where matrix products of different shapes
    round the same pair differently: the tie must hold regardless (it is decided by identity)."""
    B, W, D = shape
    N = B * W
    student, guide = make_inputs(B, N, 8, D, 1, dtype=dtype, seed=seed)
    offset = N - B
    options = GistOptions(offset=offset)
    rows = torch.arange(B)
    guide[2][rows] = guide[1][offset + rows]  # AN: negative i is a copy of positive o + i
    guide[0][(rows + 1) % B] = guide[1][offset + rows]  # AA: anchor i + 1 is a copy of positive o + i
    scores = gist_scores(student, guide, options)
    kept = torch.isfinite(scores)
    assert kept[rows, 2 * N + B + rows].all() and kept[rows, N + (rows + 1) % B].all()
    _check(student, guide, options)
    # Positive margins mask them again, exactly like the positive would be if it were not protected.
    masked = gist_scores(student, guide, options.replace(margin=1e-3))
    assert not torch.isfinite(masked[rows, 2 * N + B + rows]).any()


def test_negative_margin_keeps_self_pairs():
    """With m = -2.5 every T_i >= 1.5 exceeds the guide self-similarity (1), so without mask_self (the rule of
    sentence-transformers 6.2) AA[i,i] and PP[i,o+i] stay in the softmax."""
    B, N, offset = 5, 10, 5
    student, guide = make_inputs(B, N, 12, 12, 0, seed=4)
    options = GistOptions(offset=offset, margin=-2.5, mask_self=False)
    _check(student, guide, options)
    scores = gist_scores(student, guide, options)
    rows = torch.arange(B)
    assert torch.isfinite(scores[rows, N + rows]).all()  # AA diagonal
    assert torch.isfinite(scores[rows, N + B + offset + rows]).all()  # PP at o + i


@pytest.mark.parametrize("strategy,margin", [("absolute", 3.0), ("relative", 5.0)])
def test_everything_masked_but_the_positive(strategy, margin):
    """Every row keeps only its label: the loss is exactly 0 and so are the gradients, with no NaN."""
    student, guide = make_inputs(9, 18, 14, 10, 2, seed=5)
    for g in guide:  # positive guide scores, so the relative threshold -4*theta is below them too
        g.abs_()
    options = GistOptions(margin=margin, margin_strategy=strategy, offset=9)
    loss, grads, _ = loss_and_grads("torch", student, guide, options.replace(block_bytes=1), need_grads=True)
    assert loss.item() == 0.0
    for g in grads:
        assert torch.isfinite(g).all() and g.abs().max().item() == 0.0
    _check(student, guide, options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=precision)
def test_half_precision_accumulates_in_fp32(dtype):
    student, guide = make_inputs(13, 26, 48, 32, 1, dtype=dtype, seed=6)
    # The oracle scores the same (rounded) half inputs in float64.
    _check(student, guide, GistOptions(offset=13, margin=0.05))


HALF_PRODUCTS = {  # (student dtype, guide dtype, product dtypes): what CUDA devices run (``half_products``)
    "fp16": (torch.float16, torch.float16, (torch.float16, torch.float16)),
    "bf16-sm80": (torch.bfloat16, torch.bfloat16, (torch.bfloat16, torch.bfloat16)),
    "bf16-as-fp16": (torch.bfloat16, torch.bfloat16, (torch.float16, torch.float16)),
    "bf16-fp32-guide": (torch.bfloat16, torch.float32, (torch.float16, None)),
}


@pytest.mark.parametrize("options", [GistOptions(offset=13, margin=0.05),
                                     GistOptions(margin=-0.1, temperature=0.05, block_bytes=1)],
                         ids=["o13-m0.05", "m-0.1-tau0.05-two-pass"])
@pytest.mark.parametrize("scale", [1.0, 2.0**20, 2.0**-30], ids=["unit", "huge", "tiny"])
@pytest.mark.parametrize("case", list(HALF_PRODUCTS))
def test_half_products(case, scale, options):
    """Score products in half precision, as on a GPU (here the half operands are widened, which gives the same
    products): the forward is exact (products of the inputs as given, normalised after), the gradients carry
    the rounding of the softmax and of the normalised rows to the half dtype. bf16 rows far outside fp16's
    range, huge or tiny, still multiply as fp16 (each row scaled by a power of two)."""
    dtype, guide_dtype, products = HALF_PRODUCTS[case]
    if products[0] == torch.float16 and dtype == torch.float16 and scale != 1.0:
        pytest.skip("fp16 inputs have fp16's range")
    student, guide = make_inputs(13, 26, 48, 32, 2, seed=9)
    student = [(s * scale).to(dtype) for s in student]
    guide = [(g * scale).to(guide_dtype) for g in guide]
    unit = torch.finfo(products[0]).eps
    _check(student, guide, options, block_bytes=options.block_bytes, products=products,
           tol=(tolerance("streaming", "fp32")[0], Tol(4 * unit, 4 * unit, scaled=True)))


def test_zero_vector_row():
    """A zero embedding normalises to zero (eps clamp) and gets the clamped gradient g / eps."""
    student, guide = make_inputs(6, 6, 10, 8, 1, seed=7)
    student[2][3] = 0.0
    guide[2][4] = 0.0
    _check(student, guide, GistOptions(margin=0.1))


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


@pytest.mark.parametrize("dims", [None, (8, 4)], ids=["flat", "matryoshka"])
@pytest.mark.parametrize("block_bytes", [64 * 1024, 1], ids=["64KiB", "1B"])
def test_allocations_stay_within_the_budget_and_the_inputs(block_bytes, dims):
    """No single allocation exceeds the score budget or the size of an input column (B x N never appears).

    The workspace is one allocation of at most the budget, so B x N is larger than 64 KiB of fp32 here.
    """
    B, N, D = 64, 512, 8
    student, guide = make_inputs(B, N, D, D, 1, dtype=torch.float32, seed=8)
    options = GistOptions(block_bytes=block_bytes, matryoshka_dims=dims)
    workspace.release_workspace()  # so that this call allocates its workspace where the probe sees it
    with _LargestAllocation() as probe:
        loss_and_grads("torch", student, guide, options, need_grads=True, need_stats=True)
    inputs = max(t.numel() for t in student + guide)
    bound = max(block_bytes // 4, N * (D + 1))  # the budget in fp32 elements, or a normalised column [x_hat, 1]
    assert probe.largest <= bound, f"largest intermediate has {probe.largest} elements, bound {bound}"
    assert probe.largest < B * N and probe.largest >= inputs  # sanity: the probe saw the normalised copies


@pytest.mark.parametrize("block_bytes", [None, 1], ids=["one-pass", "two-pass"])
def test_candidates_far_above_the_positive(block_bytes, monkeypatch):
    """A candidate ~290 base-2 units above the positive (cos 1 against -1 at tau 0.01): in float32 2^(z - z_pos)
    overflows, so the row block is redone shifted by its maximum; the loss is finite and matches the oracle."""

    student, guide = make_inputs(6, 12, 10, 8, 1, dtype=torch.float32, seed=12)
    student[1][6:] = -student[0]  # each positive opposite its anchor
    student[2][2] = student[0][2]  # a negative equal to anchor 2
    guide[2][2] = -guide[0][2]  # that the guide does not mask
    calls = []
    real = pytorch_dense._RowBlock.masked_logits
    monkeypatch.setattr(pytorch_dense._RowBlock, "masked_logits", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    expected = _check(student, guide, GistOptions(offset=6, margin=0.05), block_bytes=block_bytes)
    assert float(expected.detach()) > 100  # the case is what it claims
    problem = pytorch_dense._StreamingRun(student, guide, GistOptions(offset=6), True, False)
    n_tiles = len(pytorch_dense._tiles(problem, budget.TILE_COLS if block_bytes is None else 1))
    assert len(calls) > 3 * n_tiles  # the sweep, the maximum, the sweep again (and, in two passes, the gradients)


@pytest.mark.parametrize("dims", [None, (16, 9, 4)], ids=["flat", "matryoshka"])
def test_one_pass_over_many_tiles(dims, monkeypatch):
    """Tiles of 5 columns in one pass: every group spans several tiles, each with its own place in the workspace."""
    monkeypatch.setattr(budget, "TILE_COLS", 5)
    student, guide = make_inputs(13, 26, 16, 12, 2, seed=13)
    options = GistOptions(offset=13, margin=0.1, matryoshka_dims=dims)
    schedule = budget.row_blocks(13, [26, 13, 26, 26, 26], 16, 1 if dims is None else 3, 8, None)
    assert schedule.one_pass and schedule.cols == 5
    if dims is None:
        _check(student, guide, options)
    else:
        leaves = [s.detach().requires_grad_() for s in student]
        loss, grads, _ = loss_and_grads("torch", student, guide, options, need_grads=True)
        expected = gist_loss_reference(leaves, guide, options)
        assert_close("torch", (expected, torch.autograd.grad(expected, leaves)), (loss, grads),
                     tolerance("streaming", "fp64"))


@pytest.mark.parametrize("dims", [None, (16, 9, 4)], ids=["flat", "matryoshka"])
def test_the_workspace_is_kept_between_calls_in_each_thread(dims):
    """A CPU call reuses the workspace buffer of the thread's previous call, whatever that call left in it;
    another thread gets its own, and ``release_workspace`` frees it."""
    import threading

    options = GistOptions(offset=3, margin=0.05, matryoshka_dims=dims, block_bytes=4096)
    first = make_inputs(11, 17, 16, 12, 1, torch.float32, seed=21)
    other = make_inputs(11, 17, 16, 12, 1, torch.float32, seed=22)

    def run(inputs):
        loss, grads, counters = loss_and_grads("torch", *inputs, options, need_grads=True, need_stats=True)
        return [loss, *grads, *counters]

    workspace.release_workspace()
    fresh = run(first)
    kept = workspace._THREAD.buffers[torch.float32]
    run(other)  # leaves its own values in the buffer
    again = run(first)
    assert workspace._THREAD.buffers[torch.float32] is kept
    assert all(torch.equal(a, b) for a, b in zip(fresh, again))

    in_thread = {}

    def worker():
        in_thread["result"] = run(first)
        in_thread["buffer"] = workspace._THREAD.buffers[torch.float32]

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert in_thread["buffer"].data_ptr() != kept.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(fresh, in_thread["result"]))
    workspace.release_workspace()
    assert not getattr(workspace._THREAD, "buffers", None)


def test_the_kept_workspace_is_poisoned_between_tests():
    """conftest's ``nan_poisoned_workspace`` reaches the buffers that this thread keeps: after it, they hold only
    NaN, and a call on them gives what it gives on a fresh workspace."""
    from conftest import _poison_kept_workspace

    student, guide = make_inputs(11, 17, 16, 12, 1, torch.float32, seed=23)
    options = GistOptions(offset=3, margin=0.05, block_bytes=4096)
    workspace.release_workspace()
    fresh = loss_and_grads("torch", student, guide, options, need_grads=True)
    kept = workspace._THREAD.buffers[torch.float32]
    assert not kept.isnan().all()
    _poison_kept_workspace()
    assert kept.isnan().all()
    again = loss_and_grads("torch", student, guide, options, need_grads=True)
    assert workspace._THREAD.buffers[torch.float32] is kept
    assert_close("poisoned workspace", fresh[:2], again[:2])


def test_plan_grows_the_default_budget_to_full_blocks_and_keeps_one_pass_down_to_the_floor(monkeypatch):
    """The schedule rule of ``row_blocks``: the default budget reaches ``ROW_TARGET`` rows (memory permitting, and
    never beyond an eighth of it or 1 GiB), an explicit budget gets as many rows as fit in one pass down to
    ``ROW_FLOOR``, and below that two passes of ``ROW_FLOOR`` rows with narrower tiles."""

    widths, top, item = [4096] * 4, 384, 4
    monkeypatch.setattr(budget, "free_bytes", lambda device: 2**40)
    full = budget.row_blocks(4096, widths, top, 1, item, None)
    assert full == budget.RowBlocks(budget.ROW_TARGET, budget.TILE_COLS, True)
    assert budget.row_blocks(300, [300] * 4, top, 1, item, None) == budget.RowBlocks(300, 300, True)
    # Four Matryoshka dimensions at B = 16k: 1024 rows would need 1.75 GiB; the default stops at 1 GiB.
    matryoshka = budget.row_blocks(16384, [16384] * 4, top, 4, item, None)
    assert matryoshka.one_pass and budget.ROW_FLOOR <= matryoshka.rows < budget.ROW_TARGET
    assert matryoshka.rows * 16384 * 4 * (2 * 4 - 1) * item <= budget.MAX_BLOCK_BYTES  # terms, products
    per_row = 4 * 4096 * item  # the kept terms alone
    monkeypatch.setattr(budget, "free_bytes", lambda device: 8 * 450 * per_row)
    capped = budget.row_blocks(4096, widths, top, 1, item, None)  # an eighth of memory: fewer than 450 rows
    assert capped.one_pass and budget.ROW_FLOOR <= capped.rows < 450
    middle = budget.row_blocks(4096, widths, top, 1, item, 600 * per_row)
    assert middle.one_pass and budget.ROW_FLOOR < middle.rows < 600
    small = budget.row_blocks(4096, widths, top, 1, item, 100 * per_row)
    assert not small.one_pass and small.rows == budget.ROW_FLOOR and 1 <= small.cols < budget.TILE_COLS


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=precision)
def test_hardness_in_a_smaller_dimension_after_the_shift_is_raised(dtype):
    """A candidate far above the positive raises the row's shift (a sum past ``LARGEST_SUM``); in a smaller Matryoshka
    dimension the hardness penalty then lifts a logit that, unpenalised, is far below the cutoff, up to the row's
    maximum: the cutoff applies to the penalised logit, or the row's largest term vanishes and the loss is -inf.
    Found by the property fuzz, shrunk by hand."""
    columns = [torch.tensor(rows, dtype=torch.float64) for rows in
               ([[1.0, 1.0]], [[-12.0, -52.0], [16.7, 3.1]], [[5.8, -4.8], [793.0, 9375.0]])]
    options = GistOptions(temperature=0.01, contrast_anchors=False, contrast_positives=False,
                          hardness_mode="in_batch_negatives", hardness_strength=1.0, similarity="dot",
                          matryoshka_dims=(1, 2))
    leaves = [c.clone().requires_grad_() for c in columns]
    reference = gist_loss_reference(leaves, None, options)
    reference.backward()
    loss, grads, _ = loss_and_grads("torch", [c.to(dtype) for c in columns], None, options, need_grads=True)
    assert_close("loss and gradients", (reference.detach(), [x.grad for x in leaves]), (loss, grads),
                 tolerance("streaming", dtype))
