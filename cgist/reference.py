"""Dense oracle for the GIST loss.

It materialises every score block at once and lets autograd do the backward, so it is slow and
O(B * N) in memory, but it is short enough to check by eye against the definition. It works in any
floating dtype, float64 included; tests compare every other path against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .numerics import TieIndex, guide_mask, normalize, threshold, tie_ids
from .options import GistOptions

__all__ = ["gist_loss_reference", "gist_scores"]


def gist_scores(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor], options: GistOptions = GistOptions()
) -> Tensor:
    """All student cosine scores, B x (N + [B] + [N] + k*N), with masked entries set to -inf.

    Block order: AP, AA, PP, AN_1..AN_k, as in sentence-transformers. Column ``offset + i`` of AP is the
    label of row i and is never masked. ``options.temperature`` plays no part. These are the scores of one
    dimension: with Matryoshka dimensions, score each truncation (``x[:, :d]``) with options without them.
    """
    if options.matryoshka_dims is not None:
        raise ValueError("gist_scores scores one dimension; truncate the embeddings and drop matryoshka_dims")
    a, p, *negs = (normalize(e)[0] for e in embeddings)
    ga, gp, *gnegs = (normalize(e)[0] for e in guide_embeddings)
    id_a, id_p, *id_negs = tie_ids(guide_embeddings, ga.dtype)
    rows = torch.arange(a.shape[0], device=a.device)
    labels = rows + options.offset

    guide_ap = ga @ gp.T
    theta = guide_ap[rows, labels].unsqueeze(1)
    limit = threshold(theta, options.margin, options.relative)
    theta_masked = theta > limit

    def masked(student: Tensor, guide: Tensor, col_ids: Tensor, partner_ids: Tensor, protect_label=False) -> Tensor:
        mask = guide_mask(guide, limit, theta_masked, TieIndex(col_ids).pairs(partner_ids, 0, guide.shape[1]))
        if protect_label:
            mask[rows, labels] = False
        return student.masked_fill(mask, float("-inf"))

    blocks = [masked(a @ p.T, guide_ap, id_p, id_p[labels], protect_label=True)]
    if options.contrast_anchors:
        blocks.append(masked(a @ a.T, ga @ ga.T, id_a, id_p[labels]))
    if options.contrast_positives:
        blocks.append(masked(p[labels] @ p.T, gp[labels] @ gp.T, id_p, id_a))
    for n, gn, id_n in zip(negs, gnegs, id_negs):
        blocks.append(masked(a @ n.T, ga @ gn.T, id_n, id_p[labels]))
    return torch.cat(blocks, dim=1)


def gist_loss_reference(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor], options: GistOptions = GistOptions()
) -> Tensor:
    """Mean over anchors of ``logsumexp(unmasked scores / tau) - s_AP[i, offset + i] / tau``.

    With Matryoshka dimensions, ``sum_d w_d`` times that loss of the embeddings truncated to their first d
    components (the guide untouched), as sentence-transformers' ``MatryoshkaLoss`` computes it.
    Differentiable by plain autograd with respect to ``embeddings``; the guide gets no gradient.
    """
    if options.matryoshka_dims is not None:
        one = options.replace(matryoshka_dims=None, matryoshka_weights=None)
        return sum(w * gist_loss_reference([e[:, :d] for e in embeddings], guide_embeddings, one)
                   for d, w in zip(options.matryoshka_dims, options.matryoshka_weights))
    scores = gist_scores(embeddings, [g.detach() for g in guide_embeddings], options) / options.temperature
    labels = torch.arange(options.offset, options.offset + scores.shape[0], device=scores.device)
    return torch.nn.functional.cross_entropy(scores, labels)
