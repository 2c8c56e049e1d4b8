"""What a call of the loss stage means beyond its tiles, written once for both backends (the PyTorch streaming path
and the Triton launcher): how each row's softmax ends. It imports only torch, so the kernels' launcher may use it.

Both backends keep, per row, dimension and partition, a shift ``m`` (at least the positive's logit) and the sum
``l`` of ``exp(z - m)`` over the unmasked entries other than the label, in base-2 or natural units; from the gaps
``(m - positive) * ln 2`` and the sums, these functions give the loss and the weights of the score gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["label_terms", "prefix_norms", "row_losses", "row_weights", "totals"]


def prefix_norms(x: Tensor, dims: list[int], dtype: torch.dtype) -> Tensor:
    """``||x[:, :d]||`` for each Matryoshka dimension d (ascending; one dimension without Matryoshka), as
    (n_dims x rows) in ``dtype``: one norm per segment between consecutive dimensions, squared and summed up."""
    if len(dims) == 1:
        return torch.linalg.vector_norm(x[:, : dims[0]], dim=1, dtype=dtype).unsqueeze(0)
    squares = torch.stack([torch.linalg.vector_norm(x[:, lo:hi], dim=1, dtype=dtype) ** 2
                           for lo, hi in zip([0, *dims[:-1]], dims)])
    return squares.cumsum(0).sqrt()


def row_losses(gaps: Tensor, others: Tensor) -> Tensor:
    """Each row's loss per dimension (n_dims x rows), before the Matryoshka weights: with P partitions
    (``gaps`` and ``others`` are P x n_dims x rows), the mean over them of each one's log-sum-exp, minus the positive.

    Partition 0 holds the label: ``gap + log1p(l + expm1(-gap))``, which keeps a small loss's relative precision.
    Another partition's log-sum-exp minus the positive is ``gap + ln(l)``.
    """
    lse = gaps[0] + torch.log1p(others[0] + torch.expm1(-gaps[0]))
    if len(gaps) > 1:
        lse = (lse + (gaps[1:] + torch.log(others[1:])).sum(dim=0)) / len(gaps)
    return lse


def totals(others: Tensor, label: Tensor) -> Tensor:
    """Each partition's softmax denominator over ``exp(m)``: ``others``, plus the label's term ``label``
    (``exp(positive - m)``) in partition 0."""
    out = others.clone()
    out[0] += label
    return out


def row_weights(weights: Tensor, scale: float, totals: Tensor) -> Tensor:
    """``w_d * scale / (P * total_p)`` per partition p (P x n_dims x rows): the factor of a term's score gradient,
    ``scale`` being ``1 / (temperature * B)``."""
    return weights * (scale / len(totals)) / totals


def label_terms(others: Tensor, totals: Tensor) -> Tensor:
    """The label's term (n_dims x rows): its score gradient is minus this times partition 0's row weight,
    ``l_0 + (P - 1) total_0`` (exact where ``softmax - 1`` would cancel)."""
    return others[0] + (len(totals) - 1) * totals[0]
