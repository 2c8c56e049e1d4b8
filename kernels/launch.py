"""Launchers for the GIST kernels: tensors in, tensors out (no autograd, no nn).

``gist_loss_and_grads`` has the signature and semantics of ``cgist.streaming.gist_loss_and_grads``;
``gist_forward`` and ``gist_backward`` are its two halves (benchmarks time them apart). It launches
the kernels of ``gist.py`` once per score block, in the order AP, AA, PP, AN_1..AN_k:

* forward: the AP launch stores the threshold, the flag ``theta_i > T_i``, the positive logit and the
  first running max/sum of each row; the other blocks fold into that state. Guide ties are decided by
  identity: equal normalised guide rows get equal int32 ids (``cgist.numerics.tie_ids``), and each
  launch reads the ids of its columns and of its rows' partners. The label is kept out of the running
  sum ``l`` (base 2, shifted by the running max ``m``, which starts at the positive logit ``z_pos``), so
  each row's loss is ``(m - z_pos) ln 2 + log1p(l + expm1((z_pos - m) ln 2))``: a small loss keeps its
  relative precision instead of inheriting the rounding of a logit near 1/tau.
* backward: the row pass and the column pass of each block add into fp32 (fp64) buffers of
  gradients with respect to the normalised embeddings; the first pass to reach a buffer overwrites
  it. Launches run in order on one stream, so the sums are deterministic without atomics. The
  buffers are then taken through the normalisation with ``cgist.numerics.normalize_backward_``.

At run time this module imports only torch, triton and the leaf module ``cgist.numerics``; the
options arrive as a ``cgist.GistOptions``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from cgist.numerics import EPS, compute_dtype, normalize_backward_, tie_ids

from .gist import gist_bwd_cols_kernel, gist_bwd_rows_kernel, gist_fwd_kernel, pack_scalars

if TYPE_CHECKING:
    from cgist.options import GistOptions

__all__ = ["ForwardState", "gist_backward", "gist_forward", "gist_loss_and_grads"]

LN2 = math.log(2.0)
TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: fp32 follows ``torch.get_float32_matmul_precision()`` like torch.mm."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _launch_device(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _rows_contiguous(x: Tensor) -> Tensor:
    """``x`` with a contiguous feature dimension, so that a row stride alone addresses it."""
    return x if x.stride(1) == 1 else x.contiguous()


@dataclass
class _Side:
    """Student and guide vectors of one side of a block, with their inverse norms and guide tie ids."""

    x: Tensor
    g: Tensor
    rx: Tensor
    rg: Tensor
    ids: Tensor  # int32 tie id of each guide row
    grad: int  # index of the embedding whose gradient this side feeds
    start: int = 0  # first row of that embedding

    def rows(self, start: int, stop: int) -> _Side:
        return _Side(self.x[start:stop], self.g[start:stop], self.rx[start:stop], self.rg[start:stop],
                     self.ids[start:stop], self.grad, start)


@dataclass
class _Block:
    """One score block: rows against columns; row i's partner id is ``partner[partner_start + i]``."""

    rows: _Side
    cols: _Side
    has_label: bool
    partner: Tensor
    partner_start: int

    def kernel_args(self, thr: Tensor, theta_masked: Tensor, scalars: Tensor, offset: int) -> dict:
        """The keyword arguments all three kernels share, for this block."""
        rows, cols = self.rows, self.cols
        return dict(
            q_ptr=rows.x, qg_ptr=rows.g, k_ptr=cols.x, kg_ptr=cols.g,
            rq_ptr=rows.rx, rqg_ptr=rows.rg, rk_ptr=cols.rx, rkg_ptr=cols.rg,
            col_id_ptr=cols.ids, partner_id_ptr=self.partner, thr_ptr=thr, theta_masked_ptr=theta_masked,
            scalars_ptr=scalars,
            n_rows=rows.x.shape[0], n_cols=cols.x.shape[0], dim=rows.x.shape[1], dim_g=rows.g.shape[1],
            offset=offset, partner_start=self.partner_start,
            stride_q=rows.x.stride(0), stride_qg=rows.g.stride(0), stride_k=cols.x.stride(0), stride_kg=cols.g.stride(0),
            has_label=int(self.has_label),
        )


@dataclass
class ForwardState:
    """What the backward needs from the forward: the blocks, the per-row state and the tile config."""

    embeddings: list[Tensor]
    sides: list[_Side]
    norms: list[Tensor]
    blocks: list[_Block]
    thr: Tensor
    theta_masked: Tensor
    pos: Tensor  # base-2 positive logit of each row
    run_max: Tensor  # running max m of each row (at least the positive)
    run_sum: Tensor  # sum of 2^(z - m) over the unmasked entries other than the label
    scalars: Tensor
    flags: dict
    tiles: dict
    offset: int
    temperature: float

    def row_weight(self) -> Tensor:
        """``1 / (tau * B * total)``, with ``total = l + 2^(z_pos - m)`` the softmax denominator over ``2^m``."""
        batch = self.pos.shape[0]
        return 1.0 / ((self.temperature * batch) * (self.run_sum + torch.exp2(self.pos - self.run_max)))


