"""What every guided family shares (``cgist.losses.gist``, ``cgist.losses.multi_vector_gist``): the guide's source
from the ``guide`` argument, the label column's guide embeddings, the guide model held as an attribute, and what the
guide masked, kept for ``GuideStatsCallback`` (docs/design.md#the-drop-in-protocol)."""

from __future__ import annotations

import logging

import torch
from sentence_transformers import SentenceTransformer
from torch import Tensor

from ..stage.spec.guide import LABELS, MODEL, NONE, SELF, GuideSource
from ..stage.stats import GistStats
from .base import FusedDropIn

__all__ = ["GuidedFamily", "batch_rows", "decoded_texts", "guide_source", "label_guide"]

logger = logging.getLogger(__name__)


def guide_source(guide: object, models: tuple[type, ...] = (SentenceTransformer,)) -> GuideSource:
    """The source of a ``guide`` argument of a guided drop-in (``cgist.stage.spec.guide``), whose guide models are
    ``models``; anything else is an error."""
    if guide is None:
        return NONE
    if isinstance(guide, models):
        return MODEL
    if isinstance(guide, str) and guide in ("labels", "self"):
        return LABELS if guide == "labels" else SELF
    message = f"guide must be a {' or a '.join(m.__name__ for m in models)}, 'labels', 'self' or None, got "
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


def decoded_texts(tokenizer: object, feature: dict[str, Tensor]) -> list[str]:
    """The texts of one column's features, decoded from the student's token ids without its special tokens (packed
    features cut at ``cu_seq_lens_q``): what a guide with its own tokenizer reads."""
    input_ids = feature["input_ids"]
    if "cu_seq_lens_q" in feature:  # packed: one row of every text's tokens, cut at the boundaries
        flat, bounds = input_ids[0].tolist(), feature["cu_seq_lens_q"].tolist()
        input_ids = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return tokenizer.batch_decode(input_ids, skip_special_tokens=True)


class GuidedFamily(FusedDropIn):
    """A family with GIST's guide: ``guide`` (a guide model of ``guide_models``, ``"labels"``, ``"self"`` or None)
    and its source, and the statistics of what the guide masked in each training call."""

    #: The family: the model classes its ``guide`` may be.
    guide_models: tuple[type, ...] = (SentenceTransformer,)
    _warned_positive_only = False

    def __setattr__(self, name: str, value: object) -> None:
        if name == "guide" and not isinstance(value, torch.nn.Module) and "guide" in getattr(self, "_modules", {}):
            del self._modules["guide"]  # a guide model (or the student, see _for_sentence_transformers) gives way
        super().__setattr__(name, value)

    @property
    def guide_source(self) -> GuideSource:
        """Where ``guide`` takes the guide from (``cgist.stage.spec.guide``); a loss built without one (by
        ``__new__``) takes the guide's embeddings from ``reps_guided``, as sentence-transformers does."""
        return guide_source(getattr(self, "guide"), self.guide_models) if hasattr(self, "guide") else MODEL

    @property
    def guide_mode(self) -> str:
        """The name of the guide's source: ``"model"``, ``"labels"``, ``"self"`` or ``"none"``."""
        return self.guide_source.name

    def _after_fused(self, reps: list[list[Tensor]], stats: GistStats, options: object) -> None:
        if torch.is_grad_enabled() and any(t.requires_grad for column in reps for t in column):  # a training step
            self.state.training_stats.append(stats)
            self._check_positive_only(stats, options)

    def _check_positive_only(self, stats: GistStats, options: object) -> None:
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
        state = self.state
        stats, state.training_stats = state.training_stats, []
        return stats

    def _config_extras(self) -> dict[str, object]:
        # ``guide`` is sentence-transformers' key (the model, "labels", "self" or None); the mode where it is no model.
        return {} if self.guide_source.runs_model else {"guide_mode": self.guide_mode}
