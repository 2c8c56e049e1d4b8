"""Numerics shared by the oracle, the PyTorch streaming path and the Triton launcher; imports only torch.

Each rule of the loss that more than one path applies lives here once: the normalisation and its
backward, the accumulation dtype, the guide threshold, the guide-mask rule and the tie ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["EPS", "compute_dtype", "guide_mask", "normalize", "normalize_backward", "threshold", "tie_ids"]

#: Norm floor of the normalisation, as in ``torch.nn.CosineSimilarity``.
EPS = 1e-8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def normalize(x: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(x / max(||x||_2, eps), ||x||_2)`` row-wise, in ``dtype`` (default: x's own); differentiable."""
    x = x if dtype is None else x.to(dtype)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x / norm.clamp_min(EPS), norm


def normalize_backward(x_hat: Tensor, norm: Tensor, grad_hat: Tensor) -> Tensor:
    """Gradient through ``x / max(||x||, eps)``: ``(g - x_hat (x_hat . g)) / ||x||``, or ``g / eps`` when clamped."""
    radial = (x_hat * grad_hat).sum(dim=-1, keepdim=True)
    radial = radial.masked_fill(norm < EPS, 0.0)
    return (grad_hat - x_hat * radial) / norm.clamp_min(EPS)


def threshold(theta: Tensor, margin: float, relative: bool) -> Tensor:
    """Guide threshold ``T_i`` above which a candidate is masked (strictly greater)."""
    return theta - theta.abs() * margin if relative else theta - margin


def guide_mask(guide: Tensor, limit: Tensor, theta_masked: Tensor, col_ids: Tensor, partner_ids: Tensor) -> Tensor:
    """True where a score is masked: its guide score is strictly above the row's threshold ``limit``.

    Row i's scores pair a row vector with each column; theta_i pairs the same row vector with
    ``partner_ids[i]`` (the positive for anchor rows, the anchor for positive rows). A column equal to
    that partner is a tie with theta_i and is masked exactly when ``theta_masked[i]`` (theta_i > T_i).
    Shapes: ``guide`` rows x cols, ``limit`` and ``theta_masked`` rows x 1, ids 1-D.
    """
    tie = col_ids.unsqueeze(0) == partner_ids.unsqueeze(1)
    return torch.where(tie, theta_masked, guide > limit)


def tie_ids(columns: Sequence[Tensor]) -> list[Tensor]:
    """An integer id per row of each column such that rows get equal ids iff they are equal vectors.

    Called on the normalised guide columns. sentence-transformers computes every guide score by one
    element-wise formula, so a candidate whose guide vector equals theta's partner scores exactly theta.
    Matrix products give no such promise (BLAS kernels differ with shape and position), so the tie is
    decided by identity instead of by the rounding of two different products.
    """
    ids = torch.unique(torch.cat(list(columns)), dim=0, return_inverse=True)[1]
    return list(ids.split([c.shape[0] for c in columns]))
