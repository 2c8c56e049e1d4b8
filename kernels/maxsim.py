"""Triton kernels for the MaxSim (late-interaction) loss: a forward over (query, block of documents), the label
logits, a slab's logits for a guided loss, and the backward's three passes: the logits' gradients, the query
gradients and the document gradients (docs/design.md#late-interaction).

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

XTR (the ``XTR`` constexpr of the slab kernels: a slab's logits, the query and the document gradients;
docs/design.md#xtr): each query token has a threshold ``tau[i, t]`` (the host's, laid out as the weights), a maximum
counts only where it reaches it, and the score is the sum of the counted maxima over their count ``Z`` (at least 1),
which the logits' kernel writes beside them; the host divides each logit's gradient by its ``Z``, and the gradient
kernels send it along the counted maxima only.

Layout (the launcher, ``cgist.stage.triton.maxsim``, packs the chunks): queries ``(B, Lq, D)`` with their weights
``(B, Lq)`` and fills ``(B,)``; documents ``(M, Ld, D)`` with an int8 mask ``(M, Ld)`` and each document's width
``(M,)`` (its last real token + 1, 0 when it has none), so a program reads no token past a document's last real one.
Every tensor is contiguous. Query ``i``'s label is document ``offset + i`` (the first column comes first).

Tiles. No program holds a query's tokens, nor a document's, whole. The query's ``Lq`` tokens (padded to ``LQ``, a
power of two of at least 16) are taken ``BLOCK_Q`` at a time (a token block), a document's tokens ``BLOCK_T`` at a
time (a chunk, up to its width), and the features ``BLOCK_K`` at a time (of ``BLOCK_D``, ``D`` padded to a power of
two): the products of a token block with a chunk, ``(BLOCK_Q, BLOCK_T)``, are a loop of ``tl.dot`` over the feature
slices, each slice of both sides loaded from memory (``_products``), accumulated in ``ACC`` and then rounded to the
inputs' dtype, as sentence-transformers' (and the PyTorch stage's) bf16 and fp16 products are, before their maximum.
A masked token is -inf there, a padded query token or feature 0. So a program's registers hold one
``(BLOCK_Q, BLOCK_T)`` product tile and one slice of each side, whatever ``Lq``, ``Ld`` and ``D`` (but the query
gradient's accumulator and gathered rows, ``(BLOCK_Q, BLOCK_D)``: the feature dimension whole, right for ColBERT's
128, heavy for several hundred); the maxima, the sums, the softmax and the gradients accumulate in ``ACC`` (fp32, or
fp64 for fp64 inputs). The tile sizes, the warps, the pipeline stages and the register limit of each kernel are the
launcher's (``cgist.stage.triton.maxsim.launch_configs``). The kernels do not specialise on the token counts nor on
the batch (``_RUNTIME``), so one binary serves every query and document length of a launch.

* ``maxsim_fwd_kernel`` and ``maxsim_label_kernel``: a logit is a loop over the query's token blocks, each a loop
  over the document's chunks keeping each query token's running maximum (``_token_maxima``) and adding the block's
  weighted maxima to the score (``_logit``).
* ``maxsim_grad_kernel``: the backward's first pass writes ``g(i, m)`` (0 for an empty document) for a slab of
  queries, ``(rows, M)``, with the forward's code. The two gradient kernels read it, so each recomputes only the
  maxima's tokens of its own token block: the backward forms every token product three times.
* ``maxsim_scores_kernel``: a guided loss (GIST's mask) writes the logits of a slab of queries, ``(rows, M)``, with
  the forward's code; the launcher masks them and takes their softmax on the host, and the two gradient kernels read
  the gradients it makes there: a guided step forms every token product three times.
* ``maxsim_dq_kernel``: a program per (query, token block) owns the block's rows of ``dq``, ``(BLOCK_Q, BLOCK_D)``
  in registers; per document, the maxima's tokens and a gather of those document rows weighted by ``g * w``.
* ``maxsim_dd_kernel``: a program per document owns its rows of ``dd``; per query of the slab and token block, the
  maxima's tokens, then their rows of ``dd`` are read, added to and written back, a feature slice at a time. Query
  tokens that pick the same document token are summed first (a ``(BLOCK_Q, BLOCK_Q)`` product of the weights with the
  query slice), and only the first of them writes the row, so no row is written twice at once.

Ties: where several real tokens of a document share a query token's maximum, the backward's token is the first
(lowest index) of them, within a chunk (the smallest index among the maximal entries) and across chunks (a later
chunk replaces the index only when its maximum is strictly larger).

Every kernel is deterministic: no atomics. Each output element is written by one program, in a fixed order: the
forward's partial normalisers are combined on the host in a fixed order, ``dq``'s rows are written once, and ``dd``'s
rows are read and written by their document's program alone, query after query (a barrier orders one update's
writes before the next one's reads, which other threads of the program may make); the launcher's slabs of queries
follow each other.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["SCALE", "UNIT", "maxsim_dd_kernel", "maxsim_dq_kernel", "maxsim_fwd_kernel", "maxsim_grad_kernel",
           "maxsim_label_kernel", "maxsim_scores_kernel"]

#: Slots of the scalar tensor every kernel reads, in ``ACC`` (a Python float would reach a kernel as fp32):
#: ``scale``, and ``unit = grad_output * scale / B`` (the backward's).
SCALE, UNIT = tl.constexpr(0), tl.constexpr(1)

#: Runtime integers that the kernels do not specialise on (a value of 1, or a multiple of 16): one binary serves every
#: batch, query and document width (``dim`` is specialised: its multiples of 16 vectorise the loads).
_RUNTIME = ["n_docs", "n_rows", "offset", "q_start", "lq", "ld"]


@triton.jit
def _query_block(w_ptr, i, q0, lq, BLOCK_Q: tl.constexpr):
    """Query ``i``'s token block from token ``q0``: its rows in the packed queries ``(BLOCK_Q,)`` int64, which of
    them are real (below ``lq``), and their weights (0 past ``lq``)."""
    offs = q0 + tl.arange(0, BLOCK_Q)
    real = offs < lq
    rows = tl.cast(i, tl.int64) * lq + offs
    return rows, real, tl.load(w_ptr + rows, mask=real, other=0.0)


@triton.jit
def _products(
    q_ptr, q_rows, q_real, d_ptr, d_rows, real, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The products of query rows ``q_rows`` (``q_real``) with document rows ``d_rows`` (``real``),
    ``(BLOCK_Q, BLOCK_T)`` in ``ACC``: a ``tl.dot`` per slice of ``BLOCK_K`` features, both slices loaded here; then
    rounded to the inputs' dtype (a no-op for fp32 and fp64), a masked token at -inf."""
    s = tl.zeros((q_rows.shape[0], d_rows.shape[0]), ACC)
    for k0 in range(0, BLOCK_D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < dim
        q = tl.load(q_ptr + q_rows[:, None] * dim + offs_k[None, :], mask=q_real[:, None] & mask_k[None, :],
                    other=0.0)
        d = tl.load(d_ptr + d_rows[:, None] * dim + offs_k[None, :], mask=real[:, None] & mask_k[None, :],
                    other=0.0)
        s = tl.dot(q, tl.trans(d), s, input_precision=PRECISION, out_dtype=ACC)
    s = s.to(q_ptr.dtype.element_ty).to(ACC)
    return tl.where(real[None, :], s, float("-inf"))


@triton.jit
def _token_maxima(
    q_ptr, q_rows, q_real, d_ptr, dmask_ptr, m, width, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, ARGMAX: tl.constexpr,
):
    """For each query token of a block, the largest product with a real token of document ``m``, ``(BLOCK_Q,)`` in
    ``ACC`` (-inf when the document has none), and with ``ARGMAX`` the token where it is, ``(BLOCK_Q,)`` int32 (the
    first of equal maxima; 0 when the document has no real token).

    The loop reads the document's first ``width`` tokens, ``BLOCK_T`` at a time: their mask, and their products
    (``_products``)."""
    best = tl.full((q_rows.shape[0],), float("-inf"), ACC)
    where = tl.zeros((q_rows.shape[0],), tl.int32)
    first = tl.cast(m, tl.int64) * ld  # the document's first token row
    for t0 in range(0, width, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        real = tl.load(dmask_ptr + first + offs_t, mask=offs_t < width, other=0) != 0
        s = _products(q_ptr, q_rows, q_real, d_ptr, first + offs_t, real, dim, ACC, PRECISION, BLOCK_D, BLOCK_K)
        chunk_best = tl.max(s, axis=1)
        if ARGMAX:
            chunk_where = tl.min(tl.where(s == chunk_best[:, None], offs_t[None, :], 2147483647), axis=1)
            where = tl.where(chunk_best > best, chunk_where, where)
        best = tl.maximum(best, chunk_best)
    return best, where


@triton.jit
def _retrieved(best, w, tau_ptr, q_rows, q_real, XTR: tl.constexpr):
    """Which maxima of a token block count: a real (weighted) token's, and under ``XTR`` only where the maximum
    reaches the token's threshold (``tau_ptr``, laid out as the weights)."""
    kept = w != 0.0
    if XTR:
        kept = kept & (best >= tl.load(tau_ptr + q_rows, mask=q_real, other=float("inf")))
    return kept


@triton.jit
def _logit(
    q_ptr, w_ptr, tau_ptr, d_ptr, dmask_ptr, i, m, width, fill, scale, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, XTR: tl.constexpr,
):
    """The logit of query ``i`` against document ``m``: ``scale * sum_t w[t] * max_t``, a token block at a time, or
    ``scale * fill`` for a document without a real token (``width == 0``, where every maximum is -inf); and how many
    maxima counted (``_retrieved``). Under ``XTR`` the sum runs over the retrieved maxima and is divided by their
    count (at least 1)."""
    score = tl.zeros((), ACC)
    count = tl.zeros((), ACC)
    for q0 in range(0, LQ, BLOCK_Q):
        q_rows, q_real, w = _query_block(w_ptr, i, q0, lq, BLOCK_Q)
        best, _ = _token_maxima(q_ptr, q_rows, q_real, d_ptr, dmask_ptr, m, width, ld, dim, ACC, PRECISION, BLOCK_D,
                                BLOCK_K, BLOCK_T, False)
        kept = _retrieved(best, w, tau_ptr, q_rows, q_real, XTR)
        score += tl.sum(tl.where(kept, best, 0.0) * w, axis=0)  # no -inf * 0 (NaN) for an empty document
        count += tl.sum(kept.to(ACC), axis=0)
    if XTR:
        score = score / tl.maximum(count, 1.0)
    return scale * tl.where(width > 0, score, fill), count


@triton.jit
def _logit_grad(logit, peak, total, unit, is_label):
    """The gradient of a logit, ``unit * (softmax - [label])`` with ``softmax = exp(logit - peak) / total``."""
    return unit * (tl.exp(logit - peak) / total) - tl.where(is_label, unit, 0.0)


@triton.jit(do_not_specialize=_RUNTIME)
def maxsim_fwd_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, peak_ptr, total_ptr,
    n_docs, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Partial softmax normalisers. Grid: ``(B, cdiv(M, BLOCK_M))``; program ``(i, b)`` takes query ``i`` against
    documents ``b * BLOCK_M`` to ``(b + 1) * BLOCK_M`` (the last block shorter).

    It loops over its documents (each one's logit from ``_logit``) and keeps the running largest logit ``peak`` and
    sum ``total = sum exp(logit - peak)`` of the block: two scalars. Writes them at ``(i, b)`` of the
    ``(B, cdiv(M, BLOCK_M))`` buffers ``peak_ptr`` and ``total_ptr``; the host combines the blocks in a fixed order."""
    i = tl.program_id(0)
    block = tl.program_id(1)
    fill = tl.load(fill_ptr + i)
    scale = tl.load(scalars_ptr + SCALE)
    peak = tl.full((), float("-inf"), ACC)
    total = tl.zeros((), ACC)
    for m in range(block * BLOCK_M, tl.minimum(block * BLOCK_M + BLOCK_M, n_docs)):
        logit, _ = _logit(q_ptr, w_ptr, w_ptr, d_ptr, dmask_ptr, i, m, tl.load(width_ptr + m), fill, scale, lq, ld,
                          dim, ACC, PRECISION, LQ, BLOCK_Q, BLOCK_D, BLOCK_K, BLOCK_T, False)
        new_peak = tl.maximum(peak, logit)
        total = total * tl.exp(peak - new_peak) + tl.exp(logit - new_peak)
        peak = new_peak
    slot = tl.cast(i, tl.int64) * tl.num_programs(1) + block
    tl.store(peak_ptr + slot, peak)
    tl.store(total_ptr + slot, total)


@triton.jit(do_not_specialize=_RUNTIME)
def maxsim_label_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, label_ptr,
    offset, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The label logits. Grid: ``(B,)``; program ``i`` computes query ``i``'s logit against document ``offset + i``
    with the forward's code, so the loss of a query whose label is its largest logit has ``peak - label = 0``
    exactly."""
    i = tl.program_id(0)
    m = offset + i
    logit, _ = _logit(q_ptr, w_ptr, w_ptr, d_ptr, dmask_ptr, i, m, tl.load(width_ptr + m), tl.load(fill_ptr + i),
                      tl.load(scalars_ptr + SCALE), lq, ld, dim, ACC, PRECISION, LQ, BLOCK_Q, BLOCK_D, BLOCK_K, BLOCK_T,
                      False)
    tl.store(label_ptr + i, logit)


@triton.jit(do_not_specialize=_RUNTIME)
def maxsim_scores_kernel(
    q_ptr, w_ptr, tau_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, out_ptr, z_ptr,
    n_docs, q_start, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, XTR: tl.constexpr,
):
    """The logits of a slab of queries, for a loss whose softmax the host takes (a guide's mask, XTR). Grid:
    ``(rows, cdiv(M, BLOCK_M))``; program ``(r, b)`` takes query ``q_start + r`` against the documents of block ``b``
    (as the forward's), and writes each logit at ``(r, m)`` of ``out_ptr`` ``(rows, M)`` (``fill`` for an empty
    document); under ``XTR`` (the thresholds at ``tau_ptr``) XTR's, and each logit's count of retrieved maxima at
    ``(r, m)`` of ``z_ptr``. With a scale of 1 the logits are the scores."""
    r = tl.program_id(0)
    block = tl.program_id(1)
    i = q_start + r
    fill = tl.load(fill_ptr + i)
    scale = tl.load(scalars_ptr + SCALE)
    row = tl.cast(r, tl.int64) * n_docs
    for m in range(block * BLOCK_M, tl.minimum(block * BLOCK_M + BLOCK_M, n_docs)):
        logit, count = _logit(q_ptr, w_ptr, tau_ptr, d_ptr, dmask_ptr, i, m, tl.load(width_ptr + m), fill, scale, lq,
                              ld, dim, ACC, PRECISION, LQ, BLOCK_Q, BLOCK_D, BLOCK_K, BLOCK_T, XTR)
        tl.store(out_ptr + row + m, logit)
        if XTR:
            tl.store(z_ptr + row + m, count)


@triton.jit(do_not_specialize=_RUNTIME)
def maxsim_grad_kernel(
    q_ptr, w_ptr, fill_ptr, d_ptr, dmask_ptr, width_ptr, scalars_ptr, peak_ptr, total_ptr, g_ptr,
    n_docs, offset, q_start, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The logits' gradients of a slab of queries. Grid: ``(rows, cdiv(M, BLOCK_M))``; program ``(r, b)`` takes query
    ``q_start + r`` against the documents of block ``b`` (as the forward's), and writes ``g`` at ``(r, m)`` of
    ``g_ptr`` ``(rows, M)``: 0 for an empty document, whose score is a constant."""
    r = tl.program_id(0)
    block = tl.program_id(1)
    i = q_start + r
    fill = tl.load(fill_ptr + i)
    scale = tl.load(scalars_ptr + SCALE)
    unit = tl.load(scalars_ptr + UNIT)
    peak = tl.load(peak_ptr + i)
    total = tl.load(total_ptr + i)
    row = tl.cast(r, tl.int64) * n_docs
    for m in range(block * BLOCK_M, tl.minimum(block * BLOCK_M + BLOCK_M, n_docs)):
        width = tl.load(width_ptr + m)
        logit, _ = _logit(q_ptr, w_ptr, w_ptr, d_ptr, dmask_ptr, i, m, width, fill, scale, lq, ld, dim, ACC,
                          PRECISION, LQ, BLOCK_Q, BLOCK_D, BLOCK_K, BLOCK_T, False)
        g = _logit_grad(logit, peak, total, unit, m == offset + i)
        tl.store(g_ptr + row + m, tl.where(width > 0, g, 0.0))


@triton.jit(do_not_specialize=_RUNTIME)
def maxsim_dq_kernel(
    q_ptr, w_ptr, tau_ptr, d_ptr, dmask_ptr, width_ptr, g_ptr, dq_ptr,
    n_docs, q_start, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, XTR: tl.constexpr,
):
    """The query gradients of a slab. Grid: ``(rows, cdiv(LQ, BLOCK_Q))``; program ``(r, c)`` owns the rows of token
    block ``c`` of query ``q_start + r`` in ``dq`` ``(B, Lq, D)``.

    It holds a ``(BLOCK_Q, BLOCK_D)`` accumulator and loops over every document: the maxima's tokens ``u*``
    (``_token_maxima``), then one gather of the rows ``d[m, u*[t]]`` (a row per query token) added with the weights
    ``g * w[t]`` (``g`` from ``maxsim_grad_kernel``'s ``(rows, M)``; under ``XTR`` only for the retrieved maxima,
    ``g`` already divided by the logit's count). No other program writes the rows, so nothing is reduced across
    programs."""
    r = tl.program_id(0)
    i = q_start + r
    q_rows, q_real, w = _query_block(w_ptr, i, tl.program_id(1) * BLOCK_Q, lq, BLOCK_Q)
    offs_k = tl.arange(0, BLOCK_D)
    mask_k = offs_k < dim
    row = tl.cast(r, tl.int64) * n_docs
    acc = tl.zeros((BLOCK_Q, BLOCK_D), ACC)
    for m in range(0, n_docs):
        best, where = _token_maxima(q_ptr, q_rows, q_real, d_ptr, dmask_ptr, m, tl.load(width_ptr + m), ld, dim, ACC,
                                    PRECISION, BLOCK_D, BLOCK_K, BLOCK_T, True)
        kept = _retrieved(best, w, tau_ptr, q_rows, q_real, XTR)
        gw = tl.where(kept, tl.load(g_ptr + row + m) * w, 0.0)  # (BLOCK_Q,): 0 for an empty document
        rows = tl.cast(m, tl.int64) * ld + where
        picked = tl.load(d_ptr + rows[:, None] * dim + offs_k[None, :], mask=(gw != 0.0)[:, None] & mask_k[None, :],
                         other=0.0)
        acc += gw[:, None] * picked.to(ACC)
    tl.store(dq_ptr + q_rows[:, None] * dim + offs_k[None, :], acc, mask=q_real[:, None] & mask_k[None, :])


@triton.jit(do_not_specialize=_RUNTIME)
def maxsim_dd_kernel(
    q_ptr, w_ptr, tau_ptr, d_ptr, dmask_ptr, width_ptr, g_ptr, dd_ptr,
    n_docs, n_rows, q_start, lq, ld, dim,
    ACC: tl.constexpr, PRECISION: tl.constexpr, LQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, XTR: tl.constexpr,
):
    """The document gradients from a slab of queries. Grid: ``(M,)``; program ``m`` owns document ``m``'s rows of
    ``dd`` ``(M, Ld, D)``, which the launcher zeroes, and adds to them the gradients from queries ``q_start`` to
    ``q_start + n_rows``.

    Per query and token block: the maxima's tokens ``u*`` (``_token_maxima``) and the weights ``g * w[t]`` (under
    ``XTR`` only the retrieved maxima's, as ``maxsim_dq_kernel``'s); the
    tokens that pick the same document token are grouped, ``pair[t, t'] = [u*[t] = u*[t']] * g * w[t']``, and the
    first (real, weighted) token of each group updates the row ``dd[m, u*[t]]`` with ``(pair @ q)[t]``, a slice of
    ``BLOCK_K`` features at a time (read, added, written back). The product is fp32 "ieee" (fp64 for fp64): the
    weights are not rounded to tf32. An empty document has width 0 and ``g = 0``: no token writes, and its rows stay
    0."""
    m = tl.program_id(0)
    width = tl.load(width_ptr + m)
    first = tl.cast(m, tl.int64) * ld
    offs_q = tl.arange(0, BLOCK_Q)
    for r in range(0, n_rows):
        i = q_start + r
        g = tl.load(g_ptr + tl.cast(r, tl.int64) * n_docs + m)
        for q0 in range(0, LQ, BLOCK_Q):
            q_rows, q_real, w = _query_block(w_ptr, i, q0, lq, BLOCK_Q)
            best, where = _token_maxima(q_ptr, q_rows, q_real, d_ptr, dmask_ptr, m, width, ld, dim, ACC, PRECISION,
                                        BLOCK_D, BLOCK_K, BLOCK_T, True)
            gw = tl.where(_retrieved(best, w, tau_ptr, q_rows, q_real, XTR), g * w, 0.0)
            same = (where[:, None] == where[None, :]) & (gw != 0.0)[None, :]  # (t, t'): t' picks t's token
            pair = tl.where(same, gw[None, :], 0.0)
            earlier = tl.max(tl.where(same & (offs_q[None, :] < offs_q[:, None]), 1, 0), axis=1)
            writes = (gw != 0.0) & (earlier == 0)  # the first weighted token of each group
            rows = first + where
            tl.debug_barrier()  # the previous update's writes before this one's reads, across the program's threads
            for k0 in range(0, BLOCK_D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < dim
                q = tl.load(q_ptr + q_rows[:, None] * dim + offs_k[None, :], mask=q_real[:, None] & mask_k[None, :],
                            other=0.0)
                grad = tl.dot(pair, q.to(ACC), input_precision="ieee", out_dtype=ACC)  # (BLOCK_Q, BLOCK_K)
                ptrs = dd_ptr + rows[:, None] * dim + offs_k[None, :]
                mask = writes[:, None] & mask_k[None, :]
                tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + grad, mask=mask)
