"""Dense oracle for the GIST loss.

It materialises every score block at once and lets autograd do the backward, so it is slow and
O(B * N) in memory, but it is short enough to check by eye against the definition. It works in any
floating dtype, float64 included; tests compare every other path against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

EPS = 1e-8


def normalize(x: Tensor) -> Tensor:
    """``x / max(||x||_2, 1e-8)`` row-wise, as ``torch.nn.CosineSimilarity`` does."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(EPS)


def threshold(theta: Tensor, margin: float, margin_strategy: str) -> Tensor:
    """Guide threshold T_i above which a candidate is masked (strictly greater)."""
    if margin_strategy == "absolute":
        return theta - margin
    if margin_strategy == "relative":
        return theta - theta.abs() * margin
    raise ValueError(f"margin_strategy must be 'absolute' or 'relative', got {margin_strategy!r}")


def tie_ids(columns: Sequence[Tensor]) -> list[Tensor]:
    """An integer id per row of each column such that rows get equal ids iff they are equal vectors.

    Called on the normalised guide columns. sentence-transformers computes every guide score by one
    element-wise formula, so a candidate whose guide vector equals theta's partner scores exactly theta.
    Matrix products give no such promise (BLAS kernels differ with shape and position), so the tie is
    decided by identity instead of by the rounding of two different products.
    """
    ids = torch.unique(torch.cat(list(columns)), dim=0, return_inverse=True)[1]
    return list(ids.split([c.shape[0] for c in columns]))


def guide_mask(guide: Tensor, limit: Tensor, theta_masked: Tensor, col_ids: Tensor, partner_ids: Tensor) -> Tensor:
    """True where a score is masked: its guide score is strictly above the row's threshold ``limit``.

    Row i's scores pair a row vector with each column; theta_i pairs the same row vector with
    ``partner_ids[i]`` (the positive for anchor rows, the anchor for positive rows). A column equal to
    that partner is a tie with theta_i and is masked exactly when ``theta_masked[i]`` (theta_i > T_i).
    """
    tie = col_ids.unsqueeze(0) == partner_ids.unsqueeze(1)
    return torch.where(tie, theta_masked, guide > limit)


def gist_scores(
    embeddings: Sequence[Tensor],
    guide_embeddings: Sequence[Tensor],
    *,
    margin: float = 0.0,
    margin_strategy: str = "absolute",
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    offset: int = 0,
) -> Tensor:
    """All student cosine scores, B x (N + [B] + [N] + k*N), with masked entries set to -inf.

    Block order: AP, AA, PP, AN_1..AN_k, as in sentence-transformers. Column ``offset + i`` of AP is the
    label of row i and is never masked.
    """
    a, p, *negs = (normalize(e) for e in embeddings)
    ga, gp, *gnegs = (normalize(e) for e in guide_embeddings)
    id_a, id_p, *id_negs = tie_ids([ga, gp, *gnegs])
    batch = a.shape[0]
    rows = torch.arange(batch, device=a.device)
    labels = rows + offset

    guide_ap = ga @ gp.T
    theta = guide_ap[rows, labels].unsqueeze(1)
    limit = threshold(theta, margin, margin_strategy)
    theta_masked = theta > limit

    def masked(student: Tensor, guide: Tensor, col_ids: Tensor, partner_ids: Tensor, protect_label=False) -> Tensor:
        mask = guide_mask(guide, limit, theta_masked, col_ids, partner_ids)
        if protect_label:
            mask[rows, labels] = False
        return student.masked_fill(mask, float("-inf"))

    blocks = [masked(a @ p.T, guide_ap, id_p, id_p[labels], protect_label=True)]
    if contrast_anchors:
        blocks.append(masked(a @ a.T, ga @ ga.T, id_a, id_p[labels]))
    if contrast_positives:
        blocks.append(masked(p[labels] @ p.T, gp[labels] @ gp.T, id_p, id_a))
    for n, gn, id_n in zip(negs, gnegs, id_negs):
        blocks.append(masked(a @ n.T, ga @ gn.T, id_n, id_p[labels]))
    return torch.cat(blocks, dim=1)


def gist_loss_reference(
    embeddings: Sequence[Tensor],
    guide_embeddings: Sequence[Tensor],
    *,
    temperature: float = 0.01,
    margin: float = 0.0,
    margin_strategy: str = "absolute",
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    offset: int = 0,
) -> Tensor:
    """Mean over anchors of ``logsumexp(unmasked scores / tau) - s_AP[i, offset + i] / tau``.

    Differentiable by plain autograd with respect to ``embeddings``; the guide gets no gradient.
    """
    scores = gist_scores(
        embeddings,
        [g.detach() for g in guide_embeddings],
        margin=margin,
        margin_strategy=margin_strategy,
        contrast_anchors=contrast_anchors,
        contrast_positives=contrast_positives,
        offset=offset,
    ) / temperature
    labels = torch.arange(offset, offset + scores.shape[0], device=scores.device)
    return torch.nn.functional.cross_entropy(scores, labels)
