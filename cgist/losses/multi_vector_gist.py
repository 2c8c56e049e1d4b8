"""The guided multi-vector family: GIST's guide over MaxSim scores, ``FusedCachedMultiVectorGISTLoss`` and
``FusedMultiVectorGISTLoss``, each one class over the drop-in protocol (``cgist.losses.base``), a step and
``MultiVectorGistFamily``: sentence-transformers' multi-vector ranking classes, which they replace, with GIST's
``guide``, ``margin_strategy``, ``margin`` and contrast blocks (docs/design.md#the-guide-for-late-interaction).
sentence-transformers has no guided multi-vector loss: with ``guide=None`` these are its multi-vector ranking losses.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.multi_vector_encoder.losses import (
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
from torch import Tensor

from ..stage.spec.guide import NONE, SELF
from ..stage.spec.options import GistOptions, check_bools
from .base import StepInputs, text_fingerprints
from .gist import _GISTEMBED_CITATION, _GRADCACHE_CITATION, check_guide_scalars
from .guided import GuidedFamily, batch_rows, decoded_texts, guide_source, label_guide
from .multi_vector import MultiVectorFamily
from .scorers import maxsim as maxsim_scorer
from .scorers import scorer_settings
from .steps import CachedStep, PlainStep

__all__ = ["FusedCachedMultiVectorGISTLoss", "FusedMultiVectorGISTLoss", "MultiVectorGistFamily"]

_GUIDE_ARGUMENTS = ("guide", "margin_strategy", "margin", "contrast_anchors", "contrast_positives")


def _padded(tokens: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """Token embeddings of varying lengths (each ``(L_i, D)``) as one ``(n, max L_i, D)`` tensor and its mask."""
    lengths = torch.tensor([t.shape[0] for t in tokens], device=device)
    padded = torch.nn.utils.rnn.pad_sequence([t.to(device) for t in tokens], batch_first=True)
    return padded, torch.arange(padded.shape[1], device=device) < lengths.unsqueeze(1)


class MultiVectorGistFamily(GuidedFamily, MultiVectorFamily):
    """The guided multi-vector family: the multi-vector ranking family's loss stage with GIST's guide mask.

    Query ``i``'s candidate is left out of its softmax when the guide scores it strictly above ``theta_i - margin``
    (``"absolute"``) or ``theta_i - |theta_i| * margin`` (``"relative"``), theta_i being the guide's score of ``i``
    with its positive, which is never left out. The candidates: the batch's documents, and with GIST's contrast
    blocks the other queries (AA) and, for its positive, the other positives (PP). The guide's score: a SentenceTransformer's cosine of its embeddings
    of the texts (decoded from the student's tokens), a MultiVectorEncoder's own MaxSim or MeanMaxSim of its token
    embeddings, the label column's embeddings' cosine (``"labels"``), or the student's own MaxSim, detached
    (``"self"``); None masks nothing.
    """

    family = "multi_vector_gist"
    family_attributes = ("scale", "similarity_fct", *_GUIDE_ARGUMENTS)
    guide_models = (SentenceTransformer, MultiVectorEncoder)
    added_parameters = (
        inspect.Parameter("guide", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                          annotation="SentenceTransformer | MultiVectorEncoder | Literal['labels', 'self'] | None"),
        inspect.Parameter("margin_strategy", inspect.Parameter.KEYWORD_ONLY, default="absolute",
                          annotation="Literal['absolute', 'relative']"),
        inspect.Parameter("margin", inspect.Parameter.KEYWORD_ONLY, default=0.0, annotation="float"),
        inspect.Parameter("contrast_anchors", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool"),
        inspect.Parameter("contrast_positives", inspect.Parameter.KEYWORD_ONLY, default=False, annotation="bool"),
    )

    def _check_arguments(self, arguments: Mapping[str, object]) -> None:
        super()._check_arguments(arguments)
        guide_source(arguments["guide"], self.guide_models)
        check_guide_scalars(arguments["margin"], arguments["margin_strategy"])
        check_bools(contrast_anchors=arguments["contrast_anchors"], contrast_positives=arguments["contrast_positives"])

    def _for_sentence_transformers(self, arguments: dict[str, object]) -> dict[str, object]:
        return {name: value for name, value in arguments.items() if name not in _GUIDE_ARGUMENTS}

    def _keep_arguments(self, arguments: Mapping[str, object]) -> None:
        for name in _GUIDE_ARGUMENTS:
            setattr(self, name, arguments[name])

    def _family_key(self) -> tuple:
        guide = getattr(self, "guide", None)
        scorer = getattr(guide, "_similarity", None)
        return (*super()._family_key(), self.guide_source, getattr(guide, "similarity_fn_name", None), type(scorer),
                scorer_settings(scorer))

    def _family_options(self) -> tuple[GistOptions | None, str | None]:
        check_guide_scalars(self.margin, self.margin_strategy)
        check_bools(contrast_anchors=self.contrast_anchors, contrast_positives=self.contrast_positives)
        options, reason = super()._family_options()
        if options is None:
            source, mask_duplicates = self.guide_source, self._option_fields()["mask_duplicates"]
            if source is not NONE or mask_duplicates or self.contrast_anchors or self.contrast_positives:
                asked = "a guide" if source is not NONE else "mask_duplicates=True" if mask_duplicates else \
                    "contrast blocks"
                raise ValueError(f"{reason}, which the fused loss stage does not compute; sentence-transformers has no "
                                 f"multi-vector loss with {asked} to compute it instead")
        return options, reason

    def _option_fields(self) -> dict[str, object]:
        """GIST's options over the multi-vector loss: the margin, the contrast blocks, the masks' defaults
        (``mask_duplicates`` on with ``"self"``, off otherwise; ``mask_self`` on unless False) and a multi-vector
        guide's score."""
        own = self.own_fields()
        if own["mask_duplicates"] is None:
            own["mask_duplicates"] = self.guide_source is SELF
        own["mask_self"] = own["mask_self"] is not False
        guide_similarity = "cos"
        if isinstance(getattr(self, "guide", None), MultiVectorEncoder):
            match = maxsim_scorer(None, self.guide)  # the guide's own similarity, as MaxSim's scorer reads it
            if match is None:
                raise ValueError(f"guide: a MultiVectorEncoder guide scores with MaxSim or MeanMaxSim (its "
                                 f"similarity_fn_name 'maxsim' or 'meanmaxsim'), got "
                                 f"{getattr(self.guide, 'similarity_fn_name', None)!r}")
            guide_similarity = match[0]["similarity"]
        return {**own, "margin": self.margin, "margin_strategy": self.margin_strategy,
                "contrast_anchors": self.contrast_anchors, "contrast_positives": self.contrast_positives,
                "guide_similarity": guide_similarity}

    def _step_inputs(self, features: list[dict[str, Tensor]], labels: Tensor | None,
                     options: GistOptions | None) -> StepInputs:
        """The texts' ids, and the guide's columns: the label column's (``"labels"``) or the guide model's
        embeddings of the batch (read before the student embeds it)."""
        if options is None:
            return StepInputs()
        source = self.guide_source
        guide = None
        if source.reads_labels:
            guide = {"guide": label_guide(labels, len(features), batch_rows(features[0]))}
        elif source.runs_model:
            guide = self._guide_model_columns(features)
        return StepInputs(guide=guide, text_ids=text_fingerprints(features, needed=options.mask_duplicates))

    def _guide_model_columns(self, features: list[dict[str, Tensor]]) -> dict[str, object]:
        """The guide model's embeddings of each column's texts, without gradients: a SentenceTransformer's
        ``(rows, Dg)`` embeddings, or a MultiVectorEncoder's token embeddings (the queries' as queries, the documents'
        as documents) padded, with their masks. The texts are decoded from the student's token ids (its prompts and
        special tokens left out) and tokenised by the guide. The columns of the last batch are kept (until the next
        batch's are made): a wrapper that calls the loss once per dimension on the same batch
        (``MultiVectorMatryoshkaLoss``) runs the guide once."""
        if not all("input_ids" in feature for feature in features):
            raise ValueError("a guide model reads the batch's texts, decoded from the student's token ids, but these "
                             "features have no 'input_ids'; precompute the guide's embeddings (guide='labels')")
        ids = [feature["input_ids"] for feature in features]
        state = self.state
        kept = state.guide_columns
        if kept is not None and kept[0] is self.guide and len(kept[1]) == len(ids) and all(
                a.shape == b.shape and torch.equal(a, b) for a, b in zip(kept[1], ids)):
            return kept[2]
        state.guide_columns = None  # freed before the next batch's are made
        columns = self._run_guide(features)
        state.guide_columns = (self.guide, [i.clone() for i in ids], columns)
        return columns

    def _run_guide(self, features: list[dict[str, Tensor]]) -> dict[str, object]:
        guide, device = self.guide, features[0]["input_ids"].device
        batch_size = getattr(self, "mini_batch_size", None) or 32
        tokenizer = getattr(self.model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"guide={type(guide).__name__}: a guide model reads the batch's texts, decoded from the "
                             "student's token ids by the student's tokenizer, but the model "
                             f"({type(self.model).__name__}) has no tokenizer; give the model one, or precompute the "
                             "guide's embeddings (guide='labels')")
        texts = [decoded_texts(tokenizer, feature) for feature in features]
        with torch.no_grad():
            if not isinstance(guide, MultiVectorEncoder):
                return {"guide": [guide.encode(t, batch_size=batch_size, convert_to_tensor=True,
                                               show_progress_bar=False).to(device) for t in texts]}
            columns = [(guide.encode_query if n == 0 else guide.encode_document)(
                t, batch_size=batch_size, show_progress_bar=False) for n, t in enumerate(texts)]
        padded = [_padded([torch.as_tensor(x) for x in column], device) for column in columns]
        return {"guide": [e for e, _ in padded], "guide_masks": [m for _, m in padded]}

    def _stage_guide(self, reps: list[list[Tensor]], masks_chunks: object, inputs: StepInputs) -> dict[str, object]:
        """The door's ``guide`` (and ``guide_masks``): what this step's ``forward`` read (``_step_inputs``), or the
        student's own scores (``"self"``)."""
        source = self.guide_source
        if source is SELF:
            return {"guide": "self"}
        if source is NONE:
            return {}
        if inputs.guide is None:
            raise ValueError(f"guide={'labels' if source.reads_labels else 'a model'}: the guide's embeddings are read "
                             "off the batch (its labels or its texts): call the loss on a batch (calculate_loss alone "
                             "does not see it)")
        return dict(inputs.guide)

    def _config_extras(self) -> dict[str, object]:
        guide = {"guide": self.guide} if self.guide_source.runs_model else {"guide_mode": self.guide_mode}
        return {**guide, "margin_strategy": self.margin_strategy, "margin": self.margin,
                "contrast_anchors": self.contrast_anchors, "contrast_positives": self.contrast_positives}

    @property
    def citation(self) -> str:
        """GISTEmbed, and GradCache for the cached loss."""
        return _GISTEMBED_CITATION + (_GRADCACHE_CITATION if isinstance(self, CachedStep) else "")


class FusedCachedMultiVectorGISTLoss(MultiVectorGistFamily, CachedStep,
                                     CachedMultiVectorMultipleNegativesRankingLoss):
    """A GIST loss over MaxSim scores, with GradCache: ``CachedMultiVectorMultipleNegativesRankingLoss`` with GIST's
    guide masking each query's in-batch candidates.

    The arguments are those of sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss`` (``scale``,
    ``similarity_fct``, ``mini_batch_size``, ``mini_batch_num_tokens``, ``score_mini_batch_size``,
    ``gather_across_devices``, ``show_progress_bar``), with GIST's:

    Args:
        model: the MultiVectorEncoder being trained.
        guide: what decides which in-batch candidates are left out as likely false negatives:

            - a frozen SentenceTransformer: the cosine of its embeddings of the batch's texts (one pass without
              gradients, the texts decoded from the student's tokens);
            - a frozen MultiVectorEncoder: its MaxSim (or MeanMaxSim, as its ``similarity_fn_name`` says) of its token
              embeddings of the texts, the queries embedded as queries;
            - ``"labels"``: precomputed single-vector guide embeddings, the batch's label column, shaped
              ``(batch, n_columns, Dg)`` in the order of the text columns (``cgist.add_guide_embeddings``);
            - ``"self"``: the student's own MaxSim scores, detached; nothing extra runs;
            - None: nothing is masked: the loss is ``CachedMultiVectorMultipleNegativesRankingLoss``'s.
        margin_strategy: ``"absolute"`` or ``"relative"``, how ``margin`` lowers the threshold.
        margin: how far below theta_i (the guide's score of query ``i`` with its positive) the threshold lies; a
            candidate the guide scores strictly above it is masked, the positive never.
        contrast_anchors: GIST's AA block: each query's MaxSim against every query of the batch joins its softmax,
            masked by the guide as the documents are (off by default, so that ``guide=None`` is
            sentence-transformers' multi-vector ranking loss).
        contrast_positives: GIST's PP block: each query's positive, as the left side of MaxSim, against every
            positive of the batch (gathered with ``gather_across_devices``), likewise.

    cgist's own options, keyword-only, add ``mask_duplicates`` (every candidate whose token ids are the query's or
    its positive's; on by default with ``"self"``), ``mask_self`` (the self-pairs AA[i, i] and PP[i, offset + i]
    always left out; on unless False) and the loss stage's backend and budget. The loss stage is the
    multi-vector drop-ins' streaming MaxSim stage (``cgist.maxsim_loss``), with the guide's mask made for one row
    block of queries at a time, on the MaxSim kernels where the unguided loss runs them. After each training
    call, ``last_stats`` holds a ``cgist.GistStats`` of what the guide masked (``"ap"``: the positives' column,
    ``"an"``: the negatives', ``"aa"`` and ``"pp"``: the contrast blocks); ``cgist.GuideStatsCallback(loss)`` logs
    it.

    References:
        - GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning,
          https://arxiv.org/abs/2402.16829
        - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache),
          https://arxiv.org/abs/2101.06983
    """


class FusedMultiVectorGISTLoss(MultiVectorGistFamily, PlainStep, MultiVectorMultipleNegativesRankingLoss):
    """A GIST loss over MaxSim scores: ``MultiVectorMultipleNegativesRankingLoss`` with GIST's guide masking each
    query's in-batch candidates.

    The arguments are those of sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss`` with GIST's
    ``guide``, ``margin_strategy``, ``margin``, ``contrast_anchors`` and ``contrast_positives``, as for
    ``FusedCachedMultiVectorGISTLoss``; the student embeds the
    batch once and autograd takes the loss stage's gradients back into it. With ``guide=None`` the loss is
    ``MultiVectorMultipleNegativesRankingLoss``'s.

    References:
        - GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning,
          https://arxiv.org/abs/2402.16829
    """
