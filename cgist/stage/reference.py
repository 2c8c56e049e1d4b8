"""Dense oracle for the GIST loss, in every direction.

It materialises every column group's scores at once and lets autograd do the backward, so it is slow and
O(B * N) in memory, but it is short enough to check by eye against the definition (docs/design.md#the-loss and
docs/design.md#column-groups).
It works in any floating dtype, float64 included; tests compare every other path against it.

Columns: ``embeddings = [anchor (B), positive (N), *negatives (N)]``, and with ``options.all_anchors`` one more,
the anchors of every rank (N rows, this rank's at ``offset``), which the anchor-column directions score against
(without it they take this rank's anchors). The guide's columns and the text ids follow the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .numerics import guide_mask, normalize, threshold
from .spec.options import GistOptions
from .ties import TieIndex, tie_ids

__all__ = ["ScoredGroup", "gist_loss_reference", "gist_scores", "maxsim_gist_loss_reference", "maxsim_loss_reference",
           "maxsim_scores_reference", "score_groups", "token_scores_reference", "xtr_scores_reference"]


@dataclass
class ScoredGroup:
    """One column group of a row's softmax, scored: B rows against one column.

    ``scores`` holds the student's scores (cosines, or dot products), -inf where masked; ``hard`` is True where
    the hardness penalty applies (None: nowhere); ``direction`` is the partition the group belongs to.
    ``unmasked`` holds row i's column that is never masked (AP's label, DQ's pair (positive, anchor i)), one per row:
    it is no candidate of the row's mask, which the statistics count (None: the group has no such column).
    """

    name: str
    direction: str
    scores: Tensor
    hard: Tensor | None = None
    unmasked: Tensor | None = None


def score_groups(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions = GistOptions(),
    text_ids: Sequence[Tensor] | None = None,
) -> list[ScoredGroup]:
    """Every column group of the loss, masked: GIST's AP, AA, PP, AN_1..AN_k, then the directions' QQ, DQ, DD, DN_1..DN_k.

    Row i is anchor i, or for PP, DQ, DD and DN its positive ``offset + i``. An entry is masked when its guide score
    (the guide's rows and columns alike) is strictly above T_i, a column with the text (``text_ids``; without them,
    the normalised guide vector) of the row's partner (the positive for anchor rows, anchor i for positive rows)
    tying with theta_i; not at all without a guide. Always masked: QQ's anchor i (itself), DD's and DN's column
    ``offset + i`` (anchor i's own documents); with ``mask_self`` AA[i, i] and PP[i, offset + i]; with
    ``mask_duplicates`` every column whose text id equals anchor i's or its positive's. Never masked: the label
    AP[i, offset + i] and DQ's pair (positive, anchor i). The scores of one dimension, whatever the temperature.
    """
    if options.matryoshka_dims is not None:
        raise ValueError("gist_scores scores one dimension; truncate the embeddings and drop matryoshka_dims")
    if options.mask_duplicates and text_ids is None:
        raise ValueError("mask_duplicates needs text_ids")
    n_neg = len(embeddings) - 2 - options.all_anchors
    student = [normalize(e)[0] if options.similarity == "cos" else e for e in embeddings]
    a, p = student[0], student[1]
    rows = torch.arange(a.shape[0], device=a.device)
    labels = rows + options.offset
    own_anchor = labels if options.all_anchors else rows  # anchor i among ``everyone``
    everyone = len(embeddings) - 1 if options.all_anchors else 0  # the column of every rank's anchors

    guided = guide_embeddings is not None
    if guided:
        g = [normalize(e)[0] for e in guide_embeddings]
        ids = tie_ids(guide_embeddings, g[0].dtype, text_ids=text_ids)
        theta = (g[0] @ g[1].T)[rows, labels].unsqueeze(1)
        limit = threshold(theta, options.margin, options.relative)
        # theta_i > T_i exactly when the margin lowers T_i below theta_i (docs/design.md#ties), whatever rounds
        theta_masked = (theta.abs() * options.margin > 0) if options.relative else torch.full_like(
            theta, options.margin > 0, dtype=torch.bool)
        partner = {"a": ids[1][labels], "p": ids[0]}  # anchor rows pair with their positive, positive rows with anchor i

    def group(name: str, direction: str, row: str, column: int, *, label=None, unmasked=None, excluded=None, hard=None):
        """Column group ``name``: rows ``row`` ("a": anchors, "p": their positives) against embeddings[column]."""
        rows_x = a if row == "a" else p[labels]
        scores = rows_x @ student[column].T
        mask = torch.zeros_like(scores, dtype=torch.bool)
        if guided:
            rows_g = g[0] if row == "a" else g[1][labels]
            guide = rows_g @ g[column].T
            mask |= guide_mask(guide, limit, theta_masked, TieIndex(ids[column]).pairs(partner[row], 0, guide.shape[1]))
        if options.mask_duplicates:
            col_text = text_ids[column]
            mask |= (col_text == text_ids[0][:, None]) | (col_text == text_ids[1][labels][:, None])
        never = label if label is not None else unmasked
        if never is not None:
            mask[rows, never] = False
        if excluded is not None:
            mask[rows, excluded] = True
        return ScoredGroup(name, direction, scores.masked_fill(mask, float("-inf")), hard, never)

    def hard(own: bool, others: bool, width: int) -> Tensor | None:
        """Where the hardness penalty applies in a query-to-document group: anchor i's own column, the others."""
        if options.hardness == 0.0 or not (own or others):
            return None
        out = torch.full((a.shape[0], width), others, dtype=torch.bool, device=a.device)
        out[rows, labels] = own
        return out

    mode = options.hardness_mode
    n_cand = p.shape[0]
    groups = [group("ap", "query_to_doc", "a", 1, label=labels, hard=hard(False, mode != "hard_negatives", n_cand))]
    if options.contrast_anchors:
        groups.append(group("aa", "query_to_query", "a", 0, excluded=rows if options.mask_self else None))
    if options.contrast_positives:
        groups.append(group("pp", "doc_to_doc", "p", 1, excluded=labels if options.mask_self else None))
    groups += [group("an", "query_to_doc", "a", 2 + k,
                     hard=hard(mode in ("hard_negatives", "all_negatives"), mode != "hard_negatives", n_cand))
               for k in range(n_neg)]
    if "query_to_query" in options.directions:
        groups.append(group("qq", "query_to_query", "a", everyone, excluded=own_anchor))
    if "doc_to_query" in options.directions:
        groups.append(group("dq", "doc_to_query", "p", everyone, unmasked=own_anchor))
    if "doc_to_doc" in options.directions:
        groups += [group("dd" if k == 0 else "dn", "doc_to_doc", "p", 1 if k == 0 else 1 + k, excluded=labels)
                   for k in range(1 + n_neg)]
    return groups


def gist_scores(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions = GistOptions(),
    text_ids: Sequence[Tensor] | None = None,
) -> Tensor:
    """All student scores, B x (every group's columns, in ``score_groups``' order), -inf where masked.

    With GIST's groups alone: AP, AA, PP, AN_1..AN_k, as in sentence-transformers; column ``offset + i`` of AP is
    the label of row i and is never masked.
    """
    return torch.cat([b.scores for b in score_groups(embeddings, guide_embeddings, options, text_ids)], dim=1)


def gist_loss_reference(
    embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor] | None, options: GistOptions = GistOptions(),
    text_ids: Sequence[Tensor] | None = None,
) -> Tensor:
    """Mean over anchors of ``logsumexp(unmasked logits) - s_AP[i, offset + i] / tau``.

    The logits are the scores over tau, plus ``hardness_strength * stop_grad(score)`` where the hardness mode
    says. ``"joint"`` takes one log-sum-exp over every group, ``"per_direction"`` the mean of each direction's.
    With Matryoshka dimensions, ``sum_d w_d`` times that loss of the embeddings truncated to their first d
    components (the guide untouched), as sentence-transformers' ``MatryoshkaLoss`` computes it.
    Differentiable by plain autograd with respect to ``embeddings``; the guide gets no gradient. Masking as in
    ``score_groups``.
    """
    if options.matryoshka_dims is not None:
        one = options.replace(matryoshka_dims=None, matryoshka_weights=None)
        return sum(w * gist_loss_reference([e[:, :d] for e in embeddings], guide_embeddings, one, text_ids)
                   for d, w in zip(options.matryoshka_dims, options.matryoshka_weights))
    guide = None if guide_embeddings is None else [g.detach() for g in guide_embeddings]
    groups = score_groups(embeddings, guide, options, text_ids)
    logits = {}
    for b in groups:
        z = b.scores / options.temperature
        if b.hard is not None:
            z = z + torch.where(b.hard, options.hardness * b.scores.detach(), 0.0)
        logits.setdefault(b.direction, []).append(z)
    rows = torch.arange(groups[0].scores.shape[0], device=groups[0].scores.device)
    positive = groups[0].scores[rows, rows + options.offset] / options.temperature
    if options.partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat([z for zs in logits.values() for z in zs], dim=1), dim=1)
    else:
        log_z = sum(torch.logsumexp(torch.cat(zs, dim=1), dim=1) for zs in logits.values()) / len(logits)
    return (log_z - positive).mean()


