"""The streaming MaxSim loss stage on PyTorch: the multi-vector ranking loss over blocks of documents x blocks of
queries, without the token-similarity tensor (docs/design.md#late-interaction).

A tile is ``bq`` queries against ``bd`` documents: one matrix product of their token vectors
``(bq * Lq, D) @ (D, bd * Ld)`` into a buffer bounded by the budget, the maximum over each document's tokens, and the
sum over the query's tokens, weighted by its mask, in float32 (float64 for float64 inputs). Its scores update each
query's running softmax normaliser. The backward takes each tile's argmax, kept from the forward while the scores and
argmax fit the budget (``MaxSimCall.keep``), else computed again from the tile's product; the gradient of a score
reaches one document token per query token, so both gradients are gathers (``embedding_bag`` and its weight gradient)
instead of products as large as the forward's.

Documents are read as their row chunks (GradCache's mini-batches), never concatenated. A document tile is trimmed to
its last real token; a masked token inside it is replaced by a copy of the document's first real token, which leaves
every maximum unchanged, and its gradient goes back to that token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .workspace import _thread_buffer

__all__ = ["EMPTY_DOCUMENT_SCORE", "MaxSimCall", "accumulate", "kept_bytes", "maxsim_backward", "maxsim_forward"]

#: sentence-transformers' score of a document without any real token (before MeanMaxSim's division).
EMPTY_DOCUMENT_SCORE = -1e9
#: Documents per tile: enough columns that the product is efficient, few enough that a tile of queries is tall.
DOC_ROWS = 32


def accumulate(dtype: torch.dtype) -> torch.dtype:
    """The dtype the scores, the log-sum-exp and the gradients accumulate in: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class _DocTile:
    """``bd`` documents of one chunk, rows ``start:stop``: their tokens trimmed to ``width`` (masked tokens replaced
    by the document's first real one, ``remap``: the token each position reads, None when none is masked), and which
    documents have no real token (``empty``, None when all have one)."""

    chunk: int
    start: int
    stop: int
    tokens: Tensor  # (bd, width, D), contiguous
    remap: Tensor | None  # (bd, width) long
    empty: Tensor | None  # (bd,) bool
    first_row: int  # the global row of ``start`` in its column


@dataclass
class _QueryTile:
    """``bq`` queries of one chunk, rows ``start:stop``: their tokens trimmed to the last real one and each token's
    weight in the sum (its mask, divided by the query's real token count under MeanMaxSim)."""

    chunk: int
    start: int
    stop: int
    row: int  # the local row of ``start`` among all queries
    tokens: Tensor  # (bq * width, D), contiguous
    weights: Tensor  # (bq, width) ``accumulate(dtype)``
    fill: Tensor  # (bq, 1) ``accumulate(dtype)``: the score of an empty document


def _width(mask: Tensor) -> int:
    """The position after the last real token of any row of ``mask`` (at least 1)."""
    real = mask.any(0).nonzero()
    return int(real[-1]) + 1 if len(real) else 1


