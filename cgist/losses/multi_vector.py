"""The multi-vector family: sentence-transformers' late-interaction (ColBERT, MaxSim) ranking losses,
``MultiVectorMultipleNegativesRankingLoss`` and its cached (GradCache) form, each one class over the drop-in protocol
(``cgist.losses.base``), a step and ``MultiVectorFamily``: the loss stage is the MaxSim score's
(``cgist.losses.columns.TokenColumns``), which streams the MaxSim scores into the log-sum-exp instead of building the
token-similarity tensor (docs/design.md#late-interaction). Like sentence-transformers' classes, they take any model
whose output holds ``token_embeddings`` (a ``MultiVectorEncoder``, or a module that wraps one).
"""

from __future__ import annotations

from collections.abc import Mapping

import functools

import torch
import torch.nn.functional as F
from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.util import (
    all_gather_padded,
    cat_padded_token_embeddings,
    get_rank,
    similarity_fct_name,
    stack_padded_token_embeddings,
)
from torch import Tensor

from ..stage.spec.options import GistOptions, check_scale
from ..stage.spec.scores import SCORES
from .base import FusedDropIn
from .columns import TokenColumns
from .scorers import check_optional_size, scorer_settings
from .steps import CachedStep, PlainStep

__all__ = ["FusedCachedMultiVectorMultipleNegativesRankingLoss", "FusedMultiVectorMultipleNegativesRankingLoss",
           "MultiVectorFamily", "score_fields", "score_match"]

def score_match(similarity_fct: object, model: object) -> tuple[dict[str, object], dict[str, object]] | None:
    """The loss stage's score of ``similarity_fct`` (with ``model``'s own similarity where it is None), asked of every
    registered score's ``scorer`` (``Score.match``): the ``GistOptions`` fields of the score and its door's keyword
    arguments, or None for a score that no registered score computes (a custom callable)."""
    for score in SCORES:
        match = score.match(similarity_fct, model)
        if match is not None:
            return match
    return None


def score_fields(similarity_fct: object, model: object) -> dict[str, object] | None:
    """``score_match``'s ``GistOptions`` fields (``similarity``, and its ``score_options``), or None."""
    match = score_match(similarity_fct, model)
    return None if match is None else match[0]


class MultiVectorFamily(FusedDropIn):
    """The multi-vector ranking family: the loss stage's options from ``scale`` and ``similarity_fct`` (MaxSim,
    MeanMaxSim or XTR fused, ``score_fields``; any other score runs sentence-transformers' code), over the token
    embeddings and their masks
    (``calculate_loss(reps, masks_chunks)``, as sentence-transformers' cached class calls it)."""

    family = "multi_vector"
    family_attributes = ("scale", "similarity_fct")
    family_embedding_attributes = ("mini_batch_size", "score_mini_batch_size")
    #: Any module, as sentence-transformers' classes take: one whose output holds ``token_embeddings``.
    model_class = torch.nn.Module
    columns = TokenColumns()
    # Its own dimensions are a loss per dimension (sentence-transformers' decoration), each fused.
    fuses_matryoshka = False

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        check_scale(arguments["scale"])

    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        super()._check_embedding_stage(values)
        # sentence-transformers' plain class embeds the documents in chunks of mini_batch_size rows, None: at once
        check_optional_size("mini_batch_size", values["mini_batch_size"])
        # its plain class scores `score_mini_batch_size or batch_size` queries at a time (0: all of them), its cached
        # class steps through the queries by it
        score_rows = values["score_mini_batch_size"]
        if self.replaces is MultiVectorMultipleNegativesRankingLoss:
            score_rows = score_rows or None
        check_optional_size("score_mini_batch_size", score_rows)

    def _family_key(self) -> tuple:
        model = getattr(self, "model", None)
        scorer = getattr(model, "_similarity", None)
        return (getattr(model, "similarity_fn_name", None), type(scorer), scorer_settings(scorer),
                scorer_settings(self.similarity_fct))

    def _family_options(self) -> tuple[GistOptions | None, str | None]:
        scale = check_scale(self.scale)
        match = score_match(self.similarity_fct, getattr(self, "model", None))
        if match is None:
            name = "the model's similarity" if self.similarity_fct is None else similarity_fct_name(self.similarity_fct)
            return None, (f"similarity_fct={name} (the fused stage computes MaxSim, MeanMaxSim and XTR: "
                          "colbert_scores, mean_colbert_scores, xtr_scores, XTRScores, a functools.partial of one, "
                          "or the model's maxsim / meanmaxsim; or one a registered score's scorer recognises)")
        fields = {"contrast_anchors": False, "contrast_positives": False, **self._option_fields()}
        return GistOptions(**match[0], temperature=1.0 / scale, **fields), None

    def _score_arguments(self) -> dict[str, object]:
        """The door's keyword arguments of the score (``score_match``): a learned parameter of ``similarity_fct``."""
        return score_match(self.similarity_fct, getattr(self, "model", None))[1]

    def _option_fields(self) -> dict[str, object]:
        """The family: the options' fields beyond the score and the scale (default: cgist's own options)."""
        return self.own_fields()

    def temperature_tensor(self) -> Tensor | None:
        """``1 / scale`` where ``scale`` is a tensor (a learned one, which gets sentence-transformers' gradient
        through it)."""
        if not isinstance(self.scale, Tensor):
            return None
        check_scale(self.scale)
        return 1.0 / self.scale

    def _embeddings_loss(self, reps: list[list[Tensor]], masks_chunks: object) -> Tensor:
        """sentence-transformers' scoring and cross-entropy over given token embeddings (its multi-vector class's
        ``forward`` after the embedding): the plain drop-ins' unfused loss."""
        (queries, query_mask), *columns = (cat_padded_token_embeddings(r, m) for r, m in zip(reps, masks_chunks))
        documents, masks = [e for e, _ in columns], [m for _, m in columns]
        batch = queries.shape[0]
        if self.gather_across_devices:
            gathered = [all_gather_padded(e, m, with_grad=True) for e, m in zip(documents, masks)]
            documents, masks = [e for e, _ in gathered], [m for _, m in gathered]
        stacked, stacked_mask = stack_padded_token_embeddings(documents, masks)
        score = self.similarity_fct or functools.partial(_model_scores, self.model)
        step = self.score_mini_batch_size or batch
        scores = torch.cat([score(queries[i:i + step], stacked, queries_mask=query_mask[i:i + step],
                                  documents_mask=stacked_mask) for i in range(0, batch, step)])
        labels = torch.arange(batch, device=queries.device) * len(documents)
        if self.gather_across_devices:
            labels = labels + get_rank() * batch * len(documents)
        return F.cross_entropy(scores * self.scale, labels)



