"""A row block held whole: the guide's mask over its rows' scores and their exact softmax, written once for every
backend of a score whose stage holds a block of rows against every column (``(rows, W)``: MaxSim's PyTorch stage and
its guided kernels; docs/design.md#the-guide-for-late-interaction).

``BlockMasks`` is one forward's mask: it reads the call's column groups (``MaxSimCall.groups``: GIST's AP, AA, PP and
AN, each a span of the row), its guide and its texts' ids, and counts what it masks in the layout of
``cgist.stage.stats`` (``COUNT_FIELDS``, ``SUM_FIELDS``). ``block_softmax`` turns a block's scores into its rows'
losses, the logits' gradients and the temperature's share. Neither reads a value on the host. It runs beside the
backends, which share it; it imports only torch, the spec and the loss stage's leaf modules.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .numerics import compute_dtype, guide_mask, theta_above, threshold
from .spec.maxsim import MaxSimCall
from .stats import COUNT_FIELDS, SUM_FIELDS
from .ties import TieIndex

__all__ = ["BlockMasks", "block_softmax"]


class BlockMasks:
    """The guide's mask of one forward of ``call`` over its row blocks (docs/design.md#the-guide-for-late-interaction),
    and what it masked (``counters``).

    Query ``i``'s candidate is masked when the guide scores it strictly above ``T_i``, the threshold below theta_i
    (the guide's score of ``i`` with its label) by the margin; a candidate with the text of the row's partner (query
    ``i``'s positive; in PP, whose rows are the positives, query ``i``) ties with theta_i and is masked exactly when
    the margin lowers ``T_i`` below it (``theta_above``); with ``mask_duplicates`` every candidate whose text is the
    query's or its positive's is masked; a group's excluded column (the self-pairs under ``mask_self``) always is; the
    label never is."""

    def __init__(self, call: MaxSimCall) -> None:
        self.call = call
        kind = call.guide_kind
        guide_dtype = call.guide_vectors[0].dtype if kind == "vectors" else compute_dtype(
            call.guide_tokens.dtype if kind == "tokens" else call.dtype)
        self.counts = torch.zeros(len(COUNT_FIELDS), dtype=torch.int64, device=call.device)
        self.sums = torch.zeros(len(SUM_FIELDS), dtype=guide_dtype, device=call.device)
        self.guide_dtype = guide_dtype
        self._indexes: dict[int, TieIndex] = {}  # a column's TieIndex, made once a forward

    @property
    def counters(self) -> tuple[Tensor, Tensor]:
        """``(counts, sums)`` in the layout of ``cgist.stage.stats``."""
        return self.counts, self.sums

    def __call__(self, first: int, scores: Tensor, guide_scores: Tensor | None = None) -> Tensor:
        """The mask (True: left out) of rows ``first:first + len(scores)`` over their whole row, from their scores
        (read, for ``"self"``) and, for a multi-vector guide (``"tokens"``), the guide's scores of the block, which
        the backend computes with its own score code; the counters updated."""
        call, options = self.call, self.call.options
        rows = scores.shape[0]
        local = torch.arange(rows, device=scores.device)
        labels = call.offset + first + local  # the label's column of the row: AP comes first
        ids = call.text_ids
        if call.guide_kind in (None, "none"):
            mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        else:
            guide = {"self": scores, "tokens": guide_scores}.get(call.guide_kind)
            if guide is None:
                guide = self._vector_scores(first, rows, labels)
            theta = guide[local, labels].unsqueeze(1)
            limit = threshold(theta, options.margin, options.relative)
            above = theta_above(theta, options.margin, options.relative)
            mask = guide_mask(guide, limit, above, self._ties(first, rows, labels))
            self.sums[0] += theta.sum().to(self.sums.dtype)
            self.sums[1] += limit.sum().to(self.sums.dtype)
        if options.mask_duplicates:
            own, positive = ids[0][first:first + rows, None], ids[1][labels, None]
            for group, span in call.groups:
                column = ids[group.cols]
                mask[:, span] |= (column == own) | (column == positive)
        for group, span in call.groups:
            if group.spec.excluded_offset is not None:
                mask[local, span.start + first + group.spec.excluded_offset + local] = True
        mask[local, labels] = False
        for group, span in call.groups:
            self.counts[COUNT_FIELDS.index(f"masked_{group.name}")] += mask[:, span].sum()
        self.counts[COUNT_FIELDS.index("positive_only")] += (mask.sum(1) == mask.shape[1] - 1).sum()
        return mask

    def _ties(self, first: int, rows: int, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the block's entries that tie with theta_i: a column with the text of the row's partner
        (the positive for the anchors' groups, query ``i`` for the positives'), found by binary search in each
        column's sorted text ids; none without text ids."""
        ids = self.call.text_ids
        if ids is None:
            return (labels[:0], labels[:0])
        partners = {"a": ids[1][labels], "p": ids[0][first:first + rows]}
        pairs = []
        for group, span in self.call.groups:
            if group.cols not in self._indexes:
                self._indexes[group.cols] = TieIndex(ids[group.cols])
            r, c = self._indexes[group.cols].pairs(partners[group.spec.row], 0, group.n_cols)
            pairs.append((r, c + span.start))
        return torch.cat([r for r, _ in pairs]), torch.cat([c for _, c in pairs])

    def _vector_scores(self, first: int, rows: int, labels: Tensor) -> Tensor:
        """A single-vector guide's cosines of the block's rows over their whole row, group by group."""
        call, vectors = self.call, self.call.guide_vectors
        guide = torch.empty(rows, call.width, dtype=self.guide_dtype, device=vectors[0].device)
        row_vectors = {"a": vectors[0][first:first + rows], "p": vectors[1][labels]}
        for group, span in call.groups:
            torch.mm(row_vectors[group.spec.row], vectors[group.cols].T, out=guide[:, span])
        return guide


def block_softmax(call: MaxSimCall, first: int, scores: Tensor, losses: Tensor, with_grad: bool,
                  mask: Tensor | None = None, share: Tensor | None = None) -> Tensor | None:
    """The softmax of queries ``first:first + rows`` over their scores ``(rows, W)``, the mask applied first (a
    masked score leaves the softmax, and its gradient is zero): their losses into ``losses`` and, ``with_grad``, the
    gradients of their scores ``scale / B * (softmax - [label])``, made in place of ``scores`` and returned.

    Each query's softmax is exact: its largest logit ``peak`` and ``total``, the sum of ``exp(logit - peak)``, so the
    softmax of the largest logit is ``1 / total`` exactly; with a log-sum-exp alone its rounding (an ulp of the
    log-sum-exp) would swamp the gradient of a query that already ranks its positive far above the rest. The label's
    gradient, ``scale / B * (p_label - 1)``, is ``-scale / B`` times the other terms' sum (summed apart) over
    ``total``: as precise as the other probabilities, where ``p_label - 1`` would cancel to an ulp of 1. The loss is
    ``(peak - label logit) + log(total)``, which keeps its value where every logit is the empty document's ``-1e9``.
    ``share`` (0-dim), if given, gets the block's share of ``sum_ij dL/dz_ij z_ij`` over the logits ``z``: minus the
    temperature times its derivative of the loss (``cgist.stage.node``)."""
    rows = scores.shape[0]
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    local = torch.arange(rows, device=scores.device)
    labels = call.offset + first + local
    logits = scores.mul_(call.scale)
    peak = logits.amax(1, keepdim=True)
    gap = peak.squeeze(1) - logits[local, labels]
    terms = logits.sub_(peak).exp_()  # in place: the scores are not needed again
    label_terms = terms[local, labels]
    terms[local, labels] = 0.0
    others = terms.sum(1)  # summed apart from the label's: 1 - p_label without the cancellation
    total = (others + label_terms).unsqueeze(1)
    losses[first:first + rows] = gap + torch.log(total).squeeze(1)
    if share is not None:  # sum_j p_ij z_ij - z_i,label = gap + sum_j p_ij (z_ij - peak), with z - peak = log(term)
        share += (gap + (torch.special.xlogy(terms, terms).sum(1) + torch.special.xlogy(label_terms, label_terms))
                   / total.squeeze(1)).sum() / call.n_queries
    if not with_grad:
        return None
    unit = call.scale / call.n_queries
    grad = terms.mul_(unit / total)
    grad[local, labels] = -unit * others / total.squeeze(1)  # unit * (p_label - 1), to p_label's relative precision
    return grad
