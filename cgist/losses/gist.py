"""The GIST family: ``FusedCachedGISTLoss`` (sentence-transformers' ``CachedGISTEmbedLoss``) and ``FusedGISTEmbedLoss``
(its ``GISTEmbedLoss``), each one class over the drop-in protocol (``cgist.losses.base``), a step
(``cgist.losses.steps``) and ``GistFamily``: the guide's source, the label column's guide embeddings, GIST's scalar
hyperparameters checked, the settings it leaves to sentence-transformers' own loss computation, and its citations."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping

import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss, GISTEmbedLoss
from sentence_transformers.util import batch_to_device
from torch import Tensor

from ..compat import release_rules
from ..stage.spec.guide import NONE, SELF
from ..stage.spec.options import MARGIN_STRATEGIES, GistOptions, _check_real, check_margin, real_number
from .base import StepInputs, attribute_key, text_fingerprints
from .columns import DenseColumns
from .guided import GuidedFamily, batch_rows, decoded_texts, guide_source, label_guide
from .steps import CachedStep, PlainStep

__all__ = ["FusedCachedGISTLoss", "FusedGISTEmbedLoss", "GistFamily"]


def _check_strategy(margin_strategy: object) -> None:
    """GIST's ``margin_strategy``, with sentence-transformers' message, as its constructor raises it."""
    if margin_strategy not in MARGIN_STRATEGIES:
        raise ValueError(f"margin_strategy must be 'absolute' or 'relative'. Got {margin_strategy!r}.")


def check_guide_scalars(margin: object, margin_strategy: object) -> None:
    """The multi-vector GIST drop-ins' margin and strategy: a finite margin (``check_margin``), as their stage needs;
    they have no sentence-transformers loss to fall back on."""
    _check_strategy(margin_strategy)
    check_margin(margin, margin_strategy)


def check_scalars(temperature: object, margin: object, margin_strategy: object) -> None:
    """GIST's scalar hyperparameters, checked: a temperature other than a positive finite number makes
    sentence-transformers' loss NaN (its masked similarities are -inf before the division), and a NaN margin
    silently masks nothing, so both are errors. An infinite margin is sentence-transformers' to run (the fused stage
    takes finite ones). The temperature may be a learned one (a 0-dim tensor, an ``nn.Parameter``): its value now."""
    _check_strategy(margin_strategy)
    temperature = real_number("temperature", temperature)
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


class GistFamily(GuidedFamily):
    """The GIST family (``FusedCachedGISTLoss``, ``FusedGISTEmbedLoss``): the guide's source, the options from
    sentence-transformers' GIST attributes and cgist's own, the guide's columns and the texts' ids read off a batch,
    the guide's statistics and the citations."""

    family = "gist"
    columns = DenseColumns()
    family_attributes = ("temperature", "margin", "margin_strategy", "contrast_anchors", "contrast_positives")
    argument_annotations = {"guide": "SentenceTransformer | Literal['labels', 'self'] | None"}

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        guide_source(arguments["guide"])
        check_scalars(arguments["temperature"], arguments["margin"], arguments["margin_strategy"])

    def _for_sentence_transformers(self, arguments: dict[str, object]) -> dict[str, object]:
        # Without a guide model sentence-transformers' checks see the student as the guide; the guide is set after.
        if guide_source(arguments["guide"]).runs_model:
            return arguments
        return {**arguments, "guide": arguments["model"]}

    def _keep_arguments(self, arguments: Mapping[str, object]) -> None:
        self.guide = arguments["guide"]

    def _family_key(self) -> tuple:
        similarity, cross_entropy = getattr(self, "similarity_fct", None), getattr(self, "cross_entropy_loss", None)
        return (self.guide_source, *attribute_key(similarity, ("dim", "eps")), (type(similarity), similarity),
                *attribute_key(cross_entropy, ("weight", "ignore_index", "reduction", "label_smoothing")),
                (type(cross_entropy), cross_entropy))

    def _family_options(self) -> tuple[GistOptions | None, str | None]:
        check_scalars(self.temperature, self.margin, self.margin_strategy)
        source = self.guide_source
        own = self.own_fields()
        release_excludes = release_rules().self_pairs_excluded  # the installed sentence-transformers' rule
        mask_self, mask_duplicates = source.masks(own.pop("mask_self"), own.pop("mask_duplicates"), have_text_ids=True,
                                                  self_pairs_excluded=release_excludes)
        options = GistOptions(
            margin_strategy=self.margin_strategy, contrast_anchors=self.contrast_anchors,
            contrast_positives=self.contrast_positives, mask_self=mask_self, mask_duplicates=mask_duplicates, **own,
        )
        reason = (_unfused_cosine(getattr(self, "similarity_fct", None))
                  or _unfused_cross_entropy(getattr(self, "cross_entropy_loss", None))
                  or (None if math.isfinite(self.margin) else f"margin={self.margin!r} (the fused stage takes a finite margin)"))
        if reason is None:
            return options.replace(temperature=real_number("temperature", self.temperature), margin=self.margin), None
        defaults = {option.name: option.default for option in self.own_options()}
        beyond = [f"guide={self.guide!r}"] if source is NONE else []
        beyond += [f"mask_self={options.mask_self}"] if options.mask_self != release_excludes else []
        beyond += ["mask_duplicates=True"] if options.mask_duplicates else []
        beyond += [f"{name}={getattr(options, name)!r}" for name in ("directions", "partition_mode", "hardness_mode")
                   if getattr(options, name) != defaults[name] and (name != "hardness_mode" or options.hardness)]
        if beyond:
            raise ValueError(f"{reason}, which the fused loss stage does not compute; sentence-transformers' "
                             f"{self.replaces.__name__}, which would, has no {', '.join(beyond)}")
        return None, reason

    def _step_inputs(self, features: list[dict[str, Tensor]], labels: Tensor | None,
                     options: GistOptions | None) -> StepInputs:
        """The label column's guide columns (``guide="labels"``) and, for the fused stage, the texts' ids."""
        guide = label_guide(labels, len(features), batch_rows(features[0])) if self.guide_source.reads_labels else None
        text_ids = text_fingerprints(features, needed=options.mask_duplicates) if options is not None else None
        return StepInputs(guide=guide, text_ids=text_ids)

    def _stage_guide(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]],
                     inputs: StepInputs) -> list[list[Tensor]] | list[Tensor] | str | None:
        """The guide's columns for the dense columns: the guide model's mini-batches, the label column's (read off the
        batch, ``inputs``), ``"self"``, or None."""
        if reps_guided is None:
            raise TypeError("calculate_loss of a GIST drop-in takes reps_guided, the guide's embeddings of each "
                            "column (with guide='labels', 'self' or None, the student's, which are not read)")
        reps_guided = list(reps_guided)
        if len(reps) != len(reps_guided):
            raise ValueError(f"reps and reps_guided must have the same length, got {len(reps)} and {len(reps_guided)}")
        if self.guide_source.runs_model:
            return [list(r) for r in reps_guided]
        if self.guide_source.reads_labels:
            if inputs.guide is None:
                raise ValueError("guide='labels' reads the guide embeddings off the batch's label column: call the loss "
                                 "on a batch (calculate_loss alone does not see the labels)")
            return list(inputs.guide)
        return self.guide_source.kind

    def _unfused_reps_guided(self, reps_guided: object, reps: list[list[Tensor]]) -> object:
        # sentence-transformers' own computation takes the label column's guide as mini-batches of the guide's.
        if self.guide_source.reads_labels:
            return [[column] for column in self._stage_guide(reps, reps_guided, self.step_inputs)]
        return reps_guided

    def temperature_tensor(self) -> Tensor | None:
        """``temperature`` where it is a tensor (a learned one), checked as the constructor checks it."""
        if not isinstance(self.temperature, Tensor):
            return None
        check_scalars(self.temperature, self.margin, self.margin_strategy)
        return self.temperature

    @property
    def citation(self) -> str:
        """GISTEmbed and GradCache; the Qwen3 Embedding paper for a self-guided loss or its direction set, and the
        paper whose loss a direction set is (GTE, Jina Embeddings 2)."""
        return _direction_citation(self, self.guide_source is SELF) + _GISTEMBED_CITATION + _GRADCACHE_CITATION


