"""The dense score on the PyTorch backend (``similarity`` ``"cos"`` or ``"dot"``): the streaming GIST loss, the CPU
path and the fallback for GPUs without Triton; the backend contract's ``forward`` (docs/design.md#dispatch), which
makes the gradients with the loss (``cgist.stage.dispatch.direct.loss_and_grads`` runs it on raw columns). The
algorithm is docs/design.md#the-streaming-algorithm's. Anchors are processed in row blocks, each scored
against the columns of every column group bound to the call (``cgist.stage.spec.problem.bind_groups``) in tiles:
one matrix product for the guide scores (the mask), one for the student logits, then ``exp2``; the gradients with
respect to the normalised embeddings come from the same tiles, and one normalisation backward at the end turns them
into embedding gradients. Nothing of size B x N is ever allocated: the tiles live in a workspace
(``cgist.stage.pytorch.workspace.Workspace``) whose size is the byte budget, which also chooses one pass or two
(``cgist.stage.budget.row_blocks``: two passes recompute each tile, so its masks are the same).

Precision. Logits are in base 2 and shifted by each row's positive logit, which the product subtracts itself
(``[scale * x_hat, -shift] . [k_hat, 1]``); the label is kept out of the sum of the other terms, so a small loss keeps
its relative precision, and a row whose sum passes ``LARGEST_SUM`` (a candidate far above the positive) is redone
shifted by its maximum. Shifted logits below the smallest normal exponent plus 24 are dropped before ``exp2``: many
CPUs compute on subnormal floats a hundred times slower (docs/performance.md#memory), and each dropped term is below
2^-102 of the positive's.
Half products (one dimension, on CUDA): ``cgist.stage.numerics.half_products``. Matryoshka: docs/design.md#matryoshka.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..budget import RowBlocks, row_blocks
from ..numerics import (
    EPS, HalfRows, addmm_, compute_dtype, copy_rows, guide_mask, half_products, half_rows, row_chunks, row_dots,
    theta_above, threshold,
)
from ..spec.call import Grads
from ..spec.dense import DenseCall
from ..spec.options import GistOptions
from ..spec.problem import (
    BoundGroup, Dims, bind_groups, label_terms, normalization_backward_, prefix_norms, row_losses, row_weights, totals,
)
from ..stats import COUNT_FIELDS, SUM_FIELDS
from ..ties import TieIndex, tie_ids
from .workspace import Workspace

__all__ = ["forward"]

LOG2E, LN2 = math.log2(math.e), math.log(2.0)
#: Above this sum of softmax terms (relative to the positive's) a row block is redone shifted by its maximum.
LARGEST_SUM = 2.0**64
#: Masked entries' logits are lowered by this much: far below any logit and the subnormal cutoff.
MASKED = 2.0**100


@dataclass
class _NormalizedColumn:
    """One embedding column: normalised student and guide rows, tie ids and the gradient accumulators."""

    x1: Tensor  # student rows over the first ``top`` components, normalised there, and a last column of ones
    norm: Tensor  # ||x[:top]|| (rows x 1)
    rho: Tensor  # per dimension (ascending), rho_d of each row (n_dims x rows)
    kappa: Tensor  # per dimension, rho_d^2, or 0 where ||x[:d]|| < eps (no radial gradient there)
    g: Tensor | None  # normalised guide rows (None without a guide)
    ids: Tensor | None  # their tie ids
    grad: Tensor | None  # sum over dimensions of dL/d x_hat, segment by segment (rows x top)
    radial: Tensor | None  # per dimension, sum_j dL/dcos_d[row, j] * cos_d[row, j] (n_dims x rows), Matryoshka only
    half: HalfRows | None = None  # the student rows as half operands (one dimension, ``half_products``)
    guide_half: HalfRows | None = None  # the guide rows likewise
    text: Tensor | None = None  # int32 text id of each row (``mask_duplicates``)

    def __post_init__(self) -> None:
        self.ties = None if self.ids is None else TieIndex(self.ids)
        self.texts = None if self.text is None else TieIndex(self.text)
        self.x = self.x1[:, :-1]  # the normalised rows (rows x top)


class _StreamingRun:
    """Everything one call of the streaming path shares between its row blocks: the normalised columns, the bound
    column groups, the scales, the counters, the row-block schedule and its workspace."""

    def __init__(self, embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor], options: GistOptions,
                 need_grads: bool, need_stats: bool,
                 products: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
                 text_ids: Sequence[Tensor] | None = None) -> None:
        self.options, self.want_share = options, False
        embeddings = [row_chunks(e) for e in embeddings]
        self.dtype = compute_dtype(embeddings[0][0].dtype)
        self.dims = Dims.of(options, embeddings[0][0].shape[1])
        if len(self.dims) > 1:  # half products serve one dimension; Matryoshka's prefixes keep the compute dtype
            products = (None, None)
        self.guided = guide_embeddings is not None
        if self.guided:
            guide_embeddings = [row_chunks(g) for g in guide_embeddings]
            guide = [self._normalized_guide(g) for g in guide_embeddings]
            ids = tie_ids([g for g, _ in guide], self.dtype, normalized=True, text_ids=text_ids)
        else:
            guide, ids = [(None, None)] * len(embeddings), [None] * len(embeddings)
        texts = text_ids if options.mask_duplicates else [None] * len(embeddings)
        self.columns = [self._column(e, g, i, t, need_grads) for e, (g, _), i, t in zip(embeddings, guide, ids, texts)]
        for i, (column, e) in enumerate(zip(self.columns, embeddings)):
            if products[0] is not None:
                column.half = half_rows(torch.cat(e), column.norm, products[0], column.x)
            if products[1] is not None and self.guided:
                column.guide_half = half_rows(torch.cat(guide_embeddings[i]), guide[i][1], products[1], None)
        self.groups, self.n_parts, self.side_part = bind_groups(options, self.columns,
                                                                [c.x.shape[0] for c in self.columns])
        anchor = self.columns[0]
        self.batch = anchor.x.shape[0]
        self.logit_scale = LOG2E / options.temperature
        # Hardness: a penalised logit is (1 + hardness * tau) times its plain value (the penalty adds
        # hardness * cos to cos / tau), applied to the shifted logits by ``_RowBlock.harden``.
        self.hard_factor = 1.0 + options.hardness * options.temperature
        self.grad_scale = 1.0 / (options.temperature * self.batch)
        # Shifted base-2 logits below this are dropped: their terms, and their products with embedding
        # components down to 2^-23, would be subnormal.
        self.cutoff = math.log2(torch.finfo(self.dtype).tiny) + 24.0
        self.counters = (torch.zeros(len(COUNT_FIELDS), dtype=torch.int64, device=anchor.x.device),
                         torch.zeros(len(SUM_FIELDS), dtype=self.dtype, device=anchor.x.device)) if need_stats else None
        # The row blocks within the workspace budget (cgist.stage.budget), and the buffers they reuse.
        widths, half = [g.n_cols for g in self.groups], anchor.half is not None
        itemsize = torch.finfo(self.dtype).bits // 8
        self.schedule = row_blocks(self.batch, widths, self.dims.top, len(self.dims), itemsize, options.block_bytes,
                                   anchor.x.device, half=half)
        self.work = Workspace(self.schedule, widths, len(self.dims), self.dims.top, self.dtype, anchor.x.device, half)

    def _normalized_guide(self, chunks: list[Tensor]) -> tuple[Tensor, Tensor]:
        """A guide column's rows, normalised in the compute dtype, written straight from its chunks, and their norms."""
        g = copy_rows(chunks, torch.empty(sum(c.shape[0] for c in chunks), chunks[0].shape[1], dtype=self.dtype,
                                           device=chunks[0].device))
        norm = torch.linalg.vector_norm(g, dim=1, keepdim=True)
        return g.div_(norm.clamp_min(EPS)), norm

    def _column(self, student: list[Tensor], guide: Tensor | None, ids: Tensor | None, text: Tensor | None,
                need_grads: bool) -> _NormalizedColumn:
        """One column from the row chunks of its student rows, its normalised guide rows and their ids."""
        dims = self.dims
        # [x_hat, 1]: the ones let a score product subtract a per-row shift (``_RowBlock.masked_logits``).
        x1 = torch.ones(sum(c.shape[0] for c in student), dims.top + 1, dtype=self.dtype, device=student[0].device)
        x = copy_rows(student, x1[:, :-1])
        if self.options.similarity == "dot":  # dot products: the rows as they are, every ratio 1, no radial term
            norm = torch.ones(x.shape[0], 1, dtype=self.dtype, device=x.device)
            rho = torch.ones(len(dims), x.shape[0], dtype=self.dtype, device=x.device)
            kappa = torch.zeros_like(rho)
        else:
            *prefix, norm = prefix_norms(x, dims.sizes, x.dtype)
            norm = norm.unsqueeze(1)
            x.div_(norm.clamp_min(EPS))
            floor_top = norm.squeeze(1).clamp_min(EPS)
            rho = torch.stack([floor_top / n.clamp_min(EPS) for n in prefix] + [torch.ones_like(floor_top)])
            kappa = (rho**2).masked_fill_(torch.stack([*prefix, norm.squeeze(1)]) < EPS, 0.0)
        grad = torch.zeros_like(x) if need_grads else None
        radial = torch.zeros_like(rho) if need_grads and len(dims) > 1 else None
        return _NormalizedColumn(x1, norm, rho, kappa, guide, ids, grad, radial, text=text)

    def count(self, field: str, value: Tensor) -> None:
        """Add ``value`` to the counter or sum ``field`` (``cgist.stage.stats.COUNT_FIELDS`` / ``SUM_FIELDS``)."""
        counts, fields = (self.counters[0], COUNT_FIELDS) if field in COUNT_FIELDS else (self.counters[1], SUM_FIELDS)
        counts[fields.index(field)] += value

    def gradients(self, embeddings: Sequence[Tensor]) -> list[Tensor]:
        """d(loss)/d(embeddings) from the accumulated dL/d x_hat and radial sums, in each embedding's dtype.

        Through the normalisation (``cgist.stage.spec.problem.normalization_backward_``, ``kappa = rho^2``), then divided by
        ``max(||x[:top]||, eps)``. With several dimensions the accumulated ``grad`` is ``sum_d sum_j dL/dcos_d[i, j]
        rho_d,i rho_d,j k_hat_j[:d]``, so ``x_hat . grad`` is the sum of every dimension's radial sum: the top
        dimension's is that minus the smaller ones' (which the tiles accumulated). Components past ``top`` get 0.
        Dot products have no normalisation to pass through. With ``want_share`` it keeps ``temperature_share``, half the
        sum of ``x_hat . grad`` over every row: ``sum_ij dL/ds_ij s_ij`` (each score has a row and a column side).
        """
        out, shares = [], []
        for column, e in zip(self.columns, (row_chunks(e)[0] for e in embeddings)):
            grad = column.grad
            if self.want_share:
                shares.append(row_dots(column.x, grad).sum())
            if self.options.similarity != "dot":
                if column.radial is not None:
                    column.radial[-1] = row_dots(column.x, grad) - column.radial[:-1].sum(dim=0)
                normalization_backward_(grad, column.x, column.kappa, column.radial, self.dims.segments)
                grad.div_(column.norm.clamp_min(EPS))
            if e.shape[1] > self.dims.top:
                grad = torch.cat([grad, grad.new_zeros(grad.shape[0], e.shape[1] - self.dims.top)], dim=1)
            out.append(grad.to(e.dtype))
        self.temperature_share = torch.stack(shares).sum() / 2 if shares else None
        return out


