"""``GistStats``: what the guide's mask did in one loss-stage call, as plain Python numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .numerics import STATS_FIELDS
from .options import GistOptions

__all__ = ["BLOCKS", "GistStats"]

#: Block keys, in the order of the loss: anchor-positive, anchor-anchor, positive-positive, anchor-negatives.
BLOCKS = ("ap", "aa", "pp", "an")


@dataclass(frozen=True)
class GistStats:
    """False-negative statistics of one call (or a mean over calls, see ``mean``).

    Attributes:
        masked: per block (``"ap"``, ``"aa"``, ``"pp"``, ``"an"``), the (anchor, candidate) entries the guide
            masked. AP leaves out each anchor's label, which is never masked; AA and PP count the self-pairs,
            as they count in the loss; ``"an"`` is all negative columns together. A block that is switched off
            (or has no columns) is absent, here and in ``candidates``.
        candidates: per block, the entries there were.
        positive_only: anchors whose every candidate except the label was masked.
        anchors: the anchors of the call (B).
        theta_mean: the mean over anchors of theta_i, the guide's score of anchor i with its positive.
        threshold_mean: the mean over anchors of the threshold T_i.
    """

    masked: dict[str, int]
    candidates: dict[str, int]
    positive_only: int
    anchors: int
    theta_mean: float
    threshold_mean: float

    @classmethod
    def from_counters(cls, counters: Tensor, *, batch: int, n_cand: int, n_negatives: int,
                      options: GistOptions) -> GistStats:
        """Read a backend's counter vector (``cgist.numerics.STATS_FIELDS``): one host sync."""
        values = dict(zip(STATS_FIELDS, counters.tolist()))
        candidates = {"ap": batch * (n_cand - 1)}
        if options.contrast_anchors:
            candidates["aa"] = batch * batch
        if options.contrast_positives:
            candidates["pp"] = batch * n_cand
        if n_negatives:
            candidates["an"] = n_negatives * batch * n_cand
        return cls(
            masked={key: int(values[f"masked_{key}"]) for key in candidates},
            candidates=candidates,
            positive_only=int(values["positive_only"]),
            anchors=batch,
            theta_mean=values["theta_sum"] / batch,
            threshold_mean=values["threshold_sum"] / batch,
        )

    def masked_fraction(self, block: str) -> float:
        """The share of ``block``'s entries that the guide masked (0 for a block without entries)."""
        return self.masked[block] / self.candidates[block] if self.candidates.get(block) else 0.0

    @property
    def positive_only_fraction(self) -> float:
        """The share of anchors left with only their positive."""
        return self.positive_only / self.anchors

    def _sums(self, keys: Sequence[str]) -> list[float]:
        """Everything as sums over anchors: masked and candidates per block in ``keys``, then the rest."""
        return [*(self.masked.get(k, 0) for k in keys), *(self.candidates.get(k, 0) for k in keys),
                self.positive_only, self.anchors, self.theta_mean * self.anchors, self.threshold_mean * self.anchors]

    @classmethod
    def _from_sums(cls, keys: Sequence[str], sums: Sequence[float]) -> GistStats:
        n = len(keys)
        positive_only, anchors, theta_sum, threshold_sum = sums[2 * n :]
        return cls(
            masked={k: int(v) for k, v in zip(keys, sums[:n])},
            candidates={k: int(v) for k, v in zip(keys, sums[n : 2 * n])},
            positive_only=int(positive_only),
            anchors=int(anchors),
            theta_mean=theta_sum / anchors,
            threshold_mean=threshold_sum / anchors,
        )

    @staticmethod
    def mean(stats: Sequence[GistStats]) -> GistStats:
        """The statistics of several calls as one: counts summed, means weighted by anchors."""
        if not stats:
            raise ValueError("GistStats.mean needs at least one GistStats")
        keys = [k for k in BLOCKS if any(k in s.candidates for s in stats)]
        return GistStats._from_sums(keys, [sum(column) for column in zip(*(s._sums(keys) for s in stats))])

    def sum_over_ranks(self, device: torch.device) -> GistStats:
        """The statistics of every rank of the default process group as one (a collective: every rank calls it)."""
        keys = list(self.candidates)
        total = torch.tensor(self._sums(keys), dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return GistStats._from_sums(keys, total.tolist())
