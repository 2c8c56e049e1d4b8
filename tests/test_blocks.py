"""Several row blocks, column tiles and backward chunks, by value against the dense float64 oracle.

The row floor (``cgist.stage.budget.ROW_FLOOR``, docs/design.md#the-workspace-budget) keeps every batch below it one
row block whatever the budget, so the small batches of the other modules never reach a second row block of the
PyTorch streaming path. Here the batches are above it and each budget is derived from ``row_blocks`` itself, so
that the schedule is the one the test means: several row blocks in one pass (docs/design.md#the-streaming-algorithm),
the same with several column tiles per group, and two passes over narrow tiles. Each budget's schedule is checked
before it is used (``test_each_budget_makes_the_schedule_it_means``), and each call's is observed while it runs.

The Triton launcher (docs/design.md#the-kernels) runs on shapes sized from its own tile table: more than two row
tiles and column tiles per group (16 x 16 under the interpreter: B = 40, N = 80), with budgets that cut its backward
into several row and column chunks (``cgist.stage.budget.backward_chunks``); the chunks it ran are observed too.

Every call is compared with ``gist_loss_reference`` (loss and gradients) and ``helpers.oracle_stats`` (the
statistics), computed here on the same inputs: GIST with a guide, without one and self-guided, the directions and
partitions, hardness, Matryoshka dimensions, and a later rank's rows (``offset > 0``, every rank's anchors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from helpers import (  # noqa: F401  (one_thread: autouse)
    DEVICE,
    assert_close,
    gist_loss_kwargs,
    make_inputs,
    one_thread,
    oracle_stats,
    precision,
    tolerance,
)

import cgist
from cgist import GistOptions
from cgist.stage import budget
from cgist.stage.budget import Chunks, RowBlocks
from cgist.stage.pytorch import dense as pytorch_dense
from cgist.stage.reference import gist_loss_reference

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
NO_GIST = dict(contrast_anchors=False, contrast_positives=False)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: this rank's ``batch`` anchors among ``world`` ranks (N = batch * world candidates, offset
    rank * batch), D = ``dim``, ``negatives`` negative columns, the guide (``"guide"``: a guide's embeddings in
    ``dim_g``, ``"self"``, or None) and the loss options (the offset and the budget are set per call)."""

    batch: int
    world: int = 1
    rank: int = 0
    dim: int = 16
    dim_g: int = 12
    negatives: int = 1
    guide: str | None = "guide"
    options: GistOptions = GistOptions()

    @property
    def n_cand(self) -> int:
        return self.batch * self.world

    @property
    def offset(self) -> int:
        return self.rank * self.batch

    @property
    def everyone(self) -> bool:
        """Whether a direction scores against every rank's anchors: then they are the call's last column."""
        return self.options.reads_anchors

    def full_options(self, block_bytes: int | None = None) -> GistOptions:
        return self.options.replace(offset=self.offset, all_anchors=self.everyone, block_bytes=block_bytes)

    def inputs(self, dtype: torch.dtype = torch.float64, seed: int = 0):
        """The oracle's columns ``[anchor (B), positive (N), *negatives (N)]``, plus every rank's anchors (N) when a
        direction reads them, and the guide's columns in the same layout (None without a guide model)."""
        student, guide = make_inputs(self.n_cand, self.n_cand, self.dim, self.dim_g, self.negatives, dtype, seed)
        rows = slice(self.offset, self.offset + self.batch)
        # This rank's anchors are a copy of its rows of every rank's anchors: two leaves, as two ranks' tensors are.
        columns = [student[0][rows].clone(), *student[1:]] + [student[0]] * self.everyone
        guides = [guide[0][rows].clone(), *guide[1:]] + [guide[0]] * self.everyone
        return columns, (guides if self.guide == "guide" else None)


