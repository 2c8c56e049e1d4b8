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
    batch = a.shape[0]
    rows = torch.arange(batch, device=a.device)
    labels = rows + offset

    guide_ap = ga @ gp.T
    limit = threshold(guide_ap[rows, labels].unsqueeze(1), margin, margin_strategy)

    def masked(student: Tensor, guide: Tensor, protect_label: bool = False) -> Tensor:
        mask = guide > limit
        if protect_label:
            mask[rows, labels] = False
        return student.masked_fill(mask, float("-inf"))

    blocks = [masked(a @ p.T, guide_ap, protect_label=True)]
    if contrast_anchors:
        blocks.append(masked(a @ a.T, ga @ ga.T))
    if contrast_positives:
        blocks.append(masked(p[labels] @ p.T, gp[labels] @ gp.T))
    for n, gn in zip(negs, gnegs):
        blocks.append(masked(a @ n.T, ga @ gn.T))
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
