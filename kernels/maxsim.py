"""Triton kernels for the MaxSim (late-interaction) loss: a forward over (query, block of documents), the label
logits, and the two halves of the backward (docs/design.md#late-interaction).

The math. Query ``i`` has tokens ``q[i, t]`` with weights ``w[i, t]`` (its mask, divided by its real token count under
MeanMaxSim); document ``m`` has tokens ``d[m, u]`` with a mask. Its score is
``s(i, m) = sum_t w[i, t] * max_{u real} <q[i, t], d[m, u]>``, or ``fill[i]`` (-1e9, divided likewise) when the document
has no real token, and its logit ``z(i, m) = scale * s(i, m)``. Each query's softmax normaliser is kept in two parts,
the largest logit ``peak_i`` and ``total_i = sum_m exp(z(i, m) - peak_i)``; the loss of query ``i`` is
``peak_i + log(total_i) - z(i, label_i)``. The gradient of a logit is
``g(i, m) = unit * (exp(z(i, m) - peak_i) / total_i - [m = label_i])`` with ``unit = grad_output * scale / B``, and it
reaches, for each query token ``t``, the one document token ``u*`` where the maximum is:
``dq[i, t] += g * w[i, t] * d[m, u*]`` and ``dd[m, u*] += g * w[i, t] * q[i, t]``. An empty document's score is a
constant, so it sends no gradient.

Layout (the launcher, ``cgist.stage.triton.maxsim``, packs the chunks): queries ``(B, Lq, D)`` with their weights
``(B, Lq)`` and fills ``(B,)``; documents ``(M, Ld, D)`` with an int8 mask ``(M, Ld)`` and each document's width
``(M,)`` (its last real token + 1, 0 when it has none), so a program reads no token past a document's last real one.
Every tensor is contiguous. Query ``i``'s label is document ``offset + i`` (the first column comes first).

Per program, one query's tokens live in registers: ``(LQ, BLOCK_D)``, with ``Lq`` and ``D`` padded to powers of two of
at least 16 (``tl.dot``'s smallest) and the padding masked. A document is read in chunks of ``BLOCK_T`` tokens: one
``tl.dot`` of the query's tokens with the chunk's, ``(LQ, BLOCK_T)``, a masked token set to -inf, and a running
maximum (with its index, in the backward) per query token. So a document may be as long as it likes; the
registers hold one chunk. A program's registers: the query ``(LQ, BLOCK_D)``, a chunk ``(BLOCK_T, BLOCK_D)`` and its
products ``(LQ, BLOCK_T)``, plus an ``(LQ, BLOCK_D)`` accumulator in the query-gradient kernel and a
``(BLOCK_T, LQ)`` matrix with its ``(BLOCK_T, BLOCK_D)`` product in the document-gradient kernel. The feature
dimension is held whole (no K loop): right for ColBERT-sized token vectors (128 and below), heavy for a few
hundred. The token products are rounded to the inputs' dtype before their maximum, as
sentence-transformers' (and the PyTorch stage's) bf16 and fp16 products are; the maxima, the sums, the softmax and the
gradients accumulate in ``ACC`` (fp32, or fp64 for fp64 inputs).

Ties: where several real tokens of a document share a query token's maximum, the backward's token is the first
(lowest index) of them, within a chunk (the smallest index among the maximal entries) and across chunks (a later
chunk replaces the index only when its maximum is strictly larger).

Every kernel is deterministic: no atomics. Each output element is written by one program, in a fixed order (the
forward's partial normalisers are combined on the host, in a fixed order).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["SCALE", "UNIT", "maxsim_dd_kernel", "maxsim_dq_kernel", "maxsim_fwd_kernel", "maxsim_label_kernel"]

#: Slots of the scalar tensor every kernel reads, in ``ACC`` (a Python float would reach a kernel as fp32):
#: ``scale``, and ``unit = grad_output * scale / B`` (the backward's).
SCALE, UNIT = tl.constexpr(0), tl.constexpr(1)


@triton.jit
def _load_query(q_ptr, w_ptr, i, lq, dim, LQ: tl.constexpr, BLOCK_D: tl.constexpr):
    """Query ``i``'s tokens ``(LQ, BLOCK_D)`` (input dtype, 0 past ``lq`` and ``dim``) and weights ``(LQ,)`` (0 past
    ``lq``), with the feature offsets and their mask."""
    offs_t = tl.arange(0, LQ)
    offs_k = tl.arange(0, BLOCK_D)
    mask_t = offs_t < lq
    mask_k = offs_k < dim
    rows = tl.cast(i, tl.int64) * lq + offs_t
    q = tl.load(q_ptr + rows[:, None] * dim + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
    w = tl.load(w_ptr + rows, mask=mask_t, other=0.0)
    return q, w, offs_k, mask_k


@triton.jit
def _token_maxima(
    q, d_ptr, dmask_ptr, m, width, ld, dim, offs_k, mask_k,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, ARGMAX: tl.constexpr,
):
    """For each query token (rows of ``q``), the largest product with a real token of document ``m``, ``(LQ,)`` in
    ``ACC`` (-inf when the document has none), and with ``ARGMAX`` the token where it is, ``(LQ,)`` int32 (the
    first of equal maxima; 0 when the document has no real token).

    The loop reads the document's first ``width`` tokens, ``BLOCK_T`` at a time: ``(BLOCK_T, BLOCK_D)`` of them and
    their mask, one product ``(LQ, BLOCK_T)``."""
    best = tl.full((q.shape[0],), float("-inf"), ACC)
    where = tl.zeros((q.shape[0],), tl.int32)
    first = tl.cast(m, tl.int64) * ld  # the document's first token row
    for t0 in range(0, width, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        real = tl.load(dmask_ptr + first + offs_t, mask=offs_t < width, other=0) != 0
        d = tl.load(d_ptr + (first + offs_t)[:, None] * dim + offs_k[None, :], mask=real[:, None] & mask_k[None, :],
                    other=0.0)
        # rounded to the inputs' dtype (a no-op for fp32 and fp64), then masked
        s = tl.dot(q, tl.trans(d), input_precision=PRECISION, out_dtype=ACC).to(q.dtype).to(ACC)
        s = tl.where(real[None, :], s, float("-inf"))
        chunk_best = tl.max(s, axis=1)
        if ARGMAX:
            chunk_where = tl.min(tl.where(s == chunk_best[:, None], offs_t[None, :], 2147483647), axis=1)
            where = tl.where(chunk_best > best, chunk_where, where)
        best = tl.maximum(best, chunk_best)
    return best, where


@triton.jit
def _score(best, w, width, fill):
    """The MaxSim score from the query tokens' maxima and weights: ``sum_t w[t] * best[t]``, or ``fill`` for a
    document without a real token (``width == 0``, where every maximum is -inf)."""
    score = tl.sum(tl.where(w != 0.0, best, 0.0) * w, axis=0)  # no -inf * 0 (NaN) for an empty document
    return tl.where(width > 0, score, fill)


@triton.jit
def _logit_grad(logit, peak, total, unit, is_label):
    """The gradient of a logit, ``unit * (softmax - [label])`` with ``softmax = exp(logit - peak) / total``."""
    return unit * (tl.exp(logit - peak) / total) - tl.where(is_label, unit, 0.0)


@triton.jit
def maxsim_fwd_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, peak_ptr, total_ptr,
    n_docs, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Partial softmax normalisers. Grid: ``(B, cdiv(M, BLOCK_M))``; program ``(i, b)`` takes query ``i`` against
    documents ``b * BLOCK_M`` to ``(b + 1) * BLOCK_M`` (the last block shorter).

    It holds the query's tokens and weights, loops over its documents (each one's chunks in ``_token_maxima``) and
    keeps the running largest logit ``peak`` and sum ``total = sum exp(logit - peak)`` of the block: two scalars.
    Writes them at ``(i, b)`` of the ``(B, cdiv(M, BLOCK_M))`` buffers ``peak_ptr`` and ``total_ptr``; the host
    combines the blocks in a fixed order."""
    i = tl.program_id(0)
    block = tl.program_id(1)
    q, w, offs_k, mask_k = _load_query(q_ptr, w_ptr, i, lq, dim, LQ, BLOCK_D)
    fill = tl.load(fill_ptr + i)
    scale = tl.load(scalars_ptr + SCALE)
    peak = tl.full((), float("-inf"), ACC)
    total = tl.zeros((), ACC)
    for m in range(block * BLOCK_M, tl.minimum(block * BLOCK_M + BLOCK_M, n_docs)):
        width = tl.load(width_ptr + m)
        best, _ = _token_maxima(q, d_ptr, dmask_ptr, m, width, ld, dim, offs_k, mask_k, ACC, PRECISION, BLOCK_T,
                                False)
        logit = scale * _score(best, w, width, fill)
        new_peak = tl.maximum(peak, logit)
        total = total * tl.exp(peak - new_peak) + tl.exp(logit - new_peak)
        peak = new_peak
    slot = tl.cast(i, tl.int64) * tl.num_programs(1) + block
    tl.store(peak_ptr + slot, peak)
    tl.store(total_ptr + slot, total)


