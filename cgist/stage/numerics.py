"""Numerics shared by the oracle, the PyTorch streaming path and the Triton launcher; imports only torch and
``cgist.stage.devices``.

Each rule of the loss that more than one path applies lives here once: the normalisation, the accumulation dtype,
the guide threshold, the guide-mask rule and the half-precision products (``addmm_``, ``half_rows``). The tie ids
the guide-mask rule reads are ``cgist.stage.ties``'.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .devices import bf16_tensor_cores, is_gpu

__all__ = [
    "EPS", "HalfRows", "addmm_", "compute_dtype", "copy_rows", "guide_mask", "half_accumulation", "half_products",
    "half_rows", "normalize", "row_chunks", "row_dots", "stack_rows", "theta_above", "threshold",
]

#: Norm floor of the normalisation, as in ``torch.nn.CosineSimilarity``.
EPS = 1e-8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_chunks(column: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """A column of embeddings as the list of its row chunks: itself for a tensor."""
    return [column] if isinstance(column, Tensor) else list(column)


def stack_rows(column: Tensor | Sequence[Tensor]) -> Tensor:
    """A column as one tensor: its row chunks concatenated (a copy), or the tensor itself."""
    chunks = row_chunks(column)
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def normalize(x: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(x / max(||x||_2, eps), ||x||_2)`` row-wise, in ``dtype`` (default: x's own); differentiable."""
    x = x if dtype is None else x.to(dtype)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x / norm.clamp_min(EPS), norm


def copy_rows(chunks: Sequence[Tensor], out: Tensor) -> Tensor:
    """``out`` (rows x w) filled with the first w components of the row chunks, one after the other."""
    width = out.shape[1]
    return torch.cat([c if c.shape[1] == width else c[:, :width] for c in chunks], out=out)


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for rows x dim ``a`` and ``b``, as a batch of 1 x dim by dim x 1 products: no rows x
    dim temporary (``vecdot`` makes one)."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


def threshold(theta: Tensor, margin: float, relative: bool) -> Tensor:
    """Guide threshold ``T_i`` above which a candidate is masked (strictly greater)."""
    return theta - theta.abs() * margin if relative else theta - margin


def theta_above(theta: Tensor, margin: float, relative: bool) -> Tensor:
    """Whether theta_i lies strictly above its own threshold ``T_i`` (``threshold``), so that a candidate tied with
    theta_i is masked: at any positive margin (relative: and theta_i != 0), decided from the margin rather than from
    the rounded comparison ``theta > T``, which a large ``|theta|`` rounds to equality (docs/design.md#ties)."""
    if relative:
        return (theta != 0) & (margin > 0)
    return torch.full_like(theta, margin > 0, dtype=torch.bool)


def guide_mask(guide: Tensor, limit: Tensor, theta_masked: Tensor, ties: tuple[Tensor, Tensor],
               out: Tensor | None = None) -> Tensor:
    """True where a score is masked: its guide score is strictly above the row's threshold ``limit``.

    Row i's scores pair a row vector with each column; theta_i pairs the same row vector with a partner
    (the positive for anchor rows, the anchor for positive rows). A column equal to that partner is a tie
    with theta_i and is masked exactly when ``theta_masked[i]`` (theta_i > T_i), whatever the rounding of
    its guide score; ``ties`` holds the ``(rows, cols)`` of those entries (``TieIndex.pairs``).
    Shapes: ``guide`` rows x cols, ``limit`` and ``theta_masked`` rows x 1. The mask is written into
    ``out`` if given, in its dtype (bool, or 0.0 / 1.0 in a floating one).
    """
    mask = torch.gt(guide, limit) if out is None else torch.gt(guide, limit, out=out)
    rows, cols = ties
    mask[rows, cols] = theta_masked[rows, 0].to(mask.dtype)
    return mask


