"""Triton kernels for the GIST loss: a forward row pass and the chunk score-gradient kernel of the GEMM
backward.

Every kernel works on one column group at a time: rows ``q`` (anchors, or the local positives for PP)
against columns ``k`` (positives, anchors or one negative set), with the guide rows ``qg`` / ``kg``
alongside. The launcher (``cgist.stage.triton.dense``) calls the same kernels once per column group (AP, AA,
PP, AN_1..AN_k, QQ, DQ, DD, DN_1..DN_k); the running log-sum-exp state of each row lives in global memory between
launches (O(B) floats per dimension).

Normalisation is folded into the tiles: a score is ``(q . k) * rq * rk`` with ``r = 1 / max(||x||, eps)``
precomputed per row, so no normalised copy of any embedding is made and bf16 inputs go to the tensor
cores unchanged. All logits are in base-2 units, ``z = s * log2(e) / tau``, so the softmax uses exp2.

Matryoshka dimensions d_1 < ... < d_M (ascending here; ``N_DIMS = M``, 1 without Matryoshka): the
student K loop runs over the segments between consecutive dimensions, and after segment u the
accumulator holds the prefix dot products of dimension d_u, scaled by that dimension's inverse prefix
norms (``rq``/``rk`` hold one row per dimension). The guide tile and its mask are computed once per
tile, before the student's, for every dimension.

Ties by identity: row i's guide scores pair its row vector with each column, and ``theta_i`` pairs
the same row vector with a partner (the positive ``o + i`` for anchor rows, anchor i for PP rows). A
column with the partner's text (or, without text ids, its normalised guide vector) scores theta_i in exact
arithmetic, so it is masked exactly when ``theta_i > T_i``, whatever the rounding of the tile. The launcher gives
equal texts (or equal normalised guide rows) equal integer ids (``cgist.stage.ties.tie_ids``); the kernels compare ids.

The label (AP column ``o + i``) is never masked, and it is carried apart from the other terms: the
running sum ``l`` holds the others only, the running max starts at the positive logit, and the
launcher forms each row's loss as ``(m - pos) ln 2 + log1p(l + expm1((pos - m) ln 2))``.

Layout: the launcher makes the feature dimension of every input contiguous, so each matrix comes
with one stride, that of its rows. Offsets into embeddings are int64.

Bit-identical masks: every mask comes from one helper (``_masked_start``), and the score-gradient kernel
recomputes the guide tiles with the same code and the same tile config as the forward, and reads the
flag ``theta_i > T_i`` that the AP forward launch stored.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

__all__ = ["gist_fwd_kernel", "gist_score_grad_kernel", "pack_scalars"]

#: Slots of the scalar tensor every kernel reads (see ``pack_scalars``).
SCALE, MARGIN, HARD = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
#: Bits of a column group's runtime ``rules``: it holds the labels (AP, column ``i + offset`` of row i); a guide masks it;
#: each row's column ``i + excluded_offset`` is excluded (self-pairs, own documents); candidates with row i's texts
#: are excluded; each row's column ``i + unmasked_offset`` is never masked (DQ's pair); the hardness penalty
#: (``scalars[HARD]`` times the logit) applies at each row's own column ``i + offset``, or at the others.
RULE_LABEL, RULE_GUIDED, RULE_EXCLUDED, RULE_TEXTS, RULE_UNMASKED, RULE_HARD_OWN, RULE_HARD_OTHERS = 1, 2, 4, 8, 16, 32, 64
LABEL, GUIDED, EXCLUDED, TEXTS, UNMASKED, HARD_OWN, HARD_OTHERS = (
    tl.constexpr(bit) for bit in (RULE_LABEL, RULE_GUIDED, RULE_EXCLUDED, RULE_TEXTS, RULE_UNMASKED, RULE_HARD_OWN,
                                  RULE_HARD_OTHERS))

def pack_scalars(temperature: float, margin: float, hardness: float = 0.0) -> tuple[float, float, float]:
    """``(log2(e) / tau, margin, 1 + hardness * tau)``: the scalar tensor every kernel reads, in the accumulation
    dtype. The last is the factor of a logit with the hardness penalty (``hardness * cos`` added to ``cos / tau``).

    A tensor rather than kernel arguments, so that float64 runs keep full precision (Python floats
    reach a kernel as float32).
    """
    return (math.log2(math.e) / temperature, margin, 1.0 + hardness * temperature)


@triton.jit
def _dot_range(
    acc, a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, lo, hi, stride_a, stride_b,
    BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    """``acc + a[offs_m, lo:hi] . b[offs_n, lo:hi]``, K-looped in BLOCK_K columns.

    a: (rows, dim) with row stride ``stride_a``; b: (cols, dim) likewise. acc: (BLOCK_M, BLOCK_N) in ACC.
    """
    offs_k = tl.arange(0, BLOCK_K)
    # Row pointers only (BLOCK_M x 1, 1 x BLOCK_N); the tiles' pointers are formed in the loop from the
    # scalar k0, so that no pointer tile is carried from one iteration to the next.
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_a
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * stride_b
    for k0 in range(lo, hi, BLOCK_K):
        mask_k = offs_k < hi - k0
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + offs_k)[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    return acc


@triton.jit
def _student_prefix(
    acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dims_ptr, dim, stride_q, stride_k, u,
    N_DIMS: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    """Extend the prefix dot products ``acc`` over segment u: from ``acc`` over d_{u-1} columns to d_u.

    ``dims_ptr`` holds d_1 < ... < d_M; the largest is ``dim``. With several dimensions u is a runtime
    loop index: the loop over dimensions stays a loop, so that the compiler keeps one dimension's
    values live at a time.
    """
    if N_DIMS == 1:
        lo = 0
        hi = dim
    else:
        lo = tl.load(dims_ptr + u - 1, mask=u > 0, other=0)
        hi = tl.load(dims_ptr + u)
    return _dot_range(acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, lo, hi, stride_q, stride_k,
                      BLOCK_K, ACC, PRECISION)


@triton.jit
def _dim_norms(rq_ptr, rk_ptr, offs_m, offs_n, mask_m, mask_n, stride_rq, stride_rk, u):
    """Inverse prefix norms of dimension u: rows (BLOCK_M,) and columns (BLOCK_N,).

    Out of range they read 1, so that a masked (-inf) prefix there stays -inf instead of becoming NaN.
    """
    rq = tl.load(rq_ptr + u * stride_rq + offs_m, mask=mask_m, other=1.0)
    rk = tl.load(rk_ptr + u * stride_rk + offs_n, mask=mask_n, other=1.0)
    return rq, rk


@triton.jit
def _logits(acc, rq, rk, scale):
    """Base-2 student logits of a tile from its prefix dot products: ``acc * rq * scale * rk``."""
    return acc * (rq * scale)[:, None] * rk[None, :]


@triton.jit
def _guide_scores(
    qg_ptr, kg_ptr, rqg, rkg, offs_m, offs_n, mask_m, mask_n, dim_g, stride_qg, stride_kg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
    PRECISION_G: tl.constexpr,
):
    """Guide cosines of one tile, (BLOCK_M, BLOCK_N); rqg, rkg: inverse guide norms of rows and columns."""
    g = _dot_range(tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC), qg_ptr, kg_ptr, offs_m, offs_n, mask_m, mask_n,
                   0, dim_g, stride_qg, stride_kg, BLOCK_K, ACC, PRECISION_G)
    # Both inverse norms at once, so that g[i, j] and g[j, i] of a symmetric group are bitwise equal.
    return g * (rqg[:, None] * rkg[None, :])


@triton.jit
def _is_label(offs_m, offs_n, mask_m, offset, has_label):
    """True at the label of each row of the tile (column ``offset + i`` of the AP block), (BLOCK_M, BLOCK_N)."""
    return (offs_n[None, :] == offs_m[:, None] + offset) & mask_m[:, None] & (has_label != 0)


@triton.jit
def _masked_start(
    qg_ptr, kg_ptr, rqg_ptr, rkg_ptr, col_id_ptr, partner_id, thr, theta_masked, col_text_ptr, row_text_ptr,
    offs_m, offs_n, mask_m, mask_n, dim_g, offset, excluded_offset, unmasked_offset, stride_qg, stride_kg, stride_text, rules,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
    PRECISION_G: tl.constexpr, LABEL_LIVE: tl.constexpr,
):
    """The column group's verdict on one tile, as the student accumulator's start: 0 where kept, -inf where masked.

    With a guide (``rules & GUIDED``) an entry is masked where its guide score is strictly above the row
    threshold ``thr``; a column whose tie id (read at ``col_id_ptr``) equals the row's ``partner_id`` ties
    with theta_i and is masked iff ``theta_masked`` (theta_i > T_i). With ``rules & EXCLUDED`` row i's column
    ``i + excluded_offset`` is masked; with ``rules & TEXTS`` every column whose text id (``col_text_ptr``) is that
    of row i's anchor or positive (``row_text_ptr``, two rows ``stride_text`` apart); with ``rules & UNMASKED`` row
    i's column ``i + unmasked_offset`` is kept whatever else says. Out-of-range entries are masked. The label,
    which is never masked but carried apart from the other terms, starts at 0 with LABEL_LIVE (its logit is
    wanted) and at -inf without (it drops out of the sums like a masked entry). The one code path of every
    kernel's mask.

    The student's products then accumulate onto it, and the masked entries stay -inf through every
    prefix (the products are finite): the mask rides in the accumulator, so no mask tile is live
    during the student's K loop.
    """
    in_range = mask_m[:, None] & mask_n[None, :]
    live = in_range
    if (rules & GUIDED) != 0:
        rqg = tl.load(rqg_ptr + offs_m, mask=mask_m, other=0.0)
        rkg = tl.load(rkg_ptr + offs_n, mask=mask_n, other=0.0)
        g = _guide_scores(qg_ptr, kg_ptr, rqg, rkg, offs_m, offs_n, mask_m, mask_n, dim_g, stride_qg, stride_kg,
                          BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION_G)
        col_id = tl.load(col_id_ptr + offs_n, mask=mask_n, other=0)
        live = live & tl.where(col_id[None, :] == partner_id[:, None], (theta_masked == 0)[:, None],
                               g <= thr[:, None])
    if (rules & EXCLUDED) != 0:
        live = live & (offs_n[None, :] != offs_m[:, None] + excluded_offset)
    if (rules & TEXTS) != 0:
        col_text = tl.load(col_text_ptr + offs_n, mask=mask_n, other=0)
        anchor_text = tl.load(row_text_ptr + offs_m, mask=mask_m, other=0)
        positive_text = tl.load(row_text_ptr + stride_text + offs_m, mask=mask_m, other=0)
        live = live & (col_text[None, :] != anchor_text[:, None]) & (col_text[None, :] != positive_text[:, None])
    if (rules & UNMASKED) != 0:
        live = live | ((offs_n[None, :] == offs_m[:, None] + unmasked_offset) & in_range)
    is_label = _is_label(offs_m, offs_n, mask_m, offset, rules & LABEL)
    live = (live | is_label) if LABEL_LIVE else (live & ~is_label)
    return tl.where(live, 0.0, float("-inf")).to(ACC)


@triton.jit
def _harden(z, offs_m, offs_n, offset, rules, hard_factor):
    """Logits ``z`` (BLOCK_M, BLOCK_N) with the hardness penalty: ``hard_factor`` times the logit at each row's own
    column (``offset + i``) with ``rules & HARD_OWN``, at every other column with ``rules & HARD_OTHERS``."""
    if (rules & (HARD_OWN | HARD_OTHERS)) != 0:
        own = offs_n[None, :] == offs_m[:, None] + offset
        hard = tl.where(own, (rules & HARD_OWN) != 0, (rules & HARD_OTHERS) != 0)
        z = tl.where(hard, z * hard_factor, z)
    return z


@triton.jit
def _row_mask_state(offs_m, mask_m, partner_id_ptr, partner_start, thr_ptr, theta_masked_ptr):
    """The partner's tie id, the threshold T_i and the flag theta_i > T_i of each row, each (BLOCK_M,)."""
    partner_id = tl.load(partner_id_ptr + partner_start + offs_m, mask=mask_m, other=0)
    thr = tl.load(thr_ptr + offs_m, mask=mask_m, other=0.0)
    theta_masked = tl.load(theta_masked_ptr + offs_m, mask=mask_m, other=0)
    return partner_id, thr, theta_masked