@dataclass
class _Rows:
    """The rows of a row block as one side (its anchors, or their positives) sees them."""

    x: Tensor  # normalised student rows (R x top)
    g: Tensor  # normalised guide rows (R x Dg)
    rho: Tensor  # n_dims x R
    partner_ids: Tensor | None  # tie id of theta's partner, R (None without a guide)
    grad: Tensor | None
    radial: Tensor | None
    half: HalfRows | None = None
    guide_half: HalfRows | None = None
    shifted: Tensor | None = None  # [logit_scale * x, -shift of the top dimension]: the score products' row operand
    shift: Tensor | None = None  # the shift of the side's partition's logits (n_dims x R)
    weight: Tensor | None = None  # the score-gradient weight of the side's partition (n_dims x R)
    weighted: Tensor | None = None  # x times the rows' score-gradient weight (one dimension)
    weighted_shift: Tensor | None = None  # the weight times the shift (several dimensions)

    @classmethod
    def of(cls, column: _NormalizedColumn, start: int, stop: int, partner_ids: Tensor | None) -> _Rows:
        def part(t: Tensor | None, dim: int = 0) -> Tensor | None:
            return None if t is None else t.narrow(dim, start, stop - start)

        halves = (None if h is None else h.rows(start, stop) for h in (column.half, column.guide_half))
        return cls(part(column.x), part(column.g), part(column.rho, 1), partner_ids, part(column.grad),
                   part(column.radial, 1), *halves)


