"""``FusedCachedGISTLoss``: sentence-transformers' ``CachedGISTEmbedLoss`` with the fused loss stage of
``cgist.losses.base``; and what only it reads: the guide's source, the label column's guide embeddings, GIST's scalar
hyperparameters checked, the settings it leaves to sentence-transformers' own loss computation, and its citations."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Literal

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
from torch import Tensor

from ..compat import release_rules
from ..stage.dispatch.route import requested_backend
from ..stage.spec.guide import LABELS, MODEL, NONE, SELF, GuideSource
from ..stage.spec.options import MARGIN_STRATEGIES, GistOptions, _check_real
from ..stage.stats import GistStats
from .base import (
    FUSED, UNFUSED, FusedDropIn, attribute_key, check_embedding_stage, fused_loss_stage, text_fingerprints,
)

__all__ = ["FusedCachedGISTLoss"]

logger = logging.getLogger(__name__)


def guide_source(guide: object) -> GuideSource:
    """The source of a ``guide`` argument of ``FusedCachedGISTLoss`` (``cgist.stage.spec.guide``); anything else is an error."""
    if guide is None:
        return NONE
    if isinstance(guide, SentenceTransformer):
        return MODEL
    if isinstance(guide, str) and guide in ("labels", "self"):
        return LABELS if guide == "labels" else SELF
    message = "guide must be a SentenceTransformer, 'labels', 'self' or None, got "
    if isinstance(guide, str):
        raise ValueError(message + repr(guide))
    raise TypeError(message + type(guide).__name__)


def label_guide(labels: object, n_columns: int, batch: int) -> list[Tensor]:
    """The guide's columns from a batch's label tensor ``(batch, n_columns, Dg)``, checked."""
    hint = ("guide='labels' takes the guide embeddings from the label column: a (batch, n_columns, Dg) tensor in "
            "the order of the text columns (cgist.add_guide_embeddings(dataset, guide) adds it)")
    if labels is None:
        raise ValueError(f"{hint}; this batch has no labels")
    if not isinstance(labels, Tensor) or not labels.is_floating_point():
        what = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"{hint}; got labels of {what}")
    if labels.dim() != 3:
        raise ValueError(f"{hint}; got labels of shape {tuple(labels.shape)}")
    if labels.shape[0] != batch or labels.shape[1] != n_columns:
        raise ValueError(f"{hint}; got shape {tuple(labels.shape)}, but the batch has {batch} rows and {n_columns} "
                         f"text columns")
    if labels.shape[2] == 0:
        raise ValueError(f"{hint}; got an empty embedding dimension")
    if not bool(torch.isfinite(labels).all()):
        raise ValueError("the label column's guide embeddings contain NaN or infinite values")
    return [labels[:, c] for c in range(n_columns)]


def batch_rows(feature: dict[str, Tensor]) -> int:
    """The texts in one column's features: the rows of its token ids (or of its first tensor), or the packed
    sequences of ``cu_seq_lens_q``."""
    if "cu_seq_lens_q" in feature:
        return len(feature["cu_seq_lens_q"]) - 1
    tensor = feature.get("input_ids")
    if not isinstance(tensor, Tensor):
        tensor = next((v for v in feature.values() if isinstance(v, Tensor) and v.dim()), None)
    if tensor is None:
        raise ValueError("guide='labels' checks the label tensor against the batch's rows, but these features hold "
                         "no tensor")
    return tensor.shape[0]


#: The attributes ``FusedCachedGISTLoss`` reads at each call, sentence-transformers' and cgist's own (besides the guide,
#: the similarity function and the cross-entropy, which ``options_key`` adds with their settings).
_GIST_ATTRIBUTES = (
    "temperature", "margin", "margin_strategy", "contrast_anchors", "contrast_positives", "mini_batch_size",
    "mini_batch_num_tokens", "gather_across_devices", "backend", "block_bytes", "mask_self", "mask_duplicates",
    "directions", "partition_mode", "hardness_mode", "hardness_strength",
)


def check_scalars(temperature: object, margin: object, margin_strategy: object) -> None:
    """GIST's scalar hyperparameters, checked: a temperature other than a positive finite number makes
    sentence-transformers' loss NaN (its masked similarities are -inf before the division), and a NaN margin
    silently masks nothing, so both are errors; ``margin_strategy`` keeps sentence-transformers' message."""
    if margin_strategy not in MARGIN_STRATEGIES:
        raise ValueError(f"margin_strategy must be 'absolute' or 'relative'. Got {margin_strategy!r}.")
    _check_real("temperature", temperature)
    _check_real("margin", margin)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}: the loss would be NaN")
    if math.isnan(margin):
        raise ValueError(f"margin must be a number, got {margin!r}: every guide comparison with it is false")


