"""Launchers for the MaxSim kernels (``cgist.kernels.maxsim``): the streaming MaxSim loss stage on Triton, tensors in,
tensors out (docs/design.md#late-interaction).

``maxsim_forward_triton`` and ``maxsim_backward_triton`` have the contract of ``cgist.stage.pytorch.maxsim``'s
``maxsim_forward`` and ``maxsim_backward``: a ``MaxSimCall`` in; the mean loss and each query's softmax normaliser as
``(peak, total)`` out of the forward; the gradients of every query chunk and every document chunk, in
``accumulate(dtype)`` (fp32, fp64 for fp64 inputs) and the chunks' shapes, out of the backward. ``budget_bytes`` is
not read: no kernel holds more than one chunk of token products.

The chunks are packed first (``_pack``): the kernels read one contiguous tensor per side, so the query chunks are
concatenated into ``(B, Lq, D)`` and the document chunks, column after column, into ``(M, Ld, D)``, each chunk's
tokens padded to the widest chunk's with masked tokens. That is a copy of the inputs (the PyTorch stage reads the
chunks in place). The gradients come back as views of the packed gradients, one per chunk.

* forward: ``maxsim_fwd_kernel`` over ``(query, block of BLOCK_M documents)`` writes each block's partial normaliser;
  they are combined here in a fixed order (``_combine``). ``maxsim_label_kernel`` computes the label logits with the
  same code.
* backward: ``maxsim_dq_kernel`` (a program per query, over every document) and ``maxsim_dd_kernel`` (a program per
  document, over every query) recompute the maxima, take their tokens, and gather or scatter the gradients.

Everything is deterministic (no atomics) and reads no value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

from cgist.kernels.maxsim import (
    maxsim_dd_kernel,
    maxsim_dq_kernel,
    maxsim_fwd_kernel,
    maxsim_label_kernel,
)

from .launch import TL_DTYPES, _arch, _device_constant, _launch_device, input_precision

if TYPE_CHECKING:
    from cgist.stage.pytorch.maxsim import MaxSimCall

__all__ = ["EMPTY_DOCUMENT_SCORE", "maxsim_backward_triton", "maxsim_forward_triton"]

#: sentence-transformers' score of a document without any real token (``cgist.stage.pytorch.maxsim``'s).
EMPTY_DOCUMENT_SCORE = -1e9
#: Documents per forward program: enough that a program's loop amortises loading its query.
BLOCK_M = 32
#: The largest chunk of document tokens per product (the least is 16, ``tl.dot``'s smallest).
MAX_BLOCK_T = 64


@dataclass
class _Packed:
    """A call's inputs as the kernels read them (``cgist.kernels.maxsim``: Layout), with the tile sizes."""

    queries: Tensor  # (B, Lq, D), contiguous, the inputs' dtype
    weights: Tensor  # (B, Lq) acc: the mask, divided by the real token count under MeanMaxSim
    fill: Tensor  # (B,) acc: the score of an empty document
    documents: Tensor  # (M, Ld, D), contiguous: every column's chunks, column after column
    doc_mask: Tensor  # (M, Ld) int8
    widths: Tensor  # (M,) int32: the last real token + 1, 0 for a document without one
    acc: torch.dtype
    meta: dict  # the kernels' constexprs

    @property
    def shape_args(self) -> dict:
        return dict(lq=self.queries.shape[1], ld=self.documents.shape[1], dim=self.queries.shape[2])

    def pointers(self, scalars: Tensor) -> dict:
        return dict(q_ptr=self.queries, w_ptr=self.weights, fill_ptr=self.fill, d_ptr=self.documents,
                    dmask_ptr=self.doc_mask, width_ptr=self.widths, scalars_ptr=scalars)


def _padded(chunks: list[Tensor], width: int) -> Tensor:
    """Row chunks ``(r, L, ...)`` padded with zeros (False) to ``width`` tokens and concatenated, contiguous."""
    return torch.cat([F.pad(c, (0, 0) * (c.dim() - 2) + (0, width - c.shape[1])) for c in chunks]).contiguous()


def _pack(call: MaxSimCall, block_tokens: int | None) -> _Packed:
    """Concatenate and pad the chunks (module docstring); the weights, fills and widths; the tile sizes."""
    acc = torch.promote_types(call.queries[0].dtype, torch.float32)
    lq = max(q.shape[1] for q in call.queries)
    doc_chunks = [d for column in call.documents for d in column]
    doc_masks = [m for column in call.document_masks for m in column]
    ld = max(d.shape[1] for d in doc_chunks)
    queries = _padded(list(call.queries), lq)
    query_mask = _padded(list(call.query_masks), lq)
    weights = query_mask.to(acc)
    fill = torch.full((queries.shape[0],), EMPTY_DOCUMENT_SCORE, dtype=acc, device=queries.device)
    if call.length_normalize:
        counts = query_mask.sum(1).clamp(min=1).to(acc)
        weights, fill = weights / counts[:, None], fill / counts
    documents = _padded(doc_chunks, ld)
    doc_mask = _padded(doc_masks, ld)
    positions = torch.arange(1, ld + 1, dtype=torch.int32, device=doc_mask.device)
    widths = torch.where(doc_mask, positions, 0).amax(1).to(torch.int32)
    if block_tokens is None:
        block_tokens = min(MAX_BLOCK_T, triton.next_power_of_2(ld))
    meta = dict(ACC=TL_DTYPES[acc], PRECISION=input_precision(queries.dtype, _arch(queries.device)),
                LQ=max(16, triton.next_power_of_2(lq)), BLOCK_D=max(16, triton.next_power_of_2(queries.shape[2])),
                BLOCK_T=max(16, block_tokens))
    return _Packed(queries, weights.contiguous(), fill, documents, doc_mask.to(torch.int8), widths, acc, meta)


