"""The problem of one call of the loss stage, shared by both backends (the PyTorch streaming path and the Triton
launcher): what the call means beyond its tiles, and how each row's softmax ends.

* What it means: the Matryoshka dimensions (``Dims``), the column groups bound to the call's columns
  (``BoundGroup``, ``bind_groups``: which rows score against which column, whose tie ids are the rows' partners,
  how many entries the statistics count), the prefix norms (``prefix_norms``).
* How it ends: both backends keep, per row, dimension and partition, a shift ``m`` (at least the positive's logit)
  and the sum ``l`` of ``exp(z - m)`` over the unmasked entries other than the label, in base-2 or natural units;
  from the gaps ``(m - positive) * ln 2`` and the sums, ``row_losses``, ``totals``, ``row_weights`` and
  ``label_terms`` give the loss and the weights of the score gradients, and ``normalization_backward_`` turns the
  gradients of the scores' rows into those of the embeddings.

It imports only torch and ``cgist.stage.numerics`` at run time (``cgist.stage.spec.options`` for type names), so the kernels'
launcher may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor

from ..numerics import row_dots

if TYPE_CHECKING:
    from .options import ColumnGroup, GistOptions

__all__ = [
    "BoundGroup", "Dims", "bind_groups", "candidates", "label_terms", "normalization_backward_", "prefix_norms",
    "row_losses", "row_weights", "totals",
]

C = TypeVar("C")


@dataclass(frozen=True)
class Dims:
    """The Matryoshka dimensions of a call, ascending, with their weights (one dimension, the full one, without).

    Dimension d scores the prefixes ``x[:d]``; its prefix dot products are sums over the ``segments`` between
    consecutive dimensions.
    """

    sizes: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(cls, options: GistOptions, full_dim: int) -> Dims:
        ascending = options.dims(full_dim)[::-1]
        return cls(tuple(d for d, _ in ascending), tuple(w for _, w in ascending))

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def top(self) -> int:
        """The largest dimension, over which the rows are normalised."""
        return self.sizes[-1]

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Components ``(lo, hi)`` of each segment between consecutive dimensions, ascending."""
        return list(zip([0, *self.sizes[:-1]], self.sizes))


@dataclass(frozen=True)
class BoundGroup(Generic[C]):
    """A column group (``cgist.stage.spec.options.ColumnGroup``: the rules) bound to the columns of one call.

    Its B rows are rows ``row_start .. row_start + B`` of ``rows`` (the anchors from 0, or their positives from
    ``offset``), scored against every row of ``cols`` (``n_cols`` of them); row i's partner, whose guide tie id
    decides a tie with theta_i, is row ``partner_start + i`` of ``partner`` (an anchor's positive, a positive's
    anchor). ``index`` is the group's place in the call's order. ``C`` is a backend's column type.
    """

    spec: ColumnGroup
    index: int
    rows: C
    row_start: int
    cols: C
    n_cols: int
    partner: C
    partner_start: int

    @property
    def name(self) -> str:
        """The statistics block the group counts in (``"ap"``, ``"aa"``, ``"pp"``, ``"an"``, ``"qq"``, ``"dq"``,
        ``"dd"``)."""
        return self.spec.name

    def entries(self, batch: int) -> int:
        """The entries the statistics count for this group: each of its ``batch`` rows against every column, but the
        label (AP) and the pair never masked (DQ)."""
        return batch * (self.n_cols - (self.spec.label or self.spec.unmasked_offset is not None))

    @property
    def hard(self) -> bool:
        """Whether the hardness penalty applies anywhere in the group."""
        return self.spec.hard_own or self.spec.hard_others


def bind_groups(options: GistOptions, columns: Sequence[C], sizes: Sequence[int]
                ) -> tuple[list[BoundGroup[C]], int, dict[str, int]]:
    """The call's column groups (``GistOptions.column_groups``) bound to its ``columns`` of ``sizes`` rows, the
    number of partitions, and the partition of each row side (``"a"``, ``"p"``)."""
    specs, n_parts, side_part = options.column_groups(len(columns))
    anchor, positive = columns[0], columns[1]
    sides = {"a": (anchor, 0, positive, options.offset), "p": (positive, options.offset, anchor, 0)}
    groups = []
    for index, spec in enumerate(specs):
        rows, row_start, partner, partner_start = sides[spec.row]
        groups.append(BoundGroup(spec, index, rows, row_start, columns[spec.column], sizes[spec.column], partner,
                                 partner_start))
    return groups, n_parts, side_part


def candidates(options: GistOptions, sizes: Sequence[int]) -> dict[str, int]:
    """The entries each statistics block counts (``BoundGroup.entries``, summed over its groups), for a call whose
    columns have ``sizes`` rows (the anchors first)."""
    out: dict[str, int] = {}
    for group in bind_groups(options, [None] * len(sizes), sizes)[0]:
        out[group.name] = out.get(group.name, 0) + group.entries(sizes[0])
    return out


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


def normalization_backward_(grad: Tensor, rows: Tensor, kappa: Tensor, radial: Tensor | None,
                            segments: Sequence[tuple[int, int]]) -> Tensor:
    """The normalisation's part of the backward, in place of ``grad`` (rows x top): segment s of each row loses
    ``rows[:, s] * sum_{d >= d_s} kappa_d c_d``.

    ``c_d = sum_j dL/dcos_d[row, j] * cos_d[row, j]`` is the row's radial sum of dimension d: ``radial``
    (n_dims x rows), or with one dimension (``radial`` None) ``rows . grad``. ``kappa`` (n_dims x rows) is 0 where
    ``||x[:d]|| < eps`` (the clamped norm has no gradient). The streaming path passes the normalised rows, with
    ``kappa_d = rho_d^2``, and divides by the norm afterwards; the launcher the raw rows, with ``kappa_d`` the
    squared inverse prefix norm, its ``grad`` already scaled by the inverse norms.
    """
    if radial is None:
        return grad.addcmul_(rows, (kappa[0] * row_dots(rows, grad)).unsqueeze(1), value=-1.0)
    suffix = (kappa * radial).flip(0).cumsum(0).flip(0)  # row s: the sum over d >= d_s
    for (lo, hi), coefficient in zip(segments, suffix):
        grad[:, lo:hi].addcmul_(rows[:, lo:hi], coefficient.unsqueeze(1), value=-1.0)
    return grad

