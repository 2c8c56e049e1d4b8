"""Streaming GIST loss in PyTorch: the CPU path, and the fallback for GPUs without Triton.

Anchor rows are processed in blocks. Each row block is scored against the candidate columns of every
score block (AP, AA, PP, AN_1..AN_k) with matrix products on normalised copies of the embeddings,
masked against the guide threshold and reduced to a log-sum-exp; the gradients with respect to the
normalised embeddings come from the same scores, and one normalisation backward at the end turns them
into embedding gradients. Nothing of size B x N is ever allocated.

Two schedules, chosen per call by ``plan``:

* one pass (the usual case): a row block holds its logits against all C candidate columns at once, so
  the loss and the gradients come from one set of matrix products;
* two passes, when even ``ROW_FLOOR`` rows against all columns would not fit the budget: row block x
  column chunk tiles, an online log-sum-exp over the chunks, then a second sweep that recomputes each
  tile (the same products, so the same masks) and forms its gradients. Memory is then bounded at any B,
  for one more set of score products.

Block shape. A row block of R rows costs two products per score block, R x D @ D x C and its
transposes; below a few hundred rows they run far below the machine's GEMM rate and the per-block
overhead of the gradient accumulation dominates (see ``plan``). ``ROW_FLOOR`` rows per block are
therefore the target, and the default budget grows to reach it, up to a cap from the memory that is
actually available.

Precision. Logits are in base 2 (``log2(e) / tau`` is folded into the score product), shifted by the
row maximum, which is seeded with the positive logit. The label is kept out of the running sum, so the
loss is formed as ``(max - positive) * ln 2 + log1p(sum_others + expm1((positive - max) * ln 2))``: a
small loss keeps its relative precision instead of inheriting the absolute rounding of a number near
1/tau.

Subnormal numbers. Many CPUs run arithmetic on subnormal floats a hundred times slower (a matrix
product with subnormal operands was measured 200x slower here), and at tau = 0.01 a large share of the
softmax underflows into that range. Shifted logits whose score gradient would be subnormal are dropped
before ``exp2`` (set to -inf, which ``exp2`` maps to 0 at full speed): each of them is below
``smallest normal float * C / (tau * B)``, so all of them together change the loss and the gradients by
less than the number of columns times the smallest normal float.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .numerics import TieIndex, compute_dtype, guide_mask, normalize, normalize_backward_, threshold, tie_ids
from .options import GistOptions

__all__ = ["ROW_FLOOR", "Plan", "default_block_bytes", "gist_loss_and_grads", "plan"]

#: Rows per block that the default budget grows to reach (measured, see ``plan``).
ROW_FLOOR = 256
#: Smallest default budget, bytes of score buffers held at once.
MIN_BLOCK_BYTES = 16 * 2**20
#: The default budget never exceeds this share of the memory available to the process.
MEMORY_SHARE = 8
LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def _available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free memory, or the host's MemAvailable (physical memory elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_block_bytes(device: torch.device, floor_bytes: int) -> int:
    """The budget used when none is given: enough for ``floor_bytes``, capped by available memory.

    ``floor_bytes`` is what ``ROW_FLOOR`` rows need in one pass. On CUDA the cap is also 1 GiB.
    """
    cap = _available_bytes(device) // MEMORY_SHARE
    if device.type == "cuda":
        cap = min(cap, 2**30)
    return max(min(max(MIN_BLOCK_BYTES, floor_bytes), cap), 1)


@dataclass(frozen=True)
class Plan:
    """How a call is tiled: ``rows`` per row block, and ``cols`` per column chunk (None: one pass)."""

    rows: int
    cols: int | None


def plan(batch: int, n_score_cols: int, widest_block: int, itemsize: int, block_bytes: int | None,
         device: torch.device = torch.device("cpu")) -> Plan:
    """Choose the schedule for B = ``batch`` anchor rows against ``n_score_cols`` columns in all.

    One pass holds, per row, the logits of every column plus one block's guide scores and masks:
    ``n_score_cols * itemsize + widest_block * (itemsize + 2)`` bytes. The rows per block are the budget
    divided by that; with the default budget (``block_bytes=None``) the budget first grows so that
    ``ROW_FLOOR`` rows fit, unless that exceeds an eighth of the available memory. When fewer than
    ``min(ROW_FLOOR, B)`` rows fit, the call runs in two passes with ``min(ROW_FLOOR, B)`` rows per
    block and as many columns per chunk as the budget allows (at least one).

    Measured (2 threads, D = Dg = 384, k = 1, B = 4096, fp32): see the README's CPU performance section;
    128 rows ran 1.4x slower than 256, and 512 or 1024 rows gained less than 5% over 256.
    """
    per_row = n_score_cols * itemsize + widest_block * (itemsize + 2)
    floor = min(ROW_FLOOR, batch)
    if block_bytes is None:
        block_bytes = default_block_bytes(device, floor * per_row)
    rows = min(batch, block_bytes // per_row)
    if rows >= floor:
        return Plan(rows, None)
    return Plan(floor, max(1, block_bytes // (floor * (2 * itemsize + 2))))


@dataclass
class _Column:
    """One embedding column, normalised: student rows, guide rows, guide tie ids, gradient accumulator."""

    x: Tensor
    g: Tensor
    ids: Tensor
    grad: Tensor | None

    def __post_init__(self) -> None:
        self.ties = TieIndex(self.ids)


@dataclass
class _Block:
    """A score block: its rows are anchors (or, for PP, this rank's positives) against ``cols``."""

    cols: _Column
    positive_rows: bool = False
    has_label: bool = False


@dataclass
class _Rows:
    """The rows of one row block as one score block sees them, and the per-row state they share."""

    x: Tensor  # normalised student rows, R x D
    g: Tensor  # normalised guide rows, R x Dg
    partner_ids: Tensor  # tie id of theta's partner, R
    grad: Tensor | None  # their slice of the gradient accumulator


class _Problem:
    """Everything one call shares between row blocks."""

    def __init__(self, embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor], options: GistOptions,
                 need_grads: bool) -> None:
        self.options = options
        self.dtype = compute_dtype(embeddings[0].dtype)
        normed = [normalize(e, self.dtype) for e in embeddings]
        self.hats, self.norms = [x for x, _ in normed], [n for _, n in normed]
        guide_hats = [normalize(g, self.dtype)[0] for g in guide_embeddings]
        ids = tie_ids(guide_embeddings, self.dtype)
        grads = [torch.zeros_like(x) if need_grads else None for x in self.hats]
        self.columns = [_Column(*c) for c in zip(self.hats, guide_hats, ids, grads)]
        anchor, positive, *negatives = self.columns
        self.blocks = [_Block(positive, has_label=True)]
        if options.contrast_anchors:
            self.blocks.append(_Block(anchor))
        if options.contrast_positives:
            self.blocks.append(_Block(positive, positive_rows=True))
        self.blocks.extend(_Block(n) for n in negatives)
        self.batch, self.n_cand = anchor.x.shape[0], positive.x.shape[0]
        self.n_score_cols = sum(b.cols.x.shape[0] for b in self.blocks)
        self.logit_scale = LOG2E / options.temperature
        self.grad_scale = 1.0 / (options.temperature * self.batch)
        # Shifted base-2 logits below this are dropped: their terms, and their products with embedding
        # components down to 2^-23, would be subnormal.
        self.cutoff = math.log2(torch.finfo(self.dtype).tiny) + 24.0

    def rows(self, start: int, stop: int) -> tuple[_Rows, _Rows]:
        """Rows ``start:stop`` as anchors, and as PP's rows (this rank's positives ``offset + start:stop``)."""
        anchor, positive = self.columns[0], self.columns[1]
        lo, hi = self.options.offset + start, self.options.offset + stop

        def grad(column: _Column, a: int, b: int) -> Tensor | None:
            return None if column.grad is None else column.grad[a:b]

        as_anchor = _Rows(anchor.x[start:stop], anchor.g[start:stop], positive.ids[lo:hi], grad(anchor, start, stop))
        as_positive = _Rows(positive.x[lo:hi], positive.g[lo:hi], anchor.ids[start:stop], grad(positive, lo, hi))
        return as_anchor, as_positive


