"""The multi-vector family: sentence-transformers' late-interaction (ColBERT, MaxSim) ranking losses,
``MultiVectorMultipleNegativesRankingLoss`` and its cached (GradCache) form, each one class over the drop-in protocol
(``cgist.losses.base``), a step and ``MultiVectorFamily``: the loss stage is the MaxSim score's
(``cgist.losses.columns.TokenColumns``), which streams the MaxSim scores into the log-sum-exp instead of building the
token-similarity tensor (docs/design.md#late-interaction). Like sentence-transformers' classes, they take any model
whose output holds ``token_embeddings`` (a ``MultiVectorEncoder``, or a module that wraps one).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Mapping

import torch
from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import XTRScores, colbert_scores, mean_colbert_scores, xtr_scores
from sentence_transformers.util import similarity as st_similarity
from sentence_transformers.util import similarity_fct_name
from torch import Tensor

from ..stage.spec.options import GistOptions, check_scale
from .columns import TokenColumns
from .steps import CachedStep, PlainStep

__all__ = ["FusedCachedMultiVectorMultipleNegativesRankingLoss", "FusedMultiVectorMultipleNegativesRankingLoss",
           "MultiVectorFamily", "maxsim_normalization", "score_fields"]

#: sentence-transformers' MaxSim scorers, by whether they divide by the query's token count (MeanMaxSim).
_SCORERS = {colbert_scores: False, mean_colbert_scores: True}
#: The keywords a ``functools.partial`` of them may bind: ``chunk_elements`` only bounds their memory.
_BINDABLE = {"chunk_elements", "length_normalize"}
#: The keywords a ``functools.partial`` of ``xtr_scores`` may bind, and its ``top_k`` when it binds none.
_XTR_BINDABLE = {"chunk_elements", "top_k"}
_XTR_TOP_K = inspect.signature(xtr_scores).parameters["top_k"].default


def maxsim_normalization(similarity_fct: object, model: object) -> bool | None:
    """Whether ``similarity_fct`` (with ``model``'s own similarity when it is None, as sentence-transformers 6.3
    scores by default) is MeanMaxSim (True) or MaxSim (False); None for any other score (XTR, which ``score_fields``
    reads, or a custom callable)."""
    if similarity_fct is None:
        getattr(model, "similarity_fn_name", None)  # sets the model's scorer on first use
        scorer = getattr(model, "_similarity", None)
        if type(scorer).__name__ == "_MaxSimScorer":  # the model's kernels (use_kernels): the same scores
            return bool(scorer.length_normalize)
        for name, length_normalize in (("maxsim", False), ("mean_maxsim", True)):
            if scorer is not None and scorer is getattr(st_similarity, name, None):
                return length_normalize
        return None
    keywords: Mapping[str, object] = {}
    if isinstance(similarity_fct, functools.partial):
        if similarity_fct.args or not set(similarity_fct.keywords) <= _BINDABLE:
            return None
        similarity_fct, keywords = similarity_fct.func, similarity_fct.keywords
    if similarity_fct not in _SCORERS:
        return None
    length_normalize = keywords.get("length_normalize", _SCORERS[similarity_fct])
    return length_normalize if isinstance(length_normalize, bool) else None


def score_fields(similarity_fct: object, model: object) -> dict[str, object] | None:
    """The loss stage's score of ``similarity_fct`` as ``GistOptions`` fields: ``similarity`` (``"maxsim"``,
    ``"mean_maxsim"``, ``maxsim_normalization``; ``"xtr"``) and XTR's ``top_k``; None for a score the fused stage
    does not compute (a custom callable). XTR: ``xtr_scores`` (its default ``top_k``), a ``functools.partial`` of it
    binding ``top_k`` or ``chunk_elements``, or an ``XTRScores``; ``chunk_elements`` only bounds
    sentence-transformers' memory, and is checked (the fused stage's is ``block_bytes``)."""
    if type(similarity_fct) is XTRScores:
        _check_optional_size("chunk_elements", similarity_fct.chunk_elements)
        return {"similarity": "xtr", "top_k": similarity_fct.top_k}
    if similarity_fct is xtr_scores:
        return {"similarity": "xtr", "top_k": _XTR_TOP_K}
    if isinstance(similarity_fct, functools.partial) and similarity_fct.func is xtr_scores:
        keywords = similarity_fct.keywords
        if similarity_fct.args or not set(keywords) <= _XTR_BINDABLE:
            return None
        _check_optional_size("chunk_elements", keywords.get("chunk_elements"))
        return {"similarity": "xtr", "top_k": keywords.get("top_k", _XTR_TOP_K)}
    length_normalize = maxsim_normalization(similarity_fct, model)
    if length_normalize is None:
        return None
    if isinstance(similarity_fct, functools.partial):
        _check_optional_size("chunk_elements", similarity_fct.keywords.get("chunk_elements"))
    return {"similarity": "mean_maxsim" if length_normalize else "maxsim"}


def _check_optional_size(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


class MultiVectorFamily(TokenColumns):
    """The multi-vector ranking family: the loss stage's options from ``scale`` and ``similarity_fct`` (MaxSim,
    MeanMaxSim or XTR fused, ``score_fields``; any other score runs sentence-transformers' code), over the token
    embeddings and their masks
    (``calculate_loss(reps, masks_chunks)``, as sentence-transformers' cached class calls it)."""

    family = "multi_vector"
    family_attributes = ("scale", "similarity_fct")
    family_embedding_attributes = ("mini_batch_size", "score_mini_batch_size")
    #: Any module, as sentence-transformers' classes take: one whose output holds ``token_embeddings``.
    model_class = torch.nn.Module

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        check_scale(arguments["scale"])

    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        super()._check_embedding_stage(values)
        # sentence-transformers' plain class embeds the documents in chunks of mini_batch_size rows, None: at once
        _check_optional_size("mini_batch_size", values["mini_batch_size"])
        # its plain class scores `score_mini_batch_size or batch_size` queries at a time (0: all of them), its cached
        # class steps through the queries by it
        score_rows = values["score_mini_batch_size"]
        if isinstance(self, PlainStep):
            score_rows = score_rows or None
        _check_optional_size("score_mini_batch_size", score_rows)

    def _family_key(self) -> tuple:
        model = getattr(self, "model", None)
        scorer = getattr(model, "_similarity", None)
        return (getattr(model, "similarity_fn_name", None), type(scorer), getattr(scorer, "length_normalize", None),
                getattr(self.similarity_fct, "top_k", None), getattr(self.similarity_fct, "chunk_elements", None))

    def _family_options(self) -> tuple[GistOptions | None, str | None]:
        scale = check_scale(self.scale)
        score = score_fields(self.similarity_fct, getattr(self, "model", None))
        if score is None:
            name = "the model's similarity" if self.similarity_fct is None else similarity_fct_name(self.similarity_fct)
            return None, (f"similarity_fct={name} (the fused stage computes MaxSim, MeanMaxSim and XTR: "
                          "colbert_scores, mean_colbert_scores, xtr_scores, XTRScores, a functools.partial of one, "
                          "or the model's maxsim / meanmaxsim)")
        fields = {"contrast_anchors": False, "contrast_positives": False, **self._option_fields()}
        return GistOptions(**score, temperature=1.0 / scale, **fields), None

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
