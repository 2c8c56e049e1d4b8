"""The dense score on the Triton backend (``similarity`` ``"cos"`` or ``"dot"``): the launchers of the GIST kernels,
tensors in, tensors out (no autograd, no nn), and the backend contract, ``forward`` and ``backward``
(docs/design.md#dispatch).

``forward`` has the semantics of ``cgist.stage.pytorch.dense.forward`` (``cgist.stage.dispatch.direct.loss_and_grads``
runs either on raw columns); ``gist_forward`` and ``gist_backward`` are its two halves (benchmarks time them apart,
and time the launches of one column group with ``forward_group`` / ``BackwardWork``). It launches the kernels of
``cgist.kernels.gist`` once per column group (``GistOptions.column_groups``: GIST's AP, AA, PP, AN_1..AN_k, then the
directions' QQ, DQ, DD, DN_1..DN_k):

* forward: the AP launch stores theta, the threshold, the flag ``theta_i > T_i``, the positive logits
  and the first running max/sum of each row (one row of state per Matryoshka dimension); the other
  groups fold into that state. Guide ties are decided by identity: equal texts (the text ids, when given) or
  else equal normalised guide rows get equal int32 ids (``cgist.stage.ties.tie_ids``), and each launch reads the ids
  of its columns and of
  its rows' partners. The label is kept out of the running sum ``l`` (base 2, shifted by the running
  max ``m``, which starts at the positive logit ``pos``), so each row's loss is
  ``(m - pos) ln 2 + log1p(l + expm1((pos - m) ln 2))``: a small loss keeps its relative precision.
  With ``need_stats`` the forward also counts the guide's mask in per-row int32 counters, reduced once.
* backward: for each chunk of a group (rows x columns sized by the byte budget ``options.block_bytes``),
  ``gist_score_grad_kernel`` recomputes the chunk's tiles with the forward's code and tile config (so the masks
  are bit-identical) and writes the score gradient with both inverse norms folded in, ``F = dL/dcos * rq * rk``,
  as a GEMM operand (the student's dtype; fp32 at the default matmul precision as a tf32 pair for a tf32x3
  product). Then ``dq_raw += F @ k_raw`` and ``dk_raw += F^T @ q_raw`` are GEMMs in a fixed order, so the sums are
  deterministic without atomics: ``torch``'s (cuBLAS on a GPU), or for tf32x3 ``cgist.kernels.gemm``'s. With
  Matryoshka dimensions there is one operand per segment between consecutive dimensions, and the GEMMs cover each
  segment once. It ends in the normalisation backward (``cgist.stage.spec.problem.normalization_backward_``) on the
  summed products ``h``. The fused backward (row and column passes) was removed after commit e096582; history keeps
  it.

fp32 products: ``torch.get_float32_matmul_precision()`` "highest" runs every product of the loss stage
as tf32x3 (three tf32 tensor-core products of a high/low split, see ``split_tf32``): in the kernels, and in the
backward GEMMs through ``tf32x3_addmm_``, whose kernel sets its own precision, so no process-wide setting changes.
"high" and "medium" run plain tf32, as ``torch.mm`` does.

At run time this module imports only torch, triton, the kernels (``cgist.kernels``), the tile configs (``tiles``) and
the leaf modules ``cgist.stage.numerics`` (normalisation, half-precision products), ``cgist.stage.ties`` (tie ids),
``cgist.stage.budget`` (the chunks), ``cgist.stage.stats`` (the counters' layout), ``cgist.stage.spec.problem`` (the
bound column groups, the dimensions, how each row's softmax ends) and ``cgist.stage.devices`` (the architecture); the
options arrive as a ``cgist.GistOptions``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
from torch import Tensor

from cgist.kernels.gemm import tf32x3_addmm_kernel
from cgist.kernels.gist import (
    RULE_EXCLUDED,
    RULE_GUIDED,
    RULE_HARD_OTHERS,
    RULE_HARD_OWN,
    RULE_LABEL,
    RULE_TEXTS,
    RULE_UNMASKED,
    gist_score_grad_kernel,
    pack_scalars,
)
from cgist.stage.budget import Chunks, backward_chunks
from cgist.stage.devices import launch_context
from cgist.stage.numerics import EPS, addmm_, compute_dtype, row_dots, stack_rows
from cgist.stage.spec.call import Grads
from cgist.stage.spec.dense import DenseCall
from cgist.stage.spec.problem import (
    BoundGroup,
    Dims,
    bind_groups,
    label_terms,
    normalization_backward_,
    prefix_norms,
    row_losses,
    row_weights,
    totals,
)
from cgist.stage.stats import BLOCKS
from cgist.stage.ties import tie_ids

from .common import TL_DTYPES, arch_of, device_constant, input_precision
from .tiles import gemm_configs, tuned_fwd_kernel

if TYPE_CHECKING:
    from cgist.stage.spec.options import GistOptions

__all__ = [
    "BackwardWork", "ForwardState", "forward", "forward_group", "gist_backward", "gist_forward", "split_tf32",
    "tf32x3_addmm_",
]

LN2 = math.log(2.0)
#: Counter rows of the forward: masked entries per statistics block, then the entries left unmasked, the label aside.
_COUNTER_ROW = {name: row for row, name in enumerate(BLOCKS)}
_LEFT_ROW = len(_COUNTER_ROW)


def split_tf32(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 ``x`` as ``(high, low)``: ``high`` rounded to tf32 (10 mantissa bits, ties to even), ``low = x - high``.

    ``low`` is exact in fp32. A tf32x3 product ``a @ b ~ ah @ bh + ah @ bl + al @ bh`` on tf32 tensor
    cores (which round ``bl`` and ``al`` to tf32 again) differs from the exact product by at most
    ``5 u^2 sum_k |a_k b_k|`` per entry with u = 2^-11, beside the fp32 accumulation of the three
    products (docs/design.md#numerics). The Triton kernels round with the same arithmetic.
    """
    bits = x.contiguous().view(torch.int32)
    high = ((bits + (((bits >> 13) & 1) + 0xFFF)) & -8192).view(torch.float32)
    return high, x - high


