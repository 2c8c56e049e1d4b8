"""Triton kernels for the GIST loss: a forward row pass and a backward row and column pass.

Every kernel works on one score block at a time: rows ``q`` (anchors, or the local positives for PP)
against columns ``k`` (positives, anchors or one negative set), with the guide rows ``qg`` / ``kg``
alongside. The launcher calls the same kernels once per block (AP, AA, PP, AN_1..AN_k); the running
log-sum-exp state of each row lives in global memory between launches (O(B) floats).

Normalisation is folded into the tiles: a score is ``(q . k) * rq * rk`` with ``r = 1 / max(||x||, eps)``
precomputed per row, so no normalised copy of any embedding is made and bf16 inputs go to the tensor
cores unchanged. All logits are in base-2 units, ``z = s * log2(e) / tau``, so the softmax uses exp2.

Ties by identity: row i's guide scores pair its row vector with each column, and ``theta_i`` pairs
the same row vector with a partner (the positive ``o + i`` for anchor rows, anchor i for PP rows). A
column whose normalised guide vector equals the partner's scores theta_i in exact arithmetic, so it
is masked exactly when ``theta_i > T_i``, whatever the rounding of the tile. The launcher gives equal
normalised guide rows equal integer ids (``cgist.numerics.tie_ids``); the kernels compare ids.

Layout: the launcher makes the feature dimension of every input contiguous, so each matrix comes
with one stride, that of its rows. Offsets are int64.

Bit-identical masks: every mask comes from one helper, the backward recomputes the same tiles with
the same code and the same tile config as the forward, and reads the flag ``theta_i > T_i`` that the
AP forward launch stored.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["gist_bwd_cols_kernel", "gist_bwd_rows_kernel", "gist_fwd_kernel", "pack_scalars", "tile_configs"]

#: Slots of the scalar tensor every kernel reads (see ``pack_scalars``).
SCALE, MARGIN = tl.constexpr(0), tl.constexpr(1)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs(tiles) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in tiles
    ]


#: Tensor-core tiles (bf16, fp16, tf32).
MMA_CONFIGS = _configs([
    (64, 64, 32, 4, 2),
    (128, 64, 32, 8, 3),
    (32, 64, 32, 4, 2),  # small batches: more programs per SM
])
#: IEEE fp32 / fp64 dots run on the FMA units; their operands live in registers, so smaller tiles.
FMA_CONFIGS = _configs([
    (64, 32, 16, 4, 2),
])
INTERPRET_CONFIGS = _configs([(16, 16, 16, 1, 1)])


def tile_configs(dtype: torch.dtype, precision: str, guide_dtype: torch.dtype, guide_precision: str,
                 interpret: bool = INTERPRET) -> list[triton.Config]:
    """Tile configs the forward autotunes over for these operands (the backward reuses its pick).

    Under the interpreter there is exactly one, small enough that tests with odd sizes cross several
    row, column and K tiles. On a GPU, IEEE fp32/fp64 dots run on the FMA units and get their own set.
    """
    if interpret:
        return INTERPRET_CONFIGS
    fma = any(p == "ieee" and d in (torch.float32, torch.float64)
              for d, p in ((dtype, precision), (guide_dtype, guide_precision)))
    return FMA_CONFIGS if fma else MMA_CONFIGS


def _prune_configs(configs, named_args, **kwargs) -> list[triton.Config]:
    args = {**named_args, **kwargs}  # keyword launches leave named_args empty
    return tile_configs(args["q_ptr"].dtype, args["PRECISION"], args["qg_ptr"].dtype, args["PRECISION_G"])


def pack_scalars(temperature: float, margin: float, dtype: torch.dtype, device) -> torch.Tensor:
    """``[log2(e) / tau, margin]`` as a tensor of the accumulation dtype.

    A tensor rather than kernel arguments, so that float64 runs keep full precision (Python floats
    reach a kernel as float32).
    """
    return torch.tensor([math.log2(math.e) / temperature, margin], dtype=dtype, device=device)


@triton.jit
def _tile_dot(
    a_ptr, b_ptr, offs_m, offs_n, mask_m, mask_n, dim, stride_a, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    """Raw dot products ``a[offs_m] . b[offs_n]``, K-looped over ``dim``.

    a: (rows, dim) with row stride ``stride_a``; b: (cols, dim) likewise. Returns (BLOCK_M, BLOCK_N) in ACC.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_a + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_b + offs_k[:, None]  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, dim, BLOCK_K):
        mask_k = offs_k < dim - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _tile_scores(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale,
    offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k, stride_kg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr,
):
    """Student logits ``z = cos(q, k) * scale`` and guide cosines ``g = cos(qg, kg)`` of one tile.

    rq, rqg: (BLOCK_M,) inverse row norms; rk, rkg: (BLOCK_N,) inverse column norms.
    Returns z, g: (BLOCK_M, BLOCK_N) in ACC.
    """
    s = _tile_dot(q_ptr, k_ptr, offs_m, offs_n, mask_m, mask_n, dim, stride_q, stride_k,
                  BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION)
    g = _tile_dot(qg_ptr, kg_ptr, offs_m, offs_n, mask_m, mask_n, dim_g, stride_qg, stride_kg,
                  BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION_G)
    z = s * (rq * scale)[:, None] * rk[None, :]
    # Both inverse norms at once, so that g[i, j] and g[j, i] of a symmetric block are bitwise equal.
    g = g * (rqg[:, None] * rkg[None, :])
    return z, g