def _widths(case: Case) -> list[int]:
    """The columns of each column group of ``case`` (docs/design.md#column-groups), as ``row_blocks`` takes them."""
    options = case.full_options()
    sizes = [case.batch] + [case.n_cand] * (1 + case.negatives) + [case.n_cand] * case.everyone
    groups, _, _ = options.column_groups(len(sizes))
    return [sizes[group.column] for group in groups]


def _top(case: Case) -> int:
    dims = case.options.matryoshka_dims
    return case.dim if dims is None else max(dims)


def _n_dims(case: Case) -> int:
    dims = case.options.matryoshka_dims
    return 1 if dims is None else len(dims)


def _schedule(case: Case, block_bytes: int) -> RowBlocks:
    """The streaming path's schedule of ``case`` in float64 on the CPU at ``block_bytes``."""
    return budget.row_blocks(case.batch, _widths(case), _top(case), _n_dims(case), 8, block_bytes)


def _smallest_budget(fits: Callable[[int], bool]) -> int:
    """The smallest budget for which ``fits`` holds, ``fits`` being false below some budget and true above it."""
    lo, hi = 1, 2**40
    assert fits(hi), "no budget fits"
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


#: Plans of the streaming path, as (one pass or two, ``TILE_COLS``: the widest tile on a CPU, None to leave it).
#: "one-pass": blocks of ROW_FLOOR rows, the smallest budget of one pass; whole groups per tile, as on a CPU with
#: N < TILE_COLS. "one-pass-tiled": the same over tiles of 96 columns, each with its place in the workspace.
#: "two-pass": two passes over ROW_FLOOR rows, with tiles about a quarter of the widest group.
PLANS = {"one-pass": (True, None), "one-pass-tiled": (True, 96), "two-pass": (False, None)}