@triton.jit
def maxsim_label_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, label_ptr,
    offset, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The label logits. Grid: ``(B,)``; program ``i`` computes query ``i``'s logit against document ``offset + i``
    with the forward's code, so the loss of a query whose label is its largest logit has ``peak - label = 0``
    exactly."""
    i = tl.program_id(0)
    q, w, offs_k, mask_k = _load_query(q_ptr, w_ptr, i, lq, dim, LQ, BLOCK_D)
    m = offset + i
    width = tl.load(width_ptr + m)
    best, _ = _token_maxima(q, d_ptr, dmask_ptr, m, width, ld, dim, offs_k, mask_k, ACC, PRECISION, BLOCK_T, False)
    tl.store(label_ptr + i, tl.load(scalars_ptr + SCALE) * _score(best, w, width, tl.load(fill_ptr + i)))


@triton.jit
def maxsim_dq_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, peak_ptr, total_ptr, dq_ptr,
    n_docs, offset, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The query gradients. Grid: ``(B,)``; program ``i`` owns query ``i``'s rows of ``dq`` ``(B, Lq, D)``.

    It holds the query's tokens and an ``(LQ, BLOCK_D)`` accumulator, and loops over every document: the maxima and
    their tokens ``u*`` (``_token_maxima``), the logit, its gradient ``g`` from the forward's ``peak_i`` and
    ``total_i``, then one gather of the rows ``d[m, u*[t]]`` (a row per query token) added with the weights
    ``g * w[t]``. No other program writes the rows, so nothing is reduced across programs."""
    i = tl.program_id(0)
    q, w, offs_k, mask_k = _load_query(q_ptr, w_ptr, i, lq, dim, LQ, BLOCK_D)
    fill = tl.load(fill_ptr + i)
    peak = tl.load(peak_ptr + i)
    total = tl.load(total_ptr + i)
    scale = tl.load(scalars_ptr + SCALE)
    unit = tl.load(scalars_ptr + UNIT)
    acc = tl.zeros((LQ, BLOCK_D), ACC)
    for m in range(0, n_docs):
        width = tl.load(width_ptr + m)
        best, where = _token_maxima(q, d_ptr, dmask_ptr, m, width, ld, dim, offs_k, mask_k, ACC, PRECISION,
                                    BLOCK_T, True)
        g = _logit_grad(scale * _score(best, w, width, fill), peak, total, unit, m == offset + i)
        gw = tl.where(width > 0, g, 0.0) * w  # (LQ,): an empty document sends nothing
        rows = tl.cast(m, tl.int64) * ld + where
        picked = tl.load(d_ptr + rows[:, None] * dim + offs_k[None, :], mask=(gw != 0.0)[:, None] & mask_k[None, :],
                         other=0.0)
        acc += gw[:, None] * picked.to(ACC)
    offs_t = tl.arange(0, LQ)
    rows = tl.cast(i, tl.int64) * lq + offs_t
    tl.store(dq_ptr + rows[:, None] * dim + offs_k[None, :], acc, mask=(offs_t < lq)[:, None] & mask_k[None, :])