@triton.jit
def _dim_column(state, dcol, u):
    """Column u of a (BLOCK_M, DIMS_P2) per-dimension row state, (BLOCK_M,)."""
    return tl.sum(tl.where(dcol[None, :] == u, state, 0.0), axis=1)


@triton.jit
def _score_grad(acc, rq, rk, scale, hard_factor, offs_m, offs_n, mask_m, offset, rules, m_ptr, l_ptr, rw_ptr,
                stride_state, u):
    """dL/dcos_u of one tile (BLOCK_M, BLOCK_N) from its prefix dot products ``acc`` (-inf where masked).

    With the forward's running max ``m``, sum ``l`` (label excluded) and row weight
    ``rw = w_u / (tau * B * (l + 2^(pos - m)))`` of dimension u, an unmasked entry gets
    ``2^(z - m) * rw`` (0 where masked: 2^-inf; z with the hardness penalty, ``_harden``) and the label,
    whatever its start, ``-l * rw``: exactly w_u (softmax - 1) / (tau B), with no cancellation (``l`` is then
    the label's term the launcher passes: the others' sum, with partitions more).
    """
    shift = tl.load(m_ptr + u * stride_state + offs_m, mask=mask_m, other=0.0)
    row_sum = tl.load(l_ptr + u * stride_state + offs_m, mask=mask_m, other=0.0)
    row_weight = tl.load(rw_ptr + u * stride_state + offs_m, mask=mask_m, other=0.0)
    z = _harden(_logits(acc, rq, rk, scale), offs_m, offs_n, offset, rules, hard_factor)
    p = tl.exp2(z - shift[:, None]) * row_weight[:, None]
    # the label is found here, from the indices, so that no label tile is live during the products
    return tl.where(_is_label(offs_m, offs_n, mask_m, offset, rules & LABEL), (-row_sum * row_weight)[:, None], p)


