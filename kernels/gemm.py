"""The tf32x3 products of the GEMM backward: ``out += a @ b`` for fp32 operands given as tf32 splits.

At torch's default fp32 matmul precision ("highest") the backward's products ``dq_raw += F @ k_raw`` and
``dk_raw += F^T @ q_raw`` take fp32 operands, each split into a tf32 high part and the fp32 rest (the score-gradient
kernel stores ``F`` split; the launcher splits the embeddings with the same rounding). ``tf32x3_addmm_kernel`` forms
the three tf32 tensor-core products of the split, ``a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi``, in one fp32
accumulator, and adds it into ``out``. The precision is the kernel's own (``input_precision="tf32"``), so no
process-wide setting is read or changed.

Each program computes one (BLOCK_M, BLOCK_N) tile of ``out`` over the whole K range, the small terms of each K
step first. Every matrix comes with both of its strides (a transposed view is a stride swap), the high and the low
part of an operand sharing them. Row offsets are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tf32x3_addmm_kernel"]


@triton.jit
def tf32x3_addmm_kernel(
    out_ptr, a_hi_ptr, a_lo_ptr, b_hi_ptr, b_lo_ptr, M, N, K,
    stride_om, stride_on, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out[M, N] += a[M, K] @ b[K, N]`` with ``a = a_hi + a_lo`` and ``b = b_hi + b_lo`` (fp32, the high parts
    tf32): three tf32 products per K step, accumulated in fp32. Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Row and column pointers only; the tiles' offsets are formed in the loop from the scalar k0.
    a_rows = offs_m[:, None].to(tl.int64) * stride_am
    b_cols = offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a_offs = a_rows + (k0 + offs_k)[None, :].to(tl.int64) * stride_ak
        b_offs = (k0 + offs_k)[:, None].to(tl.int64) * stride_bk + b_cols
        a_mask = mask_m[:, None] & mask_k[None, :]
        b_mask = mask_k[:, None] & mask_n[None, :]
        a_hi = tl.load(a_hi_ptr + a_offs, mask=a_mask, other=0.0)
        a_lo = tl.load(a_lo_ptr + a_offs, mask=a_mask, other=0.0)
        b_hi = tl.load(b_hi_ptr + b_offs, mask=b_mask, other=0.0)
        b_lo = tl.load(b_lo_ptr + b_offs, mask=b_mask, other=0.0)
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32", out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32", out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32", out_dtype=tl.float32)
    out_ptrs = out_ptr + (offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on)
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptrs, tl.load(out_ptrs, mask=mask, other=0.0) + acc, mask=mask)
