"""``maxsim_loss``: the multi-vector (late-interaction) ranking loss as one op, and its autograd Function
(docs/design.md#late-interaction).

The loss of sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss``: query ``i``'s score against every
document of every column is MaxSim (for each real query token, the largest dot product with a real document token,
summed in float32), or MeanMaxSim (divided by the query's real token count); a document with no real token scores
``-1e9`` (divided likewise); the scores times ``scale`` go into a cross-entropy whose label is the first column's row
``offset + i``; the loss is the mean over the queries. It is computed by the streaming stage
(``cgist.stage.pytorch.maxsim``), which never holds the scores of more than one tile.
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
from .stage.pytorch.maxsim import DOC_ROWS, MaxSimCall
from .stage.spec.checks import check_finite

__all__ = ["maxsim_loss"]

#: The default budget of one tile's token products (more where one document tile of one query needs more); the
#: default budget is twice it, the other half for what a row block of queries keeps between its sweeps. Measured:
#: smaller tiles cost time, larger ones memory, the BLAS's packing buffers growing with them
#: (docs/design.md#late-interaction).
TILE_FLOOR_BYTES = 4 * 2**20


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


def maxsim_loss(
    queries: Tensor | Sequence[Tensor], query_mask: Tensor | Sequence[Tensor],
    documents: Sequence[Tensor | Sequence[Tensor]], document_masks: Sequence[Tensor | Sequence[Tensor]], *,
    scale: float = 1.0, length_normalize: bool = False, offset: int = 0, block_bytes: int | None = None,
    backend: str = "auto",
) -> Tensor:
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
        block_bytes: the stage's working memory in bytes: half for one tile's token products, half for the scores
            and argmax a row block of queries keeps between its sweeps (None: a default for the device).
        backend: ``"auto"`` (the Triton kernels on GPUs they serve, once their first-use check passed, the PyTorch
            stage elsewhere), ``"torch"`` or ``"triton"`` (docs/design.md#late-interaction).

    Returns:
        The mean loss, differentiable with respect to ``queries`` and ``documents``.
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
    stage = select_maxsim_stage(backend, device, dtype)
    call = MaxSimCall(q_chunks, q_masks, d_chunks, d_masks, float(scale), length_normalize, int(offset),
                      int(block_bytes))
    tensors = [*q_chunks, *(x for column in d_chunks for x in column)]
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return MaxSimLossFunction.apply(call, stage, with_grad, *tensors)
