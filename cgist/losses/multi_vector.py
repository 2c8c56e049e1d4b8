"""The multi-vector family: sentence-transformers' late-interaction (ColBERT, MaxSim) ranking losses,
``MultiVectorMultipleNegativesRankingLoss`` and its cached (GradCache) form, each one class over the drop-in protocol
(``cgist.losses.base``), a step and ``MultiVectorFamily``: the loss stage is ``cgist.maxsim_loss``, which streams the
MaxSim scores into the log-sum-exp instead of building the token-similarity tensor (docs/design.md#late-interaction).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sentence_transformers.base.losses.merged_forward import embed_columns_padded
from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores
from sentence_transformers.util import (
    all_gather,
    all_gather_padded,
    cat_padded_token_embeddings,
    get_rank,
    similarity_fct_name,
    stack_padded_token_embeddings,
)
from sentence_transformers.util import similarity as st_similarity
from torch import Tensor

from ..maxsim import maxsim_loss
from .base import FUSED, UNFUSED, FusedDropIn, check_equal_batches
from .steps import CachedStep, check_embedding_stage, check_gather

__all__ = ["FusedCachedMultiVectorMultipleNegativesRankingLoss", "FusedMultiVectorMultipleNegativesRankingLoss",
           "MaxSimOptions", "MultiVectorFamily", "maxsim_normalization"]

#: sentence-transformers' MaxSim scorers, by whether they divide by the query's token count (MeanMaxSim).
_SCORERS = {colbert_scores: False, mean_colbert_scores: True}
#: The keywords a ``functools.partial`` of them may bind: ``chunk_elements`` only bounds their memory.
_BINDABLE = {"chunk_elements", "length_normalize"}


def maxsim_normalization(similarity_fct: object, model: object) -> bool | None:
    """Whether ``similarity_fct`` (with ``model``'s own similarity when it is None, as sentence-transformers 6.3
    scores by default) is MeanMaxSim (True) or MaxSim (False); None for any other score (XTR, a custom callable),
    which the fused stage does not compute."""
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


@dataclass(frozen=True)
class MaxSimOptions:
    """The multi-vector loss stage's options: ``scale``, MeanMaxSim or not, the tile budget, and the guided family's
    (``cgist.losses.multi_vector_gist``): the margin, its strategy, the duplicates' and self-pairs' masks, GIST's
    contrast blocks and the guide's own MeanMaxSim (for a multi-vector guide)."""

    scale: float
    length_normalize: bool
    block_bytes: int | None = None
    margin: float = 0.0
    margin_strategy: str = "absolute"
    mask_duplicates: bool = False
    mask_self: bool = True
    contrast_anchors: bool = False
    contrast_positives: bool = False
    guide_length_normalize: bool = False


