"""``maxsim_loss``: the multi-vector (late-interaction) ranking loss as one op, and its autograd Function
(docs/design.md#late-interaction).

The loss of sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss``: query ``i``'s score against every
document of every column is MaxSim (for each real query token, the largest dot product with a real document token,
summed in float32), or MeanMaxSim (divided by the query's real token count); a document with no real token scores
``-1e9`` (divided likewise); the scores times ``scale`` go into a cross-entropy whose label is the first column's row
``offset + i``; the loss is the mean over the queries. With a guide, GIST's mask leaves out the candidates that
the guide scores above each query's threshold (docs/design.md#the-guide-for-late-interaction). It is computed by the
streaming stage (``cgist.stage.pytorch.maxsim``), which never holds the scores of more than one row block of queries.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .stage.budget import default_block_bytes
from .stage.dispatch.route import MaxSimStage, requested_backend, select_maxsim_stage
from .stage.numerics import normalize
from .stage.pytorch.maxsim import DOC_ROWS, GUIDE_COUNTERS, MaxSimCall, MaxSimGuide, accumulate
from .stage.spec.checks import check_finite
from .stage.spec.options import check_bools, check_margin
from .stage.stats import GistStats

__all__ = ["maxsim_loss"]

#: The default budget of one tile's token products (more where one document tile of one query needs more); the
#: default budget is twice it, the other half for what a row block of queries keeps between its sweeps. Measured:
#: half of it costs 16% more time at ColBERT's shapes, for 4% less memory (docs/design.md#late-interaction).
TILE_FLOOR_BYTES = 8 * 2**20


def _chunks(value: object, name: str) -> list[Tensor]:
    """A tensor or a non-empty list of tensors (row chunks), as a list."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value \
            or not all(isinstance(v, Tensor) for v in value):
        raise TypeError(f"{name} must be a torch.Tensor or a non-empty list of them (row chunks), "
                        f"got {type(value).__name__}")
    return list(value)


def _check_side(embeddings: list[Tensor], masks: list[Tensor], name: str, mask_name: str, dim: int | None,
                dtype: torch.dtype | None,
                device: torch.device | None) -> tuple[list[Tensor], int, list[tuple[str, Tensor]]]:
    """One side's chunks checked against their masks, the embedding dim, dtype and device: the masks as bool, the
    rows, and each chunk with its name in messages (for ``check_finite``)."""
    if len(masks) != len(embeddings):
        raise ValueError(f"{mask_name} must have one mask per chunk of {name}: got {len(masks)} masks for "
                         f"{len(embeddings)} chunks")
    out, rows, named = [], 0, []
    for k, (x, m) in enumerate(zip(embeddings, masks)):
        where = name if len(embeddings) == 1 else f"{name} chunk {k}"
        if x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"{where} must be a floating (rows, tokens, dim) tensor of token embeddings, got "
                             f"{x.dtype} of shape {tuple(x.shape)}")
        if dim is not None and x.shape[2] != dim:
            raise ValueError(f"{where} has token embeddings of dim {x.shape[2]}, but the queries' have dim {dim}")
        if dtype is not None and x.dtype != dtype:
            raise ValueError(f"{where} is {x.dtype}, but the queries are {dtype}: pass one dtype")
        if device is not None and x.device != device:
            raise ValueError(f"{where} is on {x.device}, but the queries are on {device}")
        if m.shape != x.shape[:2]:
            raise ValueError(f"{mask_name}{'' if len(masks) == 1 else f' chunk {k}'} must have shape "
                             f"{tuple(x.shape[:2])} (rows, tokens) to match {where}, got {tuple(m.shape)}")
        if m.is_floating_point() or m.is_complex():
            raise TypeError(f"{mask_name} must be a bool (or integer 0/1) tensor, got {m.dtype}")
        out.append(m.to(device=x.device, dtype=torch.bool))
        rows += x.shape[0]
        named.append((where, x))
    return out, rows, named


