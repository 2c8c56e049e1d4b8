"""The step: how a drop-in embeds a batch, one of two pieces of every drop-in (``cgist.losses.base``).

* ``CachedStep``: sentence-transformers' GradCache step (the cached losses): the student embeds the batch in
  mini-batches without gradients, the loss stage puts the embeddings' gradients into the cached leaves, and a second
  pass replays the mini-batches to take them into the model.
* ``PlainStep``: the student embeds the batch once (its columns' ``_embed``: sentence-transformers' ``embed_columns``,
  or ``embed_columns_padded`` for token embeddings) and autograd takes the loss stage's gradients back into it.

Each supplies the embedding stage's attributes and their checks, ``forward``, and sentence-transformers' own loss
over a step's embeddings for where the fused stage does not run.
"""

from __future__ import annotations

import abc
import numbers
from collections.abc import Iterable, Mapping

from sentence_transformers.base.losses.gradcache import _validate_mini_batch_num_tokens
from torch import Tensor

from .base import UNFUSED, FusedDropIn, backward_if

__all__ = ["CachedStep", "PlainStep", "check_embedding_stage", "check_gather"]


def check_embedding_stage(mini_batch_size: object, mini_batch_num_tokens: object, gather_across_devices: object) -> None:
    """The embedding stage's attributes of every drop-in, checked; sentence-transformers' own check of
    ``mini_batch_num_tokens`` keeps its message."""
    for name, value, expected in (
        ("mini_batch_size", mini_batch_size, "an int"),
        ("mini_batch_num_tokens", mini_batch_num_tokens, "an int or None"),
    ):
        if value is None and name == "mini_batch_num_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be at least 1, got {mini_batch_size}")
    try:
        _validate_mini_batch_num_tokens(mini_batch_num_tokens)
    except ValueError as error:
        raise ValueError(f"{error} Got {mini_batch_num_tokens!r}.") from None
    check_gather(gather_across_devices)


def check_gather(gather_across_devices: object) -> None:
    """``gather_across_devices`` is a bool (every drop-in's; the plain ones have no other embedding-stage attribute)."""
    if not isinstance(gather_across_devices, bool):
        raise TypeError(f"gather_across_devices must be a bool, got {type(gather_across_devices).__name__}")


class CachedStep(FusedDropIn):
    """sentence-transformers' GradCache step around the fused loss stage."""

    embedding_attributes = ("mini_batch_size", "mini_batch_num_tokens", "gather_across_devices")
    # sentence-transformers' attribute that its constructor sets but its own loss computation never reads (a loss
    # built by ``__new__`` may lack it).
    mini_batch_num_tokens: int | None = None

    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        check_embedding_stage(values["mini_batch_size"], values["mini_batch_num_tokens"],
                              values["gather_across_devices"])

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        """sentence-transformers' GradCache step; the attributes are checked and what the loss stage reads off the
        batch is read first (``StepInputs``)."""
        features = list(sentence_features)
        with self.reading(self._step_inputs(features, labels, self.resolve())):
            return super().forward(features, labels)

    def _unfused_loss(self, reps: list[list[Tensor]], reps_guided: object, with_backward: bool) -> Tensor:
        return self.replaces.calculate_loss(self, reps, reps_guided, with_backward=with_backward)


class PlainStep(FusedDropIn):
    """The student embeds the batch once and autograd takes the fused loss stage's gradients back into it.

    The family's columns (``cgist.losses.columns``) embed the batch (``Columns.embed``: the loss stage's columns,
    and the token embeddings' masks); the family says what ``calculate_loss`` takes beside them (``_plain_beside``:
    the guide's embeddings, the labels, or the masks) and supplies ``_embeddings_loss`` (sentence-transformers' own
    loss over given embeddings). Where the fused stage does not run, sentence-transformers' own ``forward`` runs
    instead, unless it cannot compute the loss as configured (``_st_forward_computes``) or ``MatryoshkaLoss``
    decorated ``calculate_loss``.
    """

    embedding_attributes = ("gather_across_devices",)

    @property
    def uses_gradient_cache(self) -> bool:
        """What ``MatryoshkaLoss`` (and ``AdaptiveLayerLoss``) ask: where the drop-in computes every dimension in one
        loss stage (``fuses_matryoshka``), ``MatryoshkaLoss`` hands this loss the whole batch and decorates
        ``calculate_loss``, which the drop-in takes over, instead of running the loss once per dimension on a patched
        model; elsewhere (the multi-vector drop-ins) the wrappers run it per dimension, as sentence-transformers'
        plain class."""
        return self.fuses_matryoshka

    def _check_embedding_stage(self, values: Mapping[str, object]) -> None:
        check_gather(values["gather_across_devices"])

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """The student's embeddings of the batch and the loss stage over them; sentence-transformers' own ``forward``
        where the fused stage does not run (but under ``MatryoshkaLoss``, whose decoration of ``calculate_loss`` then
        runs its computation once per dimension)."""
        features = list(sentence_features)
        options = self.resolve()
        if options is None and "calculate_loss" not in self.__dict__ and self._st_forward_computes():
            self.record_path(UNFUSED)
            return super().forward(features, labels)
        # What the loss stage and a guide read off the batch, before the student writes its outputs into it.
        inputs, copies = self._step_inputs(features, labels, options), [dict(feature) for feature in features]
        reps, masks = self.columns.embed(self.model, features, getattr(self, "mini_batch_size", None))
        with self.reading(inputs):
            return self.calculate_loss(reps, self._plain_beside(features, copies, reps, masks, labels))

    def _plain_beside(self, features: list[dict[str, Tensor]], copies: list[dict[str, Tensor]],
                      reps: list[list[Tensor]], masks: object, labels: Tensor | None) -> object:
        """The family: what ``calculate_loss`` takes beside the student's embeddings of the batch (``reps``, made
        from ``features``; ``copies`` are the features as they came): the token embeddings' masks where the columns
        have them, else the labels (default)."""
        return labels if masks is None else masks

    def _st_forward_computes(self) -> bool:
        """The family: whether sentence-transformers' own ``forward`` computes this loss as it is configured (default:
        yes). Where it does not, the unfused path is ``_embeddings_loss`` after this ``forward``'s own embedding."""
        return True

    @abc.abstractmethod
    def _embeddings_loss(self, reps: list[list[Tensor]], reps_guided: object) -> Tensor:
        """The family: sentence-transformers' own loss over given embeddings, differentiable."""

    def _unfused_loss(self, reps: list[list[Tensor]], reps_guided: object, with_backward: bool) -> Tensor:
        return backward_if(self._embeddings_loss(reps, reps_guided), with_backward)
