"""The ranking drop-ins: sentence-transformers' ``CachedMultipleNegativesRankingLoss`` and
``CachedMultipleNegativesSymmetricRankingLoss`` with the fused loss stage every drop-in shares (``cgist.losses.base``), without
a guide.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    CachedMultipleNegativesSymmetricRankingLoss,
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score, similarity_fct_name
from torch import Tensor

from ..stage.dispatch.route import requested_backend
from ..stage.spec.options import GistOptions, _check_real
from .base import FUSED, UNFUSED, FusedDropIn, attribute_key, check_embedding_stage, check_gather, fused_loss_stage

__all__ = ["FusedCachedMultipleNegativesRankingLoss", "FusedCachedMultipleNegativesSymmetricRankingLoss",
           "FusedMultipleNegativesRankingLoss", "FusedMultipleNegativesSymmetricRankingLoss", "similarity_name"]

#: The attributes the ranking drop-ins read at each call: sentence-transformers' (the ranking hyperparameters live
#: on its wrapped ``MultipleNegativesRankingLoss``, and read through) and cgist's own.
_RANKING_ATTRIBUTES = (
    "scale", "similarity_fct", "gather_across_devices", "directions", "partition_mode", "hardness_mode",
    "hardness_strength", "mini_batch_size", "mini_batch_num_tokens", "backend", "block_bytes",
)


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


class _FusedRanking(FusedDropIn):
    """The fused loss stage under sentence-transformers' ranking losses: options from their attributes."""

    def options_key(self) -> tuple:
        return attribute_key(self, _RANKING_ATTRIBUTES)

    def build_options(self) -> tuple[GistOptions | None, str | None]:
        self._check_embedding_stage()
        requested_backend(self.backend)
        _check_real("scale", self.scale)
        # sentence-transformers' own checks of the ranking hyperparameters, with their messages: its constructor's
        # (its warnings were given when this loss was built).
        with _quiet(MultipleNegativesRankingLoss.__module__):
            MultipleNegativesRankingLoss(
                getattr(self, "model", None), scale=self.scale, similarity_fct=self.similarity_fct,
                gather_across_devices=self.gather_across_devices, directions=self.directions,
                partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
                hardness_strength=self.hardness_strength,
            )
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {self.scale!r}: the scaled similarities would be infinite")
        similarity = similarity_name(self.similarity_fct)
        if similarity is None:
            return None, (f"similarity_fct={similarity_fct_name(self.similarity_fct)} (the fused stage computes "
                          "sentence-transformers' cos_sim and dot_score)")
        return GistOptions(
            temperature=1.0 / self.scale, contrast_anchors=False, contrast_positives=False, directions=self.directions,
            partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength, similarity=similarity, block_bytes=self.block_bytes,
        ), None

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None, *,
                       with_backward: bool = False) -> Tensor:
        """Loss over a step's embeddings, each column a list of row chunks (the labels are unused: the positive pair
        is the diagonal).

        With ``with_backward`` the embedding gradients are accumulated into ``.grad`` of the leaves in ``reps`` and
        a detached scalar is returned; without, the loss is differentiable with respect to them; under
        ``torch.no_grad`` only the loss is computed.
        """
        return self._loss_stage(reps, labels, with_backward=with_backward)

    def _loss_stage(self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool,
                    dims: tuple[tuple[int, float], ...] | None = None) -> Tensor:
        options = self.resolve()
        if options is None:
            self.record_path(UNFUSED)
            return self._unfused_loss(reps, labels, with_backward)
        loss, stats = fused_loss_stage(reps, None, None, options, backend=self.backend,
                                       gather=self.gather_across_devices, with_backward=with_backward, dims=dims)
        self.record_path(FUSED, stats)
        return loss

    def get_config_dict(self) -> dict:
        """sentence-transformers' configuration, key for key, then cgist's own arguments where they differ from their
        defaults."""
        return {**super().get_config_dict(), **self.own_config()}

    def _check_embedding_stage(self) -> None:
        """The embedding stage's attributes, checked."""
        raise NotImplementedError

    def _unfused_loss(self, reps: list[list[Tensor]], labels: Tensor | None, with_backward: bool) -> Tensor:
        """sentence-transformers' own loss computation over a step's embeddings, where the fused stage does not run."""
        raise NotImplementedError

    def _take_own_arguments(self, backend: object, block_bytes: object) -> None:
        """cgist's arguments as attributes, after sentence-transformers' constructor; then every attribute checked, as
        it is again at each call once one changes."""
        self.backend = backend
        self.block_bytes = block_bytes
        self.resolve()