def _unfused_cosine(similarity_fct: object) -> str | None:
    """Why the fused stage does not compute ``similarity_fct`` as GIST's cosine (None: it does, or none is set)."""
    if similarity_fct is None or (type(similarity_fct) is torch.nn.CosineSimilarity and similarity_fct.dim in (-1, 2)
                                  and similarity_fct.eps == 1e-8):
        return None
    return (f"similarity_fct={similarity_fct!r} (the fused stage computes sentence-transformers' "
            "nn.CosineSimilarity(dim=-1))")


def _unfused_cross_entropy(cross_entropy_loss: object) -> str | None:
    """Why the fused stage does not compute ``cross_entropy_loss`` (None: it is the plain mean cross-entropy, whose
    ``ignore_index`` no label reaches, or none is set)."""
    if cross_entropy_loss is None or (
            type(cross_entropy_loss) is torch.nn.CrossEntropyLoss and cross_entropy_loss.weight is None
            and cross_entropy_loss.reduction == "mean" and cross_entropy_loss.label_smoothing == 0.0
            and cross_entropy_loss.ignore_index < 0):
        return None
    return f"cross_entropy_loss={cross_entropy_loss!r} (the fused stage computes nn.CrossEntropyLoss())"


class _FusedGIST(FusedDropIn):
    """What the GIST drop-ins share (``FusedCachedGISTLoss``, ``cgist.losses.gist_embed.FusedGISTEmbedLoss``): the
    guide's source, the options read off sentence-transformers' attributes and cgist's own, the loss stage over a
    step's embeddings, the guide's statistics and the citations.

    A subclass names the sentence-transformers class it replaces (``_st_class``), checks its embedding stage's
    attributes (``_check_embedding_stage``) and says what runs when the fused stage does not (``_unfused_loss``).
    """

    _st_class: type

    # cgist's own attributes, read at each call like sentence-transformers' (class-level defaults: see FusedDropIn).
    mask_self: bool | None = None
    mask_duplicates: bool | None = None
    directions: tuple[str, ...] = ("query_to_doc",)
    partition_mode: str = "joint"
    hardness_mode: str | None = None
    hardness_strength: float = 0.0
    OWN_DEFAULTS = {**FusedDropIn.OWN_DEFAULTS, "mask_self": None, "mask_duplicates": None,
                    "directions": ("query_to_doc",), "partition_mode": "joint", "hardness_mode": None,
                    "hardness_strength": 0.0}
    _batch: Mapping[str, object] = MappingProxyType({})  # this forward's label guide and text ids, for calculate_loss
    _warned_positive_only = False

    def _take_own_arguments(self, guide: object, **own: object) -> None:
        """The guide and cgist's own arguments as attributes, after sentence-transformers' constructor; then every
        attribute checked, as it is again at each call once one changes."""
        self.guide = guide
        for name, value in own.items():
            setattr(self, name, value)
        self._training_stats: list[GistStats] = []
        self.resolve()

    def _check_embedding_stage(self) -> None:
        """The embedding stage's attributes, checked."""
        raise NotImplementedError

    def _unfused_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], with_backward: bool) -> Tensor:
        """sentence-transformers' own loss computation over a step's embeddings, where the fused stage does not run."""
        raise NotImplementedError

    def __setattr__(self, name: str, value: object) -> None:
        if name == "guide" and not isinstance(value, torch.nn.Module) and "guide" in self.__dict__.get("_modules", {}):
            del self._modules["guide"]  # a guide model (or the student, see __init__) gives way to another source
        super().__setattr__(name, value)

    @property
    def guide_source(self) -> GuideSource:
        """Where ``guide`` takes the guide from (``cgist.stage.spec.guide``); a loss built without one (by ``__new__``) takes the
        guide's embeddings from ``reps_guided``, as sentence-transformers does."""
        return guide_source(getattr(self, "guide")) if hasattr(self, "guide") else MODEL

    @property
    def guide_mode(self) -> str:
        """The name of the guide's source: ``"model"``, ``"labels"``, ``"self"`` or ``"none"``."""
        return self.guide_source.name

    def options_key(self) -> tuple:
        similarity, cross_entropy = getattr(self, "similarity_fct", None), getattr(self, "cross_entropy_loss", None)
        return (self.guide_source, *attribute_key(self, _GIST_ATTRIBUTES),
                *attribute_key(similarity, ("dim", "eps")), (type(similarity), similarity),
                *attribute_key(cross_entropy, ("weight", "ignore_index", "reduction", "label_smoothing")),
                (type(cross_entropy), cross_entropy))

    def build_options(self) -> tuple[GistOptions | None, str | None]:
        self._check_embedding_stage()
        check_scalars(self.temperature, self.margin, self.margin_strategy)
        requested_backend(self.backend)
        for name in ("mask_self", "mask_duplicates"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
        source = self.guide_source
        release_excludes = release_rules().self_pairs_excluded  # the installed sentence-transformers' rule
        mask_self, mask_duplicates = source.masks(self.mask_self, self.mask_duplicates, have_text_ids=True,
                                                  self_pairs_excluded=release_excludes)
        options = GistOptions(
            margin_strategy=self.margin_strategy, contrast_anchors=self.contrast_anchors,
            contrast_positives=self.contrast_positives, mask_self=mask_self, mask_duplicates=mask_duplicates,
            directions=self.directions, partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength, block_bytes=self.block_bytes,
        )
        reason = (_unfused_cosine(getattr(self, "similarity_fct", None))
                  or _unfused_cross_entropy(getattr(self, "cross_entropy_loss", None))
                  or (None if math.isfinite(self.margin) else f"margin={self.margin!r} (the fused stage takes a finite margin)"))
        if reason is None:
            return options.replace(temperature=self.temperature, margin=self.margin), None
        beyond = [f"guide={self.guide!r}"] if source is NONE else []
        beyond += [f"mask_self={options.mask_self}"] if options.mask_self != release_excludes else []
        beyond += ["mask_duplicates=True"] if options.mask_duplicates else []
        beyond += [f"{name}={getattr(options, name)!r}" for name in ("directions", "partition_mode", "hardness_mode")
                   if getattr(options, name) != self.OWN_DEFAULTS[name] and (name != "hardness_mode" or options.hardness)]
        if beyond:
            raise ValueError(f"{reason}, which the fused loss stage does not compute; sentence-transformers' "
                             f"{self._st_class.__name__}, which would, has no {', '.join(beyond)}")
        return None, reason

    def _loss_stage(
        self,
        reps: list[list[Tensor]],
        reps_guided: list[list[Tensor]],
        *,
        with_backward: bool,
        dims: tuple[tuple[int, float], ...] | None = None,
    ) -> Tensor:
        """The loss over a step's embeddings (``reps``: each column's mini-batches), over ``dims`` (Matryoshka
        ``(d, w_d)`` pairs) if given; with ``with_backward`` the gradients go into the leaves' ``.grad`` and the loss
        comes back detached."""
        if len(reps) != len(reps_guided):
            raise ValueError(f"reps and reps_guided must have the same length, got {len(reps)} and {len(reps_guided)}")
        options = self.resolve()
        guide = self._guide_columns(reps_guided)
        if options is None:  # sentence-transformers' own computation, on the guide's columns as it takes them
            self.record_path(UNFUSED)
            if self.guide_source.reads_labels:
                reps_guided = [[column] for column in guide]
            return self._unfused_loss(reps, reps_guided, with_backward)
        text_ids = self._batch.get("text_ids")
        if options.mask_duplicates and text_ids is None:
            raise ValueError("mask_duplicates needs the batch's token ids: call the loss on the batch's features "
                             "(calculate_loss alone does not see them), or pass mask_duplicates=False")
        loss, stats = fused_loss_stage(reps, guide, text_ids, options, backend=self.backend,
                                       gather=self.gather_across_devices, with_backward=with_backward, dims=dims)
        self.record_path(FUSED, stats)
        if torch.is_grad_enabled() and any(t.requires_grad for column in reps for t in column):  # a training step
            self.__dict__.setdefault("_training_stats", []).append(stats)
            self._check_positive_only(stats, options)
        return loss

    def _guide_columns(self, reps_guided: list[list[Tensor]]) -> list[list[Tensor]] | list[Tensor] | str | None:
        """The guide's columns for ``gist_loss``: the guide model's mini-batches, the label column's, "self", or None."""
        source = self.guide_source
        if source.runs_model:
            return [list(r) for r in reps_guided]
        if source.reads_labels:
            if "guide" not in self._batch:
                raise ValueError("guide='labels' reads the guide embeddings off the batch's label column: call the loss "
                                 "on a batch (calculate_loss alone does not see the labels)")
            return list(self._batch["guide"])
        return source.kind

    def _check_positive_only(self, stats: GistStats, options: GistOptions) -> None:
        """Warn once when more than half of a step's anchors are left with only their positive."""
        if self._warned_positive_only or stats.positive_only_fraction <= 0.5:
            return
        self._warned_positive_only = True
        logger.warning(
            "%.0f%% of this step's anchors have every candidate but their positive masked by the guide "
            "(margin=%s, margin_strategy=%r): their loss carries no contrast. The margin masks too much for this "
            "guide; lower it (this warning is shown once).",
            100 * stats.positive_only_fraction, options.margin, options.margin_strategy,
        )

    def pop_training_stats(self) -> list[GistStats]:
        """The statistics of the training calls since the last call of this method (for logging)."""
        stats, self._training_stats = self.__dict__.get("_training_stats", []), []
        return stats

    def get_config_dict(self) -> dict:
        """sentence-transformers' configuration, key for key (``guide`` is the model, "labels", "self" or None), then
        cgist's own arguments where they differ from their defaults (and the guide mode where it is not a model)."""
        own = self.own_config()
        if not self.guide_source.runs_model:
            own = {"guide_mode": self.guide_mode, **own}
        return {**super().get_config_dict(), **own}

    @property
    def citation(self) -> str:
        """GISTEmbed and GradCache; the Qwen3 Embedding paper for a self-guided loss or its direction set, and the
        paper whose loss a direction set is (GTE, Jina Embeddings 2)."""
        return _direction_citation(self, self.guide_source is SELF) + _GISTEMBED_CITATION + _GRADCACHE_CITATION


class FusedCachedGISTLoss(_FusedGIST, CachedGISTEmbedLoss):
    """sentence-transformers' ``CachedGISTEmbedLoss`` with a fused, streaming loss stage.

    A drop-in for ``CachedGISTEmbedLoss``: the same arguments, the same loss and the same gradients, with
    a loss stage that never forms the B x N similarity matrix.

    The embedding stage is sentence-transformers' own GradCache loop (mini-batches, RandContext replay,
    retokenisation for a guide with another tokenizer, ``mini_batch_num_tokens``, gathering across devices).
    Only ``calculate_loss`` changes: the student and guide similarities are computed as matrix products over
    blocks of anchors, masked against the guide threshold and reduced by a streaming log-sum-exp, and the
    embedding gradients come out of the same pass. On CUDA tensors this runs as Triton kernels; elsewhere as
    a blockwise PyTorch computation.

    For anchor i, a candidate is dropped from the softmax when the guide scores it strictly above
    ``theta_i - margin`` (``"absolute"``) or ``theta_i - |theta_i| * margin`` (``"relative"``), where
    ``theta_i`` is the guide's score of the anchor with its own positive. The positive itself is never dropped.

    Args:
        model: the SentenceTransformer being trained.
        guide: what decides which in-batch candidates are dropped as likely false negatives:

            - a frozen SentenceTransformer, run on every batch (sentence-transformers' loss);
            - ``"labels"``: precomputed guide embeddings, the batch's label column, shaped
              ``(batch, n_columns, Dg)`` in the order of the text columns (``cgist.add_guide_embeddings``
              adds it to a dataset); no guide model is loaded or run;
            - ``"self"``: the student's own embeddings from GradCache's first, gradient-free pass, detached.
              Nothing extra runs. That pass replays the same random state as the second, so under dropout
              the guide sees exactly the vectors being trained (the same dropout masks);
            - None: no guide masking; the loss is InfoNCE over the chosen blocks (with
              ``contrast_anchors=False, contrast_positives=False`` it is
              ``CachedMultipleNegativesRankingLoss(scale=1 / temperature)``).
        temperature: divides the cosine similarities before the softmax.
        mini_batch_size: texts embedded at once in the embedding stage; sets memory, not the loss.
        mini_batch_num_tokens: if set, embedding mini-batches are packed by token count instead of
            ``mini_batch_size`` texts.
        show_progress_bar: show a progress bar over the embedding mini-batches.
        margin_strategy: ``"absolute"`` or ``"relative"``, how ``margin`` lowers the threshold.
        margin: how far below ``theta_i`` the threshold lies; 0 drops only candidates the guide ranks above the
            positive.
        contrast_anchors: include the anchor-anchor similarities.
        contrast_positives: include the positive-positive similarities.
        gather_across_devices: score each rank's anchors against the candidates of all ranks (torch.distributed);
            every rank must then hold the same number of anchors.
        backend: ``"auto"`` (Triton for CUDA tensors, PyTorch elsewhere), ``"torch"`` or ``"triton"``.
        block_bytes: bytes of score buffers the loss stage may hold at once; None picks a default for the
            device (at most an eighth of its free memory and 1 GiB).
        mask_self: always exclude the self-pairs AA[i, i] and PP[i, i]. Default: with a guide model or
            ``"labels"``, the rule of the installed sentence-transformers (``cgist.compat.release_rules``: on from
            6.3, which always excludes them; off under 6.2, where the guide masks them when it scores them above the
            threshold); on with ``"self"`` and None.
        mask_duplicates: exclude every candidate whose text is that of the anchor or of its positive, whatever
            the scores (the positive itself stays). Texts are compared by their token ids and attention mask,
            so duplicates are found also under dropout. Default: off with a guide model or ``"labels"``
            (sentence-transformers' rule), on with ``"self"`` and None.
        directions: sentence-transformers' ``MultipleNegativesRankingLoss`` directions, each block masked by the
            guide as GIST's are: ``"query_to_doc"`` (required; GIST's AP and AN blocks), ``"query_to_query"``
            (anchors against every anchor, under ``gather_across_devices`` every rank's: GIST's
            ``contrast_anchors`` over all of them, so set ``contrast_anchors=False`` to use it),
            ``"doc_to_query"`` (positives against every anchor) and ``"doc_to_doc"`` (positives against every
            document, their own left out: contains GIST's ``contrast_positives``, so set that to False). A
            combination that would hold a block twice is an error.
        partition_mode: ``"joint"`` (one softmax over every block) or ``"per_direction"`` (the mean of each
            direction's log-sum-exp; it needs every block to contain the positive pair, so it allows only
            ``"query_to_doc"`` and ``"doc_to_query"``, without the contrast blocks).
        hardness_mode, hardness_strength: add ``hardness_strength * stop_grad(cos)`` to the query-to-document
            logits that ``hardness_mode`` names (``"in_batch_negatives"``, ``"hard_negatives"`` or
            ``"all_negatives"``), after the guide's mask, not divided by the temperature: sentence-transformers'
            rule (Lan et al. 2025, arXiv:2503.04812).

    With ``MatryoshkaLoss(model, FusedCachedGISTLoss(...), matryoshka_dims=...)`` every dimension of a step is
    computed in one pass (the guide's scores and mask once, the student's from prefixes of one product), with
    the same loss, gradients and ``n_dims_per_step`` sampling as sentence-transformers' loop over dimensions.

    After each training call, ``last_stats`` holds a ``cgist.GistStats`` of what the guide masked; add
    ``cgist.GuideStatsCallback(loss)`` to the trainer's callbacks to log it as ``guide/...``.

    References:
        - GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning,
          https://arxiv.org/abs/2402.16829
        - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache),
          https://arxiv.org/abs/2101.06983

    Inputs:
        +-------------------------------------------------+--------+
        | Texts                                           | Labels |
        +=================================================+========+
        | (anchor, positive) pairs                        | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative) triplets           | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative_1, ..., negative_n) | none   |
        +-------------------------------------------------+--------+

    Raises:
        TypeError, ValueError: for a bad argument, naming it, before anything is computed.

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
            import cgist

            model = SentenceTransformer("microsoft/mpnet-base")
            guide = SentenceTransformer("all-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({
                "anchor": ["how do I reverse a list in python", "boiling point of water"],
                "positive": ["Use reversed(xs) or xs[::-1].", "Water boils at 100 degrees Celsius at sea level."],
            })
            loss = cgist.FusedCachedGISTLoss(model, guide, mini_batch_size=64, margin=0.05)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
            trainer.train()
    """

    def __init__(
        self,
        model: SentenceTransformer,
        guide: SentenceTransformer | Literal["labels", "self"] | None,
        temperature: float = 0.01,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
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
        check_embedding_stage(mini_batch_size, mini_batch_num_tokens, gather_across_devices)
        check_scalars(temperature, margin, margin_strategy)
        # sentence-transformers' constructor checks its own arguments, with its messages, and keeps them as attributes.
        # Without a guide model its checks see the student as the guide; the guide is set after.
        super().__init__(
            model,
            guide if source.runs_model else model,
            temperature=temperature,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            margin_strategy=margin_strategy,
            margin=margin,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
        )
        self._take_own_arguments(
            guide, backend=backend, block_bytes=block_bytes, mask_self=mask_self, mask_duplicates=mask_duplicates,
            directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
        )

    _st_class = CachedGISTEmbedLoss
    # sentence-transformers' attribute that its constructor sets but its own calculate_loss never reads (a loss built
    # by ``__new__`` may lack it).
    mini_batch_num_tokens: int | None = None

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        """sentence-transformers' GradCache step; the attributes are checked and the label guide and the texts' ids
        read off the batch first."""
        sentence_features = list(sentence_features)
        options = self.resolve()
        batch = {}
        if self.guide_source.reads_labels:
            batch["guide"] = label_guide(labels, len(sentence_features), batch_rows(sentence_features[0]))
        if options is not None:
            batch["text_ids"] = text_fingerprints(sentence_features, needed=options.mask_duplicates)
        self._batch = batch
        try:
            return super().forward(sentence_features, labels)
        finally:
            self._batch = MappingProxyType({})

    def embed_minibatch(self, sentence_feature: dict[str, Tensor], begin: int, end: int, with_grad: bool,
                        copy_random_state: bool, random_state=None):
        """sentence-transformers' embedding of one mini-batch; without a guide model, the student's alone.

        The first pass (``with_grad=False``) then runs the student as the second pass does, under ``no_grad``, and
        hands back as the guide's embeddings the student's own (``"self"``) or an empty placeholder (``"labels"``,
        None), which ``calculate_loss`` replaces.
        """
        source = self.guide_source
        if source.runs_model or with_grad:
            return super().embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state, random_state)
        with torch.no_grad():
            reps, _, state = super().embed_minibatch(sentence_feature, begin, end, True, copy_random_state,
                                                     random_state)
        return reps, (reps if source is SELF else reps.new_empty(reps.shape[0], 0)), state

    def calculate_loss(
        self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        """Loss over the cached mini-batch embeddings.

        With ``with_backward`` the embedding gradients are accumulated into ``.grad`` of the leaves in
        ``reps`` and a detached scalar is returned; under ``torch.no_grad`` only the loss is computed.
        """
        return self._loss_stage(reps, reps_guided, with_backward=with_backward)

    def _check_embedding_stage(self) -> None:
        check_embedding_stage(self.mini_batch_size, self.mini_batch_num_tokens, self.gather_across_devices)

    def _unfused_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], with_backward: bool) -> Tensor:
        return CachedGISTEmbedLoss.calculate_loss(self, reps, reps_guided, with_backward=with_backward)


