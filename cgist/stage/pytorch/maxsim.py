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

__all__ = ["EMPTY_DOCUMENT_SCORE", "GUIDE_COUNTERS", "GUIDE_KINDS", "MaxSimCall", "MaxSimGuide", "accumulate",
           "block_softmax", "folded", "kept_bytes", "maxsim_backward", "maxsim_forward"]

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
#: What ``MaxSimGuide.counters`` counts, in order: the entries masked in each block of a query's row
#: (``MaxSimCall.blocks``), and the queries left with their label alone.
GUIDE_COUNTERS = ("ap", "an", "aa", "pp", "positive_only")


@dataclass(frozen=True)
class MaxSimGuide:
    """GIST's guide over the multi-vector loss (docs/design.md#the-guide-for-late-interaction): query ``i``'s
    candidate is masked when the guide scores it strictly above ``T_i``, the threshold below theta_i (the guide's
    score of ``i`` with its positive) by ``margin`` (``relative``: by ``|theta_i| * margin``); a candidate that is the
    text of the row's partner (query ``i``'s positive; in the PP block, whose rows are the positives, query ``i``)
    ties with theta_i and is masked exactly when ``theta_i > T_i``; with ``mask_duplicates`` every candidate whose text
    is the query's or its positive's is masked; with ``mask_self`` the self-pairs AA[i, i] and PP[i, offset + i]
    always are; the label never is.

    ``vectors``: ``"vectors"``' normalised query and document embeddings, ``(B, Dg)`` and ``(M, Dg)`` (the document
    columns, column after column); ``tokens``: ``"tokens"``' token embeddings as a call laid out as the student's (its
    ``scale`` 1, its AA and PP blocks alike). ``query_ids`` ``(B,)`` and ``column_ids`` (one per score of a query's
    row, ``MaxSimCall.blocks``' order) are the texts' ids. ``counters`` (int64, ``GUIDE_COUNTERS``) and ``sums`` (2)
    are filled by each forward: entries masked in the AP, AN, AA and PP blocks (AP's labels left out), queries left
    with their label alone; the sums of theta_i and T_i.
    """

    kind: str
    margin: float
    relative: bool
    vectors: tuple[Tensor, Tensor] | None = None
    tokens: MaxSimCall | None = None
    query_ids: Tensor | None = None  # (B,) a text id per query
    column_ids: Tensor | None = None  # (W,) a text id per score of a query's row
    mask_duplicates: bool = False
    mask_self: bool = True
    counters: Tensor | None = None
    sums: Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise ValueError(f"kind must be one of {GUIDE_KINDS}, got {self.kind!r}")
        if (self.kind == "vectors") != (self.vectors is not None) or (self.kind == "tokens") != (self.tokens is not None):
            raise ValueError(f"a {self.kind!r} guide takes {'vectors' if self.kind == 'vectors' else 'tokens'} "
                             "and nothing else")
        if self.mask_duplicates and (self.query_ids is None or self.column_ids is None):
            raise ValueError("mask_duplicates needs query_ids and column_ids")
        object.__setattr__(self, "_tie_indexes", {})  # (lo, hi) -> the TieIndex of those columns, made once a call

    def reset(self) -> None:
        """Zero the counters and sums: a forward counts what it masks from the start."""
        self.counters.zero_()
        self.sums.zero_()

    def block_mask(self, call: MaxSimCall, first: int, scores: Tensor) -> Tensor:
        """The mask of queries ``first:first + len(scores)`` (True: left out) over their whole row
        (``MaxSimCall.blocks``), from the guide's scores of the block (``scores``, the student's, for ``"self"``);
        the counters and sums updated."""
        rows = scores.shape[0]
        local = torch.arange(rows, device=scores.device)
        labels = call.offset + first + local
        blocks = call.blocks()
        ids = self.column_ids
        partner = None if ids is None else ids[labels]  # the positive's text: AP is the row's first block
        own = None if self.query_ids is None else self.query_ids[first:first + rows]
        if self.kind == "none":
            mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        else:
            guide = scores if self.kind == "self" else self._scores(blocks, first, labels, scores)
            theta = guide[local, labels].unsqueeze(1)
            limit = threshold(theta, self.margin, self.relative)
            mask = guide_mask(guide, limit, theta > limit, self._ties(blocks, partner, own, scores.device))
            self.sums[0] += theta.sum().to(self.sums.dtype)
            self.sums[1] += limit.sum().to(self.sums.dtype)
        if self.mask_duplicates:
            mask |= (ids == own.unsqueeze(1)) | (ids == partner.unsqueeze(1))
        mask[local, labels] = False
        if self.mask_self:
            for name, own_column in (("aa", first + local), ("pp", labels)):
                if name in blocks:
                    mask[local, blocks[name].start + own_column] = True
        for k, name in enumerate(GUIDE_COUNTERS):
            if name in blocks:
                self.counters[k] += mask[:, blocks[name]].sum()
        self.counters[-1] += (mask.sum(1) == mask.shape[1] - 1).sum()
        return mask

    def _scores(self, blocks: dict[str, slice], first: int, labels: Tensor, like: Tensor) -> Tensor:
        """The guide's scores of queries ``first:first + len(labels)`` over their whole row (``blocks``)."""
        if self.kind == "tokens":
            guide = torch.empty_like(like)
            _block_scores(self.tokens, first, guide)
            return guide
        queries, documents = self.vectors
        rows_q = queries[first:first + len(labels)]
        parts = [rows_q @ documents.T]
        if "aa" in blocks:
            parts.append(rows_q @ queries.T)
        if "pp" in blocks:
            parts.append(documents[labels] @ documents[:blocks["ap"].stop].T)
        return torch.cat(parts, 1)

    def _ties(self, blocks: dict[str, slice], partner: Tensor | None, own: Tensor | None,
              device: torch.device) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the entries that tie with theta_i: a column with the text of the row's partner (the
        positive for the query's rows, query ``i`` for its positive's, the PP block)."""
        if self.column_ids is None:
            return (torch.empty(0, dtype=torch.long, device=device),) * 2
        rows, cols = [], []
        split = blocks["pp"].start if "pp" in blocks else self.column_ids.shape[0]
        for lo, hi, who in ((0, split, partner), (split, self.column_ids.shape[0], own)):
            if hi > lo:
                index = self._tie_indexes.get((lo, hi))
                if index is None:
                    index = self._tie_indexes[lo, hi] = TieIndex(self.column_ids[lo:hi])
                r, c = index.pairs(who, 0, hi - lo)
                rows.append(r)
                cols.append(c + lo)
        return torch.cat(rows), torch.cat(cols)


def _row_tiles(call: MaxSimCall, first: int, stop: int, query_rows: int) -> list[_QueryTile]:
    """The query tiles of ``call``'s queries ``first:stop``, ``query_rows`` rows each (none across a chunk's end)."""
    tiles, row = [], 0
    for c, (chunk, mask) in enumerate(zip(call.queries, call.query_masks)):
        lo, hi = max(first, row), min(stop, row + chunk.shape[0])
        tiles += [_query_tile(chunk, mask, c, start - row, min(start + query_rows, hi) - row, start,
                              call.length_normalize) for start in range(lo, hi, query_rows)]
        row += chunk.shape[0]
    return tiles


def _block_scores(call: MaxSimCall, first: int, out: Tensor) -> None:
    """The MaxSim scores of ``call``'s queries ``first:first + len(out)`` over their whole row (each part's,
    ``MaxSimCall.parts``), into ``out`` (as ``maxsim_forward``'s first sweep computes the student's, without the
    argmax)."""
    product = call.budget_bytes - call.budget_bytes // 2
    for part, cols in call.parts():
        doc_rows, query_rows = _tile_rows(part.queries, part.documents, product, product, 1)
        _sweep_scores(part, doc_rows, _row_tiles(part, first, first + out.shape[0], query_rows), first, out[:, cols],
                      None)


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
    ``documents``: columns, each a list of row chunks ``(r, Ld, D)`` with masks. A query's scores are every column's
    documents, column after column; query ``i``'s label is the first column's row ``offset + i``. Scores are
    multiplied by ``scale``; with ``length_normalize`` (MeanMaxSim) divided by the query's real token count first.
    ``budget_bytes`` bounds the stage's working memory: half for one tile's token products, half for what a row
    block of queries keeps between its two sweeps (``keep_bytes``). ``guide``: GIST's guide, which masks each query's
    candidates (None: none is masked).

    GIST's contrast blocks (docs/design.md#the-guide-for-late-interaction): with ``contrast_anchors`` the last
    document column is the queries themselves (AA); ``positives`` is the PP block, a call of its own whose queries
    are the positives (rows ``offset + i`` of the first column) and whose one column is the first column, its scores
    after the others in a query's row (``parts``, ``blocks``)."""

    queries: Sequence[Tensor]
    query_masks: Sequence[Tensor]
    documents: Sequence[Sequence[Tensor]]
    document_masks: Sequence[Sequence[Tensor]]
    scale: float
    length_normalize: bool
    offset: int
    budget_bytes: int
    guide: MaxSimGuide | None = None
    contrast_anchors: bool = False
    positives: MaxSimCall | None = None

    @classmethod
    def with_contrast(cls, queries: Sequence[Tensor], query_masks: Sequence[Tensor],
                      documents: Sequence[Sequence[Tensor]], document_masks: Sequence[Sequence[Tensor]], scale: float,
                      length_normalize: bool, offset: int, budget_bytes: int, guide: MaxSimGuide | None,
                      contrast_anchors: bool, contrast_positives: bool) -> MaxSimCall:
        """A call with GIST's contrast blocks: AA as a last document column of the queries themselves, PP as a call
        of its own whose queries are the positives (``row_views`` of the first column) against the first column."""
        pp = None
        if contrast_positives:
            rows = sum(q.shape[0] for q in queries)
            pp = cls(row_views(documents[0], offset, rows), row_views(document_masks[0], offset, rows),
                     [documents[0]], [document_masks[0]], scale, length_normalize, 0, budget_bytes)
        if contrast_anchors:
            documents, document_masks = [*documents, queries], [*document_masks, query_masks]
        return cls(queries, query_masks, documents, document_masks, scale, length_normalize, offset, budget_bytes,
                   guide, contrast_anchors, pp)

    @property
    def n_queries(self) -> int:
        return sum(q.shape[0] for q in self.queries)

    @property
    def n_documents(self) -> int:
        return sum(d.shape[0] for column in self.documents for d in column)

    @property
    def width(self) -> int:
        """The scores of a query's row: every part's (``parts``)."""
        return sum(cols.stop - cols.start for _, cols in self.parts())

    def parts(self) -> list[tuple[MaxSimCall, slice]]:
        """The calls whose scores make a query's row, each with its span of the row: this call's documents, then the
        PP block's (``positives``)."""
        parts = [(self, slice(0, self.n_documents))]
        if self.positives is not None:
            parts.append((self.positives, slice(self.n_documents, self.n_documents + self.positives.n_documents)))
        return parts

    def blocks(self) -> dict[str, slice]:
        """GIST's blocks of a query's row: ``"ap"`` (the first column), ``"an"`` (the other document columns, when
        there are any), ``"aa"`` (with ``contrast_anchors``), ``"pp"`` (with ``positives``)."""
        first = sum(d.shape[0] for d in self.documents[0])
        documents = self.n_documents - (self.n_queries if self.contrast_anchors else 0)
        blocks = {"ap": slice(0, first)}
        if documents > first:
            blocks["an"] = slice(first, documents)
        if self.contrast_anchors:
            blocks["aa"] = slice(documents, self.n_documents)
        if self.positives is not None:
            blocks["pp"] = slice(self.n_documents, self.width)
        return blocks

    def kept_per_query(self, with_grad: bool) -> int:
        """What a row block keeps per query (``kept_bytes``), every part's."""
        guide = None if self.guide is None else self.guide.kind
        total = 0
        for part, _ in self.parts():
            lq = max(q.shape[1] for q in part.queries)
            ld = max(d.shape[1] for column in part.documents for d in column)
            total += kept_bytes(1, part.n_documents, lq, ld, part.queries[0].shape[2], part.queries[0].dtype,
                                with_grad, guide)
        return total

    def tiles(self, with_grad: bool) -> tuple[int, Iterator[list[_QueryTile]]]:
        """Rows per document tile, and the row blocks of query tiles (``_query_tiles``)."""
        per_query = self.kept_per_query(with_grad)
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