def _budget(case: Case, plan: str) -> int:
    """The budget that makes ``plan``'s schedule for ``case``, found with ``row_blocks`` itself (its rows and
    columns grow with the budget), so that it follows the schedule rule rather than numbers copied from it."""
    one_pass, _ = PLANS[plan]
    if one_pass:  # rows grow with the budget: the first budget in one pass has the fewest rows, the floor
        return _smallest_budget(lambda b: _schedule(case, b).one_pass)
    quarter = -(-max(_widths(case)) // 4)

    def wide_enough(block_bytes: int) -> bool:  # in two passes the tiles widen with the budget, up to one pass
        schedule = _schedule(case, block_bytes)
        return schedule.one_pass or schedule.cols >= quarter

    return _smallest_budget(wide_enough)


def _check_schedule(case: Case, plan: str, schedule: RowBlocks) -> None:
    """``schedule`` is what ``plan`` means for ``case``: several row blocks, one pass or two as planned, and with
    narrow tiles several column tiles in the widest group."""
    one_pass, tile_cols = PLANS[plan]
    assert case.batch > budget.ROW_FLOOR, "below the row floor a batch is one row block"
    assert schedule.one_pass == one_pass, f"{plan}: {schedule}"
    assert math.ceil(case.batch / schedule.rows) >= 2, f"{plan}: one row block, {schedule}"
    if not one_pass or tile_cols is not None:
        assert math.ceil(max(_widths(case)) / schedule.cols) >= 2, f"{plan}: one tile per group, {schedule}"
    else:
        assert schedule.cols == max(_widths(case)), f"{plan}: whole groups per tile, {schedule}"


STREAMING = {
    "gist-guide-rank1of2": Case(300, 2, 1, options=GistOptions(temperature=0.05, margin=0.05)),
    "gist-guide-local-relative-k2": Case(600, negatives=2, options=GistOptions(
        temperature=0.05, margin=0.2, margin_strategy="relative")),
    "gist-noguide-rank2of3": Case(300, 3, 2, guide=None, options=GistOptions(temperature=0.05)),
    "gist-self-rank1of2": Case(300, 2, 1, guide="self", options=GistOptions(temperature=0.05, margin=0.1)),
    "q2d+q2q+d2q+d2d-guide-rank1of2": Case(300, 2, 1, options=GistOptions(
        temperature=0.05, margin=0.05, directions=ALL, **NO_GIST)),
    "q2d+d2q-per_direction-all_negatives-rank1of2": Case(300, 2, 1, options=GistOptions(
        temperature=0.05, margin=0.05, directions=ALL[::2], partition_mode="per_direction",
        hardness_mode="all_negatives", hardness_strength=5.0, **NO_GIST)),
    "q2d+q2q-self-rank1of2": Case(300, 2, 1, guide="self", options=GistOptions(
        temperature=0.05, margin=0.1, directions=ALL[:2], contrast_anchors=False)),
    "q2d+d2d-hard_negatives-noguide-rank1of2": Case(300, 2, 1, negatives=2, guide=None, options=GistOptions(
        temperature=0.05, directions=("query_to_doc", "doc_to_doc"), hardness_mode="hard_negatives",
        hardness_strength=9.0, contrast_positives=False)),
    "gist-in_batch_negatives-guide-rank1of2": Case(300, 2, 1, options=GistOptions(
        temperature=0.05, margin=0.05, hardness_mode="in_batch_negatives", hardness_strength=5.0)),
    "gist-matryoshka-guide-rank1of2": Case(300, 2, 1, dim=24, options=GistOptions(
        temperature=0.05, margin=0.05, matryoshka_dims=(24, 12, 5), matryoshka_weights=(1.0, 0.5, 0.25))),
    "q2d+d2q-matryoshka-noguide-rank1of2": Case(300, 2, 1, dim=24, guide=None, options=GistOptions(
        temperature=0.05, directions=ALL[::2], matryoshka_dims=(24, 8), **NO_GIST)),
}


def _gist_loss(case: Case, columns: list[torch.Tensor], guide: list[torch.Tensor] | None, options: GistOptions,
               backend: str):
    """``cgist.gist_loss`` on ``case``'s columns (every rank's anchors passed as ``all_anchors``), with statistics."""
    source = {"guide": guide, "self": "self", None: None}[case.guide]
    kwargs = gist_loss_kwargs(options)
    if case.everyone:
        columns, anchors = columns[:-1], columns[-1]
        kwargs.update(all_anchors=anchors)
        if case.guide == "guide":
            source, kwargs["all_anchors_guide"] = guide[:-1], guide[-1]
    return cgist.gist_loss(columns, source, backend=backend, return_stats=True, **kwargs)


def _oracle(case: Case, columns: list[torch.Tensor], guide: list[torch.Tensor] | None, options: GistOptions):
    """The oracle's loss and gradients (float64, on the CPU), and its statistics."""
    leaves = [c.detach().double().cpu().requires_grad_() for c in columns]
    guide = None if guide is None else [g.double().cpu() for g in guide]
    if case.guide == "self":
        guide = [c.detach() for c in leaves]
    loss = gist_loss_reference(leaves, guide, options)
    return (loss.detach(), list(torch.autograd.grad(loss, leaves))), oracle_stats(leaves, guide, options)


class _Observed:
    """What the streaming path ran, seen from inside: its schedules, the rows of each row block and the column
    ranges of each group's tiles."""

    def __init__(self, monkeypatch) -> None:
        self.schedules: list[RowBlocks] = []
        self.blocks: list[tuple[int, int]] = []
        self.tiles: dict[int, set[tuple[int, int]]] = {}
        row_blocks, init, tiles = pytorch_dense.row_blocks, pytorch_dense._RowBlock.__init__, pytorch_dense._tiles

        def observed_row_blocks(*args, **kwargs):
            self.schedules.append(row_blocks(*args, **kwargs))
            return self.schedules[-1]

        def observed_init(block, call, start, stop):
            self.blocks.append((start, stop))
            init(block, call, start, stop)

        def observed_tiles(call, cols):
            out = tiles(call, cols)
            for group, lo, hi in out:
                self.tiles.setdefault(group.index, set()).add((lo, hi))
            return out

        monkeypatch.setattr(pytorch_dense, "row_blocks", observed_row_blocks)
        monkeypatch.setattr(pytorch_dense._RowBlock, "__init__", observed_init)
        monkeypatch.setattr(pytorch_dense, "_tiles", observed_tiles)


def _use_plan(plan: str, monkeypatch) -> None:
    """Set the CPU's tile width of ``plan`` (``TILE_COLS``, read by ``row_blocks`` at each call)."""
    tile_cols = PLANS[plan][1]
    if tile_cols is not None:
        monkeypatch.setattr(budget, "TILE_COLS", tile_cols)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(STREAMING))
