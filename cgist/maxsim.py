"""``maxsim_loss``: the multi-vector (late-interaction) ranking loss as one op, a thin entry point over the loss stage
(docs/design.md#late-interaction).

The loss of sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss``: query ``i``'s score against every
document of every column is MaxSim (for each real query token, the largest dot product with a real document token,
summed in float32), or MeanMaxSim (divided by the query's real token count); a document with no real token scores
``-1e9`` (divided likewise); the scores times ``scale`` go into a cross-entropy whose label is the first column's row
``offset + i``; the loss is the mean over the queries. With ``top_k`` the scores are XTR's instead (sentence-transformers'
``xtr_scores``; docs/design.md#xtr). With a guide, GIST's mask leaves out the candidates that the
guide scores above each query's threshold (docs/design.md#the-guide-for-late-interaction). Its arguments become one
validated call (its score's door, ``Score.door``: MaxSim's or XTR's), which the stage runs
(``cgist.stage.node.run``) on the score's backends; it imports no backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

from .stage.node import run
from .stage.spec.options import GistOptions, check_bools, real_number
from .stage.spec.scores import SCORES, score_of, token_score_taking
from .stage.stats import GistStats

__all__ = ["maxsim_loss"]


def maxsim_loss(
    queries: Tensor | Sequence[Tensor], query_mask: Tensor | Sequence[Tensor],
    documents: Sequence[Tensor | Sequence[Tensor]], document_masks: Sequence[Tensor | Sequence[Tensor]], *,
    scale: float | Tensor = 1.0, length_normalize: bool = False, offset: int = 0, guide: object = None,
    guide_masks: Sequence[Tensor | Sequence[Tensor]] | None = None, guide_length_normalize: bool = False,
    margin: float = 0.0, margin_strategy: str = "absolute", text_ids: Sequence[Tensor] | None = None,
    mask_duplicates: bool = False, contrast_anchors: bool = False, contrast_positives: bool = False,
    mask_self: bool = True, similarity: str | None = None, block_bytes: int | None = None, backend: str = "auto",
    return_stats: bool = False, **score_options: object,
) -> Tensor | tuple[Tensor, GistStats]:
    """The multi-vector ranking loss of ``queries`` against every document of ``documents`` (module docstring).

    Args:
        queries: ``(B, Lq, D)`` token embeddings, or a list of row chunks (GradCache's mini-batches).
        query_mask: ``(B, Lq)`` bool, True at a real token (chunked as ``queries``).
        documents: the document columns (positive, then negatives), each ``(M, Ld, D)`` or a list of row chunks;
            with ``offset`` the columns hold every rank's rows and query ``i``'s positive is row ``offset + i``.
        document_masks: their masks, column by column.
        scale: multiplies the scores (sentence-transformers' ``scale``, ``1 / temperature``); a 0-dim tensor that
            requires a gradient (a learned scale, an ``nn.Parameter``) gets the loss's derivative, as under
            sentence-transformers' classes.
        length_normalize: MeanMaxSim: each score divided by its query's real token count.
        offset: the first column's row of the first query's positive.
        guide: GIST's guide, which leaves a query's candidates out of its softmax (``MaxSimGuide``): ``"self"`` (the
            student's own scores, detached), the guide's columns, queries' then each document column's, as
            ``(rows, Dg)`` embeddings (a single-vector guide: their cosine) or ``(rows, tokens, Dg)`` token
            embeddings with ``guide_masks`` (a multi-vector guide: their MaxSim, MeanMaxSim with
            ``guide_length_normalize``); None: no mask.
        guide_masks, guide_length_normalize: a multi-vector guide's masks (chunked as its columns) and scoring.
        margin, margin_strategy: how far below theta_i (the guide's score of query ``i`` with its positive) the
            threshold lies: ``theta_i - margin`` (``"absolute"``) or ``theta_i - |theta_i| * margin``
            (``"relative"``); a candidate strictly above it is masked.
        text_ids: an integer id per text of each column (queries, then the document columns), equal for equal
            texts: a candidate with the text of query ``i``'s positive ties with theta_i, masked exactly when
            ``theta_i > T_i``, whatever the rounding of its guide score.
        mask_duplicates: mask every candidate whose text is the query's or its positive's (with ``text_ids``), with
            or without a guide.
        contrast_anchors, contrast_positives: GIST's contrast blocks in each query's softmax, masked by the guide as
            the documents are: AA, query ``i``'s MaxSim against every query, and PP, its positive's (as the left side,
            row ``offset + i`` of the first column) against every document of the first column.
        mask_self: always leave the self-pairs AA[i, i] and PP[i, offset + i] out.
        similarity: the score, by its ``GistOptions.similarity`` (any registered token score's); None: the one the
            other arguments ask for, MaxSim (MeanMaxSim with ``length_normalize``), or the first registered token
            score whose own options (``Score.score_options``) include every one of ``score_options`` (``top_k``:
            XTR).
        block_bytes: the stage's working memory in bytes: half for one tile's token products, half for the scores
            and argmax a row block of queries keeps between its sweeps (None: a default for the device).
        backend: ``"auto"`` (the Triton kernels on GPUs they serve, once their first-use check passed, the PyTorch
            stage elsewhere), ``"torch"`` or ``"triton"``, with a guide or without (docs/design.md#late-interaction).
        return_stats: also return what the guide masked (``GistStats``).
        score_options: the score's own options (``GistOptions.score_options``; None: not given). XTR's ``top_k``:
            each real query token retrieves its ``top_k`` largest similarities among every real token of every
            document column, and a score is the sum of the retrieved per-token maxima over how many of the query's
            tokens retrieved one of the document's tokens (at least 1); not with ``length_normalize`` nor with the
            contrast blocks.

    Returns:
        The mean loss, differentiable with respect to ``queries`` and ``documents`` (the guide gets no gradient);
        with ``return_stats``, also its ``GistStats``.
    """
    value = real_number("scale", scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a positive finite number, got {value!r}")
    check_bools(length_normalize=length_normalize, guide_length_normalize=guide_length_normalize)
    learned = 1.0 / scale if isinstance(scale, Tensor) and scale.requires_grad else None  # its gradient: autograd's
    tokens_guide = "mean_maxsim" if guide_length_normalize else "maxsim"
    score_options = {name: value for name, value in score_options.items() if value is not None}
    if similarity is None:
        taking = token_score_taking(tuple(score_options))
        similarity = "mean_maxsim" if length_normalize else "maxsim"
        if taking is not score_of(similarity):
            if length_normalize:
                raise ValueError(f"length_normalize divides MaxSim's scores by the query's token count; the "
                                 f"{taking.name} score's ({', '.join(score_options)}) are its own: pass one of them")
            similarity = taking.similarities[0]
    elif length_normalize:
        raise ValueError(f"length_normalize picks MeanMaxSim, but similarity={similarity!r} is given: pass one of them")
    elif not score_of(similarity).tokens:
        names = tuple(name for score in SCORES if score.tokens for name in score.similarities)
        raise ValueError(f"similarity must be a token score's (one of {names}), got {similarity!r}")
    options = GistOptions(
        similarity=similarity, score_options=score_options, temperature=1.0 / value, margin=margin,
        margin_strategy=margin_strategy, contrast_anchors=contrast_anchors, contrast_positives=contrast_positives,
        mask_self=mask_self, mask_duplicates=mask_duplicates, offset=offset, block_bytes=block_bytes,
        guide_similarity=tokens_guide if guide_masks is not None else "cos",
    )
    door = options.score.door()
    call = door(queries, query_mask, documents, document_masks, options, guide=guide, guide_masks=guide_masks,
                text_ids=text_ids, temperature=learned)
    return run(call, backend, return_stats)