#: The gradients of every query chunk and of every document chunk, column by column, in ``accumulate(dtype)`` (a PP
#: block's are added into the first column's).
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
        call.guide.reset()
    if with_grad:
        main = ([torch.zeros(q.shape, dtype=dtype, device=device) for q in call.queries],
                [[torch.zeros(d.shape, dtype=dtype, device=device) for d in column] for column in call.documents])
        grads = [main]
        if call.positives is not None:  # the PP block adds into the first column's gradients, where its inputs are
            first = main[1][0]
            grads.append((row_views(first, call.offset, call.n_queries), [first]))
    for block in blocks:
        _row_block(call, block, doc_rows, losses, grads)
    return losses.mean(), None if grads is None else grads[0]


def row_views(chunks: Sequence[Tensor], start: int, count: int) -> list[Tensor]:
    """Rows ``start:start + count`` of a column's row chunks (or of their masks, or gradients), as views of them."""
    views, row = [], 0
    for chunk in chunks:
        lo, hi = max(start, row), min(start + count, row + chunk.shape[0])
        if lo < hi:
            views.append(chunk[lo - row:hi - row])
        row += chunk.shape[0]
    return views


def folded(call: MaxSimCall, grads: list[Gradients]) -> Gradients:
    """The gradients of a call's parts (``MaxSimCall.parts``) as the call's own: the PP block's, of the positives
    (rows ``offset + i`` of the first column) and of the first column, added into the first column's."""
    q_grads, d_grads = grads[0]
    if call.positives is not None:
        positives, (first,) = grads[1]
        for total, part in zip(d_grads[0], first):
            total += part
        for total, part in zip(row_views(d_grads[0], call.offset, call.n_queries), positives):
            total += part
    return q_grads, d_grads