def test_each_budget_makes_the_schedule_it_means(name, plan, monkeypatch):
    """Each budget of ``test_streaming_row_blocks_match_the_oracle`` gives the schedule its plan names, by the rule of
    ``row_blocks``: a changed floor, tile width or budget formula fails here rather than leaving one row block."""
    _use_plan(plan, monkeypatch)
    case = STREAMING[name]
    _check_schedule(case, plan, _schedule(case, _budget(case, plan)))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(STREAMING))
def test_streaming_row_blocks_match_the_oracle(name, plan, monkeypatch):
    """Loss, every column's gradient and the statistics of the PyTorch path, on several row blocks (the later ones
    with their own positives, thresholds, labels and self-pairs at the rank's offset), against the oracle."""
    _use_plan(plan, monkeypatch)
    case = STREAMING[name]
    options = case.full_options(_budget(case, plan))
    columns, guide = case.inputs(seed=len(name))
    want, want_stats = _oracle(case, columns, guide, options)

    observed = _Observed(monkeypatch)
    leaves = [c.detach().clone().requires_grad_() for c in columns]
    loss, stats = _gist_loss(case, leaves, guide, options, "torch")
    grads = torch.autograd.grad(loss, leaves)

    # The call ran the schedule its budget means: several row blocks, in order, and the planned tiles.
    assert len(observed.schedules) == 1, observed.schedules
    schedule = observed.schedules[0]
    assert schedule == _schedule(case, options.block_bytes), "the call's groups are not the ones planned for"
    _check_schedule(case, plan, schedule)
    starts = range(0, case.batch, schedule.rows)
    assert sorted(set(observed.blocks)) == [(s, min(s + schedule.rows, case.batch)) for s in starts]
    assert max(len(t) for t in observed.tiles.values()) == math.ceil(max(_widths(case)) / schedule.cols)

    loss_tol, grad_tol = tolerance("streaming", torch.float64)
    assert_close("torch", want, (loss, grads), (loss_tol, grad_tol))
    assert_close("torch stats", want_stats, stats, loss_tol)


def test_the_guided_cases_mask_some_candidates_and_keep_others():
    """The guided cases are not vacuous: in some block the guide masks some candidates and keeps others, so a later
    row block with another block's thresholds would move the loss."""
    for name, case in STREAMING.items():
        if case.guide is None:
            continue
        columns, guide = case.inputs(seed=len(name))
        stats = oracle_stats(columns, columns if case.guide == "self" else guide, case.full_options())
        assert any(0 < stats.masked[k] < stats.candidates[k] for k in stats.masked), name


# The Triton launcher -------------------------------------------------------------------------------------------------


def _arch():
    """The architecture the launcher reads on ``DEVICE`` (None under the interpreter)."""
    from cgist.stage.devices import gpu_arch

    device = torch.device(DEVICE)
    return gpu_arch(device) if device.type == "cuda" else None