class _RowBlock:
    """One row block: its threshold, its positive logits, and the masked, shifted logits of column ranges."""

    def __init__(self, problem: _Problem, start: int, stop: int) -> None:
        self.problem, self.start, self.stop = problem, start, stop
        options = problem.options
        self.anchor_rows, self.positive_rows = problem.rows(start, stop)
        positive = problem.columns[1]
        lo, hi = options.offset + start, options.offset + stop
        # theta_i and the positive logit: anchor i against its label, candidate offset + i.
        theta = (self.anchor_rows.g * positive.g[lo:hi]).sum(dim=1, keepdim=True)
        self.positive = (self.anchor_rows.x * positive.x[lo:hi]).sum(dim=1) * problem.logit_scale
        self.limit = threshold(theta, options.margin, options.relative)
        self.theta_masked = theta > self.limit
        self.local = torch.arange(stop - start, device=theta.device)

    def rows_of(self, block: _Block) -> _Rows:
        return self.positive_rows if block.positive_rows else self.anchor_rows

    def labels(self, block: _Block, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the labels among columns ``lo:hi`` of ``block`` (none unless it is AP)."""
        if not block.has_label:
            return self.local[:0], self.local[:0]
        cols = self.local + (self.problem.options.offset + self.start - lo)
        inside = (cols >= 0) & (cols < hi - lo)
        return self.local[inside], cols[inside]

    def shifted_logits(self, block: _Block, lo: int, hi: int, shift: Tensor) -> Tensor:
        """Base-2 logits minus ``shift`` of this row block against columns ``lo:hi``; -inf where masked.

        The label of row i (AP column ``offset + i``) is never masked, but its logit is carried apart
        (``self.positive``), so here it is -inf too.
        """
        rows, cols = self.rows_of(block), block.cols
        guide = rows.g @ cols.g[lo:hi].T
        mask = guide_mask(guide, self.limit, self.theta_masked, cols.ties, rows.partner_ids, lo)
        del guide
        mask[self.labels(block, lo, hi)] = True
        logits = torch.addmm(-shift.unsqueeze(1), rows.x, cols.x[lo:hi].T, alpha=self.problem.logit_scale)
        return logits.masked_fill_(mask, float("-inf"))

    def accumulate(self, block: _Block, weights: Tensor, lo: int, hi: int, row_scale: Tensor) -> None:
        """Add ``diag(row_scale) @ weights`` (dL/d cosine of the tile) into its rows' and columns' gradients."""
        rows, cols = self.rows_of(block), block.cols
        rows.grad.addcmul_(weights @ cols.x[lo:hi], row_scale.unsqueeze(1))
        cols.grad[lo:hi].addmm_(weights.T, rows.x * row_scale.unsqueeze(1))


def _spans(block: _Block, cols: int | None):
    """The column ranges ``(lo, hi)`` of ``block``: all of it, or chunks of ``cols``."""
    n = block.cols.x.shape[0]
    step = n if cols is None else cols
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _softmax_terms(problem: _Problem, block_rows: _RowBlock, cols: int | None, shift: Tensor, keep: bool):
    """``2^(z - shift)`` of every unmasked non-label entry: their row sums, and the tiles if ``keep``.

    Shifted logits below ``problem.cutoff`` are dropped (module docstring, on subnormal numbers).
    """
    others = torch.zeros_like(shift)
    tiles = []
    for b in problem.blocks:
        for lo, hi in _spans(b, cols):
            tile = block_rows.shifted_logits(b, lo, hi, shift)
            torch.nn.functional.threshold_(tile, problem.cutoff, float("-inf"))
            others += tile.exp2_().sum(dim=1)
            if keep:
                tiles.append((b, lo, hi, tile))
    return others, tiles


def _row_block(problem: _Problem, block_rows: _RowBlock, cols: int | None) -> Tensor:
    """Loss sum of one row block; accumulates its gradients when they are wanted.

    With ``cols`` None, the tiles against all columns are kept from the sums to the gradients (one
    pass); otherwise column chunks of ``cols`` are recomputed for the gradients (two passes). Logits are
    shifted by the positive's, so that the positive's term is 1 and, usually, the loss is log1p of the
    others' sum; only when that sum overflows (a candidate scores ~128 base-2 units above the positive)
    is the shift raised to the row maximum, found by one more sweep.
    """
    one_pass, want_grads = cols is None, problem.columns[0].grad is not None
    shift = block_rows.positive
    others, tiles = _softmax_terms(problem, block_rows, cols, shift, keep=one_pass and want_grads)
    if not bool(torch.isfinite(others).all()):
        peak = torch.stack([block_rows.shifted_logits(b, lo, hi, shift).amax(dim=1)
                            for b in problem.blocks for lo, hi in _spans(b, cols)]).amax(dim=0)
        shift = shift + peak.clamp_min(0.0)
        others, tiles = _softmax_terms(problem, block_rows, cols, shift, keep=one_pass and want_grads)
    gap = (shift - block_rows.positive) * LN2
    loss = (gap + torch.log1p(others + torch.expm1(-gap))).sum()
    if want_grads:
        # dL/d cosine = (softmax - onehot) / (tau * B): the tiles times grad_scale / total per row, where
        # the label's entry is -others (exact, where softmax - 1 would cancel).
        row_scale = problem.grad_scale / (others + torch.exp(-gap))
        if not one_pass:
            tiles = ((b, lo, hi, _softmax_terms_tile(problem, block_rows, b, lo, hi, shift))
                     for b in problem.blocks for lo, hi in _spans(b, cols))
        for b, lo, hi, tile in tiles:
            rows, labels = block_rows.labels(b, lo, hi)
            tile[rows, labels] = -others[rows]
            block_rows.accumulate(b, tile, lo, hi, row_scale)
    return loss


def _softmax_terms_tile(problem: _Problem, block_rows: _RowBlock, block: _Block, lo: int, hi: int,
                        shift: Tensor) -> Tensor:
    tile = block_rows.shifted_logits(block, lo, hi, shift)
    torch.nn.functional.threshold_(tile, problem.cutoff, float("-inf"))
    return tile.exp2_()


@torch.no_grad()
def gist_loss_and_grads(
    embeddings: Sequence[Tensor],
    guide_embeddings: Sequence[Tensor],
    options: GistOptions,
    *,
    need_grads: bool,
    block_bytes: int | None = None,
) -> tuple[Tensor, list[Tensor] | None]:
    """Loss and, if ``need_grads``, d(loss)/d(embeddings) for ``embeddings = [anchor, positive, *negatives]``.

    Shapes: anchor B x D, positive and negatives N x D, guide columns likewise in Dg; anchor i's label
    is candidate ``options.offset + i``. ``block_bytes`` bounds the score buffers held at once (None: a
    default from ``plan``). The loss is float64 for float64 inputs and float32 otherwise; the gradients
    have the dtype of their embedding.
    """
    problem = _Problem(embeddings, guide_embeddings, options, need_grads)
    itemsize = torch.finfo(problem.dtype).bits // 8
    widest = max(b.cols.x.shape[0] for b in problem.blocks)
    schedule = plan(problem.batch, problem.n_score_cols, widest, itemsize, block_bytes, problem.hats[0].device)
    loss = torch.zeros((), dtype=problem.dtype, device=problem.hats[0].device)
    for start in range(0, problem.batch, schedule.rows):
        block_rows = _RowBlock(problem, start, min(start + schedule.rows, problem.batch))
        loss += _row_block(problem, block_rows, schedule.cols)
    loss = loss / problem.batch
    if not need_grads:
        return loss, None
    grads = [
        normalize_backward_(x_hat, norm, column.grad).to(e.dtype)
        for x_hat, norm, column, e in zip(problem.hats, problem.norms, problem.columns, embeddings)
    ]
    return loss, grads