def _row_block(call: MaxSimCall, block: list[_QueryTile], doc_rows: int, losses: Tensor,
               grads: list[Gradients] | None) -> None:
    """One row block's two sweeps (``maxsim_forward``): its queries' losses into ``losses`` and, given ``grads`` (one
    per part of the call, ``MaxSimCall.parts``), their gradients added into it. Everything it holds is freed when it
    returns, before the next block's."""
    device, dtype = losses.device, losses.dtype
    first, rows = block[0].row, sum(query.weights.shape[0] for query in block)
    product = call.budget_bytes - call.budget_bytes // 2
    # The block's scores over its whole row (the first column's row j at position j) and the argmax of each query
    # token: all that is kept between the sweeps. A document tile is prepared in each.
    scores = torch.empty(rows, call.width, dtype=dtype, device=device)
    sweeps = []
    for part, cols in call.parts():
        tiles, part_doc_rows = block, doc_rows
        if part is not call:  # the PP block: the positives of the same queries, tiled for the product alone
            part_doc_rows, query_rows = _tile_rows(part.queries, part.documents, product, product, 1)
            tiles = _row_tiles(part, first, first + rows, query_rows)
        where = None
        if grads is not None:
            lq = max(q.shape[1] for q in part.queries)
            index = _index_dtype(max(d.shape[1] for column in part.documents for d in column))
            where = torch.zeros(rows, lq, part.n_documents, dtype=index, device=device)
        _sweep_scores(part, part_doc_rows, tiles, first, scores[:, cols], where)
        sweeps.append((part, tiles, part_doc_rows, cols, where))
    grad = block_softmax(call, first, scores, losses, grads is not None)
    if grads is None:
        return
    for (part, tiles, part_doc_rows, cols, where), part_grads in zip(sweeps, grads):
        _part_backward(part, tiles, part_doc_rows, first, grad[:, cols], where, part_grads)