def maxsim_scores_reference(queries: Tensor, query_mask: Tensor, documents: Tensor, document_mask: Tensor, *,
                            length_normalize: bool = False) -> Tensor:
    """Every query's MaxSim score against every document, dense: ``(B, Lq, D)`` queries against ``(M, Ld, D)``
    documents, ``(B, M)`` in float32 or wider (float64 stays float64).

    Padding tokens of a document never win its maximum; the query's padding is masked after it; the maxima are
    summed in float32 at least; a document without a real token scores -1e9; MeanMaxSim divides by the query's real
    token count (at least 1), after that fill. This is sentence-transformers' MaxSim, written out.
    """
    tokens = torch.einsum("qtd,msd->qmts", queries, documents)
    tokens = tokens.masked_fill(~document_mask[None, :, None, :], torch.finfo(tokens.dtype).min)
    maxima = tokens.amax(-1).to(torch.promote_types(tokens.dtype, torch.float32))
    scores = (maxima * query_mask[:, None, :]).sum(-1)
    scores = scores.masked_fill(~document_mask.any(-1)[None, :], -1e9)
    if length_normalize:
        scores = scores / query_mask.sum(-1, keepdim=True).clamp(min=1)
    return scores


def xtr_scores_reference(queries: Tensor, query_mask: Tensor, documents: Tensor, document_mask: Tensor, *,
                         top_k: int) -> Tensor:
    """Every query's XTR score against every document, dense, from XTR's definition: ``(B, Lq, D)`` queries against
    ``(M, Ld, D)`` documents, ``(B, M)`` in float32 or wider.

    Each query token retrieves its ``top_k`` largest similarities among every real token of every document (the pool;
    every one where it holds fewer), and every token tied with the ``top_k``-th; a query's score against document
    ``j`` is the sum, over its real tokens that retrieved one of ``j``'s tokens, of the largest similarity they
    retrieved there, divided by how many such tokens there are (at least 1); a document without a real token scores
    -1e9. Products in the inputs' dtype, sums in float32 at least, as sentence-transformers' ``xtr_scores``.
    """
    tokens = torch.einsum("qtd,msd->qtms", queries, documents)  # (B, Lq, M, Ld)
    pool = tokens.masked_fill(~document_mask, float("-inf")).flatten(2)
    depth = min(top_k, int(document_mask.sum()))
    if depth:
        kth = pool.topk(depth, -1).values[..., -1:].unsqueeze(-1)
        retrieved = document_mask & (tokens >= kth)
    else:
        retrieved = torch.zeros_like(tokens, dtype=torch.bool)
    hit = retrieved.any(-1) & query_mask.bool().unsqueeze(-1)  # (B, Lq, M): the token retrieved one of j's
    best = tokens.masked_fill(~retrieved, float("-inf")).amax(-1)
    best = torch.where(hit, best, 0.0).to(torch.promote_types(tokens.dtype, torch.float32))
    scores = best.sum(1) / hit.sum(1).clamp(min=1)
    return scores.masked_fill(~document_mask.any(-1)[None, :], -1e9)


