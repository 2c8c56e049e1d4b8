"""``FusedGISTEmbedLoss``: sentence-transformers' ``GISTEmbedLoss`` (no GradCache: the student embeds the batch once
and autograd takes the gradients back into it in the usual single backward) with the fused loss stage of the GIST
drop-ins (``cgist.losses.gist``)."""

from __future__ import annotations

import types
from collections.abc import Iterable
from types import MappingProxyType
from typing import Literal

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss, GISTEmbedLoss
from sentence_transformers.util import batch_to_device
from torch import Tensor

from .base import UNFUSED, check_gather, text_fingerprints
from .gist import _FusedGIST, check_scalars, guide_source, label_guide

__all__ = ["FusedGISTEmbedLoss"]


class FusedGISTEmbedLoss(_FusedGIST, GISTEmbedLoss):
    """sentence-transformers' ``GISTEmbedLoss`` with a fused, streaming loss stage.

    A drop-in for ``GISTEmbedLoss``: the same arguments, attributes, loss and gradients (with the rules of the
    installed sentence-transformers: ``cgist.compat.RELEASE_RULES``), without the broadcast products of its
    similarities (``B x N x D`` floats for each block, for the student and again for the guide). The student embeds
    the batch in one forward pass, as in sentence-transformers, and the loss's gradient reaches it through autograd;
    use it while a whole batch's activations fit, and ``FusedCachedGISTLoss`` (GradCache, one more forward pass of
    the student per step) once they do not.

    Args:
        model: the SentenceTransformer being trained.
        guide: what masks likely false negatives, as for ``FusedCachedGISTLoss``: a frozen SentenceTransformer
            (sentence-transformers' loss), ``"labels"`` (the batch's label column of precomputed guide embeddings,
            ``cgist.add_guide_embeddings``), ``"self"`` (the student's own embeddings of the batch, detached) or None.
        temperature, margin_strategy, margin, contrast_anchors, contrast_positives, gather_across_devices: as in
            sentence-transformers.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``, as for ``FusedCachedGISTLoss``.
        block_bytes: bytes of score buffers the loss stage may hold at once (None: a default for the device).
        mask_self, mask_duplicates, directions, partition_mode, hardness_mode, hardness_strength: cgist's options of
            the GIST drop-ins (``FusedCachedGISTLoss``).

    Beyond sentence-transformers' class, it takes any number of negative columns (sentence-transformers' takes at
    most one). ``MatryoshkaLoss`` around it computes every dimension in one loss stage and one guide pass: it reports
    ``uses_gradient_cache``, so ``MatryoshkaLoss`` decorates its ``calculate_loss`` (the loss over a step's
    embeddings), which it takes over as the cached drop-ins do; the dimensions, weights and ``n_dims_per_step``
    sampling are ``MatryoshkaLoss``'s, and the loss and gradients those of sentence-transformers' loop over dimensions.

    Raises:
        TypeError, ValueError: for a bad argument, naming it, before anything is computed (sentence-transformers' own
            arguments with its messages).
    """

    _st_class = GISTEmbedLoss
    #: What ``MatryoshkaLoss`` (and ``AdaptiveLayerLoss``) ask: with it, ``MatryoshkaLoss`` hands this loss the whole
    #: batch and decorates ``calculate_loss`` instead of running the loss once per dimension on a patched model.
    uses_gradient_cache = True

    def __init__(
        self,
        model: SentenceTransformer,
        guide: SentenceTransformer | Literal["labels", "self"] | None,
        temperature: float = 0.01,
        margin_strategy: Literal["absolute", "relative"] = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        backend: Literal["auto", "torch", "triton"] = "auto",
        block_bytes: int | None = None,
        mask_self: bool | None = None,
        mask_duplicates: bool | None = None,
        directions: tuple[str, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        """The loss from the arguments the class docstring describes; a bad one raises here, naming it."""
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        source = guide_source(guide)
        check_gather(gather_across_devices)
        check_scalars(temperature, margin, margin_strategy)
        # sentence-transformers' constructor checks its own arguments, with its messages; without a guide model its
        # checks see the student as the guide (no retokenisation), and the guide is set after.
        super().__init__(
            model, guide if source.runs_model else model, temperature=temperature, margin_strategy=margin_strategy,
            margin=margin, contrast_anchors=contrast_anchors, contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
        )
        self._take_own_arguments(
            guide, backend=backend, block_bytes=block_bytes, mask_self=mask_self, mask_duplicates=mask_duplicates,
            directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        """The student's embeddings of the batch (sentence-transformers' ``embed_columns``), the guide's, and the fused
        loss stage over them; sentence-transformers' own ``forward`` where the fused stage does not run (but under
        ``MatryoshkaLoss``, whose decoration of ``calculate_loss`` then runs its computation once per dimension)."""
        sentence_features = list(sentence_features)
        options = self.resolve()
        if options is None and "calculate_loss" not in self.__dict__:  # not decorated (MatryoshkaLoss)
            self.record_path(UNFUSED)
            return super().forward(sentence_features, labels)
        source = self.guide_source
        # As sentence-transformers does: the guide runs on copies made before the student writes its outputs into
        # the features.
        guide_features = [dict(feature) for feature in sentence_features] if source.runs_model else None
        embeddings = embed_columns(self.model, sentence_features)
        batch = {"text_ids": text_fingerprints(sentence_features, needed=options is not None and options.mask_duplicates)}
        if source.runs_model:
            with torch.no_grad():
                guided = [[g] for g in self._guide_embeddings(sentence_features, guide_features)]
        else:  # the guide's columns come from the label column, the student or nowhere (``_guide_columns``)
            if source.reads_labels:
                batch["guide"] = label_guide(labels, len(embeddings), embeddings[0].shape[0])
            guided = [[e.detach()] for e in embeddings]
        self._batch = batch
        try:
            return self.calculate_loss([[e] for e in embeddings], guided)
        finally:
            self._batch = MappingProxyType({})

    def _guide_embeddings(self, sentence_features: list[dict[str, Tensor]],
                          copies: list[dict[str, Tensor]]) -> list[Tensor]:
        """The guide model's embeddings of the batch, as sentence-transformers computes them: on the copies of the
        features, or, when the guide needs its own tokens (``must_retokenize``: another vocabulary or a shorter
        ``max_seq_length``), on the student's tokens decoded and tokenised again by the guide."""
        if self.must_retokenize:
            copies = []
            for feature in sentence_features:
                input_ids = feature["input_ids"]
                if "cu_seq_lens_q" in feature:  # packed: one row of every text's tokens, cut at the boundaries
                    flat, bounds = input_ids[0].tolist(), feature["cu_seq_lens_q"].tolist()
                    input_ids = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
                texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
                copies.append(batch_to_device(self.guide.preprocess(texts), self.guide.device))
        return embed_columns(self.guide, copies)

    def calculate_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *,
                       with_backward: bool = False) -> Tensor:
        """The loss over a batch's embeddings (each column a list of row chunks), differentiable with respect to them;
        with ``with_backward`` the gradients go into the leaves' ``.grad`` and the loss comes back detached."""
        return self._loss_stage(reps, reps_guided, with_backward=with_backward)

    def _check_embedding_stage(self) -> None:
        check_gather(self.gather_across_devices)

    def _unfused_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], with_backward: bool) -> Tensor:
        # sentence-transformers' GIST loss over given embeddings: its cached class's computation, the same as its
        # plain forward's once the rows are one chunk (its cross-entropy times B / B).
        rows = sum(t.shape[0] for t in reps[0])
        view = types.SimpleNamespace(
            gather_across_devices=self.gather_across_devices, mini_batch_size=rows, show_progress_bar=False,
            sim_matrix=self.sim_matrix, margin_strategy=self.margin_strategy, margin=self.margin,
            contrast_anchors=self.contrast_anchors, contrast_positives=self.contrast_positives,
            cross_entropy_loss=self.cross_entropy_loss, temperature=self.temperature,
        )
        return CachedGISTEmbedLoss.calculate_loss(view, reps, reps_guided, with_backward=with_backward)