@triton.jit
def _row_state(offs_m, mask_m, rq_ptr, rqg_ptr, partner_id_ptr, partner_start):
    """What every tile of BLOCK_M rows needs: inverse norms and the partner's tie id, each (BLOCK_M,).

    Rows past ``n_rows`` read neutral values.
    """
    rq = tl.load(rq_ptr + offs_m, mask=mask_m, other=0.0)
    rqg = tl.load(rqg_ptr + offs_m, mask=mask_m, other=0.0)
    partner_id = tl.load(partner_id_ptr + partner_start + offs_m, mask=mask_m, other=0)
    return rq, rqg, partner_id


@triton.jit
def _row_threshold(offs_m, mask_m, thr_ptr, theta_masked_ptr):
    """The threshold T_i and the flag theta_i > T_i that the AP forward launch stored, each (BLOCK_M,)."""
    thr = tl.load(thr_ptr + offs_m, mask=mask_m, other=0.0)
    theta_masked = tl.load(theta_masked_ptr + offs_m, mask=mask_m, other=0)
    return thr, theta_masked


@triton.jit
def _row_softmax(offs_m, mask_m, m_ptr, l_ptr, rw_ptr):
    """The forward's running max and sum of each row, and its row weight, each (BLOCK_M,)."""
    shift = tl.load(m_ptr + offs_m, mask=mask_m, other=0.0)
    others = tl.load(l_ptr + offs_m, mask=mask_m, other=0.0)
    row_weight = tl.load(rw_ptr + offs_m, mask=mask_m, other=0.0)
    return shift, others, row_weight


@triton.jit
def _masked_logits(z, g, thr, theta_masked, partner_id, col_id_ptr, offs_m, offs_n, mask_m, mask_n, offset,
                   has_label):
    """``z`` (BLOCK_M, BLOCK_N) with -inf where the guide score is strictly above the row threshold, at the label, or out of range.

    A column whose tie id (read at ``col_id_ptr``) equals the row's ``partner_id`` ties with theta_i and
    is masked iff ``theta_masked`` (theta_i > T_i). With ``has_label`` (the AP block) column
    ``offset + i`` of row i is the label: it is never masked, but it is carried apart from the other
    terms (its logit is the positive's), so it is -inf here too. The column ids are loaded here, after
    the tile's products, so that they are not live during them.
    """
    col_id = tl.load(col_id_ptr + offs_n, mask=mask_n, other=0)
    keep = tl.where(col_id[None, :] == partner_id[:, None], (theta_masked == 0)[:, None], g <= thr[:, None])
    keep = keep & ~_is_label(offs_m, offs_n, mask_m, offset, has_label)
    keep = keep & mask_m[:, None] & mask_n[None, :]
    return tl.where(keep, z, float("-inf"))