class FusedCachedMultiVectorMultipleNegativesRankingLoss(MultiVectorFamily, CachedStep,
                                                         CachedMultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss`` with a fused, streaming loss stage.

    A drop-in: the same arguments, defaults, attributes, loss and gradients, with a loss stage that never holds the
    ``(queries, documents, query tokens, document tokens)`` similarities: row blocks of queries, each swept over
    blocks of documents twice, the first sweep keeping the block's MaxSim scores and argmax (as many queries as fit
    ``block_bytes``), the second sending the gradients along the argmax (``cgist.maxsim_loss``). The
    embedding stage is sentence-transformers' own GradCache loop; each mini-batch's ``.grad`` is filled as its
    second pass reads it.

    Fused when ``similarity_fct`` is MaxSim or MeanMaxSim: sentence-transformers' default (the model's ``maxsim`` /
    ``meanmaxsim``, with or without its kernels), ``colbert_scores``, ``mean_colbert_scores``, or a
    ``functools.partial`` of either binding ``chunk_elements`` or ``length_normalize``; or XTR: ``xtr_scores``,
    ``XTRScores(top_k)``, or a ``functools.partial`` of ``xtr_scores`` binding ``top_k`` or ``chunk_elements``
    (each query token retrieves from every document of the batch, gathered with ``gather_across_devices``; the
    thresholds' sweep keeps ``top_k`` values per query token). Any other score (a custom callable) runs
    sentence-transformers' own computation (one warning says so). ``score_mini_batch_size`` and ``chunk_elements``
    only bound sentence-transformers' memory; the fused stage's is ``block_bytes``.
    """


class FusedMultiVectorMultipleNegativesRankingLoss(MultiVectorFamily, PlainStep, MultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss`` with a fused, streaming loss stage.

    A drop-in: the same arguments, defaults, attributes, loss and gradients, with the loss stage of
    ``FusedCachedMultiVectorMultipleNegativesRankingLoss``. The student embeds the batch as sentence-transformers
    does (the queries, then the document columns merged, in chunks of ``mini_batch_size`` rows) and autograd takes
    the loss stage's gradients back into it. What is fused, and what runs sentence-transformers' code, is as for
    the cached drop-in.
    """


def _model_scores(model: torch.nn.Module, queries: Tensor, documents: Tensor, **masks: Tensor) -> Tensor:
    """sentence-transformers 6.3's default score: the model's similarity over the stacked documents."""
    from sentence_transformers.multi_vector_encoder.scoring.colbert import _colbert_scores

    return _colbert_scores(model.similarity, queries, documents, **masks)