def _direction_citation(loss: object, self_guided: bool) -> str:
    """The papers whose loss the directions of ``loss`` (or a self-guide) make, as BibTeX entries ("" for none)."""
    directions, joint = set(loss.directions), loss.partition_mode == "joint"
    qwen3 = self_guided or (joint and directions == {"query_to_doc", "query_to_query", "doc_to_doc"})
    gte = joint and directions == {"query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"}
    jina = not joint and directions == {"query_to_doc", "doc_to_query"}
    return (_QWEN3_CITATION if qwen3 else "") + (_GTE_CITATION if gte else "") + (_JINA_CITATION if jina else "")


def _arxiv_entry(key: str, title: str, author: str, year: int, eprint: str, primary_class: str) -> str:
    """An arXiv paper as a BibTeX ``@misc`` entry, with a blank line before it."""
    return (f"\n@misc{{{key},\n    title={{{title}}},\n    author={{{author}}},\n    year={{{year}}},\n"
            f"    eprint={{{eprint}}},\n    archivePrefix={{arXiv}},\n    primaryClass={{{primary_class}}}\n}}\n")


_GISTEMBED_CITATION = _arxiv_entry(
    "solatorio2024gistembed",
    "GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning",
    "Aivin V. Solatorio", 2024, "2402.16829", "cs.LG")