@triton.jit
def maxsim_dd_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, peak_ptr, total_ptr, dd_ptr,
    n_queries, offset, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The document gradients. Grid: ``(M,)``; program ``m`` owns document ``m``'s rows of ``dd`` ``(M, Ld, D)``,
    which the launcher zeroes.

    It loops over every query: a first pass over the document's chunks finds each query token's maximum and its
    token ``u*`` (``_token_maxima``), which give the logit and its gradient ``g``; a second pass, chunk by chunk,
    forms the ``(LQ, BLOCK_T)`` matrix that is ``g * w[t]`` where query token ``t`` picked the chunk's token and 0
    elsewhere, and adds its transpose times the query's tokens, ``(BLOCK_T, LQ) @ (LQ, BLOCK_D)``, into the chunk's
    rows of ``dd`` (read, added, written back: the rows are this program's alone, so a document of any length needs
    one chunk of registers). The product is fp32 "ieee" (fp64 for fp64): the weights are not rounded to tf32. An
    empty document has width 0, so neither pass runs and its rows stay 0."""
    m = tl.program_id(0)
    width = tl.load(width_ptr + m)
    scale = tl.load(scalars_ptr + SCALE)
    unit = tl.load(scalars_ptr + UNIT)
    first = tl.cast(m, tl.int64) * ld
    for i in range(0, n_queries):
        q, w, offs_k, mask_k = _load_query(q_ptr, w_ptr, i, lq, dim, LQ, BLOCK_D)
        best, where = _token_maxima(q, d_ptr, dmask_ptr, m, width, ld, dim, offs_k, mask_k, ACC, PRECISION,
                                    BLOCK_T, True)
        logit = scale * _score(best, w, width, tl.load(fill_ptr + i))
        g = _logit_grad(logit, tl.load(peak_ptr + i), tl.load(total_ptr + i), unit, m == offset + i)
        gw = g * w
        q_acc = q.to(ACC)
        for t0 in range(0, width, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            picks = tl.where(where[:, None] == offs_t[None, :], gw[:, None], 0.0)  # (LQ, BLOCK_T)
            grad = tl.dot(tl.trans(picks), q_acc, input_precision="ieee", out_dtype=ACC)  # (BLOCK_T, BLOCK_D)
            ptrs = dd_ptr + (first + offs_t)[:, None] * dim + offs_k[None, :]
            mask = (offs_t < width)[:, None] & mask_k[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + grad, mask=mask)