def tf32x3_addmm_(out: Tensor, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> None:
    """``out += a @ b`` (fp32) for fp32 operands given as tf32 splits ``(high, low)`` (``split_tf32``): the three tf32
    tensor-core products ``al @ bh + ah @ bl + ah @ bh`` in one fp32 accumulator, by ``cgist.kernels.gemm``'s kernel
    with the tile config of ``tiles.gemm_configs``. The high and the low part of an operand share their strides."""
    (a_hi, a_lo), (b_hi, b_lo) = a, b
    if a_hi.stride() != a_lo.stride() or b_hi.stride() != b_lo.stride():
        raise ValueError("the high and the low part of a tf32 split must share their strides")
    (m, k), n = a_hi.shape, b_hi.shape[1]
    config = gemm_configs(arch_of(out.device))[0]
    grid = (triton.cdiv(m, config.kwargs["BLOCK_M"]), triton.cdiv(n, config.kwargs["BLOCK_N"]))
    with launch_context(out.device):
        tf32x3_addmm_kernel[grid](
            out, a_hi, a_lo, b_hi, b_lo, m, n, k, out.stride(0), out.stride(1), a_hi.stride(0), a_hi.stride(1),
            b_hi.stride(0), b_hi.stride(1), num_warps=config.num_warps, num_stages=config.num_stages,
            **config.kwargs,
        )


def _gemm_acc(out: Tensor, a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> None:
    """``out += a @ b`` for operands given as ``(x,)`` (``cgist.stage.numerics.addmm_``: torch's product at its
    matmul precision, accumulated in ``out``'s dtype) or as a tf32 split ``(high, low)`` (``tf32x3_addmm_``)."""
    if len(a) == 1:
        addmm_(out, a[0], b[0])
    else:
        tf32x3_addmm_(out, a, b)


def _rows_contiguous(x: Tensor) -> Tensor:
    """``x`` with a contiguous feature dimension, so that a row stride alone addresses it."""
    return x if x.stride(1) == 1 else x.contiguous()


@dataclass
class _KernelColumn:
    """One column's student and guide vectors, with their inverse norms and guide tie ids, or some of its rows."""

    x: Tensor
    g: Tensor  # without a guide, ``x`` (a pointer the kernels do not read)
    rx: Tensor  # inverse prefix norm of each row per dimension, ascending (n_dims x rows)
    rg: Tensor
    ids: Tensor  # int32 tie id of each guide row
    text: Tensor  # int32 text id of each row (mask_duplicates), or the tie ids (not read)
    grad: int  # index of the embedding whose gradient this column feeds
    start: int = 0  # first row of that embedding

    def rows(self, start: int, stop: int) -> _KernelColumn:
        return _KernelColumn(self.x[start:stop], self.g[start:stop], self.rx[:, start:stop], self.rg[start:stop],
                       self.ids[start:stop], self.text[start:stop], self.grad, start)


def _rows(group: BoundGroup[_KernelColumn], batch: int) -> _KernelColumn:
    """The B rows of ``group``: the anchors, or their positives from ``offset``."""
    return group.rows.rows(group.row_start, group.row_start + batch)


def _kernel_args(state: ForwardState, group: BoundGroup[_KernelColumn]) -> dict:
    """The keyword arguments the kernels share, for this column group (its partition's state)."""
    rows, cols, spec = _rows(group, state.batch), group.cols, group.spec
    rules = (RULE_LABEL * spec.label | RULE_GUIDED * state.guided | RULE_EXCLUDED * (spec.excluded_offset is not None)
             | RULE_TEXTS * state.options.mask_duplicates | RULE_UNMASKED * (spec.unmasked_offset is not None)
             | RULE_HARD_OWN * spec.hard_own | RULE_HARD_OTHERS * spec.hard_others)
    return dict(
        q_ptr=rows.x, qg_ptr=rows.g, k_ptr=cols.x, kg_ptr=cols.g,
        rq_ptr=rows.rx, rqg_ptr=rows.rg, rk_ptr=cols.rx, rkg_ptr=cols.rg,
        col_id_ptr=cols.ids, partner_id_ptr=group.partner.ids, thr_ptr=state.thr, theta_masked_ptr=state.theta_masked,
        col_text_ptr=cols.text, row_text_ptr=state.row_texts, stride_text=state.row_texts.stride(0),
        m_ptr=state.run_max[spec.part], l_ptr=state.run_sum[spec.part], scalars_ptr=state.scalars,
        dim=state.dims.top, dim_g=rows.g.shape[1] if state.guided else 0, offset=state.offset,
        partner_start=group.partner_start, excluded_offset=spec.excluded_offset or 0,
        unmasked_offset=spec.unmasked_offset or 0, stride_q=rows.x.stride(0), stride_qg=rows.g.stride(0),
        stride_k=cols.x.stride(0), stride_kg=cols.g.stride(0), rules=rules,
    )


@dataclass
class ForwardState:
    """What the backward needs from the forward: the column groups, the per-row state and the tile config."""

    options: GistOptions
    embeddings: list[Tensor]
    columns: list[_KernelColumn]
    norms: list[Tensor]  # prefix norms of each embedding per dimension (n_dims x rows)
    groups: list[BoundGroup[_KernelColumn]]
    dims: Dims
    weights: Tensor  # the dimensions' weights (n_dims x 1)
    dims_tensor: Tensor  # int32 dims on the device, for the kernels
    thr: Tensor
    theta: Tensor
    theta_masked: Tensor
    pos: Tensor  # base-2 positive logit of each row, per dimension (n_dims x B)
    run_max: Tensor  # running max m (at least the positive), per partition (n_parts x n_dims x B)
    run_sum: Tensor  # sum of 2^(z - m) over the unmasked entries other than the label, per partition
    counts: Tensor  # int32 counters (masked per statistics block, then the entries left) x B
    scalars: Tensor
    flags: dict
    guided: bool = True  # False: no guide masking (the guide pointers are not read)
    row_texts: Tensor | None = None  # (2, B) int32: the text ids of anchor i and of its positive (mask_duplicates)
    tiles: dict | None = None

    @property
    def offset(self) -> int:
        return self.options.offset

    @property
    def batch(self) -> int:
        return self.pos.shape[1]

    def loss(self) -> Tensor:
        """The weighted mean over rows of each row's loss (``cgist.stage.spec.problem.row_losses``), 0-dim."""
        return (self.weights * row_losses((self.run_max - self.pos) * LN2, self.run_sum)).sum() / self.batch

    def gradient_weights(self) -> tuple[Tensor, Tensor]:
        """Each partition's row weights (n_parts x n_dims x B) and the label's term (n_dims x B), from the
        partitions' softmax denominators over ``2^m`` (``cgist.stage.spec.problem``)."""
        denominators = totals(self.run_sum, torch.exp2(self.pos - self.run_max[0]))
        scale = 1.0 / (self.options.temperature * self.batch)
        return row_weights(self.weights, scale, denominators), label_terms(self.run_sum, denominators)

    def counters(self) -> tuple[Tensor, Tensor]:
        """The mask counters: int64 counts (``cgist.stage.stats.COUNT_FIELDS``) and the sums of theta and T_i."""
        counts = self.counts.sum(dim=1, dtype=torch.int64)
        positive_only = (self.counts[_LEFT_ROW] == 0).sum()
        return torch.cat([counts[:_LEFT_ROW], positive_only[None]]), torch.stack([self.theta.sum(), self.thr.sum()])


def _guide_operands(guide_embeddings: Sequence[Tensor] | None, embeddings: list[Tensor], inverse: list[Tensor],
                    acc: torch.dtype, text_ids: Sequence[Tensor] | None) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The guide's rows as the kernels read them, their inverse norms and their tie ids (the text ids when given,
    ``cgist.stage.ties.tie_ids``). Without a guide, the
    student's rows and all-zero ids (pointers the kernels do not read), so a call without a guide runs the same
    binaries."""
    if guide_embeddings is None:
        ids = [torch.zeros(x.shape[0], dtype=torch.int32, device=x.device) for x in embeddings]
        return embeddings, [r[-1] for r in inverse], ids
    guide_embeddings = [stack_rows(g) for g in guide_embeddings]
    guide_dtype = guide_embeddings[0].dtype
    if acc == torch.float64 or guide_dtype == torch.float64:
        guide_dtype = acc  # tl.dot needs both operands, and the accumulator, to agree on float64
    guide_embeddings = [_rows_contiguous(g.to(guide_dtype)) for g in guide_embeddings]
    guide_inverse = [1.0 / torch.linalg.vector_norm(g, dim=1, dtype=acc).clamp_min(EPS) for g in guide_embeddings]
    # The text ids, or fingerprints of the normalised guide rows, as the oracle and the streaming path take them.
    return guide_embeddings, guide_inverse, tie_ids(guide_embeddings, acc, text_ids=text_ids)


@torch.no_grad()
def prepare_forward(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions,
    need_stats: bool = False, text_ids: Sequence[Tensor] | None = None,
) -> ForwardState:
    """Norms, tie ids, the bound column groups (``cgist.stage.spec.problem.bind_groups``) and the per-row buffers of one call;
    launches nothing."""
    embeddings = [_rows_contiguous(stack_rows(x)) for x in embeddings]
    acc, device, batch = compute_dtype(embeddings[0].dtype), embeddings[0].device, embeddings[0].shape[0]
    dims = Dims.of(options, embeddings[0].shape[1])
    norms = [prefix_norms(x, dims.sizes, acc) for x in embeddings]
    # Dot products: no normalisation, every inverse norm 1 (and no radial term in ``gradients``).
    inverse = [torch.ones_like(n) if options.similarity == "dot" else 1.0 / n.clamp_min(EPS) for n in norms]
    guide, guide_inverse, ids = _guide_operands(guide_embeddings, embeddings, inverse, acc, text_ids)
    texts = text_ids if options.mask_duplicates else ids
    columns = [_KernelColumn(*parts, i) for i, parts in enumerate(zip(embeddings, guide, inverse, guide_inverse, ids, texts))]
    groups, n_parts, _ = bind_groups(options, columns, [x.shape[0] for x in embeddings])
    # Each row's two texts, whatever the group: its anchor's and its positive's.
    row_texts = torch.stack([columns[0].text, columns[1].text[options.offset : options.offset + batch]])
    n_dims = len(dims)
    return ForwardState(
        options=options, embeddings=embeddings, columns=columns, norms=norms, groups=groups, dims=dims,
        weights=device_constant(dims.weights, acc, device).unsqueeze(1),
        dims_tensor=device_constant(dims.sizes, torch.int32, device),
        thr=torch.empty(batch, dtype=acc, device=device), theta=torch.empty(batch, dtype=acc, device=device),
        theta_masked=torch.empty(batch, dtype=torch.int8, device=device),
        pos=torch.empty(n_dims, batch, dtype=acc, device=device),
        run_max=torch.empty(n_parts, n_dims, batch, dtype=acc, device=device),
        run_sum=torch.empty(n_parts, n_dims, batch, dtype=acc, device=device),
        counts=(torch.zeros if need_stats else torch.empty)(len(_COUNTER_ROW) + 1, batch, dtype=torch.int32,
                                                            device=device),
        scalars=device_constant(pack_scalars(options.temperature, options.margin, options.hardness), acc, device),
        flags=dict(ACC=TL_DTYPES[acc], PRECISION=input_precision(embeddings[0].dtype, arch_of(device)),
                   PRECISION_G=input_precision(guide[0].dtype, arch_of(device)), N_DIMS=n_dims),
        guided=guide_embeddings is not None, row_texts=row_texts,
    )


def forward_group(state: ForwardState, group: BoundGroup[_KernelColumn], count: bool = False) -> None:
    """Launch the forward row pass of one group (the AP group first); records the autotuner's pick."""
    batch = state.batch
    fwd = tuned_fwd_kernel(arch_of(state.pos.device))
    with launch_context(state.pos.device):
        fwd[lambda meta: (triton.cdiv(batch, meta["BLOCK_M"]),)](
            **_kernel_args(state, group), dims_ptr=state.dims_tensor, theta_ptr=state.theta, pos_ptr=state.pos,
            masked_ptr=state.counts[_COUNTER_ROW[group.name]], left_ptr=state.counts[_LEFT_ROW],
            n_rows=state.batch, n_cols=group.n_cols,
            stride_rq=group.rows.rx.stride(0), stride_rk=group.cols.rx.stride(0), stride_state=batch,
            b_bucket=triton.next_power_of_2(batch), n_bucket=triton.next_power_of_2(state.groups[0].n_cols),
            relative=int(state.options.relative), count=int(count),
            DIMS_P2=triton.next_power_of_2(len(state.dims)), **state.flags,
        )
    config = fwd.best_config
    state.tiles = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


@torch.no_grad()
def gist_forward(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions,
    need_stats: bool = False, text_ids: Sequence[Tensor] | None = None,
) -> tuple[Tensor, ForwardState]:
    """The loss (0-dim, float64 for float64 inputs else float32) and the state ``gist_backward`` needs."""
    state = prepare_forward(embeddings, guide_embeddings, options, need_stats, text_ids)
    for i, group in enumerate(state.groups):
        forward_group(state, group, count=need_stats)
        if i == 0:  # AP, first, seeded partition 0 with the positive logits; the other partitions start there too
            state.run_max[1:] = state.pos
            state.run_sum[1:] = 0.0
    return state.loss(), state


class BackwardWork:
    """The buffers of one backward: summed products ``h`` and radial sums per embedding, and the chunk operands.

    ``run()`` computes everything; ``gemm_group`` does one group (benchmarks).
    """

    def __init__(self, state: ForwardState, block_bytes: int | None = None) -> None:
        self.state = state
        acc = state.pos.dtype
        device = state.pos.device
        self.h = [torch.zeros(x.shape, dtype=acc, device=device) for x in state.embeddings]
        n_dims = len(state.dims)
        self.radial = [torch.zeros(n_dims, x.shape[0], dtype=acc, device=device) for x in state.embeddings] \
            if n_dims > 1 else None
        self.row_weight, self.label_terms = state.gradient_weights()
        self.split = state.flags["PRECISION"] == "tf32x3"
        self.block_bytes = state.options.block_bytes if block_bytes is None else block_bytes
        self._operands = None
        self._buffers = None
        self.want_share = False  # keep ``temperature_share``, the sum of dL/ds * s over every score (``gradients``)
        self.temperature_share = None

    def operands(self) -> list[tuple[Tensor, ...]]:
        """Each embedding's first ``top`` columns as GEMM operands: ``(x,)``, or its tf32 split for tf32x3."""
        if self._operands is None:
            top = self.state.dims.top
            xs = [x[:, :top] for x in self.state.embeddings]
            self._operands = [split_tf32(x) if self.split else (x,) for x in xs]
        return self._operands

    def buffers(self) -> tuple[Chunks, Tensor, Tensor, Tensor]:
        """The chunk shape, the operand buffer (segment, part, row, col) and the radial partial sums."""
        if self._buffers is None:
            state = self.state
            x = state.embeddings[0]
            parts = 2 if self.split else 1
            widest = max(g.n_cols for g in state.groups)
            n_dims = len(state.dims)
            acc_bytes = state.pos.element_size()
            chunks = backward_chunks(state.batch, widest, state.tiles, n_dims, parts * x.element_size(), acc_bytes,
                              self.block_bytes, x.device, (2**31 - 1) // (n_dims * parts))
            f = torch.empty(n_dims, parts, chunks.rows, chunks.cols, dtype=x.dtype, device=x.device)
            bm, bn = state.tiles["BLOCK_M"], state.tiles["BLOCK_N"]
            if n_dims > 1:
                row_part = torch.empty(n_dims, triton.cdiv(chunks.cols, bn), chunks.rows, dtype=state.pos.dtype,
                                       device=x.device)
                col_part = torch.empty(n_dims, triton.cdiv(chunks.rows, bm), chunks.cols, dtype=state.pos.dtype,
                                       device=x.device)
            else:
                row_part = col_part = state.pos  # not read
            self._buffers = chunks, f, row_part, col_part
        return self._buffers

    def kernel_args(self, group: BoundGroup[_KernelColumn]) -> dict:
        """The group's kernel arguments with its partition's row weights and, read at the label only, the label's
        term (``ForwardState.gradient_weights``) in place of the running sum."""
        return dict(_kernel_args(self.state, group), rw_ptr=self.row_weight[group.spec.part], l_ptr=self.label_terms)

    def score_grad_chunk(self, group: BoundGroup[_KernelColumn], r0: int, r1: int, c0: int, c1: int) -> None:
        """Launch the score-gradient kernel for rows r0:r1 and columns c0:c1 of ``group``."""
        state = self.state
        _, f, row_part, col_part = self.buffers()
        tiles = state.tiles
        grid = (triton.cdiv(r1 - r0, tiles["BLOCK_M"]), triton.cdiv(c1 - c0, tiles["BLOCK_N"]))
        with launch_context(f.device):
            gist_score_grad_kernel[grid](
                **self.kernel_args(group), dims_ptr=state.dims_tensor, f_ptr=f, row_part_ptr=row_part,
                col_part_ptr=col_part, row_stop=r1, col_stop=c1, row_start=r0, col_start=c0,
                stride_rq=group.rows.rx.stride(0), stride_rk=group.cols.rx.stride(0), stride_state=state.batch,
                stride_f_seg=f.stride(0), stride_f_part=f.stride(1), stride_f_row=f.stride(2),
                stride_rp_dim=row_part.stride(0), stride_rp_tile=row_part.stride(1) if row_part.dim() == 3 else 0,
                stride_cp_dim=col_part.stride(0), stride_cp_tile=col_part.stride(1) if col_part.dim() == 3 else 0,
                SPLIT=self.split, **state.flags, **tiles,
            )

    def chunk_gemms(self, group: BoundGroup[_KernelColumn], r0: int, r1: int, c0: int, c1: int) -> None:
        """Add the products of the chunk's operands (left by ``score_grad_chunk``) into ``h`` and the radial sums."""
        state = self.state
        _, f, row_part, col_part = self.buffers()
        rows, cols = _rows(group, state.batch), group.cols
        operands = self.operands()
        row_x = tuple(t[rows.start + r0 : rows.start + r1] for t in operands[rows.grad])
        col_x = tuple(t[c0:c1] for t in operands[cols.grad])
        h_rows = self.h[rows.grad][rows.start + r0 : rows.start + r1]
        h_cols = self.h[cols.grad][c0:c1]
        for s, (lo, hi) in enumerate(state.dims.segments):
            operand = tuple(f[s, p, : r1 - r0, : c1 - c0] for p in range(f.shape[1]))
            _gemm_acc(h_rows[:, lo:hi], operand, tuple(t[:, lo:hi] for t in col_x))
            _gemm_acc(h_cols[:, lo:hi], tuple(t.T for t in operand), tuple(t[:, lo:hi] for t in row_x))
        if self.radial is not None:
            bm, bn = state.tiles["BLOCK_M"], state.tiles["BLOCK_N"]
            n_col_tiles, n_row_tiles = triton.cdiv(c1 - c0, bn), triton.cdiv(r1 - r0, bm)
            self.radial[rows.grad][:, rows.start + r0 : rows.start + r1] += row_part[:, :n_col_tiles, : r1 - r0].sum(1)
            self.radial[cols.grad][:, c0:c1] += col_part[:, :n_row_tiles, : c1 - c0].sum(1)

    def chunks(self, group: BoundGroup[_KernelColumn]) -> list[tuple[int, int, int, int]]:
        """The chunks ``(r0, r1, c0, c1)`` of ``group``, in their fixed order."""
        shape = self.buffers()[0]
        n_rows, n_cols = self.state.batch, group.n_cols
        return [(r0, min(r0 + shape.rows, n_rows), c0, min(c0 + shape.cols, n_cols))
                for r0 in range(0, n_rows, shape.rows) for c0 in range(0, n_cols, shape.cols)]

    def gemm_group(self, group: BoundGroup[_KernelColumn]) -> None:
        for chunk in self.chunks(group):
            self.score_grad_chunk(group, *chunk)
            self.chunk_gemms(group, *chunk)

    def run(self) -> list[Tensor]:
        for group in self.state.groups:
            self.gemm_group(group)
        return self.gradients()

    def gradients(self) -> list[Tensor]:
        """Through the normalisation (``cgist.stage.spec.problem.normalization_backward_`` on the raw rows, ``kappa_u = r_u^2``,
        0 where ``||x[:d_u]|| < eps``), in each embedding's dtype. Past ``top``, ``h`` is 0 and stays 0."""
        state, top = self.state, self.state.dims.top
        out = []
        self.temperature_share = None
        for i, (x, column, norm, h) in enumerate(zip(state.embeddings, state.columns, state.norms, self.h)):
            if self.want_share:  # x . h sums dL/dcos * cos over the row's scores; each score has two sides
                share = row_dots(x[:, :top].to(h.dtype), h[:, :top]).sum() / 2
                self.temperature_share = share if self.temperature_share is None else self.temperature_share + share
            if state.options.similarity != "dot":  # dot products have no normalisation to pass through
                kappa = (column.rx**2).masked_fill_(norm < EPS, 0.0)
                radial = None if self.radial is None else self.radial[i]
                normalization_backward_(h[:, :top], x[:, :top].to(h.dtype), kappa, radial, state.dims.segments)
            out.append(h.to(x.dtype))
        return out


@torch.no_grad()
def gist_backward(state: ForwardState, *, block_bytes: int | None = None) -> list[Tensor]:
    """d(loss)/d(embeddings), each in its embedding's dtype, from the forward's state (chunk operands and library
    GEMMs). ``block_bytes`` overrides ``options.block_bytes`` for the chunks."""
    return BackwardWork(state, block_bytes).run()


# The backend contract (docs/design.md#dispatch) ------------------------------------------------------------------


def forward(call: DenseCall, with_grad: bool, need_stats: bool = False) -> tuple[Tensor, Grads | None, object]:
    """The backend contract's forward: the loss, the gradients (made here ``with_grad`` as GradCache needs them at
    once, one per chunk of the call's columns, the learned temperature's included) and the guide's counters
    (``need_stats``)."""
    loss, state = gist_forward(call.columns, call.guide, call.options, need_stats, text_ids=call.text_ids)
    grads = None
    if with_grad:
        work = BackwardWork(state)
        work.want_share = call.temperature is not None
        grads = call.grads(call.split(work.run()), work.temperature_share)
    return loss, grads, (state.counters() if need_stats else None)