class _CachedRanking(_FusedRanking):
    """The cached ranking drop-ins: sentence-transformers' GradCache step around the fused loss stage."""

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        """sentence-transformers' GradCache step, the attributes checked first."""
        self.resolve()
        return super().forward(sentence_features, labels)

    def _check_embedding_stage(self) -> None:
        check_embedding_stage(self.mini_batch_size, self.mini_batch_num_tokens, self.gather_across_devices)

    def _unfused_loss(self, reps: list[list[Tensor]], labels: Tensor | None, with_backward: bool) -> Tensor:
        return CachedMultipleNegativesRankingLoss.calculate_loss(self, reps, labels, with_backward=with_backward)

    def _construct(self, parent: type, model: object, scale: object, mini_batch_size: object,
                   mini_batch_num_tokens: object, gather_across_devices: object, backend: object, block_bytes: object,
                   **arguments: object) -> None:
        """``parent``'s constructor (sentence-transformers' class) after cgist's own type checks, then cgist's
        attributes, and every argument checked as it is again at each call."""
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        _check_real("scale", scale)
        check_embedding_stage(mini_batch_size, mini_batch_num_tokens, gather_across_devices)
        parent.__init__(self, model, scale=scale, mini_batch_size=mini_batch_size,
                        mini_batch_num_tokens=mini_batch_num_tokens, gather_across_devices=gather_across_devices,
                        **arguments)
        self._take_own_arguments(backend, block_bytes)


