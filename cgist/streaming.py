"""Streaming GIST loss in PyTorch: the CPU path, and the fallback for GPUs without Triton.

Anchor rows are processed in blocks sized by a memory budget. Each block is scored against every
candidate column with matrix products, masked against the guide threshold, reduced to a log-sum-exp,
and turned into gradients at once, so the loss and the embedding gradients come out of one pass and
nothing of size B x N is ever allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .numerics import compute_dtype, guide_mask, normalize, normalize_backward, threshold, tie_ids
from .options import GistOptions

__all__ = ["BLOCK_BYTES", "gist_loss_and_grads"]

#: Default bytes of score buffers held at once per row block.
BLOCK_BYTES = 16 * 2**20


def _rows_per_block(n_rows: int, n_score_cols: int, widest_block: int, itemsize: int, budget: int) -> int:
    """Rows per block so that the block's scores plus one guide tile and mask fit in ``budget`` bytes."""
    per_row = n_score_cols * itemsize + widest_block * (itemsize + 1)
    return max(1, min(n_rows, budget // per_row))


@torch.no_grad()
def gist_loss_and_grads(
    embeddings: Sequence[Tensor],
    guide_embeddings: Sequence[Tensor],
    options: GistOptions,
    *,
    need_grads: bool,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[Tensor, list[Tensor] | None]:
    """Loss and, if ``need_grads``, d(loss)/d(embeddings) for ``embeddings = [anchor, positive, *negatives]``.

    Shapes: anchor B x D, positive and negatives N x D, guide columns likewise in Dg; anchor i's label
    is candidate ``offset + i``. The loss is float64 for float64 inputs and float32 otherwise; the
    gradients have the dtype of their embedding.
    """
    temperature, offset = options.temperature, options.offset
    contrast_anchors, contrast_positives = options.contrast_anchors, options.contrast_positives
    dtype = compute_dtype(embeddings[0].dtype)
    normed = [normalize(e, dtype) for e in embeddings]
    a, p, *negs = (x for x, _ in normed)
    ga, gp, *gnegs = (normalize(g, dtype)[0] for g in guide_embeddings)
    id_a, id_p, *id_negs = tie_ids([ga, gp, *gnegs])
    batch, n_cand = a.shape[0], p.shape[0]
    grad_scale = 1.0 / (temperature * batch)

    # Column vectors of each block (student, guide, tie ids): AP, [AA], [PP], AN_1..AN_k.
    blocks: list[tuple[Tensor, Tensor, Tensor]] = [(p, gp, id_p)]
    if contrast_anchors:
        blocks.append((a, ga, id_a))
    if contrast_positives:
        blocks.append((p, gp, id_p))
    blocks.extend(zip(negs, gnegs, id_negs))
    pp_index = 1 + contrast_anchors if contrast_positives else None

    grads_hat = [torch.zeros_like(x) for x, _ in normed] if need_grads else None
    loss = torch.zeros((), dtype=dtype, device=a.device)
    step = _rows_per_block(
        batch, sum(b[0].shape[0] for b in blocks), max(batch, n_cand), torch.finfo(dtype).bits // 8, block_bytes
    )
    for start in range(0, batch, step):
        stop = min(start + step, batch)
        lo, hi = offset + start, offset + stop
        rows = torch.arange(stop - start, device=a.device)
        labels = rows + lo
        # Row vectors of each block and the partner of theta for that row vector: anchors paired
        # with their positives, except PP, whose rows are this block's own positives paired with the anchors.
        row_vecs = [(a[start:stop], ga[start:stop], id_p[lo:hi])] * len(blocks)
        if pp_index is not None:
            row_vecs[pp_index] = (p[lo:hi], gp[lo:hi], id_a[start:stop])

        guide_ap = ga[start:stop] @ gp.T
        theta = guide_ap[rows, labels].unsqueeze(1)
        limit = threshold(theta, options.margin, options.relative)
        theta_masked = theta > limit
        logits = []
        for i, ((cols, guide_cols, col_ids), (row_s, row_g, partner_ids)) in enumerate(zip(blocks, row_vecs)):
            guide = guide_ap if i == 0 else row_g @ guide_cols.T
            mask = guide_mask(guide, limit, theta_masked, col_ids, partner_ids)
            if i == 0:
                mask[rows, labels] = False
            del guide
            logits.append((row_s @ cols.T).div_(temperature).masked_fill_(mask, float("-inf")))
            del mask
        positive = logits[0][rows, labels]
        # The positive logit is always present and finite, so the running max is finite and no
        # fully masked block can produce exp(-inf - -inf).
        row_max = torch.stack([block.amax(dim=1) for block in logits]).amax(dim=0).unsqueeze(1)
        total = sum(block.sub_(row_max).exp_().sum(dim=1, keepdim=True) for block in logits)
        loss += (row_max + total.log()).sum() - positive.sum()
        if not need_grads:
            continue

        # logits now hold exp(s / tau - max); turn them into dL/ds = (softmax - onehot) / (tau * B).
        scale = grad_scale / total
        for block in logits:
            block.mul_(scale)
        logits[0][rows, labels] -= grad_scale
        grad_a, grad_p, *grad_negs = grads_hat
        grad_cols = [grad_p] + [grad_a] * contrast_anchors + [grad_p] * contrast_positives + grad_negs
        grad_rows = [grad_a[start:stop]] * len(blocks)
        if pp_index is not None:
            grad_rows[pp_index] = grad_p[lo:hi]
        for d_scores, (cols, _, _), grad_col, (row_s, _, _), grad_row in zip(logits, blocks, grad_cols, row_vecs, grad_rows):
            grad_row.addmm_(d_scores, cols)
            grad_col.addmm_(d_scores.T, row_s)

    loss = (loss / batch).to(torch.float64 if dtype == torch.float64 else torch.float32)
    if not need_grads:
        return loss, None
    grads = [
        normalize_backward(x_hat, norm, g).to(e.dtype) for (x_hat, norm), g, e in zip(normed, grads_hat, embeddings)
    ]
    return loss, grads