def token_scores_reference(queries: Tensor, query_mask: Tensor, documents: Tensor, document_mask: Tensor, *,
                           length_normalize: bool = False, top_k: int | None = None) -> Tensor:
    """MaxSim's scores (``maxsim_scores_reference``), or XTR's with ``top_k`` (``xtr_scores_reference``)."""
    if top_k is None:
        return maxsim_scores_reference(queries, query_mask, documents, document_mask,
                                       length_normalize=length_normalize)
    if length_normalize:
        raise ValueError("XTR scores are not length-normalised")
    return xtr_scores_reference(queries, query_mask, documents, document_mask, top_k=top_k)


def maxsim_loss_reference(queries: Tensor, query_mask: Tensor, documents: Sequence[Tensor],
                          document_masks: Sequence[Tensor], *, scale: float = 1.0, length_normalize: bool = False,
                          offset: int = 0, top_k: int | None = None) -> Tensor:
    """The multi-vector ranking loss, dense (``cgist.maxsim_loss``'s definition): the documents of every column in
    sentence-transformers' query-major order (row ``j`` of column ``n`` is score column ``j * N + n``), cross-entropy
    of the scaled scores with query ``i``'s label at column ``(offset + i) * N``, mean over the queries; XTR's scores
    with ``top_k``. Columns must share their token width. Differentiable by plain autograd."""
    n = len(documents)
    stacked = torch.stack(list(documents), 1).flatten(0, 1)
    masks = torch.stack(list(document_masks), 1).flatten(0, 1)
    scores = token_scores_reference(queries, query_mask, stacked, masks, length_normalize=length_normalize,
                                    top_k=top_k)
    labels = (torch.arange(queries.shape[0], device=queries.device) + offset) * n
    return torch.nn.functional.cross_entropy(scores * scale, labels)