def _part_backward(call: MaxSimCall, tiles: list[_QueryTile], doc_rows: int, first: int, grad: Tensor, where: Tensor,
                   grads: Gradients) -> None:
    """The second sweep of one part of a row block: its scores' gradients ``grad`` ``(rows, n_documents)`` sent along
    the kept argmax ``where``, into the part's gradients."""
    dtype, device = grad.dtype, grad.device
    rows, lq = where.shape[:2]
    spans = [slice(query.row - first, query.row - first + query.weights.shape[0]) for query in tiles]
    # The block's query tokens and weights, padded to Lq with zero weights (their argmax is 0, a real position), and
    # the gradient of its query tokens.
    tokens = torch.zeros(rows, lq, call.queries[0].shape[2], dtype=dtype, device=device)
    weights = torch.zeros(rows, lq, dtype=dtype, device=device)
    for query, span in zip(tiles, spans):
        width = query.weights.shape[1]
        tokens[span, :width] = query.tokens.view(-1, width, tokens.shape[2])
        weights[span, :width] = query.weights
    into_queries = torch.zeros_like(tokens)
    q_grads, d_grads = grads
    for (n, doc), cols in _column_spans(call, doc_rows):
        into_queries += _tile_backward(doc, grad[:, cols], where[:, :, cols], tokens, weights, d_grads[n][doc.chunk],
                                       call.budget_bytes - call.budget_bytes // 2)
    for query, span in zip(tiles, spans):
        width = query.weights.shape[1]
        q_grads[query.chunk][query.start:query.stop, :width] += into_queries[span, :width]


def block_softmax(call: MaxSimCall, first: int, scores: Tensor, losses: Tensor, with_grad: bool) -> Tensor | None:
    """The softmax of queries ``first:first + rows`` over their scores ``(rows, M)`` against every document, the
    guide's mask applied first (a masked score leaves the softmax, and its gradient is zero): their losses into
    ``losses`` and, ``with_grad``, their logits' gradients ``scale / B * (softmax - [label])``, made in place of
    ``scores`` and returned (``maxsim_forward``: the largest logit's softmax is ``1 / total`` exactly)."""
    rows = scores.shape[0]
    if call.guide is not None:
        scores.masked_fill_(call.guide.block_mask(call, first, scores), float("-inf"))
    local = torch.arange(rows, device=scores.device)
    labels = call.offset + first + local
    logits = scores.mul_(call.scale)
    peak = logits.amax(1, keepdim=True)
    label_logits = logits[local, labels]
    softmax = logits.sub_(peak).exp_()  # in place: the scores are not needed again
    total = softmax.sum(1, keepdim=True)
    losses[first:first + rows] = (peak + torch.log(total)).squeeze(1) - label_logits
    if not with_grad:
        return None
    unit = call.scale / call.n_queries
    grad = softmax.mul_(unit / total)
    grad[local, labels] -= unit
    return grad


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
