"""The MaxSim score on the PyTorch backend: the multi-vector loss over blocks of documents x blocks of queries,
without the token-similarity tensor (docs/design.md#late-interaction). The backend contract: ``forward`` and
``backward`` (docs/design.md#dispatch).

A tile is ``bq`` queries against ``bd`` documents: one matrix product of their token vectors
``(bd * Ld, D) @ (D, bq * Lq)`` into a buffer bounded by the budget, the maximum over each document's tokens, and the
sum over the query's tokens, weighted by its mask (``cgist.stage.spec.maxsim.query_weights``), in float32 (float64 for
float64 inputs). The queries go in row blocks, each swept twice over every document of every part of the call (its
row sides, ``cgist.stage.spec.maxsim.Part``): the first sweep keeps the block's scores and each tile's argmax, which
make the block's softmax exact (``cgist.stage.block``: the guide's mask and the softmax, written once); the
second sends each score's gradient along the argmax. The gradient of a score reaches one document token per query
token, so the gradients are a gather (``embedding_bag``) and a scatter (``index_add_``) instead of products as large as
the forward's, and no product is computed twice. The gradients are made in the forward (``backward`` scales them by
the loss's incoming gradient), as a loss stage's backward follows its forward at once.

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

from ..block import BlockMasks, block_softmax
from ..budget import argmax_dtype, kept_bytes, split_budget, tile_rows
from ..numerics import compute_dtype
from ..spec.call import Grads
from ..spec.maxsim import MaxSimCall, Part, query_weights
from .workspace import _thread_buffer

__all__ = ["MAXSIM_REDUCTION", "Reduction", "forward", "maxsim_scores"]


@dataclass
class _DocTile:
    """``bd`` documents of one chunk, rows ``start:stop``: their tokens trimmed to ``width`` (masked tokens replaced
    by the document's first real one, ``remap``: the token each position reads, None when none is masked; ``real``:
    which positions are real tokens), and which documents have no real token (``empty``, None when all have one)."""

    chunk: int
    start: int
    stop: int
    tokens: Tensor  # (bd, width, D), contiguous
    remap: Tensor | None  # (bd, width) long
    empty: Tensor | None  # (bd,) bool
    real: Tensor | None  # (bd, width) bool: which positions are real tokens (None when all are)
    largest: Tensor  # (bd, 1) the compute dtype: each document's largest token norm (``_tie_floor``)


@dataclass
class _QueryTile:
    """``bq`` queries of one chunk, rows ``start:stop``: their tokens trimmed to the last real one and each token's
    weight in the sum (its mask, divided by the query's real token count under MeanMaxSim)."""

    chunk: int
    start: int
    stop: int
    row: int  # the local row of ``start`` among all queries
    tokens: Tensor  # (bq * width, D), contiguous
    weights: Tensor  # (bq, width) the compute dtype
    fill: Tensor  # (bq, 1) the compute dtype: the score of an empty document
    norms: Tensor  # (bq * width,) the compute dtype: each token's norm (``_tie_floor``)


def _width(mask: Tensor) -> int:
    """The position after the last real token of any row of ``mask`` (at least 1)."""
    real = mask.any(0).nonzero()
    return int(real[-1]) + 1 if len(real) else 1


def _column_tiles(chunks: Sequence[Tensor], masks: Sequence[Tensor], rows: int) -> Iterator[_DocTile]:
    for c, (chunk, mask) in enumerate(zip(chunks, masks)):
        for start in range(0, chunk.shape[0], rows):
            stop = min(start + rows, chunk.shape[0])
            tile_mask = mask[start:stop]
            width = _width(tile_mask)
            tile_mask, tokens = tile_mask[:, :width], chunk[start:stop, :width]
            has = tile_mask.any(1)
            empty = None if bool(has.all()) else ~has
            remap = real = None
            if not bool(tile_mask.all()):
                first = tile_mask.to(torch.uint8).argmax(1, keepdim=True)
                remap = torch.where(tile_mask, torch.arange(width, device=mask.device), first)
                tokens = tokens.gather(1, remap.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
                real = tile_mask
            largest = torch.linalg.vector_norm(tokens, dim=2, dtype=compute_dtype(tokens.dtype)).amax(1, keepdim=True)
            yield _DocTile(c, start, stop, tokens.contiguous(), remap, empty, real, largest)


def _query_tiles(chunks: Sequence[Tensor], masks: Sequence[Tensor], rows: int, budget: int, per_query: int,
                 length_normalize: bool) -> Iterator[list[_QueryTile]]:
    """The query tiles of at most ``rows`` rows (none across a chunk's end; a chunk's of equal heights, so that no
    thin tile is left at its end), grouped into row blocks: consecutive tiles whose queries keep at most ``budget``
    bytes (``per_query`` each), at least one tile a block. A block's tiles are made when it is reached, so a trimmed
    query is copied for one block at a time."""
    spans, row = [], 0
    for c, chunk in enumerate(chunks):
        height = chunk.shape[0]
        even = -(-height // -(-height // rows))  # the chunk in tiles of equal height, none above rows
        spans += [(c, start, min(start + even, height), row + start) for start in range(0, height, even)]
        row += chunk.shape[0]
    block: list[tuple[int, int, int, int]] = []
    for span in [*spans, None]:
        held = sum(stop - start for _, start, stop, _ in block)
        if block and (span is None or (held + span[2] - span[1]) * per_query > budget):
            yield [_query_tile(chunks[c], masks[c], c, start, stop, r, length_normalize) for c, start, stop, r in block]
            block = []
        if span is not None:
            block.append(span)


def _query_tile(chunk: Tensor, mask: Tensor, c: int, start: int, stop: int, row: int,
                length_normalize: bool) -> _QueryTile:
    tile_mask = mask[start:stop]
    width = _width(tile_mask)
    weights, fill = query_weights(tile_mask[:, :width], length_normalize, compute_dtype(chunk.dtype))
    tokens = chunk[start:stop, :width].reshape(-1, chunk.shape[-1])
    norms = torch.linalg.vector_norm(tokens, dim=1, dtype=weights.dtype)
    return _QueryTile(c, start, stop, row, tokens, weights, fill, norms)


def _widths(part: Part) -> tuple[int, int]:
    """The widest query and document of a part, in tokens."""
    return (max(q.shape[1] for q in part.queries), max(d.shape[1] for column in part.documents for d in column))


def _part_tile_rows(part: Part, product_bytes: int, keep_bytes: int, keep_per_query: int) -> tuple[int, int]:
    return tile_rows(*_widths(part), part.queries[0].element_size(), product_bytes, keep_bytes, keep_per_query)


def _kept_per_query(call: MaxSimCall, with_grad: bool, reduction: Reduction) -> int:
    """What a row block keeps per query (``cgist.stage.budget.kept_bytes``), every part's."""
    acc = torch.empty(0, dtype=compute_dtype(call.dtype)).element_size()
    return sum(kept_bytes(1, part.n_documents, *_widths(part), call.first.shape[2], acc, with_grad, call.guide_kind)
               + reduction.kept_per_query(_widths(part)[0], part.n_documents, acc, with_grad)
               for part in call.parts)


class Reduction:
    """How a tile's maxima become its scores, and what each maximum sends back in the second sweep: MaxSim's, their
    sum weighted by each query token's weight (``cgist.stage.spec.maxsim.query_weights``). Another score over the
    same maxima (``cgist.stage.pytorch.xtr``) subclasses it: it may read each tile's products as it finds their
    maxima, before the argmax takes them over (``tile_maxima``), and finish a row block's scores once its first
    sweep is done (``finish``). One serves a forward; ``start`` opens a row block."""

    def start(self, first: int, rows: int, lq: int, n_docs: int, with_grad: bool, dtype: torch.dtype) -> None:
        """A row block of ``rows`` queries from ``first``, against ``n_docs`` documents (nothing to keep)."""

    def kept_per_query(self, query_tokens: int, n_documents: int, acc_bytes: int, with_grad: bool) -> int:
        """What a row block keeps per query beyond ``kept_bytes``' count (nothing)."""
        return 0

    def tile_maxima(self, query: _QueryTile, doc: _DocTile, products: Tensor, span: slice) -> Tensor:
        """The maxima ``(bd, bq * Lq)`` of a tile's products ``(bd, Ld, bq * Lq)`` over each document's tokens, at
        the row block's rows ``span``, before the argmax overwrites the products."""
        return products.amax(1)

    def scores(self, query: _QueryTile, doc: _DocTile, maxima: Tensor, span: slice, cols: slice) -> Tensor:
        """The scores ``(bq, bd)`` of a tile's maxima ``(bd, bq, Lq)`` (the compute dtype), at rows ``span`` and
        columns ``cols`` of the row block."""
        return torch.einsum("dqt,qt->qd", maxima, query.weights)

    def finish(self, scores: Tensor) -> None:
        """The row block's scores ``(rows, W)`` after its first sweep (final as they are)."""

    def sent(self, grad: Tensor, weights: Tensor, cols: slice) -> Tensor:
        """What each (query token, document) of a document tile sends along its maximum, ``(R, Lq, bd)``: the score's
        gradient ``grad`` ``(R, bd)`` times the token's weight ``(R, Lq)``."""
        return grad.unsqueeze(1) * weights.unsqueeze(2)

    def block_grad(self, grad: Tensor) -> Tensor:
        """The block's scores' gradients ``(R, W)`` as the second sweep sends them (as they are)."""
        return grad


#: MaxSim's reduction (and a multi-vector guide's, whatever the student's score).
MAXSIM_REDUCTION = Reduction()


def _tile_scores(query: _QueryTile, doc: _DocTile, scores: Tensor, where: Tensor | None,
                 reduction: Reduction = MAXSIM_REDUCTION, span: slice = slice(None), cols: slice = slice(None)) -> None:
    """The tile's scores into ``scores`` ``(bq, bd)`` (the compute dtype; ``reduction``'s of the maxima, at the row
    block's rows ``span`` and columns ``cols``), sentence-transformers' score where a document is empty; and, given
    ``where`` ``(bq, Lq, bd)``, the document token each query token's maximum is at, as positions of ``doc.tokens``:
    the first token whose product ties with the maximum, within the products' rounding bound (``_tie_floor``).

    The product is laid out document token by query token, so that the maximum over a document's tokens runs down
    its rows, elementwise over contiguous rows, which vectorises (a maximum along a row does not). The argmax is not
    ``torch.max``'s, which does not vectorise either: once the maxima are known the product is no longer
    needed, and becomes ``Ld - t`` where token ``t`` ties with its query token's maximum, 0 elsewhere; the largest of
    these, per query token, is the first tied position (exact in a dtype that holds the integers up to ``Ld``, else
    ``torch.max`` of the ties, which returns the first)."""
    bq, lq = query.weights.shape
    bd, ld = doc.tokens.shape[:2]
    product = _thread_buffer(bd * ld * bq * lq, query.tokens.dtype, query.tokens.device)
    product = product.view(bd * ld, bq * lq)
    torch.mm(doc.tokens.view(bd * ld, -1), query.tokens.T, out=product)
    per_token = product.view(bd, ld, bq * lq)
    maxima = reduction.tile_maxima(query, doc, per_token, span)
    if where is not None:
        tied = per_token.ge_(_tie_floor(query, doc, maxima).unsqueeze(1))
        if ld <= _exact_integers(per_token.dtype):
            countdown = torch.arange(ld, 0, -1, dtype=per_token.dtype, device=per_token.device).view(1, ld, 1)
            first = tied.mul_(countdown).amax(1)
            where.copy_(first.neg_().add_(ld).view(bd, bq, lq).permute(1, 2, 0))
        else:
            where.copy_(tied.max(1).indices.view(bd, bq, lq).permute(1, 2, 0))
    tile = reduction.scores(query, doc, maxima.view(bd, bq, lq).to(query.weights.dtype), span, cols)
    scores.copy_(tile if doc.empty is None else torch.where(doc.empty, query.fill, tile))


def _tie_floor(query: _QueryTile, doc: _DocTile, maxima: Tensor) -> Tensor:
    """The least product that ties with each maximum ``(bd, bq * Lq)``: the maximum lowered by the rounding bound of
    the difference of two of its document's products, ``D * eps * |q_t| * max_u |d_u|`` (``eps`` the compute
    dtype's), in the products' dtype (docs/design.md#ties-of-a-maximum). Two equal tokens of a document tie whatever
    the summation order a CPU's matrix product gives each (it differs by position within a product on some CPUs),
    so the first of them gets the gradient everywhere; half-precision products tie only when equal."""
    eps = torch.finfo(query.norms.dtype).eps
    slack = doc.largest * query.norms * (query.tokens.shape[1] * eps)
    return maxima - slack.to(maxima.dtype)


def _exact_integers(dtype: torch.dtype) -> int:
    """The largest n such that ``dtype`` holds every integer up to n exactly."""
    return round(2 / torch.finfo(dtype).eps)


def _row_tiles(part: Part, first: int, stop: int, query_rows: int, length_normalize: bool) -> list[_QueryTile]:
    """The query tiles of ``part``'s queries ``first:stop``, ``query_rows`` rows each (none across a chunk's end)."""
    tiles, row = [], 0
    for c, (chunk, mask) in enumerate(zip(part.queries, part.query_masks)):
        lo, hi = max(first, row), min(stop, row + chunk.shape[0])
        tiles += [_query_tile(chunk, mask, c, start - row, min(start + query_rows, hi) - row, start,
                              length_normalize) for start in range(lo, hi, query_rows)]
        row += chunk.shape[0]
    return tiles


def maxsim_scores(call: MaxSimCall, first: int, out: Tensor) -> None:
    """The MaxSim scores of ``call``'s queries ``first:first + len(out)`` over their whole row (each part's), into
    ``out``, as the forward's first sweep computes them, without the argmax (a multi-vector guide's scores)."""
    product = split_budget(call.budget_bytes)[0]
    for part in call.parts:
        doc_rows, query_rows = _part_tile_rows(part, product, product, 1)
        _sweep_scores(part, doc_rows, _row_tiles(part, first, first + out.shape[0], query_rows, call.length_normalize),
                      first, out[:, part.span], None)


def _document_tiles(part: Part, doc_rows: int) -> Iterator[tuple[tuple[int, _DocTile], slice]]:
    """Every document tile of a part with its column (column after column: the order of the part's span of a row),
    and its documents' positions among the part's scores."""
    start = 0
    for n, (column, masks) in enumerate(zip(part.documents, part.document_masks)):
        for doc in _column_tiles(column, masks, doc_rows):
            yield (n, doc), slice(start, start + doc.stop - doc.start)
            start += doc.stop - doc.start


def _sweep_scores(part: Part, doc_rows: int, tiles: list[_QueryTile], first: int, scores: Tensor,
                  where: Tensor | None, reduction: Reduction = MAXSIM_REDUCTION) -> None:
    """Every tile of the query tiles ``tiles`` (rows from ``first``) against every document of ``part``: the
    scores into ``scores`` and, given ``where``, the argmax (``_tile_scores``); each document tile prepared once."""
    spans = [slice(query.row - first, query.row - first + query.weights.shape[0]) for query in tiles]
    for (_, doc), cols in _document_tiles(part, doc_rows):
        for query, span in zip(tiles, spans):
            _tile_scores(query, doc, scores[span, cols],
                         None if where is None else where[span, :query.weights.shape[1], cols], reduction, span, cols)


#: The gradients of every chunk of every column of a call (``MaxSimCall.columns``' layout), in the compute dtype.
Gradients = list[list[Tensor]]


def forward(call: MaxSimCall, with_grad: bool, need_stats: bool = False, reduction: Reduction = MAXSIM_REDUCTION
            ) -> tuple[Tensor, Grads | None, tuple[Tensor, Tensor] | None]:
    """The backend contract's forward: the mean loss over the local queries, the gradients (made here
    ``with_grad``, the learned temperature's included), and the guide's counters.

    A row block of queries is swept twice. The first sweep computes every tile of the block against every document
    of every part and keeps the tiles' scores and (``with_grad``) argmax: a byte per query token and document (up to
    256 document tokens). The block's mask and exact softmax are ``cgist.stage.block``'s. The second sweep
    sends each score's gradient ``scale / B * (softmax - label)`` along the kept argmax: to each query token, the
    document token where its maximum is, and back (``_tile_backward``). No tile's product is computed twice, and
    what is held between the sweeps is bounded by the budget (``cgist.stage.budget.kept_bytes``), whatever the batch.
    ``reduction`` makes a tile's scores from its maxima (MaxSim's by default).
    """
    dtype = compute_dtype(call.dtype)
    losses = torch.empty(call.n_queries, dtype=dtype, device=call.device)
    masks = None if call.guide_kind is None else BlockMasks(call)
    share = torch.zeros((), dtype=dtype, device=call.device) if with_grad and call.temperature is not None else None
    grads = [[torch.zeros(t.shape, dtype=dtype, device=call.device) for t in column] for column in call.columns] \
        if with_grad else None
    per_query = _kept_per_query(call, with_grad, reduction)
    product, keep = split_budget(call.budget_bytes)
    doc_rows, query_rows = _part_tile_rows(call.parts[0], product, keep, per_query)
    blocks = _query_tiles(call.parts[0].queries, call.parts[0].query_masks, query_rows, keep, per_query,
                          call.length_normalize)
    for block in blocks:
        _row_block(call, block, doc_rows, losses, grads, masks, share, reduction)
    state = call.grads((g for column in grads for g in column), share) if with_grad else None
    return losses.mean(), state, None if masks is None or not need_stats else masks.counters


def _row_block(call: MaxSimCall, block: list[_QueryTile], doc_rows: int, losses: Tensor, grads: Gradients | None,
               masks: BlockMasks | None, share: Tensor | None, reduction: Reduction) -> None:
    """One row block's two sweeps (``forward``): its queries' losses into ``losses`` and, given ``grads``, their
    gradients added into them. Everything it holds is freed when it returns, before the next block's."""
    device, dtype = losses.device, losses.dtype
    first, rows = block[0].row, sum(query.weights.shape[0] for query in block)
    product = split_budget(call.budget_bytes)[0]
    # The block's scores over its whole row and the argmax of each query token: all that is kept between the sweeps.
    # A document tile is prepared in each.
    scores = torch.empty(rows, call.width, dtype=dtype, device=device)
    reduction.start(first, rows, _widths(call.parts[0])[0], call.width, grads is not None, dtype)
    sweeps = []
    for part in call.parts:
        tiles, part_doc_rows = block, doc_rows
        if part is not call.parts[0]:  # the PP block: the positives of the same queries, tiled for the product alone
            part_doc_rows, query_rows = _part_tile_rows(part, product, product, 1)
            tiles = _row_tiles(part, first, first + rows, query_rows, call.length_normalize)
        where = None
        if grads is not None:
            lq, ld = _widths(part)
            where = torch.zeros(rows, lq, part.n_documents, dtype=argmax_dtype(ld), device=device)
        _sweep_scores(part, part_doc_rows, tiles, first, scores[:, part.span], where, reduction)
        sweeps.append((part, tiles, part_doc_rows, where))
    reduction.finish(scores)
    mask = None
    if masks is not None:
        guide = None
        if call.guide_kind == "tokens":
            guide = torch.empty_like(scores)
            maxsim_scores(call.guide_tokens, first, guide)
        mask = masks(first, scores, guide)
    grad = block_softmax(call, first, scores, losses, grads is not None, mask, share)
    if grads is None:
        return
    grad = reduction.block_grad(grad)
    for (part, tiles, part_doc_rows, where), part_grads in zip(sweeps, call.part_gradients(grads)):
        _part_backward(part, tiles, part_doc_rows, first, grad[:, part.span], where, part_grads, product, reduction)


def _part_backward(part: Part, tiles: list[_QueryTile], doc_rows: int, first: int, grad: Tensor, where: Tensor,
                   grads: tuple[list[Tensor], list[list[Tensor]]], scratch_bytes: int, reduction: Reduction) -> None:
    """The second sweep of one part of a row block: its scores' gradients ``grad`` ``(rows, n_documents)`` sent along
    the kept argmax ``where``, into the part's gradients (its rows', its columns')."""
    dtype, device = grad.dtype, grad.device
    rows, lq = where.shape[:2]
    spans = [slice(query.row - first, query.row - first + query.weights.shape[0]) for query in tiles]
    # The block's query tokens and weights, padded to Lq with zero weights (their argmax is 0, a real position), and
    # the gradient of its query tokens.
    tokens = torch.zeros(rows, lq, part.queries[0].shape[2], dtype=dtype, device=device)
    weights = torch.zeros(rows, lq, dtype=dtype, device=device)
    for query, span in zip(tiles, spans):
        width = query.weights.shape[1]
        tokens[span, :width] = query.tokens.view(-1, width, tokens.shape[2])
        weights[span, :width] = query.weights
    into_queries = torch.zeros_like(tokens)
    q_grads, d_grads = grads
    for (n, doc), cols in _document_tiles(part, doc_rows):
        sent = reduction.sent(grad[:, cols] if doc.empty is None else grad[:, cols].masked_fill(doc.empty, 0.0),
                              weights, cols)
        into_queries += _tile_backward(doc, sent, where[:, :, cols], tokens, d_grads[n][doc.chunk], scratch_bytes)
    for query, span in zip(tiles, spans):
        width = query.weights.shape[1]
        q_grads[query.chunk][query.start:query.stop, :width] += into_queries[span, :width]


def _tile_backward(doc: _DocTile, per_token: Tensor, where: Tensor, tokens: Tensor, doc_grad: Tensor,
                   scratch_bytes: int) -> Tensor:
    """One document tile's share of the gradients of a row block of queries (``tokens`` ``(R, Lq, D)``): what each
    (query token, document) sends (``per_token``, ``(R, Lq, bd)``: ``Reduction.sent``; 0 for an empty document, whose
    score is a constant) along the kept argmax of each query token (``where``, ``(R, Lq, bd)``), to the query token
    (the document token's vector, gathered: returned, ``(R, Lq, D)``) and to the document token (the query token's
    vector, added into its row of ``doc_grad``; a masked position's row is its document's first real token's).

    The documents' side is a scatter: ``index_add_``, whose additions run in index order on a CPU, so the sums do
    not depend on the threads (grouping them into bags for ``embedding_bag`` needs a sort, which costs more), over the
    query tokens in chunks whose weighted copies fit ``scratch_bytes`` (the product's buffer, idle in this sweep)."""
    bd, ld, dim = doc.tokens.shape
    rows, lq = per_token.shape[:2]
    documents = torch.arange(bd, device=per_token.device)
    at = where.long()
    index = at + documents * ld  # the row of doc.tokens of each (query token, document)
    doc_tokens = doc.tokens.view(bd * ld, dim).to(per_token.dtype)
    gathered = F.embedding_bag(index.view(rows * lq, bd), doc_tokens,
                               per_sample_weights=per_token.view(rows * lq, bd), mode="sum")
    target = doc_grad[doc.start:doc.stop]
    full = target.shape[1]
    if doc.remap is None:
        into = index if full == ld else at + documents * full
    else:
        into = (doc.remap + documents.unsqueeze(1) * full).reshape(-1)[index]
    flat, into = target.view(bd * full, dim), into.view(rows * lq, bd)
    query_tokens, per_token = tokens.view(rows * lq, 1, dim), per_token.view(rows * lq, bd, 1)
    itemsize = per_token.element_size()
    step = max(1, scratch_bytes // (bd * dim * itemsize))
    need = min(step, rows * lq) * bd * dim * itemsize
    scratch = _thread_buffer(need // doc.tokens.element_size(), doc.tokens.dtype, per_token.device)
    scratch = scratch.view(per_token.dtype)
    for start in range(0, rows * lq, step):
        stop = min(start + step, rows * lq)
        weighted = scratch[:(stop - start) * bd * dim].view(stop - start, bd, dim)
        torch.mul(query_tokens[start:stop], per_token[start:stop], out=weighted)
        flat.index_add_(0, into[start:stop].reshape(-1), weighted.view(-1, dim))
    return gathered.view(rows, lq, dim)
