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
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions = GistOptions(),
    text_ids: Sequence[Tensor] | None = None,
) -> Tensor:
    """All student cosine scores, B x (N + [B] + [N] + k*N), with masked entries set to -inf.

    Block order: AP, AA, PP, AN_1..AN_k, as in sentence-transformers. Column ``offset + i`` of AP is the
    label of row i and is never masked. An entry is masked when its guide score is strictly above T_i (not at
    all without a guide, ``guide_embeddings=None``); with ``options.mask_self`` at AA[i, i] and PP[i, offset + i];
    with ``options.mask_duplicates`` where the column's text id (``text_ids``, one per row of each column) equals
    that of anchor i or of its positive. ``options.temperature`` plays no part. These are the scores of one
    dimension: with Matryoshka dimensions, score each truncation (``x[:, :d]``) with options without them.
    """
    if options.matryoshka_dims is not None:
        raise ValueError("gist_scores scores one dimension; truncate the embeddings and drop matryoshka_dims")
    if options.mask_duplicates and text_ids is None:
        raise ValueError("mask_duplicates needs text_ids")
    a, p, *negs = (normalize(e)[0] for e in embeddings)
    rows = torch.arange(a.shape[0], device=a.device)
    labels = rows + options.offset

    def excluded(kind: str, cols: int, column: int) -> Tensor:
        """The explicit exclusions of a block: self-pairs and duplicate texts."""
        out = torch.zeros(a.shape[0], cols, dtype=torch.bool, device=a.device)
        if options.mask_self and kind in ("aa", "pp"):
            out[rows, rows if kind == "aa" else labels] = True
        if options.mask_duplicates:
            col_text = text_ids[column]
            out |= (col_text == text_ids[0][:, None]) | (col_text == text_ids[1][labels][:, None])
        return out

    if guide_embeddings is not None:
        ga, gp, *gnegs = (normalize(e)[0] for e in guide_embeddings)
        id_a, id_p, *id_negs = tie_ids(guide_embeddings, ga.dtype)
        theta = (ga @ gp.T)[rows, labels].unsqueeze(1)
        limit = threshold(theta, options.margin, options.relative)
        theta_masked = theta > limit

    def masked(kind: str, student: Tensor, column: int, guide_pair=None) -> Tensor:
        if guide_embeddings is None:
            mask = excluded(kind, student.shape[1], column)
        else:
            rows_g, cols_g, col_ids, partner_ids = guide_pair
            guide = rows_g @ cols_g.T
            mask = guide_mask(guide, limit, theta_masked, TieIndex(col_ids).pairs(partner_ids, 0, guide.shape[1]))
            mask |= excluded(kind, student.shape[1], column)
        if kind == "ap":
            mask[rows, labels] = False
        return student.masked_fill(mask, float("-inf"))

    guided = guide_embeddings is not None
    blocks = [masked("ap", a @ p.T, 1, (ga, gp, id_p, id_p[labels]) if guided else None)]
    if options.contrast_anchors:
        blocks.append(masked("aa", a @ a.T, 0, (ga, ga, id_a, id_p[labels]) if guided else None))
    if options.contrast_positives:
        blocks.append(masked("pp", p[labels] @ p.T, 1, (gp[labels], gp, id_p, id_a) if guided else None))
    for k, n in enumerate(negs):
        blocks.append(masked("an", a @ n.T, 2 + k, (ga, gnegs[k], id_negs[k], id_p[labels]) if guided else None))
    return torch.cat(blocks, dim=1)


def gist_loss_reference(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions = GistOptions(),
    text_ids: Sequence[Tensor] | None = None,
) -> Tensor:
    """Mean over anchors of ``logsumexp(unmasked scores / tau) - s_AP[i, offset + i] / tau``.

    With Matryoshka dimensions, ``sum_d w_d`` times that loss of the embeddings truncated to their first d
    components (the guide untouched), as sentence-transformers' ``MatryoshkaLoss`` computes it.
    Differentiable by plain autograd with respect to ``embeddings``; the guide gets no gradient. Masking as in
    ``gist_scores``.
    """
    if options.matryoshka_dims is not None:
        one = options.replace(matryoshka_dims=None, matryoshka_weights=None)
        return sum(w * gist_loss_reference([e[:, :d] for e in embeddings], guide_embeddings, one, text_ids)
                   for d, w in zip(options.matryoshka_dims, options.matryoshka_weights))
    guide = None if guide_embeddings is None else [g.detach() for g in guide_embeddings]
    scores = gist_scores(embeddings, guide, options, text_ids) / options.temperature
    labels = torch.arange(options.offset, options.offset + scores.shape[0], device=scores.device)
    return torch.nn.functional.cross_entropy(scores, labels)
