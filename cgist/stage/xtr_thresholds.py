"""XTR's thresholds (docs/design.md#xtr), run as they are by both of the XTR score's backends (torch, on any
device): the sweep that finds each query token's threshold ``tau_t`` (``thresholds``, over ``TopK``), the rounding
bound under which a maximum still ties with it (``tie_slack``, ``lowered``), and the rule that keeps a maximum
(``retrieved``). The score's problem model, its call and its door are ``cgist.stage.spec.xtr``'s. It imports only
torch, the spec and the loss stage's leaf modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .budget import split_budget, threshold_rows
from .numerics import compute_dtype
from .spec.maxsim import Part
from .spec.xtr import XTRCall

__all__ = ["DOC_ROWS", "TopK", "lowered", "retrieved", "run_length", "thresholds", "tie_slack"]

#: Document tiles of the thresholds' sweep, in documents.
DOC_ROWS = 16
#: ``TopK`` lists at most ``1 / MERGE_SHARE`` as many candidates as it keeps values (and at most ``2 k`` a row)
#: before it merges them, ``MERGE_ROWS`` rows at a time: what it holds beyond its kept values stays a fraction of
#: them.
MERGE_SHARE = 4
MERGE_ROWS = 256



def retrieved(maxima: Tensor, tau: Tensor, weights: Tensor) -> Tensor:
    """Which maxima count (float 0/1, as ``maxima``): a real query token's (``weights`` non-zero) maximum at least its
    threshold ``tau`` (broadcast against ``maxima``): XTR's rule as the PyTorch backend applies it; the kernels compare
    alike."""
    return ((maxima >= tau) & (weights != 0)).to(maxima.dtype)


class TopK:
    """The ``k`` largest similarities offered so far for each of ``rows`` query tokens, and their least (the row's
    floor): the sweep that finds XTR's thresholds, fed a tile of document tokens at a time by ``thresholds`` (its own
    products) or by the PyTorch backend's first sweep (its tiles' products, ``cgist.stage.pytorch.xtr``).

    A tile's similarities come laid out ``(documents, tokens, query tokens)``. Each document's tokens are read in
    runs (``run_length``: a divisor of the token count near 16); the runs' maxima give the documents' (which the
    caller gets back: MaxSim's maxima), and a document or a run whose largest similarity is not above a query token's
    floor holds none that is, so only the runs above it, in the documents above it, are read again; their
    similarities above the floor are candidates, listed, and merged into the kept values once they are as many (so
    the floor they pass may be a few tiles old: a candidate that a newer floor would have stopped is dropped at the
    merge). After the first few tiles few documents are above the floor, and a tile costs its product and the
    maxima of its runs. While a row has fewer than ``k`` values (its floor is -inf) the tile's own ``k`` largest are
    merged at once. Ties: a similarity equal to the floor adds nothing (the ``k``-th largest stays), so none is
    listed."""

    def __init__(self, rows: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = k
        self.kept = torch.full((rows, k), float("-inf"), dtype=dtype, device=device)
        self.floor = torch.full((rows,), float("-inf"), dtype=dtype, device=device)
        self.filled = False  # every row holds k values: every floor is finite
        self.candidates: list[tuple[Tensor, Tensor]] = []
        self.limit = max(k, rows * k // MERGE_SHARE)  # candidates listed before a merge
        self.held = 0  # listed
        self.counts = torch.zeros(rows, dtype=torch.long, device=device)  # listed, by row

    def offer(self, values: Tensor, real: Tensor | None, rows: Tensor) -> Tensor:
        """A tile: ``values`` ``(bd, Ld, Q)`` (a view of any strides whose token axis can be split), which document
        tokens are real ``(bd, Ld)`` (None: all), and the row of each of the ``Q`` query tokens. Returns each
        document's largest value for each query token, ``(bd, Q)`` in ``values``' dtype (the runs' maxima's)."""
        bd, ld, q = values.shape
        if not self.filled:
            for start in range(0, q, MERGE_ROWS):
                tile = values[:, :, start:start + MERGE_ROWS].reshape(bd * ld, -1).to(self.kept.dtype)
                if real is not None:
                    tile = tile.masked_fill(~real.reshape(bd * ld, 1), float("-inf"))
                self._merge(rows[start:start + MERGE_ROWS], tile.topk(min(self.k, bd * ld), 0).values.T)
            self.filled = bool(self.floor.isfinite().all())
            return values.amax(1)
        run = run_length(ld)
        runs = values.view(bd, ld // run, run, q)
        peaks = runs.amax(2)  # (bd, runs, Q)
        maxima = peaks.amax(1)
        floor = self.floor[rows]
        doc, col = (maxima > floor).nonzero(as_tuple=True)  # the documents with a token above the floor
        if not doc.shape[0]:
            return maxima
        pair, at = (peaks[doc, :, col] > floor[col].unsqueeze(1)).nonzero(as_tuple=True)
        doc, col = doc[pair], col[pair]
        step = max(1, self.limit // run)  # hot runs read at once: their values fit the list
        for start in range(0, doc.shape[0], step):
            d, a, c = doc[start:start + step], at[start:start + step], col[start:start + step]
            segments = runs[d, a, :, c].to(self.kept.dtype)  # (hot runs, run)
            passing = segments > self.floor[rows[c]].unsqueeze(1)  # the floor as the last merge left it
            if real is not None:
                passing &= real.view(bd, ld // run, run)[d, a]
            hit, _ = passing.nonzero(as_tuple=True)
            self._add(rows[c[hit]], segments[passing])
        return maxima

    def kth(self) -> Tensor:
        """Each row's ``k``-th largest similarity offered, ``(rows,)``; -inf where fewer were."""
        if self.candidates:
            self._merge_listed()
        return self.floor

    def _add(self, rows: Tensor, values: Tensor) -> None:
        self.candidates.append((rows, values))
        self.held += rows.shape[0]
        self.counts += torch.bincount(rows, minlength=self.counts.shape[0])
        if self.held > self.limit or int(self.counts.max()) > 2 * self.k:
            self._merge_listed()

    def _merge(self, rows: Tensor | slice, more: Tensor) -> None:
        """Keep the ``k`` largest of each of ``rows``' kept values (an index or a slice) and ``more`` ``(rows, n)``."""
        merged = torch.cat([self.kept[rows], more], 1).topk(self.k, 1, sorted=False).values
        self.kept[rows] = merged
        self.floor[rows] = merged.amin(1)

    def _merge_listed(self) -> None:
        """The listed candidates merged, ``MERGE_ROWS`` rows at a time, laid out by row (-inf past a row's own);
        the list emptied."""
        row = torch.cat([r for r, _ in self.candidates])
        value = torch.cat([v for _, v in self.candidates])
        counts, most = self.counts, int(self.counts.max())
        self.candidates, self.held, self.counts = [], 0, torch.zeros_like(counts)
        order = row.argsort(stable=True)
        row, value = row[order], value[order]
        ends = counts.cumsum(0)
        position = torch.arange(row.shape[0], device=row.device) - (ends - counts)[row]
        ends = ends.tolist()
        for start in range(0, counts.shape[0], MERGE_ROWS):
            stop = min(start + MERGE_ROWS, counts.shape[0])
            first, last = (ends[start - 1] if start else 0), ends[stop - 1]
            out = torch.full((stop - start, most), float("-inf"), dtype=value.dtype, device=value.device)
            out[row[first:last] - start, position[first:last]] = value[first:last]
            self._merge(slice(start, stop), out)


@torch.no_grad()
def thresholds(call: XTRCall) -> Tensor:
    """Each query token's threshold, ``(n_queries, Lq)`` in the compute dtype (``Lq`` the widest query chunk's; +inf
    past a chunk's width): ``tau_t``, the ``top_k``-th largest of its similarities with every real document token of
    the call (products in the inputs' dtype, as the tiles' and sentence-transformers'), -inf where the pool holds
    fewer real tokens (every one is retrieved); lowered by ``tie_slack`` (docs/design.md#xtr).

    A block of query tokens sweeps the documents a tile of ``DOC_ROWS`` documents at a time (``TopK``: the product,
    each document's maximum, and the few documents above the floor read again). The block's kept values and
    candidates and a tile's similarities fit half the budget (``cgist.stage.budget.threshold_rows``)."""
    (part,) = call.parts
    acc = compute_dtype(call.dtype)
    tiles = _document_tiles(part)
    ld = max(tokens.shape[1] for tokens, _ in tiles)
    block_rows = threshold_rows(call.top_k, DOC_ROWS * ld, torch.empty(0, dtype=acc).element_size(),
                                split_budget(call.budget_bytes)[0])
    lq = max(chunk.shape[1] for chunk in part.queries)
    tau = torch.full((call.n_queries, lq), float("inf"), dtype=acc, device=call.device)
    row = 0
    for chunk in part.queries:
        tokens = chunk.reshape(-1, chunk.shape[2])
        chunk_tau = torch.empty(tokens.shape[0], dtype=acc, device=call.device)
        for start in range(0, tokens.shape[0], block_rows):
            block = tokens[start:start + block_rows]
            top = TopK(block.shape[0], call.top_k, acc, call.device)
            rows = torch.arange(block.shape[0], device=call.device)
            for documents, real in tiles:
                bd, width = documents.shape[:2]
                similarities = (block @ documents.reshape(bd * width, -1).T).view(-1, bd, width)
                if real is not None:
                    similarities.masked_fill_(~real, float("-inf"))
                top.offer(similarities.permute(1, 2, 0), None, rows)
            chunk_tau[start:start + block.shape[0]] = top.kth()
        tau[row:row + chunk.shape[0], :chunk.shape[1]] = chunk_tau.view(chunk.shape[:2])
        row += chunk.shape[0]
    return lowered(tau, tie_slack(call))


def run_length(tokens: int) -> int:
    """The run of a document's tokens whose maximum ``TopK`` compares with the floors: the divisor of ``tokens``
    nearest 16 from 8 to 32 (``tokens`` itself where none is)."""
    runs = [d for d in range(8, 33) if tokens % d == 0]
    return min(runs, key=lambda d: abs(d - 16)) if runs else tokens


def _document_tiles(part: Part) -> list[tuple[Tensor, Tensor | None]]:
    """The part's documents, ``DOC_ROWS`` of a chunk at a time: their tokens ``(n, Ld, D)`` (a view) and which are
    real ``(n, Ld)`` (None where all are)."""
    tiles = []
    for column, masks in zip(part.documents, part.document_masks):
        for chunk, mask in zip(column, masks):
            for start in range(0, chunk.shape[0], DOC_ROWS):
                real = mask[start:start + DOC_ROWS]
                tiles.append((chunk[start:start + DOC_ROWS], None if bool(real.all()) else real))
    return tiles


def tie_slack(call: XTRCall) -> Tensor:
    """How far below its threshold a query token's maximum still counts as tied with it, ``(n_queries, Lq)`` in the
    compute dtype: the rounding bound of a dot product of ``D`` terms, ``D * eps * |q_t| * max |d|`` (``max |d|``
    over the documents' real tokens), so that a maximum that another summation order of the same products (a tile,
    a kernel) puts a rounding error below the threshold is retrieved, as the token at the threshold is. It is far
    below a half-precision step: half-precision products tie only when equal."""
    (part,) = call.parts
    acc = compute_dtype(call.dtype)
    largest = torch.zeros((), dtype=acc, device=call.device)
    for documents, real in _document_tiles(part):
        norms = torch.linalg.vector_norm(documents, dim=2, dtype=acc)
        largest = torch.maximum(largest, (norms if real is None else norms.masked_fill(~real, 0.0)).max())
    lq = max(q.shape[1] for q in part.queries)
    norms = torch.cat([F.pad(torch.linalg.vector_norm(q, dim=2, dtype=acc), (0, lq - q.shape[1]))
                       for q in part.queries])
    return call.first.shape[2] * torch.finfo(acc).eps * norms * largest


def lowered(tau: Tensor, slack: Tensor) -> Tensor:
    """The thresholds ``tau`` lowered by ``slack`` (``tie_slack``'s, the same shape) where they are finite."""
    return torch.where(tau.isfinite(), tau - slack, tau)