def _check_scale(scale: object) -> None:
    """sentence-transformers' check of ``scale`` (its message), and a finite one: an infinite scale makes the loss NaN."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not scale > 0:
        raise ValueError("Scale must be a positive value.")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}: the scaled scores would be infinite")


def _check_optional_size(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


class MultiVectorFamily(FusedDropIn):
    """The multi-vector ranking family: the loss stage's options from ``scale`` and ``similarity_fct`` (MaxSim or
    MeanMaxSim fused; any other score runs sentence-transformers' code), and the loss stage over the token embeddings
    and their masks (``calculate_loss(reps, masks_chunks)``, as sentence-transformers' cached class calls it)."""

    family = "multi_vector"
    family_attributes = ("scale", "similarity_fct")
    model_class = MultiVectorEncoder
    # Its own dimensions are a loss per dimension (sentence-transformers' decoration), each fused.
    fuses_matryoshka = False

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        _check_scale(arguments["scale"])

    def _family_key(self) -> tuple:
        model = getattr(self, "model", None)
        scorer = getattr(model, "_similarity", None)
        return (getattr(model, "similarity_fn_name", None), type(scorer), getattr(scorer, "length_normalize", None))

    def _family_options(self) -> tuple[MaxSimOptions | None, str | None]:
        _check_scale(self.scale)
        length_normalize = maxsim_normalization(self.similarity_fct, getattr(self, "model", None))
        if length_normalize is None:
            name = "the model's similarity" if self.similarity_fct is None else similarity_fct_name(self.similarity_fct)
            return None, (f"similarity_fct={name} (the fused stage computes MaxSim and MeanMaxSim: colbert_scores, "
                          "mean_colbert_scores, or the model's maxsim / meanmaxsim)")
        return MaxSimOptions(scale=float(self.scale), length_normalize=length_normalize, **self.own_fields()), None

    def _guide_arguments(self, reps: list[list[Tensor]], options: MaxSimOptions) -> dict[str, object] | None:
        """The family: ``maxsim_loss``'s guide arguments for a step (None: an unguided family)."""
        return None

    def loss_stage(self, reps: list[list[Tensor]], masks_chunks: object, *, with_backward: bool,
                   dims: tuple[tuple[int, float], ...] | None = None) -> Tensor:
        """The loss over a step's token embeddings ``reps`` and masks ``masks_chunks`` (each column's mini-batches):
        ``cgist.maxsim_loss``, or sentence-transformers' own computation where it does not run."""
        if dims is not None:  # fuses_matryoshka is off: sentence-transformers' decoration calls once per dimension
            raise NotImplementedError("the multi-vector loss stage computes one Matryoshka dimension per call")
        options = self.resolve()
        if options is None:
            self.record_path(UNFUSED)
            return self._unfused_loss(reps, masks_chunks, with_backward)
        if masks_chunks is None or len(masks_chunks) != len(reps):
            raise TypeError("calculate_loss of a multi-vector drop-in takes the token embeddings' masks beside them, "
                            "one list of mini-batch masks per column (masks_chunks)")
        queries, *documents = (list(r) for r in reps)
        query_masks, *document_masks = (list(m) for m in masks_chunks)
        guide = self._guide_arguments(reps, options)
        offset = 0
        if self.gather_across_devices:
            batch = sum(q.shape[0] for q in queries)
            check_equal_batches(batch, queries[0].device)
            gathered = [all_gather_padded(*cat_padded_token_embeddings(c, m), with_grad=True)
                        for c, m in zip(documents, document_masks)]
            documents, document_masks = [[e] for e, _ in gathered], [[m] for _, m in gathered]
            offset = get_rank() * batch
            guide = None if guide is None else _gathered_guide(guide)
        loss, stats = maxsim_loss(queries, query_masks, documents, document_masks, scale=options.scale,
                                  length_normalize=options.length_normalize, offset=offset,
                                  block_bytes=options.block_bytes, backend=self.backend, return_stats=True,
                                  **(guide or {}))
        self.record_path(FUSED, None if guide is None else stats)
        if guide is not None:
            self._after_fused(reps, stats, options)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss


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
    ``functools.partial`` of either binding ``chunk_elements`` or ``length_normalize``. Any other score (XTR, a custom
    callable) runs sentence-transformers' own computation (one warning says so). ``score_mini_batch_size`` only
    bounds sentence-transformers' memory; the fused stage's is ``block_bytes``.
    """

    embedding_attributes = ("mini_batch_size", "mini_batch_num_tokens", "score_mini_batch_size",
                            "gather_across_devices")

    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        check_embedding_stage(values["mini_batch_size"], values["mini_batch_num_tokens"],
                              values["gather_across_devices"])
        _check_optional_size("score_mini_batch_size", values["score_mini_batch_size"])


class FusedMultiVectorMultipleNegativesRankingLoss(MultiVectorFamily, MultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss`` with a fused, streaming loss stage.

    A drop-in: the same arguments, defaults, attributes, loss and gradients, with the loss stage of
    ``FusedCachedMultiVectorMultipleNegativesRankingLoss``. The student embeds the batch as sentence-transformers
    does (the queries, then the document columns merged, in chunks of ``mini_batch_size`` rows) and autograd takes
    the loss stage's gradients back into it. What is fused, and what runs sentence-transformers' code, is as for
    the cached drop-in.
    """

    embedding_attributes = ("mini_batch_size", "score_mini_batch_size", "gather_across_devices")

    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        _check_optional_size("mini_batch_size", values["mini_batch_size"])
        _check_optional_size("score_mini_batch_size", values["score_mini_batch_size"])
        check_gather(values["gather_across_devices"])

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """sentence-transformers' embedding of the batch, then the fused loss stage; its own ``forward`` where the
        fused stage does not run."""
        options = self.resolve()
        if options is None:
            self.record_path(UNFUSED)
            return super().forward(sentence_features, labels)
        features = [dict(feature) for feature in sentence_features]
        inputs = self._step_inputs(features, labels, options)  # before the student writes into the features
        query = features[0]
        outputs = self.model(query, task=query.get("task", "query"))
        documents, masks = embed_columns_padded(self.model, features[1:], self.mini_batch_size,
                                                task_default="document")
        with self.reading(inputs):
            return self.calculate_loss([[outputs["token_embeddings"]], *([d] for d in documents)],
                                       [[outputs["attention_mask"].bool()], *([m] for m in masks)])

    def _unfused_loss(self, reps: list[list[Tensor]], masks_chunks: object, with_backward: bool) -> Tensor:
        """sentence-transformers' scoring and cross-entropy over given token embeddings (its ``forward`` after the
        embedding)."""
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
        loss = F.cross_entropy(scores * self.scale, labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss


def _gathered_guide(guide: dict[str, object]) -> dict[str, object]:
    """``maxsim_loss``'s guide arguments with the document columns' guide and text ids gathered from every rank, as
    the documents are (the queries' stay local); a multi-vector guide's token axis padded to the ranks' longest."""
    out = dict(guide)
    columns = guide.get("guide")
    if isinstance(columns, list):
        if guide.get("guide_masks") is None:
            out["guide"] = [columns[0], *(all_gather(torch.cat(_listed(c))) for c in columns[1:])]
        else:
            gathered = [all_gather_padded(*cat_padded_token_embeddings(_listed(c), _listed(m)))
                        for c, m in zip(columns[1:], guide["guide_masks"][1:])]
            out["guide"] = [columns[0], *(e for e, _ in gathered)]
            out["guide_masks"] = [guide["guide_masks"][0], *(m for _, m in gathered)]
    if guide.get("text_ids") is not None:
        out["text_ids"] = [guide["text_ids"][0], *(all_gather(t) for t in guide["text_ids"][1:])]
    return out


def _listed(value: Tensor | list[Tensor]) -> list[Tensor]:
    """A tensor or a list of row chunks, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _model_scores(model: MultiVectorEncoder, queries: Tensor, documents: Tensor, **masks: Tensor) -> Tensor:
    """sentence-transformers 6.3's default score: the model's similarity over the stacked documents."""
    from sentence_transformers.multi_vector_encoder.scoring.colbert import _colbert_scores

    return _colbert_scores(model.similarity, queries, documents, **masks)
