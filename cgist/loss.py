"""``FusedCachedGISTLoss``: sentence-transformers' ``CachedGISTEmbedLoss`` with a fused loss stage."""

from __future__ import annotations

import logging
import math
import numbers
import random
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.distributed as dist
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss, CachedMultipleNegativesRankingLoss
from sentence_transformers.util import all_gather, all_gather_with_grad, cos_sim, get_rank
from torch import Tensor

from .function import BACKENDS, default_masks, gist_loss_with_options
from .numerics import token_fingerprints
from .options import GistOptions, _check_real
from .stats import GistStats

__all__ = ["FusedCachedGISTLoss", "FusedCachedMultipleNegativesRankingLoss", "FusedMatryoshka"]

logger = logging.getLogger(__name__)


#: ``guide`` as a name: a guide model, precomputed embeddings in the label column, the student itself, or none.
GUIDE_MODES = ("model", "labels", "self", "none")


def guide_mode(guide: object) -> str:
    """The ``GUIDE_MODES`` name of a ``guide`` argument of ``FusedCachedGISTLoss``; anything else is an error."""
    if guide is None:
        return "none"
    if isinstance(guide, SentenceTransformer):
        return "model"
    if isinstance(guide, str) and guide in ("labels", "self"):
        return guide
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


def text_fingerprints(feature: dict[str, Tensor]) -> Tensor:
    """A key per text of one column's features, from its token ids and attention mask (or packed lengths)."""
    if "input_ids" not in feature:
        raise ValueError("mask_duplicates compares texts by their token ids, but these features have no 'input_ids'; "
                         "pass mask_duplicates=False")
    input_ids = feature["input_ids"]
    if "cu_seq_lens_q" in feature:  # packed: one row of all tokens, with cumulative lengths
        bounds = feature["cu_seq_lens_q"].tolist()
        input_ids = torch.nn.utils.rnn.pad_sequence([input_ids[0, a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                                                    batch_first=True, padding_value=0)
        lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=input_ids.device)
        mask = torch.arange(input_ids.shape[1], device=input_ids.device) < lengths.unsqueeze(1)
        return token_fingerprints(input_ids, mask)
    return token_fingerprints(input_ids, feature.get("attention_mask"))


def fused_loss_stage(
    reps: list[list[Tensor]], guide: list | str | None, text_ids: list[Tensor] | None, options: GistOptions, *,
    backend: str, gather: bool, with_backward: bool, dims: tuple[tuple[int, float], ...] | None = None,
) -> tuple[Tensor, GistStats]:
    """The loss stage of a GradCache step: the loss over the cached mini-batch embeddings ``reps`` and its statistics.

    Each column stays a list of its mini-batches (the loss stage takes them as row chunks, so the embeddings are not
    concatenated into a copy). With ``gather`` the candidates are gathered with gradients from every rank, as
    sentence-transformers does, and so are the anchors when a direction scores against them; the guide's columns
    (``guide``: a list of the guide's columns, "self" or None) and the text ids go with them. ``dims`` are Matryoshka
    ``(d, w_d)`` pairs. With ``with_backward`` the embedding gradients are accumulated into the leaves' ``.grad``
    and the loss is returned detached.
    """
    anchors, *candidates = (list(r) for r in reps)
    if gather:
        batch = sum(r.shape[0] for r in anchors)
        check_equal_batches(batch, anchors[0].device)
        everyone = bool({"query_to_query", "doc_to_query"} & set(options.directions))
        candidates = [all_gather_with_grad(torch.cat(c)) for c in candidates]
        if everyone:  # every rank's anchors, as one more column
            candidates.append(all_gather_with_grad(torch.cat(anchors)))
        if isinstance(guide, list):  # the guide model's mini-batches, or the label column's whole columns
            whole = [torch.cat(c) if isinstance(c, (list, tuple)) else c for c in guide]
            gathered = [all_gather_with_grad(c) for c in whole[1:]]
            guide = [guide[0], *gathered, *([all_gather_with_grad(whole[0])] if everyone else [])]
        if text_ids is not None:
            text_ids = [text_ids[0], *(all_gather(t) for t in text_ids[1:]), *([all_gather(text_ids[0])] if everyone else [])]
        options = options.replace(offset=get_rank() * batch, all_anchors=everyone)
    if dims is not None:
        options = options.replace(matryoshka_dims=tuple(d for d, _ in dims), matryoshka_weights=tuple(w for _, w in dims))
    loss, stats = gist_loss_with_options([anchors, *candidates], guide, options, backend=backend, return_stats=True,
                                         text_ids=text_ids)
    if with_backward:
        loss.backward()
        loss = loss.detach()
    return loss, stats


def _check_mini_batches(mini_batch_size: object, mini_batch_num_tokens: object, gather_across_devices: object) -> None:
    """The embedding stage's arguments of both losses, checked."""
    for name, value, expected in (
        ("mini_batch_size", mini_batch_size, "an int"),
        ("mini_batch_num_tokens", mini_batch_num_tokens, "an int or None"),
    ):
        if value is None and name == "mini_batch_num_tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not isinstance(gather_across_devices, bool):
        raise TypeError(f"gather_across_devices must be a bool, got {type(gather_across_devices).__name__}")


def check_equal_batches(batch_size: int, device: torch.device) -> None:
    """With gathering, every rank must hold the same number of anchors, or the offsets would be wrong.

    The sizes travel on ``device``, the embeddings' own, which the process group can reach.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    sizes = [torch.zeros((), dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(batch_size, device=device))
    sizes = [int(s) for s in sizes]
    if len(set(sizes)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
        raise ValueError(
            f"gather_across_devices=True needs the same local batch size on every rank, got {listing} rows; "
            "use a sampler that gives every rank full batches (e.g. drop_last / dataloader_drop_last=True)"
        )


class FusedCachedGISTLoss(CachedGISTEmbedLoss):
    """sentence-transformers' ``CachedGISTEmbedLoss`` with a fused, streaming loss stage."""

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
        """
        A drop-in for :class:`CachedGISTEmbedLoss`: the same arguments, the same loss and the same gradients, with
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
            mask_self: always exclude the self-pairs AA[i, i] and PP[i, i]. Default: off with a guide model or
                ``"labels"`` (the guide masks them, as in sentence-transformers), on with ``"self"`` and None.
            mask_duplicates: exclude every candidate whose text is that of the anchor or of its positive, whatever
                the scores (the positive itself stays). Texts are compared by their token ids and attention mask,
                so duplicates are found also under dropout. Default as for ``mask_self``.
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
        self.guide_mode = guide_mode(guide)
        source = "embeddings" if self.guide_mode in ("model", "labels") else "self" if self.guide_mode == "self" else None
        for name, value in (("mask_self", mask_self), ("mask_duplicates", mask_duplicates)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
        mask_self, mask_duplicates = default_masks(source, mask_self, mask_duplicates, have_text_ids=True)
        self.options = GistOptions(
            temperature=temperature,
            margin=margin,
            margin_strategy=margin_strategy,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            mask_self=mask_self,
            mask_duplicates=mask_duplicates,
            directions=directions,
            partition_mode=partition_mode,
            hardness_mode=hardness_mode,
            hardness_strength=hardness_strength,
            block_bytes=block_bytes,
        )
        _check_mini_batches(mini_batch_size, mini_batch_num_tokens, gather_across_devices)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        # Without a guide model sentence-transformers' checks see the student as the guide; the guide is set after.
        super().__init__(
            model,
            guide if self.guide_mode == "model" else model,
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
        if self.guide_mode != "model":
            del self.guide  # the student, registered by sentence-transformers' constructor as the guide module
        self.guide = guide
        self.backend = backend
        self._batch: dict[str, object] = {}  # this forward's label guide and text ids, for calculate_loss
        self.last_stats: GistStats | None = None
        self._training_stats: list[GistStats] = []
        self._warned_positive_only = False

    def __setattr__(self, name: str, value: object) -> None:
        # MatryoshkaLoss decorates a gradient-cache loss by replacing its ``calculate_loss`` with a loop over
        # dimensions; take that decoration over and compute the dimensions in one pass instead.
        if name == "calculate_loss":
            value = FusedMatryoshka.take_over(self, value)
        super().__setattr__(name, value)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        """sentence-transformers' GradCache step; the label guide and the texts' ids are read off the batch first."""
        sentence_features = list(sentence_features)
        batch = {}
        if self.guide_mode == "labels":
            batch["guide"] = label_guide(labels, len(sentence_features), batch_rows(sentence_features[0]))
        if self.options.mask_duplicates:
            batch["text_ids"] = [text_fingerprints(feature) for feature in sentence_features]
        self._batch = batch
        try:
            return super().forward(sentence_features, labels)
        finally:
            self._batch = {}

    def embed_minibatch(self, sentence_feature: dict[str, Tensor], begin: int, end: int, with_grad: bool,
                        copy_random_state: bool, random_state=None):
        """sentence-transformers' embedding of one mini-batch; without a guide model, the student's alone.

        The first pass (``with_grad=False``) then runs the student as the second pass does, under ``no_grad``, and
        hands back as the guide's embeddings the student's own (``"self"``) or an empty placeholder (``"labels"``,
        None), which ``calculate_loss`` replaces.
        """
        if self.guide_mode == "model" or with_grad:
            return super().embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state, random_state)
        with torch.no_grad():
            reps, _, state = super().embed_minibatch(sentence_feature, begin, end, True, copy_random_state,
                                                     random_state)
        return reps, (reps if self.guide_mode == "self" else reps.new_empty(reps.shape[0], 0)), state

    def calculate_loss(
        self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        """Loss over the cached mini-batch embeddings.

        With ``with_backward`` the embedding gradients are accumulated into ``.grad`` of the leaves in
        ``reps`` and a detached scalar is returned; under ``torch.no_grad`` only the loss is computed.
        """
        return self._loss_stage(reps, reps_guided, with_backward=with_backward)

    def _loss_stage(
        self,
        reps: list[list[Tensor]],
        reps_guided: list[list[Tensor]],
        *,
        with_backward: bool,
        dims: tuple[tuple[int, float], ...] | None = None,
    ) -> Tensor:
        """``calculate_loss``, over ``dims`` (Matryoshka ``(d, w_d)`` pairs) if given."""
        if len(reps) != len(reps_guided):
            raise ValueError(f"reps and reps_guided must have the same length, got {len(reps)} and {len(reps_guided)}")
        guide, text_ids = self._guide_columns(reps_guided), self._batch.get("text_ids")
        if self.options.mask_duplicates and text_ids is None:
            raise ValueError("mask_duplicates needs the batch's token ids: call the loss on the batch's features "
                             "(calculate_loss alone does not see them), or pass mask_duplicates=False")
        loss, stats = fused_loss_stage(reps, guide, text_ids, self.options, backend=self.backend,
                                       gather=self.gather_across_devices, with_backward=with_backward, dims=dims)
        self.last_stats = stats
        if with_backward and torch.is_grad_enabled():
            self._training_stats.append(stats)
            self._check_positive_only(stats)
        return loss

    def _guide_columns(self, reps_guided: list[list[Tensor]]) -> list[list[Tensor]] | list[Tensor] | str | None:
        """The guide's columns for ``gist_loss``: the guide model's mini-batches, the label column's, "self", or None."""
        if self.guide_mode == "model":
            return [list(r) for r in reps_guided]
        if self.guide_mode == "labels":
            if "guide" not in self._batch:
                raise ValueError("guide='labels' reads the guide embeddings off the batch's label column: call the loss "
                                 "on a batch (calculate_loss alone does not see the labels)")
            return list(self._batch["guide"])
        return "self" if self.guide_mode == "self" else None

    def _check_positive_only(self, stats: GistStats) -> None:
        """Warn once when more than half of a step's anchors are left with only their positive."""
        if self._warned_positive_only or stats.positive_only_fraction <= 0.5:
            return
        self._warned_positive_only = True
        logger.warning(
            "%.0f%% of this step's anchors have every candidate but their positive masked by the guide "
            "(margin=%s, margin_strategy=%r): their loss carries no contrast. The margin masks too much for this "
            "guide; lower it (this warning is shown once).",
            100 * stats.positive_only_fraction, self.options.margin, self.options.margin_strategy,
        )

    def pop_training_stats(self) -> list[GistStats]:
        """The statistics of the training calls since the last call of this method (for logging)."""
        stats, self._training_stats = self._training_stats, []
        return stats

    def get_config_dict(self) -> dict:
        """sentence-transformers' configuration (``guide`` is the model, "labels", "self" or None), with the guide
        mode named, the explicit masks and cgist's own options."""
        options = self.options
        config = {**super().get_config_dict(), "guide_mode": self.guide_mode, "mask_self": options.mask_self,
                  "mask_duplicates": options.mask_duplicates, "directions": options.directions,
                  "partition_mode": options.partition_mode, "hardness_mode": options.hardness_mode,
                  "hardness_strength": options.hardness_strength, "backend": self.backend}
        if self.options.block_bytes is not None:
            config["block_bytes"] = self.options.block_bytes
        return config

    @property
    def citation(self) -> str:
        """GISTEmbed and GradCache; the Qwen3 Embedding paper for a self-guided loss or its direction set, and the
        paper whose loss a direction set is (GTE, Jina Embeddings 2)."""
        return _direction_citation(self.options, self.guide_mode == "self") + """
@misc{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Aivin V. Solatorio},
    year={2024},
    eprint={2402.16829},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}

@misc{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


def _direction_citation(options: GistOptions, self_guided: bool) -> str:
    """The papers whose loss these directions (or a self-guide) make, as BibTeX entries ("" for none)."""
    directions, joint = set(options.directions), options.partition_mode == "joint"
    qwen3 = self_guided or (joint and directions == {"query_to_doc", "query_to_query", "doc_to_doc"})
    gte = joint and directions == {"query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"}
    jina = not joint and directions == {"query_to_doc", "doc_to_query"}
    return (_QWEN3_CITATION if qwen3 else "") + (_GTE_CITATION if gte else "") + (_JINA_CITATION if jina else "")


_GTE_CITATION = """
@misc{li2023gte,
    title={Towards General Text Embeddings with Multi-stage Contrastive Learning},
    author={Zehan Li and Xin Zhang and Yanzhao Zhang and Dingkun Long and Pengjun Xie and Meishan Zhang},
    year={2023},
    eprint={2308.03281},
    archivePrefix={arXiv},
    primaryClass={cs.CL}
}
"""

_JINA_CITATION = """
@misc{guenther2024jina2,
    title={Jina Embeddings 2: 8192-Token General-Purpose Text Embeddings for Long Documents},
    author={Michael G{\"u}nther and others},
    year={2024},
    eprint={2310.19923},
    archivePrefix={arXiv},
    primaryClass={cs.CL}
}
"""

#: The self-guided recipe and the three-direction loss with false-negative masks.
_QWEN3_CITATION = """
@misc{zhang2025qwen3embedding,
    title={Qwen3 Embedding: Advancing Text Embedding and Reranking Through Foundation Models},
    author={Yanzhao Zhang and Mingxin Li and Dingkun Long and Xin Zhang and Huan Lin and Baosong Yang and Pengjun Xie
            and An Yang and Dayiheng Liu and Junyang Lin and Fei Huang and Jingren Zhou},
    year={2025},
    eprint={2506.05176},
    archivePrefix={arXiv},
    primaryClass={cs.CL}
}
"""


class FusedMatryoshka:
    """``calculate_loss`` of a ``FusedCachedGISTLoss`` under ``MatryoshkaLoss``: every dimension in one pass.

    It stands in for sentence-transformers' ``CachedLossDecorator`` and keeps its attributes (``fn``,
    ``matryoshka_dims``, ``matryoshka_weights``, ``n_dims_per_step``). Each call picks the dimensions with the
    same random call as that decorator (``random.sample`` over the dimension indices when ``n_dims_per_step``
    is below their number), then computes ``sum_d w_d * L_d`` and its gradients in one loss-stage call.
    """

    def __init__(self, loss: FusedCachedGISTLoss, decorator: object) -> None:
        self.loss = loss
        self.fn = decorator.fn
        self.matryoshka_dims = tuple(decorator.matryoshka_dims)
        self.matryoshka_weights = tuple(decorator.matryoshka_weights)
        self.n_dims_per_step = decorator.n_dims_per_step

    @staticmethod
    def take_over(loss: FusedCachedGISTLoss | FusedCachedMultipleNegativesRankingLoss, value: object) -> object:
        """``value`` replaced by a ``FusedMatryoshka`` if it is the Matryoshka decoration of ``loss``'s own method.

        Anything else (another wrapper, or a decorator whose shape has changed) is kept as it is: the loss then
        runs once per dimension, as in sentence-transformers, which is slower but the same.
        """
        try:
            from sentence_transformers.sentence_transformer.losses.matryoshka import CachedLossDecorator
        except ImportError:
            return value
        fn = getattr(value, "fn", None)
        if not (isinstance(value, CachedLossDecorator) and getattr(fn, "__self__", None) is loss
                and getattr(fn, "__func__", None) in (FusedCachedGISTLoss.calculate_loss,
                                                      FusedCachedMultipleNegativesRankingLoss.calculate_loss)
                and all(hasattr(value, a) for a in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"))):
            return value
        return FusedMatryoshka(loss, value)

    def __call__(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]] | Tensor | None = None, *,
                 with_backward: bool = False) -> Tensor:
        """``calculate_loss`` over the sampled dimensions; ``reps_guided`` is the GIST loss's guide embeddings, or the
        labels of the ranking loss (unused)."""
        indices: range | list[int] = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(indices):
            indices = random.sample(indices, self.n_dims_per_step)
        dims = tuple((self.matryoshka_dims[i], float(self.matryoshka_weights[i])) for i in indices)
        return self.loss._loss_stage(reps, reps_guided, with_backward=with_backward, dims=dims)


def similarity_name(similarity_fct: object) -> str:
    """``"cos"`` for sentence-transformers' ``cos_sim`` and ``"dot"`` for ``dot_score``; any other function is an
    error naming the two the fused loss stage computes."""
    from sentence_transformers.util import cos_sim, dot_score

    if similarity_fct is cos_sim:
        return "cos"
    if similarity_fct is dot_score:
        return "dot"
    name = getattr(similarity_fct, "__name__", type(similarity_fct).__name__)
    raise ValueError(f"similarity_fct must be sentence_transformers.util.cos_sim or dot_score (the two the fused loss "
                     f"stage computes), got {name}")


class FusedCachedMultipleNegativesRankingLoss(CachedMultipleNegativesRankingLoss):
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
        A drop-in for :class:`CachedMultipleNegativesRankingLoss`: the same arguments, defaults, loss and gradients,
        with a loss stage that never forms the B x N similarity matrix. It is ``FusedCachedGISTLoss``'s loss stage
        without a guide: every direction, both partition modes, the hardness penalty and ``gather_across_devices``
        run as matrix products over blocks of anchors with a streaming log-sum-exp (Triton kernels on CUDA, a
        blockwise PyTorch computation elsewhere).

        Args:
            model: the SentenceTransformer being trained.
            scale: multiplies the similarities before the softmax (1 / temperature).
            similarity_fct: ``sentence_transformers.util.cos_sim`` or ``dot_score``; any other is an error.
            mini_batch_size, mini_batch_num_tokens, show_progress_bar: the embedding stage's, as in
                sentence-transformers.
            gather_across_devices: score this rank's rows against every rank's candidates (and anchors, for the
                directions that read them).
            directions, partition_mode, hardness_mode, hardness_strength: sentence-transformers' meaning (see
                ``cgist.GistOptions``).
            backend: ``"auto"``, ``"torch"`` or ``"triton"``, as for ``FusedCachedGISTLoss``.
            block_bytes: bytes of score buffers the loss stage may hold at once (None: a default for the device).

        Raises:
            TypeError, ValueError: for a bad argument, naming it, before anything is computed.
        """
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer, got {type(model).__name__}")
        _check_real("scale", scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.options = GistOptions(
            temperature=1.0 / scale, contrast_anchors=False, contrast_positives=False, directions=directions,
            partition_mode=partition_mode, hardness_mode=hardness_mode, hardness_strength=hardness_strength,
            similarity=similarity_name(similarity_fct), block_bytes=block_bytes,
        )
        _check_mini_batches(mini_batch_size, mini_batch_num_tokens, gather_across_devices)
        super().__init__(
            model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens, gather_across_devices=gather_across_devices,
            directions=directions, partition_mode=partition_mode, show_progress_bar=show_progress_bar,
            hardness_mode=hardness_mode, hardness_strength=hardness_strength,
        )
        self.backend = backend
        self.last_stats: GistStats | None = None

    def __setattr__(self, name: str, value: object) -> None:
        # As for FusedCachedGISTLoss: compute MatryoshkaLoss's dimensions in one pass.
        if name == "calculate_loss":
            value = FusedMatryoshka.take_over(self, value)
        super().__setattr__(name, value)

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None, *,
                       with_backward: bool = False) -> Tensor:
        """Loss over the cached mini-batch embeddings (the labels are unused: the positive pair is the diagonal).

        With ``with_backward`` the embedding gradients are accumulated into ``.grad`` of the leaves in ``reps`` and
        a detached scalar is returned; under ``torch.no_grad`` only the loss is computed.
        """
        return self._loss_stage(reps, labels, with_backward=with_backward)

    def _loss_stage(self, reps: list[list[Tensor]], labels: Tensor | None = None, *, with_backward: bool,
                    dims: tuple[tuple[int, float], ...] | None = None) -> Tensor:
        loss, self.last_stats = fused_loss_stage(reps, None, None, self.options, backend=self.backend,
                                                 gather=self.gather_across_devices, with_backward=with_backward,
                                                 dims=dims)
        return loss

    def get_config_dict(self) -> dict:
        config = {**super().get_config_dict(), "backend": self.backend}
        if self.options.block_bytes is not None:
            config["block_bytes"] = self.options.block_bytes
        return config