_GRADCACHE_CITATION = _arxiv_entry(
    "gao2021scaling", "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup",
    "Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan", 2021, "2101.06983", "cs.LG")

_GTE_CITATION = _arxiv_entry(
    "li2023gte", "Towards General Text Embeddings with Multi-stage Contrastive Learning",
    "Zehan Li and Xin Zhang and Yanzhao Zhang and Dingkun Long and Pengjun Xie and Meishan Zhang", 2023,
    "2308.03281", "cs.CL")

_JINA_CITATION = _arxiv_entry(
    "guenther2024jina2", "Jina Embeddings 2: 8192-Token General-Purpose Text Embeddings for Long Documents",
    'Michael G{"u}nther and others', 2024, "2310.19923", "cs.CL")

#: The self-guided recipe and the three-direction loss with false-negative masks.
_QWEN3_CITATION = _arxiv_entry(
    "zhang2025qwen3embedding",
    "Qwen3 Embedding: Advancing Text Embedding and Reranking Through Foundation Models",
    "Yanzhao Zhang and Mingxin Li and Dingkun Long and Xin Zhang and Huan Lin and Baosong Yang and Pengjun Xie\n"
    "            and An Yang and Dayiheng Liu and Junyang Lin and Fei Huang and Jingren Zhou",
    2025, "2506.05176", "cs.CL")

