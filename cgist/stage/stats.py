"""``GistStats``: what the guide's mask did in one loss-stage call, as plain Python numbers; and the layout of the
counters every backend fills for it (``BLOCKS``, ``COUNT_FIELDS``, ``SUM_FIELDS``)."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .spec import problem
from .spec.options import GistOptions

__all__ = ["BLOCKS", "COUNT_FIELDS", "STATS_FIELDS", "SUM_FIELDS", "GistStats"]

#: The statistics blocks, in the order of the loss: anchor-positive, anchor-anchor, positive-positive,
#: anchor-negatives, and the directions' query-to-query, document-to-query and document-to-document (every document
#: column). Each column group (``cgist.stage.spec.options.ColumnGroup.name``) counts in one of them.
BLOCKS = ("ap", "aa", "pp", "an", "qq", "dq", "dd")


#: The counters of one call's guide mask, in the order every backend returns them (``need_stats``), as an
#: int64 vector: entries masked per block (AP without its label; AN over all negative columns; the directions'
#: QQ, DQ and DD, DD with DN) and anchors whose candidates are all masked but the label. Exact at any size.
COUNT_FIELDS = (*(f"masked_{name}" for name in BLOCKS), "positive_only")
#: The sums over anchors of theta_i and T_i, returned beside the counts as a vector in the compute dtype.
SUM_FIELDS = ("theta_sum", "threshold_sum")
STATS_FIELDS = COUNT_FIELDS + SUM_FIELDS


def _to_host(counts: Tensor, sums: Tensor) -> list[float]:
    """The int64 ``counts`` and the float ``sums`` as Python numbers, in one transfer (one host sync).

    The sums travel as their bit patterns, widened to int64 (float32 through int32, sign-extended), and are read
    back bitwise on the host.
    """
    wide = sums.element_size() == 8
    bits = sums.view(torch.int64) if wide else sums.view(torch.int32).to(torch.int64)
    values = torch.cat([counts, bits]).tolist()
    n = counts.numel()
    code, int_code = ("d", "q") if wide else ("f", "i")
    return values[:n] + [struct.unpack(code, struct.pack(int_code, v))[0] for v in values[n:]]


@dataclass(frozen=True)
class GistStats:
    """False-negative statistics of one call (or a mean over calls, see ``mean``).

    Attributes:
        masked: per block (``"ap"``, ``"aa"``, ``"pp"``, ``"an"``, and the directions' ``"qq"``, ``"dq"``,
            ``"dd"``), the (row, candidate) entries left out of the softmax: masked by the guide, or excluded by
            ``mask_self``, ``mask_duplicates`` or a direction's own rule (QQ's self-pairs, DD's own documents):
            those are counted in their blocks, not apart. AP leaves out each anchor's label and DQ each pair,
            which are never masked; AA and PP count the self-pairs, as they count in the loss; ``"an"`` is all
            negative columns together, ``"dd"`` every document column. A block that is switched off (or has no
            columns) is absent, here and in ``candidates``.
        candidates: per block, the entries there were.
        positive_only: anchors whose every candidate except the label was masked.
        anchors: the anchors of the call (B).
        theta_mean: the mean over anchors of theta_i, the guide's score of anchor i with its positive (None
            without a guide).
        threshold_mean: the mean over anchors of the threshold T_i (None without a guide).
    """

    masked: dict[str, int]
    candidates: dict[str, int]
    positive_only: int
    anchors: int
    theta_mean: float | None
    threshold_mean: float | None

    @classmethod
    def from_counters(cls, counts: Tensor, sums: Tensor, *, sizes: Sequence[int], options: GistOptions,
                      guided: bool, flags: Tensor) -> tuple[GistStats, list[int]]:
        """Read a backend's counters (``cgist.stage.stats.COUNT_FIELDS`` and ``SUM_FIELDS``) and the caller's int64
        ``flags`` (returned as Python ints: ``cgist.stage.node.run``'s, whether the loss is finite) in one host sync.

        ``sizes``: the rows of each column of the call (the anchors first; with ``options.all_anchors`` every rank's
        anchors last). The candidates of each block follow from the column groups
        (``cgist.stage.spec.problem.candidates``); ``guided``: whether a guide scored them (else no means).
        """
        n_flags = flags.numel()
        host = _to_host(torch.cat([flags, counts]), sums)
        values = dict(zip(COUNT_FIELDS + SUM_FIELDS, host[n_flags:]))
        batch = sizes[0]
        candidates = problem.candidates(options, sizes)
        return cls(
            masked={key: int(values[f"masked_{key}"]) for key in candidates},
            candidates=candidates,
            positive_only=int(values["positive_only"]),
            anchors=batch,
            theta_mean=values["theta_sum"] / batch if guided else None,
            threshold_mean=values["threshold_sum"] / batch if guided else None,
        ), [int(v) for v in host[:n_flags]]

    def masked_fraction(self, block: str) -> float:
        """The share of ``block``'s entries that the guide masked (0 for a block without entries)."""
        return self.masked[block] / self.candidates[block] if self.candidates.get(block) else 0.0

    @property
    def positive_only_fraction(self) -> float:
        """The share of anchors left with only their positive."""
        return self.positive_only / self.anchors

    def _sums(self, keys: Sequence[str]) -> list[float]:
        """Everything as sums over anchors: masked and candidates per block in ``keys``, then the rest (the means'
        sums NaN without a guide)."""
        means = [math.nan if m is None else m * self.anchors for m in (self.theta_mean, self.threshold_mean)]
        return [*(self.masked.get(k, 0) for k in keys), *(self.candidates.get(k, 0) for k in keys),
                self.positive_only, self.anchors, *means]

    @classmethod
    def _from_sums(cls, keys: Sequence[str], sums: Sequence[float]) -> GistStats:
        n = len(keys)
        positive_only, anchors, theta_sum, threshold_sum = sums[2 * n :]
        return cls(
            masked={k: int(v) for k, v in zip(keys, sums[:n])},
            candidates={k: int(v) for k, v in zip(keys, sums[n : 2 * n])},
            positive_only=int(positive_only),
            anchors=int(anchors),
            theta_mean=None if math.isnan(theta_sum) else theta_sum / anchors,
            threshold_mean=None if math.isnan(threshold_sum) else threshold_sum / anchors,
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
        sums = self._sums(keys)
        # The counts exactly, as int64; the sums of theta and T_i in float32 (no float64 on devices without it).
        counts = torch.tensor(sums[:-2], dtype=torch.int64, device=device)
        means = torch.tensor(sums[-2:], dtype=torch.float32, device=device)
        dist.all_reduce(counts)
        dist.all_reduce(means)
        return GistStats._from_sums(keys, counts.tolist() + means.tolist())