@triton.jit
def _is_label(offs_m, offs_n, mask_m, offset, has_label):
    """True at the label of each row of the tile (column ``offset + i`` of the AP block), (BLOCK_M, BLOCK_N)."""
    return (offs_n[None, :] == offs_m[:, None] + offset) & mask_m[:, None] & (has_label != 0)


@triton.jit
def _masked_tile(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale, thr, theta_masked, partner_id, col_id_ptr,
    offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k, stride_kg, offset, has_label,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr,
):
    """The masked base-2 logits of one tile (BLOCK_M, BLOCK_N): the one code path of every kernel's mask."""
    z, g = _tile_scores(q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale,
                        offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k, stride_kg,
                        BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION, PRECISION_G)
    return _masked_logits(z, g, thr, theta_masked, partner_id, col_id_ptr, offs_m, offs_n, mask_m, mask_n, offset,
                          has_label)


@triton.jit
def _online_lse(m_i, l_i, z):
    """Fold a tile of base-2 logits z (BLOCK_M, BLOCK_N) into the running max and sum (BLOCK_M,); m_i finite."""
    m_new = tl.maximum(m_i, tl.max(z, axis=1))
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(z - m_new[:, None]), axis=1)
    return m_new, l_i


@triton.jit
def _score_grad(z, shift, others, row_weight, offs_m, offs_n, mask_m, offset, has_label):
    """dL/ds of one tile (BLOCK_M, BLOCK_N) from its masked logits z (label at -inf); 0 where masked.

    With ``total = others + 2^(positive - shift)`` the row's softmax denominator in units of
    ``2^shift`` and ``row_weight = 1 / (tau * B * total)``, an entry gets ``2^(z - shift) * row_weight``
    and the label ``-others * row_weight``: exactly softmax - 1, with no cancellation.
    """
    p = tl.exp2(z - shift[:, None]) * row_weight[:, None]
    return tl.where(_is_label(offs_m, offs_n, mask_m, offset, has_label), (-others * row_weight)[:, None], p)


