"""The ranking family: sentence-transformers' ``MultipleNegativesRankingLoss`` and
``MultipleNegativesSymmetricRankingLoss``, cached and plain, each one class over the drop-in protocol
(``cgist.losses.base``), a step (``cgist.losses.steps``) and ``RankingFamily``: the options from the ranking
hyperparameters, without a guide.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    CachedMultipleNegativesSymmetricRankingLoss,
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score, similarity_fct_name
from torch import Tensor

from ..stage.spec.options import GistOptions, check_scale, real_number
from .base import FusedDropIn
from .columns import DenseColumns
from .steps import CachedStep, PlainStep

__all__ = ["FusedCachedMultipleNegativesRankingLoss", "FusedCachedMultipleNegativesSymmetricRankingLoss",
           "FusedMultipleNegativesRankingLoss", "FusedMultipleNegativesSymmetricRankingLoss", "RankingFamily",
           "similarity_name"]

def similarity_name(similarity_fct: object) -> str | None:
    """``"cos"`` for sentence-transformers' ``cos_sim``, ``"dot"`` for ``dot_score`` (each also as a
    ``functools.partial`` that binds nothing), None for any other function: the fused stage computes those two."""
    if isinstance(similarity_fct, functools.partial) and not similarity_fct.args and not similarity_fct.keywords:
        similarity_fct = similarity_fct.func
    return "cos" if similarity_fct is cos_sim else "dot" if similarity_fct is dot_score else None


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """``logger_name``'s records dropped for the duration (a check that repeats a constructor's warnings)."""
    named = logging.getLogger(logger_name)
    disabled, named.disabled = named.disabled, True
    try:
        yield
    finally:
        named.disabled = disabled


def _deprecation(replaced: str, instead: str) -> str:
    """The ``DeprecationWarning`` of a symmetric drop-in: sentence-transformers deprecates ``replaced``."""
    return (f"{replaced} is deprecated by sentence-transformers; use cgist.{instead}(model, "
            "directions=('query_to_doc', 'doc_to_query'), partition_mode='per_direction'), which computes the same loss")


class RankingFamily(FusedDropIn):
    """The ranking family: the fused loss stage's options from sentence-transformers' ranking hyperparameters (no
    guide, no contrast blocks)."""

    family = "ranking"
    columns = DenseColumns()
    # The symmetric losses' constructors take no directions; their parent sets them, and they are read all the same.
    family_attributes = ("scale", "similarity_fct", "directions", "partition_mode", "hardness_mode",
                         "hardness_strength")

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        real_number("scale", arguments["scale"])

    def _family_options(self) -> tuple[GistOptions | None, str | None]:
        scale = real_number("scale", self.scale)
        # sentence-transformers' own checks of the ranking hyperparameters, with their messages: its constructor's
        # (its warnings were given when this loss was built).
        with _quiet(MultipleNegativesRankingLoss.__module__):
            MultipleNegativesRankingLoss(
                getattr(self, "model", None), scale=scale, similarity_fct=self.similarity_fct,
                gather_across_devices=self.gather_across_devices, directions=self.directions,
                partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
                hardness_strength=self.hardness_strength,
            )
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}: the scaled similarities would be infinite")
        similarity = similarity_name(self.similarity_fct)
        if similarity is None:
            return None, (f"similarity_fct={similarity_fct_name(self.similarity_fct)} (the fused stage computes "
                          "sentence-transformers' cos_sim and dot_score)")
        return GistOptions(
            temperature=1.0 / scale, contrast_anchors=False, contrast_positives=False, directions=self.directions,
            partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength, similarity=similarity, **self.own_fields(),
        ), None

    def temperature_tensor(self) -> Tensor | None:
        """``1 / scale`` where ``scale`` is a tensor (a learned one, which gets its gradient through it)."""
        if not isinstance(self.scale, Tensor):
            return None
        check_scale(self.scale)
        return 1.0 / self.scale

    def _embeddings_loss(self, reps: list[list[Tensor]], labels: Tensor | None) -> Tensor:
        """The plain drop-ins' unfused loss (``PlainStep``): sentence-transformers' over the concatenated columns."""
        return self.replaces.compute_loss_from_embeddings(self, [torch.cat(r) for r in reps], labels)


class FusedCachedMultipleNegativesRankingLoss(RankingFamily, CachedStep, CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` with a fused, streaming loss stage.

    A drop-in for ``CachedMultipleNegativesRankingLoss``: the same arguments, defaults, attributes, loss and
    gradients, with a loss stage that never forms the B x N similarity matrix. It is ``FusedCachedGISTLoss``'s loss
    stage without a guide: every direction, both partition modes, the hardness penalty and ``gather_across_devices``
    run as matrix products over blocks of anchors with a streaming log-sum-exp (Triton kernels on CUDA, a blockwise
    PyTorch computation elsewhere).

    The hyperparameters stay sentence-transformers' attributes and are read at each call, so ``loss.scale = 5.0``
    takes effect on the next one (and is checked then, as the constructor checks it). ``similarity_fct``
    ``sentence_transformers.util.cos_sim`` or ``dot_score`` runs fused; any other function runs sentence-transformers'
    own loss computation (one warning says so). cgist's own options, keyword-only: ``backend`` and ``block_bytes``
    (docs/losses.md#cgists-own-options).

    Raises:
        TypeError, ValueError: for a bad argument, naming it, before anything is computed (sentence-transformers' own
            arguments with its messages).
    """