@triton.jit
def _round_tf32(x):
    """``x`` (fp32) rounded to the nearest tf32 value (10 mantissa bits, ties to even), as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (((bits >> 13) & 1) + 0xFFF)) & -8192  # -8192 = 0xFFFFE000: clear the 13 low bits
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_operand(f_ptr, local_m, local_n, stride_row, stride_part, value, mask, SPLIT: tl.constexpr):
    """Store a tile of GEMM operand at rows ``local_m`` and columns ``local_n`` of the chunk buffer ``f_ptr``.

    With SPLIT, as its tf32 high part and, one part (``stride_part``) further, the fp32 rest. The
    offsets are int32 (the launcher keeps a chunk under 2^31 entries) and formed here, at the store,
    so that no pointer tile is live during the products.
    """
    ptrs = f_ptr + (local_m[:, None] * stride_row + local_n[None, :])
    if SPLIT:
        high = _round_tf32(value)
        tl.store(ptrs, high, mask=mask)
        tl.store(ptrs + stride_part, value - high, mask=mask)
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


# A column group's rules (label, guide, exclusions, hardness; relative; count) are runtime values, not a constexpr, and
# are kept out of the JIT's integer specialisation: all the column groups of a step then share one binary per
# kernel and tile config, instead of compiling and autotuning a variant per group. The branches they select
# are per program, so they cost nothing measurable. The launcher autotunes the forward over its tile configs
# (``cgist.stage.triton.tiles``); the score-gradient kernel takes the forward's pick.
@triton.jit(do_not_specialize=["partner_start", "excluded_offset", "unmasked_offset", "stride_text", "rules",
                               "relative", "count"])
def gist_fwd_kernel(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq_ptr, rqg_ptr, rk_ptr, rkg_ptr, col_id_ptr, partner_id_ptr, dims_ptr,
    thr_ptr, theta_masked_ptr, theta_ptr, pos_ptr, m_ptr, l_ptr, masked_ptr, left_ptr, scalars_ptr,
    col_text_ptr, row_text_ptr,
    n_rows, n_cols, dim, dim_g, offset, partner_start, excluded_offset, unmasked_offset,
    stride_q, stride_qg, stride_k, stride_kg, stride_rq, stride_rk, stride_state, stride_text,
    b_bucket, n_bucket, rules, relative, count,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr,
    N_DIMS: tl.constexpr, DIMS_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Forward row pass of one column group: q (n_rows x dim) against k (n_cols x dim), guide in dim_g.

    Per dimension u (row u of ``m``, ``l``, ``pos``; ``stride_state`` apart), updates the running
    base-2 max ``m`` and sum ``l`` of each row over the unmasked logits other than the label. The AP
    launch (``rules & LABEL``) comes first: it computes the positive logits and, with a guide, ``theta_i`` from
    the label tiles, stores theta, the threshold ``T_i``, the flag ``theta_i > T_i`` (int8) and the positives,
    and seeds ``m`` with the positive logit (so ``l`` starts at 0). ``col_id_ptr`` holds the tie ids
    of the columns and ``partner_id_ptr[partner_start + i]`` the tie id of row i's partner; the other
    rules are ``_masked_start``'s and ``_harden``'s. A partition's state is the launcher's view of its rows.

    With ``count``, adds to each row's int32 counters the entries the guide masked in this group
    (``masked_ptr``, the label excluded) and the unmasked entries other than the label (``left_ptr``).
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    scale = tl.load(scalars_ptr + SCALE)
    hard_factor = tl.load(scalars_ptr + HARD)
    dcol = tl.arange(0, DIMS_P2)
    state_ptrs = dcol[None, :] * stride_state + offs_m[:, None]  # (BLOCK_M, DIMS_P2)
    state_mask = mask_m[:, None] & (dcol < N_DIMS)[None, :]
    if (rules & LABEL) != 0:
        # theta and the positive logits, read off the label tiles with the same code as the main loop.
        rqg = tl.load(rqg_ptr + offs_m, mask=mask_m, other=0.0)
        theta = tl.zeros((BLOCK_M,), dtype=ACC)
        m_i = tl.zeros((BLOCK_M, DIMS_P2), dtype=ACC)
        first_label = offset + tl.program_id(0) * BLOCK_M
        last_label = offset + tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, n_rows)
        for start_n in range((first_label // BLOCK_N) * BLOCK_N, last_label, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_cols
            is_label = offs_n[None, :] == offs_m[:, None] + offset
            if (rules & GUIDED) != 0:
                rkg = tl.load(rkg_ptr + offs_n, mask=mask_n, other=0.0)
                g = _guide_scores(qg_ptr, kg_ptr, rqg, rkg, offs_m, offs_n, mask_m, mask_n, dim_g, stride_qg,
                                  stride_kg, BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION_G)
                theta += tl.sum(tl.where(is_label, g, 0.0), axis=1)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
            for u in range(N_DIMS):
                acc = _student_prefix(acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dims_ptr, dim, stride_q,
                                      stride_k, u, N_DIMS, BLOCK_K, ACC, PRECISION)
                rq, rk = _dim_norms(rq_ptr, rk_ptr, offs_m, offs_n, mask_m, mask_n, stride_rq, stride_rk, u)
                pos = tl.sum(tl.where(is_label, _logits(acc, rq, rk, scale), 0.0), axis=1)
                m_i += tl.where(dcol[None, :] == u, pos[:, None], 0.0)
        margin = tl.load(scalars_ptr + MARGIN)
        thr = theta - tl.where(relative != 0, tl.abs(theta), 1.0) * margin
        # theta_i > T_i exactly when the margin lowers T_i below it, whatever the rounding (docs/design.md#ties)
        theta_masked = tl.where(margin > 0, tl.where(relative != 0, (theta != 0).to(tl.int8), 1), 0).to(tl.int8)
        tl.store(theta_ptr + offs_m, theta, mask=mask_m)
        tl.store(thr_ptr + offs_m, thr, mask=mask_m)
        tl.store(theta_masked_ptr + offs_m, theta_masked, mask=mask_m)
        tl.store(pos_ptr + state_ptrs, m_i, mask=state_mask)
        l_i = tl.zeros((BLOCK_M, DIMS_P2), dtype=ACC)
    else:
        thr = tl.load(thr_ptr + offs_m, mask=mask_m, other=0.0)
        theta_masked = tl.load(theta_masked_ptr + offs_m, mask=mask_m, other=0)
        m_i = tl.load(m_ptr + state_ptrs, mask=state_mask, other=0.0)
        l_i = tl.load(l_ptr + state_ptrs, mask=state_mask, other=0.0)
    partner_id = tl.load(partner_id_ptr + partner_start + offs_m, mask=mask_m, other=0)
    n_masked = tl.zeros((BLOCK_M,), dtype=tl.int32)
    n_left = tl.zeros((BLOCK_M,), dtype=tl.int32)

    for start_n in range(0, n_cols, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_cols
        acc = _masked_start(qg_ptr, kg_ptr, rqg_ptr, rkg_ptr, col_id_ptr, partner_id, thr, theta_masked,
                            col_text_ptr, row_text_ptr, offs_m, offs_n, mask_m, mask_n, dim_g, offset, excluded_offset,
                            unmasked_offset, stride_qg, stride_kg, stride_text, rules, BLOCK_M, BLOCK_N, BLOCK_K, ACC,
                            PRECISION_G, False)
        if count:
            # the unmasked entries other than the label, and so the masked ones (in range - left - label):
            # one tile reduction
            left = tl.sum((acc == 0.0).to(tl.int32), axis=1)
            labels = ((offs_m + offset >= start_n) & (offs_m + offset < start_n + BLOCK_N) & mask_m
                      & ((rules & LABEL) != 0)).to(tl.int32)
            n_masked += tl.where(mask_m, tl.minimum(n_cols - start_n, BLOCK_N), 0) - left - labels
            n_left += left
        for u in range(N_DIMS):
            acc = _student_prefix(acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dims_ptr, dim, stride_q,
                                  stride_k, u, N_DIMS, BLOCK_K, ACC, PRECISION)
            rq, rk = _dim_norms(rq_ptr, rk_ptr, offs_m, offs_n, mask_m, mask_n, stride_rq, stride_rk, u)
            # -inf where masked and at the label
            z = _harden(_logits(acc, rq, rk, scale), offs_m, offs_n, offset, rules, hard_factor)
            m_u = _dim_column(m_i, dcol, u)
            l_u = _dim_column(l_i, dcol, u)
            m_new = tl.maximum(m_u, tl.max(z, axis=1))  # m_u is finite: it starts at the positive logit
            l_new = l_u * tl.exp2(m_u - m_new) + tl.sum(tl.exp2(z - m_new[:, None]), axis=1)
            m_i = tl.where(dcol[None, :] == u, m_new[:, None], m_i)
            l_i = tl.where(dcol[None, :] == u, l_new[:, None], l_i)
    tl.store(m_ptr + state_ptrs, m_i, mask=state_mask)
    tl.store(l_ptr + state_ptrs, l_i, mask=state_mask)
    if count:
        tl.store(masked_ptr + offs_m, tl.load(masked_ptr + offs_m, mask=mask_m, other=0) + n_masked, mask=mask_m)
        tl.store(left_ptr + offs_m, tl.load(left_ptr + offs_m, mask=mask_m, other=0) + n_left, mask=mask_m)


@triton.jit(do_not_specialize=["partner_start", "excluded_offset", "unmasked_offset", "stride_text", "rules", "row_start",
                               "col_start"])
def gist_score_grad_kernel(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq_ptr, rqg_ptr, rk_ptr, rkg_ptr, col_id_ptr, partner_id_ptr, dims_ptr,
    thr_ptr, theta_masked_ptr, m_ptr, l_ptr, rw_ptr, scalars_ptr, f_ptr, row_part_ptr, col_part_ptr,
    col_text_ptr, row_text_ptr,
    row_stop, col_stop, dim, dim_g, offset, partner_start, excluded_offset, unmasked_offset, row_start, col_start,
    stride_q, stride_qg, stride_k, stride_kg, stride_rq, stride_rk, stride_state, stride_text,
    stride_f_seg, stride_f_part, stride_f_row, stride_rp_dim, stride_rp_tile, stride_cp_dim, stride_cp_tile,
    rules,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr, N_DIMS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Score gradients of one chunk of a block, as GEMM operands: one (BLOCK_M, BLOCK_N) tile per program.

    The chunk is rows ``row_start:row_stop`` against columns ``col_start:col_stop`` (both starts tile
    aligned, so that every tile is one of the forward's, computed by the same code). Writes, for each
    segment s between consecutive dimensions (the columns d_{s-1}..d_s of the embeddings),
    ``F_s = sum over dims u >= s of dL/dcos_u * rq_u * rk_u`` at ``f_ptr`` (segment, [part,] chunk row,
    chunk column), in ``f_ptr``'s dtype; with SPLIT (fp32 operands of a tf32x3 product) as a tf32 high
    part and the fp32 rest. Then dL/dq_raw[:, s] += F_s @ k_raw[:, s] and dL/dk_raw[:, s] += F_s^T @
    q_raw[:, s] are GEMMs: ``torch``'s, or with SPLIT ``gemm.tf32x3_addmm_kernel``.

    With several dimensions the normalisation backward needs ``c_u = sum_j dL/dcos_u * cos_u`` of every
    row and column: each program stores its tile's row sums at ``row_part_ptr`` (dim, column tile, chunk
    row) and column sums at ``col_part_ptr`` (dim, row tile, chunk column), which the launcher adds up in
    a fixed order. The sums over dimensions are formed with one running tile: the first sweep adds up
    F_1 + ... + F_M (= F_1's segment); a second, up to d_{M-1}, subtracts F_u to get segment u + 1's.
    """
    offs_m = row_start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = col_start + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < row_stop
    mask_n = offs_n < col_stop
    scale = tl.load(scalars_ptr + SCALE)
    hard_factor = tl.load(scalars_ptr + HARD)
    partner_id, thr, theta_masked = _row_mask_state(offs_m, mask_m, partner_id_ptr, partner_start, thr_ptr,
                                                    theta_masked_ptr)
    acc = _masked_start(qg_ptr, kg_ptr, rqg_ptr, rkg_ptr, col_id_ptr, partner_id, thr, theta_masked,
                        col_text_ptr, row_text_ptr, offs_m, offs_n, mask_m, mask_n, dim_g, offset, excluded_offset,
                        unmasked_offset, stride_qg, stride_kg, stride_text, rules, BLOCK_M, BLOCK_N, BLOCK_K, ACC,
                        PRECISION_G, N_DIMS > 1)
    local_m = offs_m - row_start
    local_n = offs_n - col_start

    if N_DIMS == 1:
        acc = _student_prefix(acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dims_ptr, dim, stride_q, stride_k,
                              0, N_DIMS, BLOCK_K, ACC, PRECISION)
        rq, rk = _dim_norms(rq_ptr, rk_ptr, offs_m, offs_n, mask_m, mask_n, stride_rq, stride_rk, 0)
        grad = _score_grad(acc, rq, rk, scale, hard_factor, offs_m, offs_n, mask_m, offset, rules, m_ptr, l_ptr, rw_ptr,
                           stride_state, 0)
        _store_operand(f_ptr, local_m, local_n, stride_f_row, stride_f_part, grad * rq[:, None] * rk[None, :],
                       mask_m[:, None] & mask_n[None, :], SPLIT)
    else:
        summed = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for u in range(N_DIMS):
            acc = _student_prefix(acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dims_ptr, dim, stride_q,
                                  stride_k, u, N_DIMS, BLOCK_K, ACC, PRECISION)
            rq, rk = _dim_norms(rq_ptr, rk_ptr, offs_m, offs_n, mask_m, mask_n, stride_rq, stride_rk, u)
            grad = _score_grad(acc, rq, rk, scale, hard_factor, offs_m, offs_n, mask_m, offset, rules, m_ptr, l_ptr,
                               rw_ptr, stride_state, u)
            # dL/dcos_u * cos_u (grad is 0 where acc is -inf)
            radial = grad * tl.where(acc > float("-inf"), acc, 0.0) * rq[:, None] * rk[None, :]
            tl.store(row_part_ptr + u * stride_rp_dim + tl.program_id(1) * stride_rp_tile + local_m,
                     tl.sum(radial, axis=1), mask=mask_m)
            tl.store(col_part_ptr + u * stride_cp_dim + tl.program_id(0) * stride_cp_tile + local_n,
                     tl.sum(radial, axis=0), mask=mask_n)
            summed += grad * rq[:, None] * rk[None, :]
        _store_operand(f_ptr, local_m, local_n, stride_f_row, stride_f_part, summed,
                       mask_m[:, None] & mask_n[None, :], SPLIT)
        # the masked start again, read off the accumulator (still -inf exactly where masked), so that the
        # start was not live during the first sweep
        acc = tl.where(acc == float("-inf"), float("-inf"), 0.0).to(ACC)
        for u in range(N_DIMS - 1):
            acc = _student_prefix(acc, q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dims_ptr, dim, stride_q,
                                  stride_k, u, N_DIMS, BLOCK_K, ACC, PRECISION)
            rq, rk = _dim_norms(rq_ptr, rk_ptr, offs_m, offs_n, mask_m, mask_n, stride_rq, stride_rk, u)
            grad = _score_grad(acc, rq, rk, scale, hard_factor, offs_m, offs_n, mask_m, offset, rules, m_ptr, l_ptr,
                               rw_ptr, stride_state, u)
            summed -= grad * rq[:, None] * rk[None, :]
            _store_operand(f_ptr + (u + 1) * stride_f_seg, local_m, local_n, stride_f_row, stride_f_part, summed,
                           mask_m[:, None] & mask_n[None, :], SPLIT)