class _RowBlock:
    """One row block: its thresholds, its positive logits, and the softmax terms of column ranges."""

    def __init__(self, call: _StreamingRun, start: int, stop: int) -> None:
        self.call, self.start, self.stop = call, start, stop
        options, dims = call.options, call.dims
        anchor, positive = call.columns[0], call.columns[1]
        lo, hi = options.offset + start, options.offset + stop
        guided = call.guided
        self.anchor_rows = _Rows.of(anchor, start, stop, positive.ids[lo:hi] if guided else None)
        self.positive_rows = _Rows.of(positive, lo, hi, anchor.ids[start:stop] if guided else None)
        label_rows = self.positive_rows
        dots = torch.stack([row_dots(self.anchor_rows.x[:, a:b], label_rows.x[:, a:b]) for a, b in dims.segments])
        self.positive = dots.cumsum(0) * self.anchor_rows.rho * label_rows.rho * call.logit_scale  # n_dims x R
        self.local = torch.arange(stop - start, device=dots.device)
        # Without a guide nothing is guide-masked: no threshold.
        self.limit = self.theta_masked = None
        if guided:  # theta_i: the guide's score of anchor i with its label, candidate offset + i
            theta = row_dots(self.anchor_rows.g, label_rows.g).unsqueeze(1)
            self.limit = threshold(theta, options.margin, options.relative)
            self.theta_masked = theta_above(theta, options.margin, options.relative)
            if call.counters is not None:
                call.count("theta_sum", theta.sum())
                call.count("threshold_sum", self.limit.sum())
        # Each row's texts, the anchor's and its positive's, against which mask_duplicates compares a column's.
        self.texts = (anchor.text[start:stop], positive.text[lo:hi]) if options.mask_duplicates else None
        self.ties: dict[int, tuple[Tensor, Tensor]] = {}
        self.exclusions: dict[int, tuple[Tensor, Tensor]] = {}

    def rows_of(self, group: BoundGroup) -> _Rows:
        return self.positive_rows if group.spec.row == "p" else self.anchor_rows

    def _row_operand(self, name: str, rows: _Rows, extra: int = 0) -> Tensor:
        """The workspace's R x (top + ``extra``) buffer ``name`` for the anchor or the positive rows."""
        shape = (self.stop - self.start, self.call.dims.top + extra)
        return self.call.work.view(name, shape, 0 if rows is self.anchor_rows else shape[0] * shape[1])

    def set_shift(self, shift: Tensor) -> None:
        """Shift the logits of the next sweeps by ``shift`` (n_parts x n_dims x R): each row side by its partition's."""
        for side, rows in (("a", self.anchor_rows), ("p", self.positive_rows)):
            rows.shift = shift[self.call.side_part[side]]
            if rows.half is not None:  # the half products take the shift after the product
                continue
            rows.shifted = self._row_operand("shifted", rows, 1)
            torch.mul(rows.x, self.call.logit_scale, out=rows.shifted[:, :-1])
            rows.shifted[:, -1] = -rows.shift[-1]

    def set_weights(self, row_weight: Tensor, label_terms: Tensor) -> None:
        """The score-gradient weight of each partition's rows (n_parts x n_dims x R), for ``accumulate``, and the
        label's term (n_dims x R): its score gradient is ``-label_terms`` times partition 0's weight."""
        self.label_weight, self.label_terms = row_weight[0], label_terms
        for side, rows in (("a", self.anchor_rows), ("p", self.positive_rows)):
            rows.weight = row_weight[self.call.side_part[side]]
            if rows.half is not None:  # the half products weigh the tile instead
                continue
            if len(self.call.dims) == 1:
                rows.weighted = torch.mul(rows.x, rows.weight[0].unsqueeze(1), out=self._row_operand("weighted", rows))
            else:
                rows.weighted_shift = rows.weight * rows.shift

    def add_radial_rows(self, side_sums: dict[str, Tensor]) -> None:
        """The parts of the smaller dimensions' radial sums that need no tile: the shift's and the label's.

        A row's radial sum is ``sum_j dL/dcos_d[row, j] * cos_d[row, j]``, with ``cos = z / logit_scale`` and
        ``2^L' * z = 2^L' * L + shift * 2^L'`` for the shifted logit L (L' after the hardness penalty): the tiles
        give the sums of ``2^L' * L`` (``accumulate``); the shift's part is ``shift`` times the row's sum of terms,
        ``side_sums`` of the anchor rows' groups and of the positive rows' (n_dims x R). The label's term is
        ``-label_terms * z_pos`` times partition 0's weight, for the anchor row and for its label's column, the
        positive row.
        """
        scale = 1.0 / self.call.logit_scale
        label = (self.label_weight * self.label_terms * self.positive)[:-1]
        for side, rows in (("a", self.anchor_rows), ("p", self.positive_rows)):
            rows.radial[:-1].add_((rows.weighted_shift[:-1] * side_sums[side][:-1] - label) * scale)

    def tie_pairs(self, group: BoundGroup, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the entries of columns ``lo:hi`` that tie with theta (cols counted from ``lo``)."""
        if group.index not in self.ties:  # the whole group's, looked up once per row block
            n = group.n_cols
            self.ties[group.index] = group.cols.ties.pairs(self.rows_of(group).partner_ids, 0, n)
        return _within(*self.ties[group.index], lo, hi)

    def excluded(self, group: BoundGroup, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the entries of columns ``lo:hi`` that the group's rules exclude.

        Each row's own column where the group excludes it (``group.spec.excluded_offset``: self-pairs, own documents), and
        with ``mask_duplicates`` the columns whose text id is that of the row's anchor or of its positive (found
        like the ties, by binary search). A label or a kept pair among them is restored by the caller.
        """
        if group.index not in self.exclusions:  # the whole group's, once per row block
            parts = []
            if group.spec.excluded_offset is not None:
                parts.append(self.own(group.spec.excluded_offset, 0, group.n_cols))
            if self.texts is not None:
                n = group.n_cols
                parts += [group.cols.texts.pairs(text, 0, n) for text in self.texts]
            self.exclusions[group.index] = tuple(torch.cat(p) for p in zip(*parts)) if parts else (self.local[:0],) * 2
        return _within(*self.exclusions[group.index], lo, hi)

    def own(self, offset: int, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of each row's column ``offset + i`` among columns ``lo:hi`` (cols counted from ``lo``)."""
        return _within(self.local, self.local + (self.start + offset), lo, hi)

    def labels(self, group: BoundGroup, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the labels among columns ``lo:hi`` of ``group`` (none unless it is AP)."""
        if not group.spec.label:
            return self.local[:0], self.local[:0]
        return self.own(self.call.options.offset, lo, hi)

    def harden(self, group: BoundGroup, lo: int, hi: int, t: Tensor, m: int) -> Tensor:
        """Add the hardness penalty to dimension m's shifted logits ``t`` of a query-to-document tile, in place,
        where the group says.

        A penalised logit is ``factor`` times its plain value z (``_StreamingRun.hard_factor``); on the shifted logit
        ``L = z - shift`` that is ``factor * L + (factor - 1) * shift``. Masked entries stay far below the cutoff.
        """
        if not group.hard:
            return t
        factor = self.call.hard_factor
        own_rows, own_cols = self.own(self.call.options.offset, lo, hi)
        lift = ((factor - 1.0) * self.rows_of(group).shift[m]).unsqueeze(1)
        if group.spec.hard_others:
            plain = t[own_rows, own_cols]
            t.mul_(factor).add_(lift)
            if not group.spec.hard_own:
                t[own_rows, own_cols] = plain
        else:
            t[own_rows, own_cols] = t[own_rows, own_cols] * factor + lift[own_rows, 0]
        return t

    def masked_logits(self, group: BoundGroup, lo: int, hi: int, unmasked: Tensor | None = None) -> list[Tensor]:
        """Per dimension, the base-2 logits minus the shift (``set_shift``) against columns ``lo:hi``.

        Masked entries are pushed down by ``MASKED``, far below any logit and the subnormal cutoff. The label
        of row i (AP column ``offset + i``) is never masked, but its logit is carried apart (``self.positive``),
        so here it is pushed down too; DQ's pair is never masked. The hardness penalty is not applied
        here (``harden``). ``unmasked``, if given, gets each row's count of entries left (R): the
        statistics, taken on the first sweep only. The results are views of the workspace's term buffers.
        The mask is kept as 0.0 / 1.0 in the compute dtype, written where the logits will be: the first score
        product scales it by -MASKED as it adds (``beta`` of ``addmm_``), so masking costs one comparison. On
        CPUs a comparison into floats and a float sum run several times faster than a boolean mask,
        ``masked_fill`` and a boolean count.
        """
        call, dims, work = self.call, self.call.dims, self.call.work
        rows, cols = self.rows_of(group), group.cols
        shape = (rows.x.shape[0], hi - lo)
        # A smaller dimension's logits go where their products with the terms will be kept; the top
        # dimension's, where its terms will be (``exp2_`` in place).
        last = len(dims) - 1
        out = [work.terms(m, group.index, lo, shape, "terms" if m == last else "products") for m in range(len(dims))]
        # The mask is written where the top dimension's logits go; the first product scales it by -MASKED.
        prefix = out[-1]
        if call.guided:
            guide = work.view("guide", shape)
            if rows.guide_half is not None:  # exact half products, then both normalisations
                addmm_(guide, rows.guide_half.y, cols.guide_half.y[lo:hi].T, beta=0.0)
                guide.mul_(rows.guide_half.inv.unsqueeze(1)).mul_(cols.guide_half.inv[lo:hi].unsqueeze(0))
            else:
                torch.mm(rows.g, cols.g[lo:hi].T, out=guide)
            mask = guide_mask(guide, self.limit, self.theta_masked, self.tie_pairs(group, lo, hi), out=prefix)
        else:
            mask = prefix.zero_()
        excluded_rows, excluded_cols = self.excluded(group, lo, hi)
        mask[excluded_rows, excluded_cols] = 1.0
        if group.spec.unmasked_offset is not None:
            spared_rows, spared_cols = self.own(group.spec.unmasked_offset, lo, hi)
            mask[spared_rows, spared_cols] = 0.0
        label_rows, label_cols = self.labels(group, lo, hi)
        mask[label_rows, label_cols] = 1.0
        if unmasked is not None:
            masked = mask.sum(dim=1)
            # per row at most a tile's width, exact in floats; summed over the rows as integers
            call.count(f"masked_{group.name}", masked.sum(dtype=torch.int64) - label_rows.shape[0])
            unmasked += (hi - lo) - masked
        if rows.half is not None:  # one dimension: exact half products, then the normalisations, scale and shift
            addmm_(prefix, rows.half.y, cols.half.y[lo:hi].T, beta=-MASKED)
            prefix.mul_(cols.half.inv[lo:hi].unsqueeze(0))
            return [torch.addcmul(-rows.shift[-1].unsqueeze(1), prefix, (call.logit_scale * rows.half.inv).unsqueeze(1),
                                  out=prefix)]
        # The scale and the top dimension's shift ride on the products: [scale * x_hat, -shift] . [k_hat, 1]
        # over the last segment (all of it with one dimension). The top dimension's buffer holds the prefix
        # sums; each smaller dimension is taken from it, rescaled by its rho, when its segment is in.
        for m, (a, b) in enumerate(dims.segments):
            cols_part = cols.x1[lo:hi, a:] if m == last else cols.x[lo:hi, a:b]
            rows_part = rows.shifted[:, a:] if m == last else rows.shifted[:, a:b]
            prefix.addmm_(rows_part, cols_part.T, beta=-MASKED if m == 0 else 1.0)
            if m < last:  # logits = rho_row * (prefix * rho_col - shift / rho_row): two passes instead of three
                row_rho = rows.rho[m].unsqueeze(1)
                torch.addcmul(-rows.shift[m].unsqueeze(1) / row_rho, prefix, cols.rho[m, lo:hi].unsqueeze(0),
                              out=out[m]).mul_(row_rho)
        return out

    def terms(self, group: BoundGroup, lo: int, hi: int, unmasked: Tensor | None = None) -> list[Tensor]:
        """``2^(logit - shift)`` per dimension, the logit with its hardness penalty; 0 where masked, at the label,
        and below the subnormal cutoff.

        The top dimension's terms replace its logits. A smaller dimension's logits' buffer keeps each term
        times its shifted logit without the penalty (its radial sums in ``accumulate`` need the score; the top
        dimension's come from the gradient itself, ``_StreamingRun.gradients``).
        """
        *smaller, top = self.masked_logits(group, lo, hi, unmasked)
        out = []
        for m, t in enumerate(smaller):
            term = self.call.work.terms(m, group.index, lo, t.shape)
            if group.hard:
                # The penalised logits, in the terms' buffer, from the plain ones as they are: the cutoff applies to
                # the penalised logit, which a raised shift can lift far above a plain one below the cutoff.
                self.harden(group, lo, hi, term.copy_(t), m)
                torch.nn.functional.threshold_(term, self.call.cutoff, -MASKED)
                out.append(term.exp2_())
            else:
                torch.nn.functional.threshold_(t, self.call.cutoff, -MASKED)  # finite: 0 * logit stays 0
                out.append(torch.exp2(t, out=term))
            t.mul_(out[-1])
        self.harden(group, lo, hi, top, len(smaller))
        torch.nn.functional.threshold_(top, self.call.cutoff, float("-inf"))
        return [*out, top.exp2_()]

    def accumulate(self, group: BoundGroup, lo: int, hi: int, terms: list[Tensor]) -> None:
        """Add one tile's gradients, from its softmax ``terms``, into its rows' and columns' accumulators.

        dL/d cos_d = w_d * (softmax_d - onehot) / (P tau B) over the group's partition = ``row_weight[d]`` * terms
        (``set_weights``), the label's term being -label_terms_d (exact, where softmax - 1 would cancel). Per
        dimension the tile's weights on the prefix dot products are ``dL/dcos_d * rho_d,i * rho_d,j``; segment s
        takes their sum over d >= d_s.
        """
        rows, cols = self.rows_of(group), group.cols
        label_terms, row_weight = self.label_terms, rows.weight
        label_rows, label_cols = self.labels(group, lo, hi)
        if rows.half is not None:  # one dimension in half products: the softmax itself is the operand
            tile = terms[0]
            tile[label_rows, label_cols] = -label_terms[0, label_rows]
            # dL/dcos = grad_scale * tile / total: probabilities in [-1, 1] (the label's in [-P, 0], P <= 2)
            weights = self.call.work.half_tile(tile.shape, rows.half.x_hat.dtype)
            weights.copy_(tile.mul_((row_weight[0] / self.call.grad_scale).unsqueeze(1)))
            addmm_(rows.grad, weights, cols.half.x_hat[lo:hi], alpha=self.call.grad_scale)
            addmm_(cols.grad[lo:hi], weights.T, rows.half.x_hat, alpha=self.call.grad_scale)
            return
        if rows.radial is None:  # one dimension: the row weight is applied after the products
            tile = terms[0]
            tile[label_rows, label_cols] = -label_terms[0, label_rows]
            rows.grad.addcmul_(torch.mm(tile, cols.x[lo:hi], out=self.call.work.view("rows", rows.x.shape)),
                               row_weight[0].unsqueeze(1))
            cols.grad[lo:hi].addmm_(tile.T, rows.weighted)
            return
        inv_scale, last = 1.0 / self.call.logit_scale, len(terms) - 1
        summed = None
        for m in reversed(range(len(terms))):
            tile = terms[m]
            if m < last:
                # The tile's parts of a smaller dimension's radial sums (``add_radial_rows``): by rows, the sums
                # of 2^L * L; by columns, those weighted by the rows plus the shift's part. 0 where masked and
                # at the label.
                products = self.call.work.terms(m, group.index, lo, tile.shape, "products")  # 2^L' * L, ``terms``
                rows.radial[m] += row_weight[m] * products.sum(dim=1) * inv_scale
                by_cols = torch.addmv(products.T @ row_weight[m], tile.T, rows.weighted_shift[m])
                cols.radial[m, lo:hi].add_(by_cols, alpha=inv_scale)
                del products
            tile[label_rows, label_cols] = -label_terms[m, label_rows]
            weights = tile.mul_((row_weight[m] * rows.rho[m]).unsqueeze(1))  # times the columns' rho_d
            if summed is None:  # the top dimension, whose rho is 1
                summed = weights
            else:
                summed.addcmul_(weights, cols.rho[m, lo:hi].unsqueeze(0))
            a, b = self.call.dims.segments[m]
            rows.grad[:, a:b].addmm_(summed, cols.x[lo:hi, a:b])
            cols.grad[lo:hi, a:b].addmm_(summed.T, rows.x[:, a:b])


def _within(rows: Tensor, cols: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """The ``(rows, cols)`` pairs with a column in ``lo:hi``, columns counted from ``lo``."""
    inside = (cols >= lo) & (cols < hi)
    return rows[inside], cols[inside] - lo


def _tiles(call: _StreamingRun, cols: int) -> list[tuple[BoundGroup, int, int]]:
    """Every tile of a row block, as ``(group, lo, hi)``: each group's columns in ranges ``cols`` wide."""
    return [(g, lo, min(lo + cols, g.n_cols)) for g in call.groups for lo in range(0, g.n_cols, cols)]


def _sweep(call: _StreamingRun, rb: _RowBlock, cols: int, shift: Tensor, hold: bool, count: bool):
    """Row sums of the softmax terms of every tile per partition (n_parts x n_dims x R), shifted by the partition's
    ``shift``, those of each row side's groups (``"a"``, ``"p"``: n_dims x R each), and the tiles themselves if
    ``hold`` (one pass: the gradients reuse them)."""
    rb.set_shift(shift)
    others = torch.zeros_like(shift)
    side_sums = {"a": torch.zeros_like(shift[0]), "p": torch.zeros_like(shift[0])}
    unmasked = torch.zeros_like(shift[0, 0]) if count else None
    tiles = []
    for g, lo, hi in _tiles(call, cols):
        terms = rb.terms(g, lo, hi, unmasked)
        sums = torch.stack([t.sum(dim=1) for t in terms])
        others[g.spec.part] += sums
        side_sums[g.spec.row] += sums
        if hold:
            tiles.append((g, lo, hi, terms))
    if count:
        call.count("positive_only", (unmasked == 0).sum())
    return others, side_sums, tiles


def _row_block(call: _StreamingRun, rb: _RowBlock, schedule: RowBlocks) -> Tensor:
    """Weighted loss sum of one row block; accumulates its gradients when they are wanted.

    In one pass the tiles against all columns are kept from the sums to the gradients; in two passes they
    are recomputed for the gradients. Logits are shifted by the positive's, so that the positive's term is
    1 and the loss is usually log1p of the others' sum. Only when a sum exceeds ``2^64`` (a candidate
    64 base-2 units above the positive; its products with the logits or the embeddings could overflow
    further on) is the shift raised to the row maximum, found by one more sweep, and the sums taken again. The
    partitioned loss and the gradients' weights follow from the sums (``cgist.stage.spec.problem``).
    """
    one_pass, want_grads, cols = schedule.one_pass, call.columns[0].grad is not None, schedule.cols
    n_parts = call.n_parts
    shift = rb.positive.expand(n_parts, *rb.positive.shape)
    others, side_sums, tiles = _sweep(call, rb, cols, shift, hold=one_pass and want_grads,
                                      count=call.counters is not None)
    if not bool((others <= LARGEST_SUM).all()):  # also catches inf and NaN
        peak = torch.zeros_like(shift)
        for g, lo, hi in _tiles(call, cols):
            for m, logits in enumerate(rb.masked_logits(g, lo, hi)):
                part = peak[g.spec.part, m]
                torch.maximum(part, rb.harden(g, lo, hi, logits, m).amax(dim=1), out=part)
        shift = shift + peak
        others, side_sums, tiles = _sweep(call, rb, cols, shift, hold=one_pass and want_grads, count=False)
    gaps = (shift - rb.positive) * LN2
    weights = torch.tensor(call.dims.weights, dtype=shift.dtype, device=shift.device).unsqueeze(1)
    loss = (weights * row_losses(gaps, others)).sum()
    if want_grads:
        denominators = totals(others, torch.exp(-gaps[0]))
        rb.set_weights(row_weights(weights, call.grad_scale, denominators), label_terms(others, denominators))
        if len(call.dims) > 1:
            rb.add_radial_rows(side_sums)
        if not one_pass:
            tiles = ((g, lo, hi, rb.terms(g, lo, hi)) for g, lo, hi in _tiles(call, cols))
        for g, lo, hi, terms in tiles:
            rb.accumulate(g, lo, hi, terms)
    return loss


def _run(embeddings, guide_embeddings, options, need_grads, need_stats, text_ids, products=None, want_share=False):
    """``forward``'s work on the columns (each a tensor or its row chunks): the loss (float64 for float64 inputs, else
    float32), the gradients if ``need_grads`` (one per column, in its dtype), the counters if ``need_stats``
    (``(counts, sums)``: ``cgist.stage.stats.COUNT_FIELDS``, ``SUM_FIELDS``), and with ``want_share`` the sum of
    ``dL/ds * s`` over every score. ``products``: the half dtypes of the student's and the guide's score products
    (None: ``half_products`` picks them for the device)."""
    if products is None:
        device = row_chunks(embeddings[0])[0].device
        products = tuple(None if c is None else half_products(device, row_chunks(c[0])[0].dtype)
                         for c in (embeddings, guide_embeddings))
    call = _StreamingRun(embeddings, guide_embeddings, options, need_grads, need_stats, products, text_ids)
    call.want_share = want_share and need_grads
    schedule = call.schedule
    loss = torch.zeros((), dtype=call.dtype, device=call.columns[0].x.device)
    for start in range(0, call.batch, schedule.rows):
        loss += _row_block(call, _RowBlock(call, start, min(start + schedule.rows, call.batch)), schedule)
    loss = loss / call.batch
    grads = call.gradients(embeddings) if need_grads else None
    return loss, grads, call.counters, (call.temperature_share if need_grads else None)


@torch.no_grad()
def forward(call: DenseCall, with_grad: bool, need_stats: bool = False,
            products: tuple[torch.dtype | None, torch.dtype | None] | None = None,
            ) -> tuple[Tensor, Grads | None, object]:
    """The backend contract's forward: the loss, the gradients (made here ``with_grad``, one per chunk of the call's
    columns, the learned temperature's included) and the guide's counters. ``products``: the half dtypes of the
    student's and the guide's score products (None: ``half_products`` picks them for the device; tests force them
    on a CPU)."""
    loss, grads, counters, radial = _run(call.columns, call.guide, call.options, with_grad, need_stats,
                                         call.text_ids, products, want_share=call.temperature is not None)
    return loss, call.grads(call.split(grads), radial) if with_grad else None, counters