def _document_tiles(chunks: Sequence[Tensor], masks: Sequence[Tensor], rows: int) -> Iterator[_DocTile]:
    first_row = 0
    for c, (chunk, mask) in enumerate(zip(chunks, masks)):
        for start in range(0, chunk.shape[0], rows):
            stop = min(start + rows, chunk.shape[0])
            tile_mask = mask[start:stop]
            width = _width(tile_mask)
            tile_mask, tokens = tile_mask[:, :width], chunk[start:stop, :width]
            has = tile_mask.any(1)
            empty = None if bool(has.all()) else ~has
            remap = None
            if not bool(tile_mask.all()):
                first = tile_mask.to(torch.uint8).argmax(1, keepdim=True)
                remap = torch.where(tile_mask, torch.arange(width, device=mask.device), first)
                tokens = tokens.gather(1, remap.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
            yield _DocTile(c, start, stop, tokens.contiguous(), remap, empty, first_row + start)
        first_row += chunk.shape[0]


def _query_tiles(chunks: Sequence[Tensor], masks: Sequence[Tensor], rows: int,
                 length_normalize: bool) -> list[_QueryTile]:
    tiles, row = [], 0
    for c, (chunk, mask) in enumerate(zip(chunks, masks)):
        for start in range(0, chunk.shape[0], rows):
            stop = min(start + rows, chunk.shape[0])
            tile_mask = mask[start:stop]
            width = _width(tile_mask)
            weights = tile_mask[:, :width].to(accumulate(chunk.dtype))
            fill = torch.full((stop - start, 1), EMPTY_DOCUMENT_SCORE, dtype=weights.dtype, device=chunk.device)
            if length_normalize:
                counts = tile_mask.sum(1, keepdim=True).clamp(min=1).to(weights.dtype)
                weights, fill = weights / counts, fill / counts
            tokens = chunk[start:stop, :width].reshape(-1, chunk.shape[-1])
            tiles.append(_QueryTile(c, start, stop, row + start, tokens, weights, fill))
        row += chunk.shape[0]
    return tiles


def _tile_rows(queries: Sequence[Tensor], documents: Sequence[Sequence[Tensor]], budget_bytes: int) -> tuple[int, int]:
    """Rows per document tile and per query tile, so that one tile's product fits ``budget_bytes``."""
    lq = max(q.shape[1] for q in queries)
    ld = max(d.shape[1] for column in documents for d in column)
    itemsize = queries[0].element_size()
    doc_rows = max(1, min(DOC_ROWS, budget_bytes // max(1, lq * ld * itemsize)))
    query_rows = max(1, budget_bytes // max(1, lq * doc_rows * ld * itemsize))
    return doc_rows, query_rows


def _tile_scores(query: _QueryTile, doc: _DocTile, *, argmax: bool) -> tuple[Tensor, Tensor | None]:
    """The tile's MaxSim scores ``(bq, bd)`` in ``accumulate(dtype)``, sentence-transformers' score where a document is empty; with
    ``argmax``, the document token each query token's maximum is at ``(bq, Lq, bd)``, as positions of ``doc.tokens``."""
    bq, lq = query.weights.shape
    bd, ld = doc.tokens.shape[:2]
    product = _thread_buffer(bq * lq * bd * ld, query.tokens.dtype, query.tokens.device)
    product = product.view(bq * lq, bd * ld)
    torch.mm(query.tokens, doc.tokens.view(bd * ld, -1).T, out=product)
    per_token = product.view(bq, lq, bd, ld)
    if argmax:
        maxima, where = per_token.max(-1)
    else:
        maxima, where = per_token.amax(-1), None
    scores = torch.einsum("qtd,qt->qd", maxima.to(query.weights.dtype), query.weights)
    if doc.empty is not None:
        scores = torch.where(doc.empty, query.fill, scores)
    return scores, where


def _positives(query: _QueryTile, doc: _DocTile, offset: int) -> tuple[slice, slice] | None:
    """Where query rows' positives fall in a tile of the first document column: ``(query rows, document rows)``
    within the tile, or None. Query ``i`` (local) is paired with the first column's global row ``offset + i``."""
    lo = max(doc.first_row, offset + query.row)
    hi = min(doc.first_row + (doc.stop - doc.start), offset + query.row + (query.stop - query.start))
    if lo >= hi:
        return None
    q0, d0 = lo - offset - query.row, lo - doc.first_row
    return slice(q0, q0 + hi - lo), slice(d0, d0 + hi - lo)


@dataclass(frozen=True)
class MaxSimCall:
    """One loss-stage call's inputs. ``queries``: row chunks ``(b, Lq, D)`` with masks ``(b, Lq)`` (bool);
    ``documents``: columns, each a list of row chunks ``(r, Ld, D)`` with masks. Column ``n``'s global row ``j`` is
    score column ``j * N + n``; query ``i``'s label is the first column's row ``offset + i``. Scores are multiplied by
    ``scale``; with ``length_normalize`` (MeanMaxSim) divided by the query's real token count first."""

    queries: Sequence[Tensor]
    query_masks: Sequence[Tensor]
    documents: Sequence[Sequence[Tensor]]
    document_masks: Sequence[Sequence[Tensor]]
    scale: float
    length_normalize: bool
    offset: int
    budget_bytes: int
    #: Keep each tile's scores and argmax from the forward for the backward, instead of recomputing its product.
    keep: bool = False

    @property
    def n_queries(self) -> int:
        return sum(q.shape[0] for q in self.queries)

    def tiles(self) -> tuple[int, list[_QueryTile]]:
        """Rows per document tile, and the query tiles."""
        doc_rows, query_rows = _tile_rows(self.queries, self.documents, self.budget_bytes)
        return doc_rows, _query_tiles(self.queries, self.query_masks, query_rows, self.length_normalize)

    def document_tiles(self, doc_rows: int) -> Iterator[tuple[int, _DocTile]]:
        """Every document tile, with its column."""
        for n, (column, masks) in enumerate(zip(self.documents, self.document_masks)):
            for doc in _document_tiles(column, masks, doc_rows):
                yield n, doc


def maxsim_forward(call: MaxSimCall) -> tuple[Tensor, Tensor, Tensor, list[tuple[Tensor, Tensor]] | None]:
    """The mean loss over the local queries, each query's softmax normaliser as its largest logit ``peak`` and the
    sum of ``exp(logit - peak)``, and with ``call.keep`` each tile's scores and argmax (for ``maxsim_backward``).

    The normaliser stays in two parts, as a softmax does: the softmax of a query's largest logit is then
    ``1 / sum`` exactly, not ``exp(logit - log-sum-exp)``, whose rounding (an ulp of the log-sum-exp) would swamp
    the gradient of a query that already ranks its positive far above the rest.
    """
    doc_rows, q_tiles = call.tiles()
    device = call.queries[0].device
    dtype = accumulate(call.queries[0].dtype)
    peak = torch.full((call.n_queries,), float("-inf"), dtype=dtype, device=device)
    total = torch.zeros(call.n_queries, dtype=dtype, device=device)
    positive = torch.zeros(call.n_queries, dtype=dtype, device=device)
    kept = [] if call.keep else None
    for n, doc in call.document_tiles(doc_rows):
        for query in q_tiles:
            scores, where = _tile_scores(query, doc, argmax=call.keep)
            if kept is not None:
                kept.append((scores, where.to(_index_dtype(doc.tokens.shape[1]))))
            logits = scores * call.scale
            rows = slice(query.row, query.row + logits.shape[0])
            new_peak = torch.maximum(peak[rows], logits.amax(1))
            total[rows] = total[rows] * torch.exp(peak[rows] - new_peak) + torch.exp(logits - new_peak[:, None]).sum(1)
            peak[rows] = new_peak
            pairs = _positives(query, doc, call.offset) if n == 0 else None
            if pairs is not None:
                q_rows, d_rows = pairs
                positive[query.row + q_rows.start:query.row + q_rows.stop] = logits[q_rows, d_rows].diagonal()
    return (peak + torch.log(total) - positive).mean(), peak, total, kept


def _index_dtype(width: int) -> torch.dtype:
    """The narrowest integer dtype that holds a token position below ``width``."""
    return torch.uint8 if width <= 256 else torch.int16 if width <= 2**15 else torch.int32


def kept_bytes(n_queries: int, n_documents: int, query_tokens: int, document_tokens: int,
               dtype: torch.dtype) -> int:
    """The bytes that ``MaxSimCall.keep`` holds between the passes: a score and an argmax per query token for every
    query and document (at most; trimmed tiles hold less)."""
    index = torch.empty(0, dtype=_index_dtype(document_tokens)).element_size()
    return n_queries * n_documents * (query_tokens * index + torch.empty(0, dtype=accumulate(dtype)).element_size())


def maxsim_backward(call: MaxSimCall, peak: Tensor, total: Tensor, grad_output: float,
                    kept: list[tuple[Tensor, Tensor]] | None = None) -> tuple[list[Tensor], list[list[Tensor]]]:
    """The gradients of ``grad_output`` times the loss, for every query chunk and every document chunk (in
    ``accumulate(dtype)``), from the softmax normaliser of ``maxsim_forward`` and, if it kept them, its tiles'
    scores and argmax (else each tile's product is computed again)."""
    doc_rows, q_tiles = call.tiles()
    device = call.queries[0].device
    dtype = peak.dtype
    q_grads = [torch.zeros(q.shape, dtype=dtype, device=device) for q in call.queries]
    d_grads = [[torch.zeros(d.shape, dtype=dtype, device=device) for d in column] for column in call.documents]
    unit = grad_output * call.scale / call.n_queries
    tiles = iter(kept) if kept is not None else None
    for n, doc in call.document_tiles(doc_rows):
        _tile_backward(doc, q_tiles, d_grads[n][doc.chunk], q_grads, (peak, total), unit, call.scale,
                       call.offset if n == 0 else None, tiles)
    return q_grads, d_grads


def _tile_backward(doc: _DocTile, q_tiles: list[_QueryTile], doc_grad: Tensor, q_grads: list[Tensor],
                   normaliser: tuple[Tensor, Tensor], unit: float, scale: float, offset: int | None,
                   kept: Iterator[tuple[Tensor, Tensor]] | None) -> None:
    """One document tile's share of the gradients: against every query tile, each score's gradient
    ``unit * (softmax - label)`` sent along the argmax of each query token, to the query token (the document token's
    vector, gathered) and to the document token (the query token's vector, scattered)."""
    peak, total = normaliser
    bd, ld, dim = doc.tokens.shape
    doc_tokens = doc.tokens.view(bd * ld, dim).to(peak.dtype).requires_grad_()
    column_base = torch.arange(bd, device=doc_tokens.device) * ld
    doc_acc = torch.zeros(bd * ld, dim, dtype=peak.dtype, device=doc_tokens.device)
    for query in q_tiles:
        scores, where = _tile_scores(query, doc, argmax=True) if kept is None else next(kept)
        rows = slice(query.row, query.row + scores.shape[0])
        grad = torch.exp(scores * scale - peak[rows, None]) * (unit / total[rows, None])
        pairs = _positives(query, doc, offset) if offset is not None else None
        if pairs is not None:
            q_rows, d_rows = pairs
            grad[q_rows, d_rows] -= torch.eye(q_rows.stop - q_rows.start, dtype=grad.dtype, device=grad.device) * unit
        if doc.empty is not None:
            grad = grad.masked_fill(doc.empty, 0.0)
        bq, lq = query.weights.shape
        weights = (grad.unsqueeze(1) * query.weights.unsqueeze(2)).reshape(bq * lq, bd)
        index = (where.long() + column_base).reshape(bq * lq, bd)
        with torch.enable_grad():
            gathered = F.embedding_bag(index, doc_tokens, per_sample_weights=weights, mode="sum")
            (into_doc,) = torch.autograd.grad(gathered, doc_tokens, query.tokens.to(peak.dtype))
        q_grads[query.chunk][query.start:query.stop, :lq] += gathered.detach().view(bq, lq, dim)
        doc_acc += into_doc
    target = doc_grad[doc.start:doc.stop]
    if doc.remap is None:
        target[:, :ld] += doc_acc.view(bd, ld, dim)
    else:
        flat = target.view(bd * target.shape[1], dim)
        positions = doc.remap + torch.arange(bd, device=flat.device).unsqueeze(1) * target.shape[1]
        flat.index_add_(0, positions.reshape(-1), doc_acc)