class FusedCachedGISTLoss(GistFamily, CachedStep, CachedGISTEmbedLoss):
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

    cgist's own options, keyword-only (docs/losses.md#cgists-own-options), add the masks of self-pairs and
    duplicates, sentence-transformers' directions, partitions and hardness (Lan et al. 2025, arXiv:2503.04812) under
    the guide's mask, and the loss stage's backend and budget; docs/losses.md explains each.

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


class FusedGISTEmbedLoss(GistFamily, PlainStep, GISTEmbedLoss):
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

    cgist's own options are those of ``FusedCachedGISTLoss``, keyword-only (docs/losses.md#cgists-own-options).

    Beyond sentence-transformers' class, it takes any number of negative columns (sentence-transformers' takes at
    most one). ``MatryoshkaLoss`` around it computes every dimension in one loss stage and one guide pass: it reports
    ``uses_gradient_cache``, so ``MatryoshkaLoss`` decorates its ``calculate_loss`` (the loss over a step's
    embeddings), which it takes over as the cached drop-ins do; the dimensions, weights and ``n_dims_per_step``
    sampling are ``MatryoshkaLoss``'s, and the loss and gradients those of sentence-transformers' loop over dimensions.

    Raises:
        TypeError, ValueError: for a bad argument, naming it, before anything is computed (sentence-transformers' own
            arguments with its messages).
    """

    def _st_forward_computes(self) -> bool:
        # sentence-transformers' forward runs a guide model; the label column's guide is this drop-in's own.
        return self.guide_source.runs_model

    def _plain_beside(self, features: list[dict[str, Tensor]], copies: list[dict[str, Tensor]],
                      reps: list[list[Tensor]], masks: object, labels: Tensor | None) -> list[list[Tensor]]:
        """The guide model's embeddings of the batch; without one, the student's, detached (``_stage_guide`` takes
        the guide from the label column, the student or nowhere)."""
        if not self.guide_source.runs_model:
            return [[e.detach() for e in r] for r in reps]
        with torch.no_grad():
            return [[g] for g in self._guide_embeddings(features, copies)]

    def _guide_embeddings(self, sentence_features: list[dict[str, Tensor]],
                          copies: list[dict[str, Tensor]]) -> list[Tensor]:
        """The guide model's embeddings of the batch, as sentence-transformers computes them: on the copies of the
        features, or, when the guide needs its own tokens (``must_retokenize``: another vocabulary or a shorter
        ``max_seq_length``), on the student's tokens decoded and tokenised again by the guide."""
        if self.must_retokenize:
            copies = []
            for feature in sentence_features:
                texts = decoded_texts(self.tokenizer, feature)
                copies.append(batch_to_device(self.guide.preprocess(texts), self.guide.device))
        return embed_columns(self.guide, copies)

    def _embeddings_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]]) -> Tensor:
        # sentence-transformers' GIST loss over given embeddings: its cached class's computation, the same as its
        # plain forward's once the rows are one chunk (its cross-entropy times B / B).
        rows = sum(t.shape[0] for t in reps[0])
        view = types.SimpleNamespace(
            gather_across_devices=self.gather_across_devices, mini_batch_size=rows, show_progress_bar=False,
            sim_matrix=self.sim_matrix, margin_strategy=self.margin_strategy, margin=self.margin,
            contrast_anchors=self.contrast_anchors, contrast_positives=self.contrast_positives,
            cross_entropy_loss=self.cross_entropy_loss, temperature=self.temperature,
        )
        return CachedGISTEmbedLoss.calculate_loss(view, reps, reps_guided)


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

