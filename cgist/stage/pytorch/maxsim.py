"""The streaming MaxSim loss stage on PyTorch: the multi-vector ranking loss over blocks of documents x blocks of
queries, without the token-similarity tensor (docs/design.md#late-interaction).

A tile is ``bq`` queries against ``bd`` documents: one matrix product of their token vectors
``(bd * Ld, D) @ (D, bq * Lq)`` into a buffer bounded by the budget, the maximum over each document's tokens, and the
sum over the query's tokens, weighted by its mask, in float32 (float64 for float64 inputs). The queries go in row
blocks, each swept twice over every document (``maxsim_forward``): the first sweep keeps the block's scores and each
tile's argmax, which make the block's softmax exact; the second sends each score's gradient along the argmax. The
gradient of a score reaches one document token per query token, so the gradients are a gather (``embedding_bag``)
and a scatter (``index_add_``) instead of products as large as the forward's, and no product is computed twice. The
gradients are made in the forward (``maxsim_backward`` scales them by the loss's incoming gradient), as a loss stage's
backward follows its forward at once.

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

from ..numerics import guide_mask, threshold
from ..ties import TieIndex
from .workspace import _thread_buffer

__all__ = ["EMPTY_DOCUMENT_SCORE", "GUIDE_KINDS", "MaxSimCall", "MaxSimGuide", "accumulate", "kept_bytes",
           "maxsim_backward", "maxsim_forward"]

#: sentence-transformers' score of a document without any real token (before MeanMaxSim's division).
EMPTY_DOCUMENT_SCORE = -1e9
#: Documents per tile: enough columns that the product is efficient, few enough that a tile of queries is tall.
DOC_ROWS = 16


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
            yield _DocTile(c, start, stop, tokens.contiguous(), remap, empty)


def _query_tiles(chunks: Sequence[Tensor], masks: Sequence[Tensor], rows: int, budget: int, per_query: int,
                 length_normalize: bool) -> Iterator[list[_QueryTile]]:
    """The query tiles of ``rows`` rows (none across a chunk's end), grouped into row blocks: consecutive tiles whose
    queries keep at most ``budget`` bytes (``per_query`` each), at least one tile a block. A block's tiles are made
    when it is reached, so a trimmed query is copied for one block at a time."""
    spans, row = [], 0
    for c, chunk in enumerate(chunks):
        height = chunk.shape[0]
        spans += [(c, start, min(start + rows, height), row + start) for start in range(0, height, rows)]
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
    weights = tile_mask[:, :width].to(accumulate(chunk.dtype))
    fill = torch.full((stop - start, 1), EMPTY_DOCUMENT_SCORE, dtype=weights.dtype, device=chunk.device)
    if length_normalize:
        counts = tile_mask.sum(1, keepdim=True).clamp(min=1).to(weights.dtype)
        weights, fill = weights / counts, fill / counts
    tokens = chunk[start:stop, :width].reshape(-1, chunk.shape[-1])
    return _QueryTile(c, start, stop, row, tokens, weights, fill)


def _tile_rows(queries: Sequence[Tensor], documents: Sequence[Sequence[Tensor]], product_bytes: int,
               keep_bytes: int, keep_per_query: int) -> tuple[int, int]:
    """Rows per document tile and per query tile: one tile's product fits ``product_bytes``, and one query tile's
    kept scores and argmax (``keep_per_query`` bytes a query) fit ``keep_bytes``."""
    lq = max(q.shape[1] for q in queries)
    ld = max(d.shape[1] for column in documents for d in column)
    itemsize = queries[0].element_size()
    doc_rows = max(1, min(DOC_ROWS, product_bytes // max(1, lq * ld * itemsize)))
    query_rows = max(1, product_bytes // max(1, lq * doc_rows * ld * itemsize))
    return doc_rows, max(1, min(query_rows, keep_bytes // max(1, keep_per_query)))


def _tile_scores(query: _QueryTile, doc: _DocTile, scores: Tensor, where: Tensor | None) -> None:
    """The tile's MaxSim scores into ``scores`` ``(bq, bd)`` (``accumulate(dtype)``), sentence-transformers' score
    where a document is empty; and, given ``where`` ``(bq, Lq, bd)``, the document token each query token's maximum
    is at (the first, on a tie), as positions of ``doc.tokens``.

    The product is laid out document token by query token, so that the maximum over a document's tokens runs down
    its rows, elementwise over contiguous rows, which vectorises (a maximum along a row does not). The argmax is not
    ``torch.max``'s, which does not vectorise either: once the maxima are known the product is no longer
    needed, and becomes ``Ld - t`` where token ``t`` attains its query token's maximum, 0 elsewhere; the largest of
    these, per query token, is the first position of its maximum (exact in a dtype that holds the integers up to
    ``Ld``, else ``torch.max``)."""
    bq, lq = query.weights.shape
    bd, ld = doc.tokens.shape[:2]
    product = _thread_buffer(bd * ld * bq * lq, query.tokens.dtype, query.tokens.device)
    product = product.view(bd * ld, bq * lq)
    torch.mm(doc.tokens.view(bd * ld, -1), query.tokens.T, out=product)
    per_token = product.view(bd, ld, bq * lq)
    if where is None:
        maxima = per_token.amax(1)
    elif ld <= _exact_integers(per_token.dtype):
        maxima = per_token.amax(1)
        countdown = torch.arange(ld, 0, -1, dtype=per_token.dtype, device=per_token.device).view(1, ld, 1)
        first = per_token.eq_(maxima.unsqueeze(1)).mul_(countdown).amax(1)
        where.copy_(first.neg_().add_(ld).view(bd, bq, lq).permute(1, 2, 0))
    else:
        maxima, at = per_token.max(1)
        where.copy_(at.view(bd, bq, lq).permute(1, 2, 0))
    tile = torch.einsum("dqt,qt->qd", maxima.view(bd, bq, lq).to(query.weights.dtype), query.weights)
    scores.copy_(tile if doc.empty is None else torch.where(doc.empty, query.fill, tile))


def _exact_integers(dtype: torch.dtype) -> int:
    """The largest n such that ``dtype`` holds every integer up to n exactly."""
    return round(2 / torch.finfo(dtype).eps)


#: What a guide scores each query's candidates with: a single-vector guide's cosines (``"vectors"``), a multi-vector
#: guide's MaxSim (``"tokens"``), the student's own scores, detached (``"self"``), or nothing (``"none"``: only
#: ``mask_duplicates`` masks).
GUIDE_KINDS = ("vectors", "tokens", "self", "none")


@dataclass(frozen=True)
class MaxSimGuide:
    """GIST's guide over the multi-vector loss (docs/design.md#the-guide-for-late-interaction): query ``i``'s
    candidate is masked when the guide scores it strictly above ``T_i``, the threshold below theta_i (the guide's
    score of ``i`` with its positive) by ``margin`` (``relative``: by ``|theta_i| * margin``); a candidate that is the
    text of ``i``'s positive (``document_ids``) ties with theta_i and is masked exactly when ``theta_i > T_i``; with
    ``mask_duplicates`` every candidate whose text is the query's or its positive's is masked; the label never is.

    ``vectors``: ``"vectors"``' normalised query and document embeddings, ``(B, Dg)`` and ``(M, Dg)`` in the order of
    the scores (column after column); ``tokens``: ``"tokens"``' token embeddings as a call over the same rows (its
    ``scale`` 1). ``counters`` (int64, 3) and ``sums`` (2) are filled by each forward: entries masked in the first
    column (the label left out) and in the others, queries left with their label alone; the sums of theta_i and T_i.
    """

    kind: str
    margin: float
    relative: bool
    vectors: tuple[Tensor, Tensor] | None = None
    tokens: MaxSimCall | None = None
    query_ids: Tensor | None = None  # (B,) a text id per query
    document_ids: Tensor | None = None  # (M,) a text id per document, in the order of the scores
    mask_duplicates: bool = False
    counters: Tensor | None = None
    sums: Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"kind must be one of {GUIDE_KINDS}, got {self.kind!r}")
        if (self.kind == "vectors") != (self.vectors is not None) or (self.kind == "tokens") != (self.tokens is not None):
            raise ValueError(f"a {self.kind!r} guide takes {'vectors' if self.kind == 'vectors' else 'tokens'} "
                             "and nothing else")
        if self.mask_duplicates and (self.query_ids is None or self.document_ids is None):
            raise ValueError("mask_duplicates needs query_ids and document_ids")
        ties = None if self.document_ids is None else TieIndex(self.document_ids)
        object.__setattr__(self, "ties", ties)

    def block_mask(self, call: MaxSimCall, first: int, scores: Tensor) -> Tensor:
        """The mask of queries ``first:first + len(scores)`` (True: left out), from the guide's scores of the block
        (``scores``, the student's, for ``"self"``); the counters and sums updated."""
        rows = scores.shape[0]
        local = torch.arange(rows, device=scores.device)
        labels = call.offset + first + local
        partner = None if self.document_ids is None else self.document_ids[labels]
        if self.kind == "none":
            mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        else:
            if self.kind == "self":
                guide = scores
            elif self.kind == "vectors":
                queries, documents = self.vectors
                guide = queries[first:first + rows] @ documents.T
            else:
                guide = torch.empty_like(scores)
                _block_scores(self.tokens, first, guide)
            theta = guide[local, labels].unsqueeze(1)
            limit = threshold(theta, self.margin, self.relative)
            ties = ((torch.empty(0, dtype=torch.long, device=scores.device),) * 2 if self.ties is None
                    else self.ties.pairs(partner, 0, guide.shape[1]))
            mask = guide_mask(guide, limit, theta > limit, ties)
            self.sums[0] += theta.sum().to(self.sums.dtype)
            self.sums[1] += limit.sum().to(self.sums.dtype)
        if self.mask_duplicates:
            own = self.query_ids[first:first + rows].unsqueeze(1)
            mask |= (self.document_ids == own) | (self.document_ids == partner.unsqueeze(1))
        mask[local, labels] = False
        first_column = sum(d.shape[0] for d in call.documents[0])
        self.counters[0] += mask[:, :first_column].sum()
        self.counters[1] += mask[:, first_column:].sum()
        self.counters[2] += (mask.sum(1) == mask.shape[1] - 1).sum()
        return mask


def _block_scores(call: MaxSimCall, first: int, out: Tensor) -> None:
    """The MaxSim scores of ``call``'s queries ``first:first + len(out)`` against all its documents, into ``out``
    (as ``maxsim_forward``'s first sweep computes the student's, without the argmax)."""
    stop = first + out.shape[0]
    product = call.budget_bytes - call.budget_bytes // 2
    doc_rows, query_rows = _tile_rows(call.queries, call.documents, product, product, 1)
    tiles, row = [], 0
    for c, (chunk, mask) in enumerate(zip(call.queries, call.query_masks)):
        lo, hi = max(first, row), min(stop, row + chunk.shape[0])
        tiles += [_query_tile(chunk, mask, c, start - row, min(start + query_rows, hi) - row, start,
                              call.length_normalize) for start in range(lo, hi, query_rows)]
        row += chunk.shape[0]
    _sweep_scores(call, doc_rows, tiles, first, out, None)


def _sweep_scores(call: MaxSimCall, doc_rows: int, tiles: list[_QueryTile], first: int, scores: Tensor,
                  where: Tensor | None) -> None:
    """Every tile of the query tiles ``tiles`` (rows from ``first``) against every document of ``call``: the
    scores into ``scores`` and, given ``where``, the argmax (``_tile_scores``); each document tile prepared once."""
    spans = [slice(query.row - first, query.row - first + query.weights.shape[0]) for query in tiles]
    for (_, doc), cols in _column_spans(call, doc_rows):
        for query, span in zip(tiles, spans):
            _tile_scores(query, doc, scores[span, cols],
                         None if where is None else where[span, :query.weights.shape[1], cols])


@dataclass(frozen=True)
class MaxSimCall:
    """One loss-stage call's inputs. ``queries``: row chunks ``(b, Lq, D)`` with masks ``(b, Lq)`` (bool);
    ``documents``: columns, each a list of row chunks ``(r, Ld, D)`` with masks. Column ``n``'s global row ``j`` is
    score column ``j * N + n``; query ``i``'s label is the first column's row ``offset + i``. Scores are multiplied by
    ``scale``; with ``length_normalize`` (MeanMaxSim) divided by the query's real token count first.
    ``budget_bytes`` bounds the stage's working memory: half for one tile's token products, half for what a row
    block of queries keeps between its two sweeps (``keep_bytes``). ``guide``: GIST's guide, which masks each query's
    candidates (None: none is masked)."""

    queries: Sequence[Tensor]
    query_masks: Sequence[Tensor]
    documents: Sequence[Sequence[Tensor]]
    document_masks: Sequence[Sequence[Tensor]]
    scale: float
    length_normalize: bool
    offset: int
    budget_bytes: int
    guide: MaxSimGuide | None = None

    @property
    def n_queries(self) -> int:
        return sum(q.shape[0] for q in self.queries)

    @property
    def n_documents(self) -> int:
        return sum(d.shape[0] for column in self.documents for d in column)

    def tiles(self, with_grad: bool) -> tuple[int, Iterator[list[_QueryTile]]]:
        """Rows per document tile, and the row blocks of query tiles (``_query_tiles``)."""
        lq = max(q.shape[1] for q in self.queries)
        ld = max(d.shape[1] for column in self.documents for d in column)
        per_query = kept_bytes(1, self.n_documents, lq, ld, self.queries[0].shape[2], self.queries[0].dtype,
                               with_grad, None if self.guide is None else self.guide.kind)
        product, keep = self.budget_bytes - self.budget_bytes // 2, self.budget_bytes // 2
        doc_rows, query_rows = _tile_rows(self.queries, self.documents, product, keep, per_query)
        return doc_rows, _query_tiles(self.queries, self.query_masks, query_rows, keep, per_query,
                                      self.length_normalize)

    def document_tiles(self, doc_rows: int) -> Iterator[tuple[int, _DocTile]]:
        """Every document tile with its column, column after column: the order in which ``maxsim_forward``
        concatenates a query's scores (the first column's row ``j`` at position ``j``)."""
        for n, (column, masks) in enumerate(zip(self.documents, self.document_masks)):
            for doc in _document_tiles(column, masks, doc_rows):
                yield n, doc


#: The gradients of every query chunk and of every document chunk, column by column, in ``accumulate(dtype)``.
Gradients = tuple[list[Tensor], list[list[Tensor]]]


def maxsim_forward(call: MaxSimCall, with_grad: bool) -> tuple[Tensor, Gradients | None]:
    """The mean loss over the local queries and, ``with_grad``, its gradients (``maxsim_backward`` scales them).

    A row block of queries is swept twice. The first sweep computes every tile of the block against every document
    and keeps the tiles' scores and (``with_grad``) argmax: a byte per query token and document (up to 256 document
    tokens). The block's softmax is then exact: each query's largest logit ``peak`` and ``total``, the sum of
    ``exp(logit - peak)``, so the softmax of the largest logit is ``1 / total`` exactly, not
    ``exp(logit - log-sum-exp)``, whose rounding (an ulp of the log-sum-exp) would swamp the gradient of a query that
    already ranks its positive far above the rest. The second sweep sends each score's gradient
    ``scale / B * (softmax - label)`` along the kept argmax: to each query token, the document token where its maximum
    is, and back (``_tile_backward``). No tile's product is computed twice, and what is held between the sweeps is
    bounded by the budget (``MaxSimCall.tiles``), whatever the batch.
    """
    doc_rows, blocks = call.tiles(with_grad)
    device, dtype = call.queries[0].device, accumulate(call.queries[0].dtype)
    losses = torch.empty(call.n_queries, dtype=dtype, device=device)
    grads = None
    if call.guide is not None:
        call.guide.counters.zero_()
        call.guide.sums.zero_()
    if with_grad:
        grads = ([torch.zeros(q.shape, dtype=dtype, device=device) for q in call.queries],
                 [[torch.zeros(d.shape, dtype=dtype, device=device) for d in column] for column in call.documents])
    for block in blocks:
        _row_block(call, block, doc_rows, losses, grads)
    return losses.mean(), grads


def _row_block(call: MaxSimCall, block: list[_QueryTile], doc_rows: int, losses: Tensor,
               grads: Gradients | None) -> None:
    """One row block's two sweeps (``maxsim_forward``): its queries' losses into ``losses`` and, given ``grads``,
    their gradients added into it. Everything it holds is freed when it returns, before the next block's."""
    device, dtype = losses.device, losses.dtype
    lq = max(q.shape[1] for q in call.queries)
    index = _index_dtype(max(d.shape[1] for column in call.documents for d in column))
    first, rows = block[0].row, sum(query.weights.shape[0] for query in block)
    spans = [slice(query.row - first, query.row - first + query.weights.shape[0]) for query in block]
    # The block's scores against every document of every column (the first column's row j at position j) and the
    # argmax of each query token: all that is kept between the sweeps. A document tile is prepared in each.
    scores = torch.empty(rows, call.n_documents, dtype=dtype, device=device)
    where = torch.zeros(rows, lq, call.n_documents, dtype=index, device=device) if grads is not None else None
    _sweep_scores(call, doc_rows, block, first, scores, where)
    if call.guide is not None:  # a masked score leaves the softmax, and its gradient is zero
        scores.masked_fill_(call.guide.block_mask(call, first, scores), float("-inf"))
    local = torch.arange(rows, device=device)
    labels = call.offset + first + local
    logits = scores.mul_(call.scale)
    peak = logits.amax(1, keepdim=True)
    label_logits = logits[local, labels]
    softmax = logits.sub_(peak).exp_()  # in place: the scores are not needed again
    total = softmax.sum(1, keepdim=True)
    losses[first:first + rows] = (peak + torch.log(total)).squeeze(1) - label_logits
    if grads is None:
        return
    unit = call.scale / call.n_queries
    grad = softmax.mul_(unit / total)
    grad[local, labels] -= unit
    # The block's query tokens and weights, padded to Lq with zero weights (their argmax is 0, a real position), and
    # the gradient of its query tokens.
    tokens = torch.zeros(rows, lq, call.queries[0].shape[2], dtype=dtype, device=device)
    weights = torch.zeros(rows, lq, dtype=dtype, device=device)
    for query, span in zip(block, spans):
        width = query.weights.shape[1]
        tokens[span, :width] = query.tokens.view(-1, width, tokens.shape[2])
        weights[span, :width] = query.weights
    into_queries = torch.zeros_like(tokens)
    q_grads, d_grads = grads
    for (n, doc), cols in _column_spans(call, doc_rows):
        into_queries += _tile_backward(doc, grad[:, cols], where[:, :, cols], tokens, weights, d_grads[n][doc.chunk],
                                       call.budget_bytes - call.budget_bytes // 2)
    for query, span in zip(block, spans):
        width = query.weights.shape[1]
        q_grads[query.chunk][query.start:query.stop, :width] += into_queries[span, :width]


def _column_spans(call: MaxSimCall, doc_rows: int) -> Iterator[tuple[tuple[int, _DocTile], slice]]:
    """Every document tile with its column (``MaxSimCall.document_tiles``), and its documents' positions among a
    query's scores."""
    start = 0
    for n, doc in call.document_tiles(doc_rows):
        yield (n, doc), slice(start, start + doc.stop - doc.start)
        start += doc.stop - doc.start


def _index_dtype(width: int) -> torch.dtype:
    """The narrowest integer dtype that holds a token position below ``width``."""
    return torch.uint8 if width <= 256 else torch.int16 if width <= 2**15 else torch.int32


#: Bytes per (query token, document) of a document tile's backward (``_tile_backward``): the weight, the argmax as
#: int64, the token row it reads, the gradient row it adds into, and ``embedding_bag``'s bag of each index.
_BACKWARD_BYTES = 4 + 8 + 8 + 8 + 8


def kept_bytes(n_queries: int, n_documents: int, query_tokens: int, document_tokens: int, dim: int,
               dtype: torch.dtype, with_grad: bool, guide: str | None = None) -> int:
    """The bytes that ``maxsim_forward`` holds for a row block of ``n_queries`` queries: a score per document (which
    becomes its gradient), and with a guide of kind ``guide`` its mask and (but for ``"self"``) its scores;
    ``with_grad`` also an argmax per query token and document, the block's query tokens and their gradient in
    ``accumulate(dtype)``, and a document tile's backward temporaries (``_BACKWARD_BYTES`` per query token and
    document of the tile, and the gathered rows)."""
    acc = torch.empty(0, dtype=accumulate(dtype)).element_size()
    guided = 0 if guide is None else n_queries * n_documents * (1 + (0 if guide == "self" else acc))
    if not with_grad:
        return n_queries * n_documents * acc + guided
    index = torch.empty(0, dtype=_index_dtype(document_tokens)).element_size()
    tile = query_tokens * (DOC_ROWS * _BACKWARD_BYTES + dim * acc)
    return n_queries * (n_documents * (query_tokens * index + acc) + 2 * query_tokens * dim * acc + tile) + guided


def maxsim_backward(call: MaxSimCall, grads: Gradients, grad_output: float) -> Gradients:
    """The gradients of ``grad_output`` times the loss, from those of ``maxsim_forward`` (the loss's own)."""
    if grad_output == 1.0:
        return grads
    q_grads, d_grads = grads
    return [g * grad_output for g in q_grads], [[g * grad_output for g in column] for column in d_grads]


def _tile_backward(doc: _DocTile, grad: Tensor, where: Tensor, tokens: Tensor, weights: Tensor, doc_grad: Tensor,
                   scratch_bytes: int) -> Tensor:
    """One document tile's share of the gradients of a row block of queries (``tokens`` ``(R, Lq, D)``, ``weights``
    ``(R, Lq)``): each score's gradient (``grad``, ``(R, bd)``) sent along the kept argmax of each query token
    (``where``, ``(R, Lq, bd)``), to the query token (the document token's vector, gathered: returned,
    ``(R, Lq, D)``) and to the document token (the query token's vector, added into its row of ``doc_grad``; a
    masked position's row is its document's first real token's). An empty document's score is a constant: it sends
    nothing.

    The documents' side is a scatter: ``index_add_``, whose additions run in index order on a CPU, so the sums do
    not depend on the threads (grouping them into bags for ``embedding_bag`` needs a sort, which costs more), over the
    query tokens in chunks whose weighted copies fit ``scratch_bytes`` (the product's buffer, idle in this sweep)."""
    bd, ld, dim = doc.tokens.shape
    rows, lq = weights.shape
    if doc.empty is not None:
        grad = grad.masked_fill(doc.empty, 0.0)
    per_token = grad.unsqueeze(1) * weights.unsqueeze(2)  # (R, Lq, bd)
    documents = torch.arange(bd, device=grad.device)
    at = where.long()
    index = at + documents * ld  # the row of doc.tokens of each (query token, document)
    doc_tokens = doc.tokens.view(bd * ld, dim).to(grad.dtype)
    gathered = F.embedding_bag(index.view(rows * lq, bd), doc_tokens,
                               per_sample_weights=per_token.view(rows * lq, bd), mode="sum")
    target = doc_grad[doc.start:doc.stop]
    full = target.shape[1]
    if doc.remap is None:
        into = index if full == ld else at + documents * full
    else:
        into = (doc.remap + documents.unsqueeze(1) * full).view(-1)[index]
    flat, into = target.view(bd * full, dim), into.view(rows * lq, bd)
    query_tokens, per_token = tokens.view(rows * lq, 1, dim), per_token.view(rows * lq, bd, 1)
    step = max(1, scratch_bytes // (bd * dim * grad.element_size()))
    need = min(step, rows * lq) * bd * dim * grad.element_size()
    scratch = _thread_buffer(need // doc.tokens.element_size(), doc.tokens.dtype, grad.device).view(grad.dtype)
    for start in range(0, rows * lq, step):
        stop = min(start + step, rows * lq)
        weighted = scratch[:(stop - start) * bd * dim].view(stop - start, bd, dim)
        torch.mul(query_tokens[start:stop], per_token[start:stop], out=weighted)
        flat.index_add_(0, into[start:stop].reshape(-1), weighted.view(-1, dim))
    return gathered.view(rows, lq, dim)