class MaxSimLossFunction(torch.autograd.Function):
    """Autograd node over the query chunks and the documents' chunks, column after column: the stage's forward (with
    the gradients when the backward will want them), and its backward with the loss's incoming gradient
    (``select_maxsim_stage``)."""

    @staticmethod
    def forward(ctx, call: MaxSimCall, stage: MaxSimStage, with_grad: bool, *tensors: Tensor) -> Tensor:
        ctx.call, ctx.stage = call, stage
        loss, ctx.state = stage[0](call, with_grad and any(ctx.needs_input_grad[3:]))
        ctx.dtypes = [t.dtype for t in tensors]
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        forward, backward = ctx.stage
        state, ctx.state = ctx.state, None  # the gradients are handed over; a second backward recomputes them
        if state is None:
            state = forward(ctx.call, True)[1]
        q_grads, d_grads = backward(ctx.call, state, float(grad_output))
        grads = [*q_grads, *(g for column in d_grads for g in column)]
        return (None, None, None, *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)))


def _guide(guide: object, guide_masks: object, guide_length_normalize: object, margin: object,
           margin_strategy: object, text_ids: object, mask_duplicates: object, contrast: tuple[bool, bool, bool],
           heights: list[int], n_queries: int, offset: int, budget: int, device: torch.device,
           dtype: torch.dtype) -> MaxSimGuide | None:
    """``maxsim_loss``'s guide arguments, checked, as the stage's ``MaxSimGuide`` (None where nothing masks and there
    is no contrast block); ``contrast`` is ``(contrast_anchors, contrast_positives, mask_self)``."""
    if not isinstance(mask_duplicates, bool):
        raise TypeError(f"mask_duplicates must be a bool, got {type(mask_duplicates).__name__}")
    ids = _text_ids(text_ids, [n_queries, *heights], device)
    if mask_duplicates and ids is None:
        raise ValueError("mask_duplicates needs text_ids: one id per text of each column, equal for equal texts")
    anchors, positives, mask_self = contrast
    if guide is None and not mask_duplicates and not (anchors or positives):
        return None
    check_margin(margin, margin_strategy)
    column_ids = None
    if ids is not None:  # a text id per score of a query's row (``MaxSimCall.blocks``)
        column_ids = torch.cat([*ids[1:], *([ids[0]] if anchors else []), *([ids[1]] if positives else [])])
    common = dict(margin=float(margin), relative=margin_strategy == "relative", mask_duplicates=mask_duplicates,
                  mask_self=mask_self, query_ids=None if ids is None else ids[0], column_ids=column_ids,
                  counters=torch.zeros(len(GUIDE_COUNTERS), dtype=torch.int64, device=device))
    if guide is None or isinstance(guide, str):
        if guide not in (None, "self"):
            raise ValueError(f"guide must be 'self', the guide's columns or None, got {guide!r}")
        return MaxSimGuide(guide or "none", sums=torch.zeros(2, dtype=accumulate(dtype), device=device), **common)
    if isinstance(guide, Tensor) or not isinstance(guide, Sequence) or len(guide) != 1 + len(heights):
        raise ValueError(f"guide must be 'self', None, or a list of the guide's columns: the queries', then the "
                         f"{len(heights)} document columns' (each a tensor or a list of row chunks)")
    columns = [_chunks(g, f"guide[{n}]") for n, g in enumerate(guide)]
    if columns[0][0].dim() == 2:  # a single-vector guide: the cosine of its embeddings
        if guide_masks is not None:
            raise ValueError("guide_masks are for a multi-vector guide's (rows, tokens, dim) columns; this guide's "
                             "columns are (rows, dim) embeddings")
        vectors = _vector_guide(columns, [n_queries, *heights], device)
        return MaxSimGuide("vectors", vectors=(vectors[0], torch.cat(vectors[1:])),
                           sums=torch.zeros(2, dtype=vectors[0].dtype, device=device), **common)
    if columns[0][0].dim() != 3:
        raise ValueError(f"guide[0] must be (rows, dim) embeddings or (rows, tokens, dim) token embeddings, got shape "
                         f"{tuple(columns[0][0].shape)}")
    tokens = _token_guide(columns, guide_masks, guide_length_normalize, heights, n_queries, offset, budget, device,
                          anchors, positives)
    return MaxSimGuide("tokens", tokens=tokens,
                       sums=torch.zeros(2, dtype=accumulate(tokens.queries[0].dtype), device=device), **common)