class _PlainRanking(_FusedRanking):
    """The plain ranking drop-ins: the student embeds the batch once (sentence-transformers' ``embed_columns``) and
    autograd takes the fused loss stage's gradients back into it."""

    #: What ``MatryoshkaLoss`` asks: with it, ``MatryoshkaLoss`` hands this loss the whole batch and decorates
    #: ``calculate_loss``, which the drop-in takes over (every dimension in one loss stage), instead of running the loss
    #: once per dimension on a patched model.
    uses_gradient_cache = True

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        """The student's embeddings of the batch and the fused loss stage over them; sentence-transformers' own
        ``forward`` where the fused stage does not run."""
        if self.resolve() is None and "calculate_loss" not in self.__dict__:  # not decorated (MatryoshkaLoss)
            self.record_path(UNFUSED)
            return super().forward(sentence_features, labels)
        embeddings = embed_columns(self.model, list(sentence_features))
        return self.calculate_loss([[e] for e in embeddings], labels)

    def _check_embedding_stage(self) -> None:
        check_gather(self.gather_across_devices)

    def _unfused_loss(self, reps: list[list[Tensor]], labels: Tensor | None, with_backward: bool) -> Tensor:
        loss = MultipleNegativesRankingLoss.compute_loss_from_embeddings(self, [torch.cat(r) for r in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def _construct(self, parent: type, model: object, scale: object, gather_across_devices: object, backend: object,
                   block_bytes: object, **arguments: object) -> None:
        """``parent``'s constructor (sentence-transformers' class) after cgist's own type checks, then cgist's
        attributes, and every argument checked as it is again at each call."""
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        _check_real("scale", scale)
        check_gather(gather_across_devices)
        parent.__init__(self, model, scale=scale, gather_across_devices=gather_across_devices, **arguments)
        self._take_own_arguments(backend, block_bytes)


class FusedCachedMultipleNegativesRankingLoss(_CachedRanking, CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` with a fused, streaming loss stage."""

    def __init__(
        self,
        model: SentenceTransformer,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        directions: tuple[str, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        show_progress_bar: bool = False,
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None,
        hardness_strength: float = 0.0,
        backend: Literal["auto", "torch", "triton"] = "auto",
        block_bytes: int | None = None,
    ) -> None:
        """
        A drop-in for ``CachedMultipleNegativesRankingLoss``: the same arguments, defaults, attributes, loss and
        gradients, with a loss stage that never forms the B x N similarity matrix. It is ``FusedCachedGISTLoss``'s
        loss stage without a guide: every direction, both partition modes, the hardness penalty and
        ``gather_across_devices`` run as matrix products over blocks of anchors with a streaming log-sum-exp (Triton
        kernels on CUDA, a blockwise PyTorch computation elsewhere).

        The hyperparameters stay sentence-transformers' attributes and are read at each call, so ``loss.scale = 5.0``
        takes effect on the next one (and is checked then, as the constructor checks it).

        Args:
            model: the SentenceTransformer being trained.
            scale: multiplies the similarities before the softmax (1 / temperature).
            similarity_fct: ``sentence_transformers.util.cos_sim`` or ``dot_score`` run fused; any other function
                runs sentence-transformers' own loss computation (one warning says so).
            mini_batch_size, mini_batch_num_tokens, show_progress_bar: the embedding stage's, as in
                sentence-transformers.
            gather_across_devices: score this rank's rows against every rank's candidates (and anchors, for the
                directions that read them).
            directions, partition_mode, hardness_mode, hardness_strength: sentence-transformers' meaning (see
                ``cgist.GistOptions``).
            backend: ``"auto"``, ``"torch"`` or ``"triton"``, as for ``FusedCachedGISTLoss``.
            block_bytes: bytes of score buffers the loss stage may hold at once (None: a default for the device).

        Raises:
            TypeError, ValueError: for a bad argument, naming it, before anything is computed (sentence-transformers'
                own arguments with its messages).
        """
        self._construct(
            CachedMultipleNegativesRankingLoss, model, scale, mini_batch_size, mini_batch_num_tokens,
            gather_across_devices, backend, block_bytes, similarity_fct=similarity_fct, directions=directions,
            partition_mode=partition_mode, show_progress_bar=show_progress_bar, hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )


# sentence-transformers deprecates the symmetric loss in favour of the directions; subclassing it is not using it.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    class FusedCachedMultipleNegativesSymmetricRankingLoss(_CachedRanking, CachedMultipleNegativesSymmetricRankingLoss):
        """sentence-transformers' ``CachedMultipleNegativesSymmetricRankingLoss`` with a fused, streaming loss stage."""

        def __init__(
            self,
            model: SentenceTransformer,
            scale: float = 20.0,
            similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
            mini_batch_size: int = 32,
            mini_batch_num_tokens: int | None = None,
            gather_across_devices: bool = False,
            show_progress_bar: bool = False,
            backend: Literal["auto", "torch", "triton"] = "auto",
            block_bytes: int | None = None,
        ) -> None:
            """
            A drop-in for ``CachedMultipleNegativesSymmetricRankingLoss``: the same arguments, defaults,
            attributes, loss and gradients (query-to-document and document-to-query, one softmax each, averaged),
            with the fused loss stage of ``FusedCachedMultipleNegativesRankingLoss``.

            sentence-transformers deprecates its class for ``CachedMultipleNegativesRankingLoss(model,
            directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")``; so does this one, for
            ``cgist.FusedCachedMultipleNegativesRankingLoss`` with the same arguments (a ``DeprecationWarning``).

            Args:
                model, scale, similarity_fct, mini_batch_size, mini_batch_num_tokens, gather_across_devices,
                    show_progress_bar: as in sentence-transformers.
                backend, block_bytes: as for ``FusedCachedMultipleNegativesRankingLoss``.
            """
            warnings.warn(
                "CachedMultipleNegativesSymmetricRankingLoss is deprecated by sentence-transformers; use "
                "cgist.FusedCachedMultipleNegativesRankingLoss(model, directions=('query_to_doc', 'doc_to_query'), "
                "partition_mode='per_direction'), which computes the same loss",
                DeprecationWarning, stacklevel=2,
            )
            self._construct(
                CachedMultipleNegativesSymmetricRankingLoss, model, scale, mini_batch_size, mini_batch_num_tokens,
                gather_across_devices, backend, block_bytes, similarity_fct=similarity_fct,
                show_progress_bar=show_progress_bar,
            )


class FusedMultipleNegativesRankingLoss(_PlainRanking, MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` with a fused, streaming loss stage."""

    def __init__(
        self,
        model: SentenceTransformer,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        gather_across_devices: bool = False,
        directions: tuple[str, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None,
        hardness_strength: float = 0.0,
        backend: Literal["auto", "torch", "triton"] = "auto",
        block_bytes: int | None = None,
    ) -> None:
        """
        A drop-in for ``MultipleNegativesRankingLoss``: the same arguments, defaults, attributes, loss and
        gradients, with the loss stage of ``FusedCachedMultipleNegativesRankingLoss`` (no B x N similarity matrix).
        The student embeds the batch in one forward pass and the gradients reach it through autograd, as in
        sentence-transformers; ``MatryoshkaLoss`` around it computes every dimension in one loss stage (see
        ``cgist.losses.gist_embed.FusedGISTEmbedLoss`` for how it takes the decoration over).

        Args:
            model, scale, similarity_fct, gather_across_devices, directions, partition_mode, hardness_mode,
                hardness_strength: as in sentence-transformers (``cos_sim`` and ``dot_score`` run fused; any other
                function runs sentence-transformers' own computation, with one warning).
            backend, block_bytes: as for ``FusedCachedMultipleNegativesRankingLoss``.

        Raises:
            TypeError, ValueError: for a bad argument, naming it, before anything is computed (sentence-transformers'
                own arguments with its messages).
        """
        self._construct(
            MultipleNegativesRankingLoss, model, scale, gather_across_devices, backend, block_bytes,
            similarity_fct=similarity_fct, directions=directions, partition_mode=partition_mode,
            hardness_mode=hardness_mode, hardness_strength=hardness_strength,
        )


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    class FusedMultipleNegativesSymmetricRankingLoss(_PlainRanking, MultipleNegativesSymmetricRankingLoss):
        """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` with a fused, streaming loss stage."""

        def __init__(
            self,
            model: SentenceTransformer,
            scale: float = 20.0,
            similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
            gather_across_devices: bool = False,
            backend: Literal["auto", "torch", "triton"] = "auto",
            block_bytes: int | None = None,
        ) -> None:
            """
            A drop-in for ``MultipleNegativesSymmetricRankingLoss``: the same arguments, defaults, attributes,
            loss and gradients (query-to-document and document-to-query, one softmax each, averaged), with the fused
            loss stage of ``FusedMultipleNegativesRankingLoss``.

            sentence-transformers deprecates its class for ``MultipleNegativesRankingLoss(model,
            directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")``; so does this one, for
            ``cgist.FusedMultipleNegativesRankingLoss`` with the same arguments (a ``DeprecationWarning``).

            Args:
                model, scale, similarity_fct, gather_across_devices: as in sentence-transformers.
                backend, block_bytes: as for ``FusedMultipleNegativesRankingLoss``.
            """
            warnings.warn(
                "MultipleNegativesSymmetricRankingLoss is deprecated by sentence-transformers; use "
                "cgist.FusedMultipleNegativesRankingLoss(model, directions=('query_to_doc', 'doc_to_query'), "
                "partition_mode='per_direction'), which computes the same loss",
                DeprecationWarning, stacklevel=2,
            )
            self._construct(MultipleNegativesSymmetricRankingLoss, model, scale, gather_across_devices, backend,
                            block_bytes, similarity_fct=similarity_fct)