def maxsim_gist_loss_reference(queries: Tensor, query_mask: Tensor, documents: Sequence[Tensor],
                               document_masks: Sequence[Tensor], guide: object, *,
                               guide_masks: Sequence[Tensor] | None = None, guide_length_normalize: bool = False,
                               scale: float = 1.0, length_normalize: bool = False, offset: int = 0,
                               margin: float = 0.0, relative: bool = False, text_ids: Sequence[Tensor] | None = None,
                               mask_duplicates: bool = False, contrast_anchors: bool = False,
                               contrast_positives: bool = False, mask_self: bool = True,
                               top_k: int | None = None) -> tuple[Tensor, Tensor]:
    """The guided multi-vector loss, dense (``cgist.maxsim_loss`` with a guide), and its mask.

    Query ``i``'s row: every document column's scores, concatenated (column ``n``'s row ``j`` after every row of the
    columns before it), then with ``contrast_anchors`` its scores against every query (AA), then with
    ``contrast_positives`` its positive's (row ``offset + i`` of the first column, as the left side, its mask as the
    query mask) against every document of the first column (PP); the label is the first column's row ``offset + i``.
    With ``top_k`` the student's scores are XTR's (``xtr_scores_reference``; no contrast block).
    The guide's score of every pair alike: ``"self"`` the student's MaxSim, detached; ``(rows, Dg)`` columns their
    cosine; ``(rows, tokens, Dg)`` columns with ``guide_masks`` their MaxSim (MeanMaxSim with
    ``guide_length_normalize``); None none. theta_i is the guide's score of query ``i`` with its label,
    ``T_i = theta_i - margin`` (``relative``: ``theta_i - |theta_i| * margin``). Masked: a candidate the guide scores
    strictly above ``T_i``; instead, one with the text of the row's partner (``text_ids``: query ``i``'s positive; in
    PP, query ``i``) exactly when ``theta_i > T_i``; with ``mask_duplicates`` every candidate whose text is the
    query's or its positive's; with ``mask_self`` AA[i, i] and PP[i, offset + i]. Never: the label. The loss is the
    cross-entropy of the scaled scores, masked out of the softmax, differentiable by plain autograd. Columns of
    different token widths are padded to the widest.
    """
    rows = torch.arange(queries.shape[0], device=queries.device)
    labels = rows + offset
    if top_k is not None and (contrast_anchors or contrast_positives):
        raise ValueError("XTR has no contrast blocks")

    def blocks(left, left_mask, columns, masks, length_normalize, top_k=None):
        """A row's blocks of token scores: the documents, AA, PP (``(B, W)``), for the student or a token guide."""
        out = [token_scores_reference(left, left_mask, *_cat_padded(columns, masks),
                                      length_normalize=length_normalize, top_k=top_k)]
        if contrast_anchors:
            out.append(maxsim_scores_reference(left, left_mask, left, left_mask, length_normalize=length_normalize))
        if contrast_positives:
            out.append(maxsim_scores_reference(columns[0][labels], masks[0][labels], columns[0], masks[0],
                                               length_normalize=length_normalize))
        return torch.cat(out, 1)

    scores = blocks(queries, query_mask, documents, document_masks, length_normalize, top_k)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    ids = partner = None
    if text_ids is not None:
        first_ids, q_ids = text_ids[1], text_ids[0]
        parts = [torch.cat(list(text_ids[1:]))] + [q_ids] * contrast_anchors + [first_ids] * contrast_positives
        ids = torch.cat(parts)
        # the row's partner: the positive's text, but in PP (whose rows are the positives) the query's
        partner = first_ids[labels].unsqueeze(1).expand(-1, ids.shape[0]).clone()
        if contrast_positives:
            partner[:, ids.shape[0] - first_ids.shape[0]:] = q_ids.unsqueeze(1)
    if guide is not None:
        if isinstance(guide, str):
            score = scores.detach()
        elif guide[0].dim() == 2:
            g = [normalize(c)[0] for c in guide]
            score = [g[0] @ torch.cat(g[1:]).T] + [g[0] @ g[0].T] * contrast_anchors + \
                [g[1][labels] @ g[1].T] * contrast_positives
            score = torch.cat(score, 1)
        else:
            score = blocks(guide[0], guide_masks[0], guide[1:], guide_masks[1:], guide_length_normalize)
        theta = score[rows, labels].unsqueeze(1)
        limit = theta - theta.abs() * margin if relative else theta - margin
        mask = score > limit
        if ids is not None:  # a tie with theta_i: masked when the margin lowers T_i below theta_i
            above = theta.abs() * margin > 0 if relative else torch.full_like(theta, margin > 0, dtype=torch.bool)
            mask = torch.where(ids == partner, above, mask)
    if mask_duplicates:
        mask |= (ids == text_ids[0].unsqueeze(1)) | (ids == text_ids[1][labels].unsqueeze(1))
    mask[rows, labels] = False
    if mask_self:
        documents_width = sum(d.shape[0] for d in documents)
        if contrast_anchors:
            mask[rows, documents_width + rows] = True
        if contrast_positives:
            mask[rows, scores.shape[1] - documents[0].shape[0] + labels] = True
    logits = scores.masked_fill(mask, float("-inf")) * scale
    return torch.nn.functional.cross_entropy(logits, labels), mask


def _cat_padded(columns: Sequence[Tensor], masks: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Columns of token embeddings and their masks, one after the other, padded to the widest column's tokens."""
    width = max(c.shape[1] for c in columns)
    return (torch.cat([torch.nn.functional.pad(c, (0, 0, 0, width - c.shape[1])) for c in columns]),
            torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks]))