def _scalars(scale: float, unit: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(scale, unit)`` on ``device`` in the accumulation dtype (``cgist.kernels.maxsim.SCALE``, ``UNIT``): a Python
    float would reach a kernel as fp32. Made once per value (``launch._device_constant``). Read only."""
    return _device_constant((float(scale), float(unit)), dtype, device)


def _combine(peaks: Tensor, totals: Tensor) -> tuple[Tensor, Tensor]:
    """The blocks' partial normalisers ``(B, n_blocks)`` as one per query: the largest peak, and the totals rescaled to
    it and summed, in a fixed order."""
    peak = peaks.amax(1)
    return peak, (totals * torch.exp(peaks - peak[:, None])).sum(1)


@torch.no_grad()
def maxsim_forward_triton(call: MaxSimCall, *, block_tokens: int | None = None,
                          block_docs: int = BLOCK_M) -> tuple[Tensor, Tensor, Tensor]:
    """The mean loss over the queries, and each query's softmax normaliser as its largest logit ``peak`` and the sum
    of ``exp(logit - peak)`` (for ``maxsim_backward_triton``), as ``cgist.stage.pytorch.maxsim.maxsim_forward``.

    ``block_tokens`` (document tokens per product, a power of two of at least 16; None: the widest document's,
    at most ``MAX_BLOCK_T``) and ``block_docs`` (documents per forward program) are the tiles: tests make them small.
    """
    packed = _pack(call, block_tokens)
    batch, n_docs = packed.queries.shape[0], packed.documents.shape[0]
    device = packed.queries.device
    scalars = _scalars(call.scale, 0.0, packed.acc, device)
    n_blocks = triton.cdiv(n_docs, block_docs)
    peaks = torch.empty(batch, n_blocks, dtype=packed.acc, device=device)
    totals = torch.empty(batch, n_blocks, dtype=packed.acc, device=device)
    labels = torch.empty(batch, dtype=packed.acc, device=device)
    with _launch_device(device):
        maxsim_fwd_kernel[(batch, n_blocks)](
            **packed.pointers(scalars), peak_ptr=peaks, total_ptr=totals, n_docs=n_docs, **packed.shape_args,
            BLOCK_M=block_docs, **packed.meta,
        )
        maxsim_label_kernel[(batch,)](
            **packed.pointers(scalars), label_ptr=labels, offset=call.offset, **packed.shape_args, **packed.meta,
        )
    peak, total = _combine(peaks, totals)
    return (peak + torch.log(total) - labels).mean(), peak, total


@torch.no_grad()
def maxsim_backward_triton(call: MaxSimCall, peak: Tensor, total: Tensor, grad_output: float, *,
                           block_tokens: int | None = None) -> tuple[list[Tensor], list[list[Tensor]]]:
    """The gradients of ``grad_output`` times the loss, for every query chunk and every document chunk (in
    ``accumulate(dtype)``, the chunks' shapes), from the softmax normaliser of ``maxsim_forward_triton``, as
    ``cgist.stage.pytorch.maxsim.maxsim_backward``."""
    packed = _pack(call, block_tokens)
    batch, n_docs = packed.queries.shape[0], packed.documents.shape[0]
    device = packed.queries.device
    scalars = _scalars(call.scale, grad_output * call.scale / batch, packed.acc, device)
    peak, total = peak.to(packed.acc).contiguous(), total.to(packed.acc).contiguous()
    dq = torch.zeros(packed.queries.shape, dtype=packed.acc, device=device)  # padding rows stay 0
    dd = torch.zeros(packed.documents.shape, dtype=packed.acc, device=device)  # the kernel adds into it
    with _launch_device(device):
        maxsim_dq_kernel[(batch,)](
            **packed.pointers(scalars), peak_ptr=peak, total_ptr=total, dq_ptr=dq, n_docs=n_docs, offset=call.offset,
            **packed.shape_args, **packed.meta,
        )
        maxsim_dd_kernel[(n_docs,)](
            **packed.pointers(scalars), peak_ptr=peak, total_ptr=total, dd_ptr=dd, n_queries=batch,
            offset=call.offset, **packed.shape_args, **packed.meta,
        )
    q_grads = [g[:, : q.shape[1]] for g, q in zip(dq.split([q.shape[0] for q in call.queries]), call.queries)]
    d_grads, row = [], 0
    for column in call.documents:
        grads = []
        for d in column:
            grads.append(dd[row : row + d.shape[0], : d.shape[1]])
            row += d.shape[0]
        d_grads.append(grads)
    return q_grads, d_grads