def _launcher_tiles(dtype: torch.dtype, n_dims: int) -> tuple[int, int]:
    """The largest BLOCK_M and BLOCK_N of the tile configs the launcher's forward picks from for ``dtype`` on
    ``DEVICE`` (under the interpreter, one config of 16 x 16)."""
    from cgist.stage.triton.common import input_precision
    from cgist.stage.triton.tiles import tile_configs

    kind = input_precision(dtype, _arch())
    configs = tile_configs(dtype, kind, dtype, kind, n_dims, _arch())
    return max(c.kwargs["BLOCK_M"] for c in configs), max(c.kwargs["BLOCK_N"] for c in configs)


def _launcher_chunks(batch: int, widest: int, dtype: torch.dtype, n_dims: int, block_bytes: int) -> Chunks:
    """``backward_chunks`` with the arguments the launcher's backward (``BackwardWork.buffers``) gives it for a
    ``dtype`` student and guide: its tiles, one operand entry in ``dtype`` (a tf32 pair of them at tf32x3) and
    partial sums in the compute dtype."""
    from cgist.stage.numerics import compute_dtype
    from cgist.stage.triton.common import input_precision

    block_m, block_n = _launcher_tiles(dtype, n_dims)
    parts = 2 if input_precision(dtype, _arch()) == "tf32x3" else 1
    entry = parts * (torch.finfo(dtype).bits // 8)
    acc = torch.finfo(compute_dtype(dtype)).bits // 8
    return budget.backward_chunks(batch, widest, {"BLOCK_M": block_m, "BLOCK_N": block_n}, n_dims, entry, acc,
                                  block_bytes, torch.device(DEVICE))


#: Backward chunks of the Triton launcher: "tiles", one row tile against two column tiles (several row and column
#: chunks); "rows", two row tiles against whole groups (several row chunks, each over several row tiles).
CHUNK_PLANS = {"tiles": (1, 2), "rows": (2, None)}


def _triton_case(dtype: torch.dtype, dims: tuple[int, ...] | None, world: int, **options) -> Case:
    """The last of ``world`` ranks, sized from the launcher's tiles: more than two row tiles (B = 2 BLOCK_M + 8, the
    last one partial) and, with N = world * B, more than four column tiles; D = 24 over two K steps of 16."""
    block_m, _ = _launcher_tiles(dtype, 1 if dims is None else len(dims))
    return Case(2 * block_m + 8, world, world - 1, dim=24, dim_g=20,
                options=GistOptions(matryoshka_dims=dims, **options))


#: (name, dtype, Matryoshka dimensions, chunk plan, ranks, options). Under the interpreter B = 40 and N = 80 (five
#: whole column tiles) or, with three ranks, N = 120 (a partial last one).
TRITON = [
    ("gist-guide", torch.float64, None, "tiles", 2, dict(temperature=0.05, margin=0.05)),
    ("gist-guide", torch.float32, None, "tiles", 2, dict(temperature=0.05, margin=0.05)),
    ("q2d+q2q+d2q+d2d-all_negatives", torch.float64, None, "rows", 3, dict(
        temperature=0.05, margin=0.05, directions=ALL, hardness_mode="all_negatives", hardness_strength=5.0,
        **NO_GIST)),
    ("gist-matryoshka", torch.float64, (24, 12, 5), "tiles", 2, dict(temperature=0.05, margin=0.05)),
    ("gist-matryoshka", torch.float32, (24, 12, 5), "rows", 2, dict(temperature=0.05, margin=0.05)),
]
TRITON_IDS = [f"{name}-{precision(dtype)}-{plan}-rank{world - 1}of{world}" for name, dtype, _, plan, world, _ in TRITON]


def _chunk_budget(case: Case, dtype: torch.dtype, plan: str) -> int:
    """The backward budget of ``plan`` for ``case``: the bytes of one chunk of the plan's shape, counted by
    ``backward_chunks`` itself (given a problem of that shape and no bound, it makes the whole of it one chunk)."""
    block_m, block_n = _launcher_tiles(dtype, _n_dims(case))
    row_tiles, col_tiles = CHUNK_PLANS[plan]
    rows, cols = row_tiles * block_m, max(_widths(case)) if col_tiles is None else col_tiles * block_n
    chunk = _launcher_chunks(rows, cols, dtype, _n_dims(case), 2**60)
    assert (chunk.rows, chunk.cols) == (rows, cols), chunk
    return chunk.bytes


@pytest.mark.parametrize(("name", "dtype", "dims", "plan", "world", "options"), TRITON, ids=TRITON_IDS)
def test_each_chunk_budget_makes_the_chunks_it_means(name, dtype, dims, plan, world, options):
    """Each budget of ``test_triton_tiles_and_chunks_match_the_oracle`` cuts the backward as its plan says, by the
    rule of ``backward_chunks``: several row chunks, and several column chunks or chunks of several row tiles."""
    case = _triton_case(dtype, dims, world, **options)
    block_m, _ = _launcher_tiles(dtype, _n_dims(case))
    widest = max(_widths(case))
    chunks = _launcher_chunks(case.batch, widest, dtype, _n_dims(case), _chunk_budget(case, dtype, plan))
    assert math.ceil(case.batch / chunks.rows) >= 2, chunks
    if CHUNK_PLANS[plan][1] is None:
        assert chunks.cols == widest and chunks.rows > block_m, chunks
    else:
        assert math.ceil(widest / chunks.cols) >= 2, chunks


@pytest.mark.parametrize(("name", "dtype", "dims", "plan", "world", "options"), TRITON, ids=TRITON_IDS)
def test_triton_tiles_and_chunks_match_the_oracle(name, dtype, dims, plan, world, options, monkeypatch):
    """Loss, gradients and statistics of the Triton launcher over several row and column tiles per group and
    several backward chunks (the later ones at their row and column offsets), against the oracle."""
    from cgist.stage.triton import dense as triton_dense

    case = _triton_case(dtype, dims, world, **options)
    col_tiles = CHUNK_PLANS[plan][1]
    options = case.full_options(_chunk_budget(case, dtype, plan))
    columns, guide = case.inputs(dtype, seed=len(name))
    want, want_stats = _oracle(case, columns, guide, options)

    chunks: dict[str, list[tuple[int, int, int, int]]] = {}
    ran_tiles: list[dict] = []
    real_chunks = triton_dense.BackwardWork.chunks

    def observed_chunks(work, group):
        out = real_chunks(work, group)
        chunks.setdefault(group.name, []).extend(out)
        ran_tiles.append(work.state.tiles)
        return out

    monkeypatch.setattr(triton_dense.BackwardWork, "chunks", observed_chunks)
    leaves = [c.detach().to(DEVICE).requires_grad_() for c in columns]
    guide_here = None if guide is None else [g.to(DEVICE) for g in guide]
    loss, stats = _gist_loss(case, leaves, guide_here, options, "triton")
    grads = torch.autograd.grad(loss, leaves)

    # Every group spans several row and column tiles of the tiles the launcher ran, and the backward several chunks.
    bm, bn = ran_tiles[0]["BLOCK_M"], ran_tiles[0]["BLOCK_N"]
    assert math.ceil(case.batch / bm) > 2 and min(_widths(case)) > 2 * bn, (case.batch, _widths(case), ran_tiles[0])
    widest_chunks = max(chunks.values(), key=len)
    row_starts, col_starts = {c[0] for c in widest_chunks}, {c[2] for c in widest_chunks}
    assert len(row_starts) >= 2, widest_chunks
    if col_tiles is None:  # whole groups, several row tiles per chunk
        assert col_starts == {0} and widest_chunks[0][1] - widest_chunks[0][0] > bm, widest_chunks
    else:
        assert len(col_starts) >= 2, widest_chunks

    loss_tol, grad_tol = tolerance("triton", dtype)
    assert_close("triton", want, (loss, grads), (loss_tol, grad_tol))
    assert_close("triton stats", want_stats, stats, loss_tol)