def _text_ids(text_ids: object, rows: list[int], device: torch.device) -> list[Tensor] | None:
    """``text_ids``, checked (an integer id tensor per column of ``rows`` rows), as int64 on ``device``."""
    if text_ids is None:
        return None
    if isinstance(text_ids, (Tensor, str, bytes)) or not isinstance(text_ids, Sequence) or len(text_ids) != len(rows):
        raise ValueError(f"text_ids must be a list of one id tensor per column (the queries, then the "
                         f"{len(rows) - 1} document columns)")
    for n, (t, height) in enumerate(zip(text_ids, rows)):
        if not isinstance(t, Tensor) or t.shape != (height,) or t.is_floating_point() or t.is_complex():
            raise ValueError(f"text_ids[{n}] must be an integer tensor of shape ({height},), got "
                             f"{t.dtype if isinstance(t, Tensor) else type(t).__name__} of shape "
                             f"{tuple(getattr(t, 'shape', ()))}")
    return [t.to(device=device, dtype=torch.int64) for t in text_ids]


def _vector_guide(columns: list[list[Tensor]], rows: list[int], device: torch.device) -> list[Tensor]:
    """A single-vector guide's columns, checked (floating ``(rows, Dg)``, finite), whole and normalised in
    ``accumulate(dtype)``."""
    whole = []
    for n, (chunks, height) in enumerate(zip(columns, rows)):
        if any(c.dim() != 2 or not c.is_floating_point() for c in chunks):
            raise ValueError(f"guide[{n}] must be floating (rows, dim) embeddings like guide[0], got "
                             f"{[tuple(c.shape) for c in chunks]}")
        column = torch.cat(chunks).detach().to(device)
        if column.shape[0] != height or column.shape[1] != columns[0][0].shape[1]:
            raise ValueError(f"guide[{n}] must have shape ({height}, {columns[0][0].shape[1]}), got "
                             f"{tuple(column.shape)}")
        whole.append(column)
    check_finite([(f"guide[{n}]", c) for n, c in enumerate(whole)])
    return [normalize(c, accumulate(whole[0].dtype))[0] for c in whole]


def _token_guide(columns: list[list[Tensor]], guide_masks: object, guide_length_normalize: object, heights: list[int],
                 n_queries: int, offset: int, budget: int, device: torch.device, anchors: bool,
                 positives: bool) -> MaxSimCall:
    """A multi-vector guide's columns and masks, checked as the student's are, as a call over the same rows laid out
    as the student's (its ``scale`` 1; GIST's contrast blocks alike)."""
    if isinstance(guide_masks, Tensor) or not isinstance(guide_masks, Sequence) or len(guide_masks) != len(columns):
        raise ValueError(f"a multi-vector guide needs guide_masks: one mask per guide column ({len(columns)}), each "
                         "a tensor or a list of row chunks as the column")
    if not isinstance(guide_length_normalize, bool):
        raise TypeError(f"guide_length_normalize must be a bool, got {type(guide_length_normalize).__name__}")
    chunks = [[c.detach() for c in column] for column in columns]
    q_masks, rows, named = _check_side(chunks[0], _chunks(guide_masks[0], "guide_masks[0]"), "guide[0]",
                                       "guide_masks[0]", None, None, device)
    dim, guide_dtype = chunks[0][0].shape[2], chunks[0][0].dtype
    d_masks = []
    for n, column in enumerate(chunks[1:], 1):
        checked, height, more = _check_side(column, _chunks(guide_masks[n], f"guide_masks[{n}]"), f"guide[{n}]",
                                            f"guide_masks[{n}]", dim, guide_dtype, device)
        if height != heights[n - 1]:
            raise ValueError(f"guide[{n}] has {height} rows, but documents[{n - 1}] has {heights[n - 1]}")
        d_masks.append(checked)
        named += more
    if rows != n_queries:
        raise ValueError(f"guide[0] has {rows} rows, but the queries have {n_queries}")
    check_finite(named)
    return MaxSimCall.with_contrast(chunks[0], q_masks, chunks[1:], d_masks, 1.0, guide_length_normalize, offset,
                                    budget, None, anchors, positives)