class FusedMultipleNegativesRankingLoss(RankingFamily, PlainStep, MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` with a fused, streaming loss stage.

    A drop-in for ``MultipleNegativesRankingLoss``: the same arguments, defaults, attributes, loss and gradients, with
    the loss stage of ``FusedCachedMultipleNegativesRankingLoss`` (no B x N similarity matrix). The student embeds the
    batch in one forward pass and the gradients reach it through autograd, as in sentence-transformers;
    ``MatryoshkaLoss`` around it computes every dimension in one loss stage (``cgist.losses.matryoshka``). cgist's
    own options, keyword-only: ``backend`` and ``block_bytes`` (docs/losses.md#cgists-own-options).
    """


# sentence-transformers deprecates the symmetric losses in favour of the directions; subclassing them is not using them.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    class FusedCachedMultipleNegativesSymmetricRankingLoss(RankingFamily, CachedStep,
                                                           CachedMultipleNegativesSymmetricRankingLoss):
        """sentence-transformers' ``CachedMultipleNegativesSymmetricRankingLoss`` with a fused, streaming loss stage:
        the same arguments, defaults, attributes, loss and gradients (query-to-document and document-to-query, one
        softmax each, averaged), with the loss stage of ``FusedCachedMultipleNegativesRankingLoss``.

        sentence-transformers deprecates its class for ``CachedMultipleNegativesRankingLoss(model,
        directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")``; so does this one, for
        ``cgist.FusedCachedMultipleNegativesRankingLoss`` with the same arguments (a ``DeprecationWarning``).
        """

        deprecation = _deprecation("CachedMultipleNegativesSymmetricRankingLoss", "FusedCachedMultipleNegativesRankingLoss")

    class FusedMultipleNegativesSymmetricRankingLoss(RankingFamily, PlainStep, MultipleNegativesSymmetricRankingLoss):
        """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` with a fused, streaming loss stage: the
        same arguments, defaults, attributes, loss and gradients, with the loss stage of
        ``FusedMultipleNegativesRankingLoss``.

        sentence-transformers deprecates its class for ``MultipleNegativesRankingLoss(model,
        directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")``; so does this one, for
        ``cgist.FusedMultipleNegativesRankingLoss`` with the same arguments (a ``DeprecationWarning``).
        """

        deprecation = _deprecation("MultipleNegativesSymmetricRankingLoss", "FusedMultipleNegativesRankingLoss")
