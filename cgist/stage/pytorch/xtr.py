"""The XTR score on the PyTorch backend (docs/design.md#xtr): MaxSim's two sweeps (``cgist.stage.pytorch.maxsim``)
with XTR's reduction of the maxima, the thresholds found in the first sweep itself.

A row block's first sweep keeps each query token's maximum over every document (not only the scores), and feeds
each tile's products to the block's ``cgist.stage.xtr_thresholds.TopK``, which finds their maxima as it reads them, before
the argmax takes them over: no token product is formed a second time for the thresholds, nor read once more for the
maxima. Once the sweep is done, the block's thresholds are known (lowered by ``tie_slack``), and with them which
maxima are retrieved, each score's ``Z`` and the scores. The second sweep sends a retrieved maximum its score's
gradient divided by ``Z``, and a maximum not retrieved nothing. It imports only torch, its MaxSim backend and the
spec.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..budget import xtr_kept_bytes
from ..spec.xtr import XTRCall
from ..xtr_thresholds import TopK, lowered, retrieved, tie_slack
from . import maxsim

__all__ = ["forward"]


class _Retrieval(maxsim.Reduction):
    """XTR's reduction of a call's row blocks (``cgist.stage.pytorch.maxsim.Reduction``)."""

    def __init__(self, call: XTRCall) -> None:
        self.k = call.top_k
        self.slack = tie_slack(call)  # (n_queries, Lq)

    def start(self, first: int, rows: int, lq: int, n_docs: int, with_grad: bool, dtype: torch.dtype) -> None:
        device = self.slack.device
        self.first, self.lq = first, lq
        self.maxima = torch.zeros(rows, lq, n_docs, dtype=dtype, device=device)
        self.weights = torch.zeros(rows, lq, dtype=dtype, device=device)
        self.empty = torch.zeros(n_docs, dtype=torch.bool, device=device)
        self.top = TopK(rows * lq, self.k, dtype, device)
        self.tau = self.counts = None

    def kept_per_query(self, query_tokens: int, n_documents: int, acc_bytes: int, with_grad: bool) -> int:
        return xtr_kept_bytes(query_tokens, n_documents, self.k, acc_bytes)

    def tile_maxima(self, query: maxsim._QueryTile, doc: maxsim._DocTile, products: Tensor, span: slice) -> Tensor:
        """The products offered to the block's ``TopK``, which finds their maxima as it reads them."""
        width = query.weights.shape[1]
        local = torch.arange(span.start, span.stop, device=products.device).unsqueeze(1) * self.lq
        rows = (local + torch.arange(width, device=products.device)).reshape(-1)
        return self.top.offer(products, doc.real, rows)

    def scores(self, query: maxsim._QueryTile, doc: maxsim._DocTile, maxima: Tensor, span: slice,
               cols: slice) -> Tensor:
        width = query.weights.shape[1]
        self.maxima[span, :width, cols] = maxima.permute(1, 2, 0)
        self.weights[span, :width] = query.weights
        if doc.empty is not None:
            self.empty[cols] = doc.empty
        return maxima.new_zeros(maxima.shape[1], maxima.shape[0])  # the scores come once the sweep is done

    def finish(self, scores: Tensor) -> None:
        rows = self.weights.shape[0]
        tau = self.top.kth().view(rows, self.lq)
        self.tau = lowered(tau, self.slack[self.first:self.first + rows, :self.lq])
        kept = retrieved(self.maxima, self.tau.unsqueeze(2), self.weights.unsqueeze(2))  # (rows, Lq, W)
        self.counts = kept.sum(1).clamp_(min=1.0)
        xtr = (self.maxima * kept).sum(1) / self.counts
        scores.copy_(torch.where(self.empty, scores, xtr))

    def sent(self, grad: Tensor, weights: Tensor, cols: slice) -> Tensor:
        width = weights.shape[1]
        kept = (self.maxima[:, :width, cols] >= self.tau[:, :width, None]) & (weights != 0).unsqueeze(2)
        return torch.where(kept, grad.unsqueeze(1), 0.0)

    def block_grad(self, grad: Tensor) -> Tensor:
        return grad / self.counts


def forward(call: XTRCall, with_grad: bool, need_stats: bool = False):
    """The backend contract's forward (``cgist.stage.pytorch.maxsim.forward``'s), with XTR's reduction."""
    return maxsim.forward(call, with_grad, need_stats, _Retrieval(call))