def _stats(call: MaxSimCall) -> GistStats:
    """What the guide masked in the call (``GistStats``, per block of ``MaxSimCall.blocks``: AP, the first column,
    its labels left out; AN, the others; AA and PP, GIST's contrast blocks, their self-pairs counted)."""
    n_queries, guide = call.n_queries, call.guide
    blocks = call.blocks()
    candidates = {name: n_queries * (cols.stop - cols.start - (name == "ap")) for name, cols in blocks.items()}
    if guide is None:
        return GistStats({k: 0 for k in candidates}, candidates, 0, n_queries, None, None)
    counts, sums = guide.counters.tolist(), guide.sums.tolist()
    masked = {name: counts[k] for k, name in enumerate(GUIDE_COUNTERS) if name in blocks}
    means = (None, None) if guide.kind == "none" else (sums[0] / n_queries, sums[1] / n_queries)
    return GistStats(masked, candidates, counts[-1], n_queries, *means)


def maxsim_loss(
    queries: Tensor | Sequence[Tensor], query_mask: Tensor | Sequence[Tensor],
    documents: Sequence[Tensor | Sequence[Tensor]], document_masks: Sequence[Tensor | Sequence[Tensor]], *,
    scale: float = 1.0, length_normalize: bool = False, offset: int = 0, guide: object = None,
    guide_masks: Sequence[Tensor | Sequence[Tensor]] | None = None, guide_length_normalize: bool = False,
    margin: float = 0.0, margin_strategy: str = "absolute", text_ids: Sequence[Tensor] | None = None,
    mask_duplicates: bool = False, contrast_anchors: bool = False, contrast_positives: bool = False,
    mask_self: bool = True, block_bytes: int | None = None, backend: str = "auto", return_stats: bool = False,
) -> Tensor | tuple[Tensor, GistStats]:
    """The multi-vector ranking loss of ``queries`` against every document of ``documents`` (module docstring).

    Args:
        queries: ``(B, Lq, D)`` token embeddings, or a list of row chunks (GradCache's mini-batches).
        query_mask: ``(B, Lq)`` bool, True at a real token (chunked as ``queries``).
        documents: the document columns (positive, then negatives), each ``(M, Ld, D)`` or a list of row chunks;
            with ``offset`` the columns hold every rank's rows and query ``i``'s positive is row ``offset + i``.
        document_masks: their masks, column by column.
        scale: multiplies the scores (sentence-transformers' ``scale``, ``1 / temperature``).
        length_normalize: MeanMaxSim: each score divided by its query's real token count.
        offset: the first column's row of the first query's positive.
        guide: GIST's guide, which leaves a query's candidates out of its softmax (``MaxSimGuide``): ``"self"`` (the
            student's own scores, detached), the guide's columns, queries' then each document column's, as
            ``(rows, Dg)`` embeddings (a single-vector guide: their cosine) or ``(rows, tokens, Dg)`` token
            embeddings with ``guide_masks`` (a multi-vector guide: their MaxSim, MeanMaxSim with
            ``guide_length_normalize``); None: no mask.
        guide_masks, guide_length_normalize: a multi-vector guide's masks (chunked as its columns) and scoring.
        margin, margin_strategy: how far below theta_i (the guide's score of query ``i`` with its positive) the
            threshold lies: ``theta_i - margin`` (``"absolute"``) or ``theta_i - |theta_i| * margin``
            (``"relative"``); a candidate strictly above it is masked.
        text_ids: an integer id per text of each column (queries, then the document columns), equal for equal
            texts: a candidate with the text of query ``i``'s positive ties with theta_i, masked exactly when
            ``theta_i > T_i``, whatever the rounding of its guide score.
        mask_duplicates: mask every candidate whose text is the query's or its positive's (with ``text_ids``), with
            or without a guide.
        contrast_anchors, contrast_positives: GIST's contrast blocks in each query's softmax, masked by the guide as
            the documents are: AA, query ``i``'s MaxSim against every query, and PP, its positive's (as the left side,
            row ``offset + i`` of the first column) against every document of the first column.
        mask_self: always leave the self-pairs AA[i, i] and PP[i, offset + i] out.
        block_bytes: the stage's working memory in bytes: half for one tile's token products, half for the scores
            and argmax a row block of queries keeps between its sweeps (None: a default for the device).
        backend: ``"auto"`` (the Triton kernels on GPUs they serve, once their first-use check passed, the PyTorch
            stage elsewhere), ``"torch"`` or ``"triton"``, with a guide or without (docs/design.md#late-interaction).
        return_stats: also return what the guide masked (``GistStats``).

    Returns:
        The mean loss, differentiable with respect to ``queries`` and ``documents`` (the guide gets no gradient);
        with ``return_stats``, also its ``GistStats``.
    """
    requested_backend(backend)
    q_chunks = _chunks(queries, "queries")
    q_masks, n_queries, named = _check_side(q_chunks, _chunks(query_mask, "query_mask"), "queries", "query_mask",
                                            None, None, None)
    dim, dtype, device = q_chunks[0].shape[2], q_chunks[0].dtype, q_chunks[0].device
    if isinstance(documents, Tensor) or not isinstance(documents, Sequence) or not documents:
        raise TypeError("documents must be a non-empty list of columns (positive, then negatives), each a tensor or "
                        f"a list of row chunks; got {type(documents).__name__}")
    if isinstance(document_masks, Tensor) or not isinstance(document_masks, Sequence) \
            or len(document_masks) != len(documents):
        raise ValueError(f"document_masks must be a list of one mask per document column ({len(documents)})")
    d_chunks, d_masks, heights = [], [], []
    for n, (column, masks) in enumerate(zip(documents, document_masks)):
        chunks = _chunks(column, f"documents[{n}]")
        checked, rows, column_named = _check_side(chunks, _chunks(masks, f"document_masks[{n}]"), f"documents[{n}]",
                                                  f"document_masks[{n}]", dim, dtype, device)
        named += column_named
        d_chunks.append(chunks)
        d_masks.append(checked)
        heights.append(rows)
    check_finite(named)
    if len(set(heights)) > 1:
        raise ValueError(f"every document column must have the same number of rows, got {heights}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or not 0 <= offset <= heights[0] - n_queries:
        raise ValueError(f"offset must be an int in [0, {heights[0] - n_queries}] (the first document column has "
                         f"{heights[0]} rows for {n_queries} queries), got {offset!r}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if not isinstance(length_normalize, bool):
        raise TypeError(f"length_normalize must be a bool, got {type(length_normalize).__name__}")
    if block_bytes is None:
        lq, ld = max(x.shape[1] for x in q_chunks), max(x.shape[1] for column in d_chunks for x in column)
        tile = max(TILE_FLOOR_BYTES, lq * ld * DOC_ROWS * q_chunks[0].element_size())
        block_bytes = min(2 * tile, default_block_bytes(device, 2 * tile))  # below the dense stage's least default
    elif isinstance(block_bytes, bool) or not isinstance(block_bytes, numbers.Integral) or block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int or None, got {block_bytes!r}")
    check_bools(contrast_anchors=contrast_anchors, contrast_positives=contrast_positives, mask_self=mask_self)
    contrast = (contrast_anchors, contrast_positives, mask_self)
    checked_guide = _guide(guide, guide_masks, guide_length_normalize, margin, margin_strategy, text_ids,
                           mask_duplicates, contrast, heights, n_queries, int(offset), int(block_bytes), device, dtype)
    stage = select_maxsim_stage(backend, device, dtype, guided=checked_guide is not None)
    call = MaxSimCall.with_contrast(q_chunks, q_masks, d_chunks, d_masks, float(scale), length_normalize, int(offset),
                                    int(block_bytes), checked_guide, contrast_anchors, contrast_positives)
    # In the order of the stage's gradients (GIST's PP block reads the first column's chunks, and adds into theirs).
    tensors = [*call.queries, *(x for column in call.documents for x in column)]
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    loss = MaxSimLossFunction.apply(call, stage, with_grad, *tensors)
    return (loss, _stats(call)) if return_stats else loss