@torch.no_grad()
def gist_forward(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor], options: GistOptions
) -> tuple[Tensor, ForwardState]:
    """The loss (0-dim, float64 for float64 inputs else float32) and the state ``gist_backward`` needs."""
    acc = compute_dtype(embeddings[0].dtype)
    guide_dtype = guide_embeddings[0].dtype
    if acc == torch.float64 or guide_dtype == torch.float64:
        guide_dtype = acc  # tl.dot needs both operands, and the accumulator, to agree on float64
    embeddings = [_rows_contiguous(x) for x in embeddings]
    guide_embeddings = [_rows_contiguous(g.to(guide_dtype)) for g in guide_embeddings]
    device = embeddings[0].device
    batch, n_cand = embeddings[0].shape[0], embeddings[1].shape[0]
    offset = options.offset

    norms = [torch.linalg.vector_norm(x, dim=1, dtype=acc) for x in embeddings]
    guide_norms = [torch.linalg.vector_norm(g, dim=1, dtype=acc) for g in guide_embeddings]
    # Fingerprints of the normalised guide rows, as the oracle and the streaming path take them.
    ids = tie_ids(guide_embeddings, acc)
    sides = [
        _Side(x, g, 1.0 / n.clamp_min(EPS), 1.0 / gn.clamp_min(EPS), tid, i)
        for i, (x, g, n, gn, tid) in enumerate(zip(embeddings, guide_embeddings, norms, guide_norms, ids))
    ]
    anchor, positive, *negatives = sides
    # The blocks in the order of the loss: AP, AA, PP, AN_1..AN_k. The partner of an anchor row is its
    # positive offset + i; PP's rows are the positives offset + i, whose partner is anchor i.
    blocks = [_Block(anchor, positive, True, positive.ids, offset)]
    if options.contrast_anchors:
        blocks.append(_Block(anchor, anchor, False, positive.ids, offset))
    if options.contrast_positives:
        blocks.append(_Block(positive.rows(offset, offset + batch), positive, False, anchor.ids, 0))
    blocks.extend(_Block(anchor, negative, False, positive.ids, offset) for negative in negatives)

    scalars = pack_scalars(options.temperature, options.margin, acc, device)
    thr, pos, run_max, run_sum = (torch.empty(batch, dtype=acc, device=device) for _ in range(4))
    theta_masked = torch.empty(batch, dtype=torch.int8, device=device)
    flags = dict(
        ACC=TL_DTYPES[acc], PRECISION=input_precision(embeddings[0].dtype), PRECISION_G=input_precision(guide_dtype)
    )
    with _launch_device(device):
        for block in blocks:
            gist_fwd_kernel[lambda meta: (triton.cdiv(batch, meta["BLOCK_M"]),)](
                **block.kernel_args(thr, theta_masked, scalars, offset),
                pos_ptr=pos, m_ptr=run_max, l_ptr=run_sum,
                b_bucket=triton.next_power_of_2(batch), n_bucket=triton.next_power_of_2(n_cand),
                relative=int(options.relative), **flags,
            )
    config = gist_fwd_kernel.best_config
    tiles = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    gap = (run_max - pos) * LN2
    loss = (gap + torch.log1p(run_sum + torch.expm1(-gap))).sum() / batch
    return loss, ForwardState(embeddings, sides, norms, blocks, thr, theta_masked, pos, run_max, run_sum, scalars,
                              flags, tiles, offset, options.temperature)


@torch.no_grad()
def gist_backward(state: ForwardState) -> list[Tensor]:
    """d(loss)/d(embeddings), each in its embedding's dtype, from the forward's state."""
    acc = state.pos.dtype
    row_weight = state.row_weight()
    grads_hat = [torch.empty(x.shape, dtype=acc, device=x.device) for x in state.embeddings]
    written: set[int] = set()
    with _launch_device(state.pos.device):
        for block in state.blocks:
            args = block.kernel_args(state.thr, state.theta_masked, state.scalars, state.offset)
            for kernel, side, tile in ((gist_bwd_rows_kernel, block.rows, "BLOCK_M"),
                                       (gist_bwd_cols_kernel, block.cols, "BLOCK_N")):
                out = grads_hat[side.grad][side.start : side.start + side.x.shape[0]]
                kernel[(triton.cdiv(side.x.shape[0], state.tiles[tile]),)](
                    **args, m_ptr=state.run_max, l_ptr=state.run_sum, rw_ptr=row_weight, grad_ptr=out, stride_grad=out.stride(0),
                    accumulate=int(side.grad in written), **state.flags, **state.tiles,
                )
                written.add(side.grad)
    return [
        normalize_backward_(x.to(acc) * side.rx[:, None], norm[:, None], g).to(x.dtype)
        for x, side, norm, g in zip(state.embeddings, state.sides, state.norms, grads_hat)
    ]


def gist_loss_and_grads(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor], options: GistOptions, *, need_grads: bool,
    need_stats: bool = False,
) -> tuple[Tensor, list[Tensor] | None, Tensor | None]:
    """Loss, d(loss)/d(embeddings) if ``need_grads``, and the mask counters if ``need_stats``.

    ``embeddings = [anchor, positive, *negatives]``: anchor B x D, positive and negatives N x D, guide
    columns likewise in Dg; anchor i's label is candidate ``options.offset + i``. Inputs are assumed
    validated by ``cgist.gist_loss``. The loss is float64 for float64 inputs and float32 otherwise; the
    gradients have the dtype of their embedding.
    """
    if need_stats or options.matryoshka_dims is not None:
        raise NotImplementedError("the Triton backend does not compute statistics or Matryoshka dimensions yet")
    loss, state = gist_forward(embeddings, guide_embeddings, options)
    return loss, (gist_backward(state) if need_grads else None), None
