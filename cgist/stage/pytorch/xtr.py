"""The XTR score on the PyTorch backend (docs/design.md#xtr): MaxSim's two sweeps (``cgist.stage.pytorch.maxsim``)
with XTR's reduction of each tile's maxima, after the thresholds' sweep (``cgist.stage.spec.xtr.thresholds``).

A row block keeps, beside MaxSim's scores and argmax, which maxima were retrieved (a bool per query token and
document) and each score's ``Z`` (the compute dtype); the second sweep sends a retrieved maximum the score's gradient
divided by ``Z`` and a maximum not retrieved nothing. It imports only torch, its MaxSim backend and the spec.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec.xtr import XTRCall, retrieved, thresholds
from . import maxsim

__all__ = ["backward", "forward"]


class _Retrieval(maxsim.Reduction):
    """XTR's reduction: each maximum counts where it reaches its query token's threshold (``tau``, the call's
    ``(n_queries, Lq)``), and a score is the sum of the retrieved maxima over ``Z``, how many there are (at least 1)."""

    def __init__(self, tau: Tensor) -> None:
        self.tau = tau
        self.kept: Tensor | None = None  # (rows, Lq, W) bool: the row block's retrieved maxima (with a gradient)
        self.counts: Tensor | None = None  # (rows, W): each score's Z, at least 1
        self.first = 0

    def start(self, first: int, rows: int, lq: int, n_docs: int, with_grad: bool, dtype: torch.dtype) -> None:
        self.first = first
        self.counts = torch.empty(rows, n_docs, dtype=dtype, device=self.tau.device)
        self.kept = torch.zeros(rows, lq, n_docs, dtype=torch.bool, device=self.tau.device) if with_grad else None

    def kept_per_document(self, query_tokens: int, acc_bytes: int, with_grad: bool) -> int:
        return acc_bytes + (query_tokens if with_grad else 0)

    def scores(self, query: maxsim._QueryTile, maxima: Tensor, span: slice, cols: slice) -> Tensor:
        rows, width = query.weights.shape
        row = self.first + span.start
        tau = self.tau[row:row + rows, :width]
        kept = retrieved(maxima, tau, query.weights)  # (bd, bq, Lq)
        counts = kept.sum(2).clamp_(min=1.0)  # (bd, bq)
        self.counts[span, cols] = counts.T
        if self.kept is not None:
            self.kept[span, :width, cols] = kept.permute(1, 2, 0).bool()
        return ((maxima * kept).sum(2) / counts).T

    def sent(self, grad: Tensor, weights: Tensor, cols: slice) -> Tensor:
        kept = self.kept[:, :weights.shape[1], cols]
        return torch.where(kept, grad.unsqueeze(1), 0.0)

    def block_grad(self, grad: Tensor) -> Tensor:
        return grad / self.counts


def forward(call: XTRCall, with_grad: bool, need_stats: bool = False):
    """The backend contract's forward (``cgist.stage.pytorch.maxsim.forward``'s), with XTR's thresholds and
    reduction."""
    return maxsim.forward(call, with_grad, need_stats, _Retrieval(thresholds(call)))


#: The backward reads the gradients the forward made: MaxSim's.
backward = maxsim.backward