@triton.jit
def _add_product(
    out_ptr, offs_o, mask_o, stride_out, read_old, ds, v_ptr, offs_v, mask_v, stride_v, dim,
    BLOCK_D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    """``out[offs_o, :] (+)= ds @ v[offs_v, :]``, tiled over ``dim`` in BLOCK_D columns.

    ds: (len(offs_o), len(offs_v)) in v's dtype; out: (rows, dim) in ACC. The old rows count only when ``read_old``.
    """
    offs_d = tl.arange(0, BLOCK_D)
    out_ptrs = out_ptr + offs_o[:, None].to(tl.int64) * stride_out + offs_d[None, :]
    v_ptrs = v_ptr + offs_v[:, None].to(tl.int64) * stride_v + offs_d[None, :]
    for d0 in range(0, dim, BLOCK_D):
        mask_d = offs_d < dim - d0
        v = tl.load(v_ptrs, mask=mask_v[:, None] & mask_d[None, :], other=0.0)
        out_mask = mask_o[:, None] & mask_d[None, :]
        old = tl.where(read_old, tl.load(out_ptrs, mask=out_mask, other=0.0), 0.0)
        tl.store(out_ptrs, tl.dot(ds, v, old, input_precision=PRECISION, out_dtype=ACC), mask=out_mask)
        out_ptrs += BLOCK_D
        v_ptrs += BLOCK_D


# The block kind (has_label; relative; accumulate) is a runtime value, not a constexpr, and is kept out of
# the JIT's integer specialisation: all the blocks of a step (AP, AA, PP, AN_1..AN_k) then share one binary
# per kernel and tile config, instead of compiling and autotuning a variant per block. The branches it
# selects are per program, so they cost nothing measurable.
@triton.autotune(
    configs=INTERPRET_CONFIGS if INTERPRET else MMA_CONFIGS + FMA_CONFIGS,
    key=["b_bucket", "n_bucket", "dim", "dim_g", "PRECISION", "PRECISION_G"],
    prune_configs_by={"early_config_prune": _prune_configs},
    restore_value=["m_ptr", "l_ptr"],
)
@triton.jit(do_not_specialize=["partner_start", "has_label", "relative"])
def gist_fwd_kernel(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq_ptr, rqg_ptr, rk_ptr, rkg_ptr, col_id_ptr, partner_id_ptr,
    thr_ptr, theta_masked_ptr, pos_ptr, m_ptr, l_ptr, scalars_ptr,
    n_rows, n_cols, dim, dim_g, offset, partner_start,
    stride_q, stride_qg, stride_k, stride_kg,
    b_bucket, n_bucket, has_label, relative,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Forward row pass of one block: q (n_rows x dim) against k (n_cols x dim), guide in dim_g.

    Updates the running base-2 max ``m`` and sum ``l`` of each row over the unmasked logits other than
    the label, which is carried apart so that a small loss keeps its relative precision. The AP
    launch (``has_label``) comes first: it computes ``theta_i`` and the positive logit from the label
    tiles, stores the threshold ``T_i``, the flag ``theta_i > T_i`` (int8) and the positive, and seeds
    ``m_i`` with the positive logit (so ``l`` starts at 0). ``col_id_ptr`` holds the tie ids of the columns and
    ``partner_id_ptr[partner_start + i]`` the tie id of row i's partner.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    scale = tl.load(scalars_ptr + SCALE)
    rq, rqg, partner_id = _row_state(offs_m, mask_m, rq_ptr, rqg_ptr, partner_id_ptr, partner_start)
    if has_label:
        # theta and the positive logit, read off the label tiles with the same code as the main loop.
        theta = tl.zeros((BLOCK_M,), dtype=ACC)
        m_i = tl.zeros((BLOCK_M,), dtype=ACC)
        first_label = offset + tl.program_id(0) * BLOCK_M
        last_label = offset + tl.minimum(tl.program_id(0) * BLOCK_M + BLOCK_M, n_rows)
        for start_n in range((first_label // BLOCK_N) * BLOCK_N, last_label, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_cols
            rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
            rkg = tl.load(rkg_ptr + offs_n, mask=mask_n, other=0.0)
            z, g = _tile_scores(q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale,
                                offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k, stride_kg,
                                BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION, PRECISION_G)
            is_label = offs_n[None, :] == offs_m[:, None] + offset
            theta += tl.sum(tl.where(is_label, g, 0.0), axis=1)
            m_i += tl.sum(tl.where(is_label, z, 0.0), axis=1)
        margin = tl.load(scalars_ptr + MARGIN)
        thr = theta - tl.where(relative != 0, tl.abs(theta), 1.0) * margin
        theta_masked = (theta > thr).to(tl.int8)
        tl.store(thr_ptr + offs_m, thr, mask=mask_m)
        tl.store(theta_masked_ptr + offs_m, theta_masked, mask=mask_m)
        tl.store(pos_ptr + offs_m, m_i, mask=mask_m)
        l_i = tl.zeros((BLOCK_M,), dtype=ACC)
    else:
        thr, theta_masked = _row_threshold(offs_m, mask_m, thr_ptr, theta_masked_ptr)
        m_i = tl.load(m_ptr + offs_m, mask=mask_m, other=0.0)
        l_i = tl.load(l_ptr + offs_m, mask=mask_m, other=0.0)

    for start_n in range(0, n_cols, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_cols
        rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
        rkg = tl.load(rkg_ptr + offs_n, mask=mask_n, other=0.0)
        z = _masked_tile(q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale, thr, theta_masked, partner_id,
                         col_id_ptr, offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k,
                         stride_kg, offset, has_label, BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION, PRECISION_G)
        m_i, l_i = _online_lse(m_i, l_i, z)
    tl.store(m_ptr + offs_m, m_i, mask=mask_m)
    tl.store(l_ptr + offs_m, l_i, mask=mask_m)


@triton.jit(do_not_specialize=["partner_start", "has_label", "accumulate"])
def gist_bwd_rows_kernel(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq_ptr, rqg_ptr, rk_ptr, rkg_ptr, col_id_ptr, partner_id_ptr,
    thr_ptr, theta_masked_ptr, m_ptr, l_ptr, rw_ptr, scalars_ptr, grad_ptr,
    n_rows, n_cols, dim, dim_g, offset, partner_start,
    stride_q, stride_qg, stride_k, stride_kg, stride_grad, has_label, accumulate,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Backward row pass of one block: ``grad[i] (+)= sum_j dS[i, j] * k_hat[j]``, grad = dL/dq_hat (n_rows x dim).

    Recomputes each tile and its mask exactly as the forward; ``m`` and ``l`` are the forward's running
    max and sum of the row (label excluded) and ``rw`` its row weight (see ``_score_grad``).
    Unless ``accumulate``, the first column tile overwrites ``grad`` instead of adding to it.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    scale = tl.load(scalars_ptr + SCALE)
    rq, rqg, partner_id = _row_state(offs_m, mask_m, rq_ptr, rqg_ptr, partner_id_ptr, partner_start)
    thr, theta_masked = _row_threshold(offs_m, mask_m, thr_ptr, theta_masked_ptr)
    for start_n in range(0, n_cols, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_cols
        # loaded in the loop (cached), so that they are not live during the products
        shift, others, row_weight = _row_softmax(offs_m, mask_m, m_ptr, l_ptr, rw_ptr)
        rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
        rkg = tl.load(rkg_ptr + offs_n, mask=mask_n, other=0.0)
        z = _masked_tile(q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale, thr, theta_masked, partner_id,
                         col_id_ptr, offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k,
                         stride_kg, offset, has_label, BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION, PRECISION_G)
        ds = _score_grad(z, shift, others, row_weight, offs_m, offs_n, mask_m, offset, has_label) * rk[None, :]
        _add_product(grad_ptr, offs_m, mask_m, stride_grad, accumulate + start_n > 0,
                     ds.to(k_ptr.dtype.element_ty), k_ptr, offs_n, mask_n, stride_k, dim, BLOCK_K, ACC, PRECISION)


@triton.jit(do_not_specialize=["partner_start", "has_label", "accumulate"])
def gist_bwd_cols_kernel(
    q_ptr, qg_ptr, k_ptr, kg_ptr, rq_ptr, rqg_ptr, rk_ptr, rkg_ptr, col_id_ptr, partner_id_ptr,
    thr_ptr, theta_masked_ptr, m_ptr, l_ptr, rw_ptr, scalars_ptr, grad_ptr,
    n_rows, n_cols, dim, dim_g, offset, partner_start,
    stride_q, stride_qg, stride_k, stride_kg, stride_grad, has_label, accumulate,
    ACC: tl.constexpr, PRECISION: tl.constexpr, PRECISION_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Backward column pass of one block: ``grad[j] (+)= sum_i dS[i, j] * q_hat[i]``, grad = dL/dk_hat (n_cols x dim).

    One program per BLOCK_N columns loops over the row tiles; each tile is computed in the same
    orientation and with the same code as the forward, so the masks are bit-identical.
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    scale = tl.load(scalars_ptr + SCALE)
    rk = tl.load(rk_ptr + offs_n, mask=mask_n, other=0.0)
    rkg = tl.load(rkg_ptr + offs_n, mask=mask_n, other=0.0)
    for start_m in range(0, n_rows, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_rows
        rq, rqg, partner_id = _row_state(offs_m, mask_m, rq_ptr, rqg_ptr, partner_id_ptr, partner_start)
        thr, theta_masked = _row_threshold(offs_m, mask_m, thr_ptr, theta_masked_ptr)
        shift, others, row_weight = _row_softmax(offs_m, mask_m, m_ptr, l_ptr, rw_ptr)
        z = _masked_tile(q_ptr, qg_ptr, k_ptr, kg_ptr, rq, rqg, rk, rkg, scale, thr, theta_masked, partner_id,
                         col_id_ptr, offs_m, offs_n, mask_m, mask_n, dim, dim_g, stride_q, stride_qg, stride_k,
                         stride_kg, offset, has_label, BLOCK_M, BLOCK_N, BLOCK_K, ACC, PRECISION, PRECISION_G)
        ds = _score_grad(z, shift, others, row_weight, offs_m, offs_n, mask_m, offset, has_label) * rq[:, None]
        _add_product(grad_ptr, offs_n, mask_n, stride_grad, accumulate + start_m > 0,
                     tl.trans(ds).to(q_ptr.dtype.element_ty), q_ptr, offs_m, mask_m, stride_q, dim,
                     BLOCK_K, ACC, PRECISION)