@functools.cache
def half_accumulation(device_type: str) -> str:
    """How ``out (fp32) += a @ b`` runs for half operands on ``device_type``: one call (``"addmm"``), a product then
    an add (``"mm"``), or the operands widened first (``"upcast"``).

    Recent torch multiplies bf16 and fp16 into fp32 directly on CUDA (``out_dtype``), on the tensor cores; probed
    once per device type on tiny tensors (torch 2.13 has no such call on a CPU).
    """
    out = torch.zeros(2, 2, device=device_type)
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        return "addmm"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return "mm"
    except (RuntimeError, TypeError, NotImplementedError):
        return "upcast"


def addmm_(out: Tensor, a: Tensor, b: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``out = beta * out + alpha * (a @ b)``, accumulated in ``out``'s dtype (float32 for half operands), in place.

    Half operands are multiplied into float32 where torch can (``half_accumulation``); widening them first gives the
    same products, as a product of two half values is exact in float32. With ``beta = 0`` the old ``out`` is not
    read (a NaN there stays out).
    """
    if a.dtype == out.dtype:
        return out.addmm_(a, b, beta=beta, alpha=alpha)
    how = half_accumulation(out.device.type)
    if how == "addmm":
        return torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=out.dtype, out=out)
    if how == "mm":
        product = torch.mm(a, b, out_dtype=out.dtype)
        return out.copy_(product).mul_(alpha) if beta == 0 else out.mul_(beta).add_(product, alpha=alpha)
    return out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta, alpha=alpha)


@dataclass
class HalfRows:
    """A column's rows as half-precision operands of the score products (``half_products``).

    ``y`` holds the rows as given, or, as fp16 for bf16 rows, scaled by a power of two; ``inv`` is the factor that
    normalises them (``x_hat = inv * y``, in fp32), so a product of two ``y`` is exact and the normalisation is
    applied after it. ``x_hat`` (student only) is the normalised rows rounded to the half dtype, the operand of the
    gradient products.
    """

    y: Tensor
    inv: Tensor
    x_hat: Tensor | None = None

    def rows(self, start: int, stop: int) -> HalfRows:
        return HalfRows(*(None if t is None else t[start:stop] for t in (self.y, self.inv, self.x_hat)))


def half_rows(x: Tensor, norm: Tensor, dtype: torch.dtype, x_hat: Tensor | None) -> HalfRows:
    """``x`` (rows x dim, any floating dtype) as a ``HalfRows`` in ``dtype``, with ``norm`` = ||x|| (rows x 1, fp32).

    bf16 rows bound for fp16 are first scaled by a power of two that brings their largest component into
    [0.5, 1): every component within 2^14 of it converts exactly (bf16's 8 significant bits fit in fp16's 11),
    a smaller one with an error below 2^-25 of the largest, so a cosine moves by less than 2^-24 sqrt(dim).
    """
    inv = 1.0 / norm.squeeze(1).clamp_min(EPS)
    if x.dtype == torch.bfloat16 and dtype == torch.float16:
        exponent = torch.frexp(x.abs().amax(dim=1).float())[1]
        y = torch.ldexp(x.float(), -exponent.unsqueeze(1)).to(dtype)
        inv = torch.ldexp(inv, exponent)
    else:
        y = x.to(dtype)
    return HalfRows(y, inv, None if x_hat is None else x_hat.to(dtype))


def half_products(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The half dtype in which rows of ``dtype`` enter the score products on ``device``, or None (compute dtype).

    On CUDA (and ROCm) a bf16 or fp16 column is multiplied on the tensor cores: fp16 as it is, bf16 as it is where
    the GPU has bf16 tensor cores (sm_80 and newer) and as fp16 below (``half_rows``), accumulating in float32.
    This is the path "auto" takes below sm_80, where Triton emits no tensor-core instructions. Elsewhere, and for
    float32 rows, the products run in the compute dtype.

    The streaming path (one dimension) then multiplies the inputs as given (bf16 as fp16 below sm_80, each row
    scaled by a power of two), so that every score product is exact, with the normalisation, the scale and the shift
    applied to the float32 result; its gradient products take the softmax probabilities and the normalised rows
    rounded to the half dtype (a relative error of one half-ulp each).
    """
    if not is_gpu(device) or dtype not in (torch.float16, torch.bfloat16):
        return None
    if dtype == torch.bfloat16 and not bf16_tensor_cores(device):
        return torch.float16
    return dtype
