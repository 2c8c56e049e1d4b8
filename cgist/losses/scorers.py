"""sentence-transformers' multi-vector scorers that the loss stage computes: each token score's ``scorer``
(``cgist.stage.spec.scores.Score.scorer``), which recognises its forms of a drop-in's ``similarity_fct``: MaxSim's and
MeanMaxSim's (``maxsim``), XTR's (``xtr``).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Mapping

from sentence_transformers.multi_vector_encoder.scoring import (
    XTRScores,
    colbert_scores,
    mean_colbert_scores,
    xtr_scores,
)
from sentence_transformers.util import similarity as st_similarity

__all__ = ["check_optional_size", "maxsim", "maxsim_normalization", "scorer_settings", "xtr"]

#: sentence-transformers' MaxSim scorers, by whether they divide by the query's token count (MeanMaxSim).
_SCORERS = {colbert_scores: False, mean_colbert_scores: True}
#: The keywords a ``functools.partial`` of them may bind: ``chunk_elements`` only bounds their memory.
_BINDABLE = {"chunk_elements", "length_normalize"}
#: The keywords a ``functools.partial`` of ``xtr_scores`` may bind, and its ``top_k`` when it binds none.
_XTR_BINDABLE = {"chunk_elements", "top_k"}
_XTR_TOP_K = inspect.signature(xtr_scores).parameters["top_k"].default


def maxsim_normalization(similarity_fct: object, model: object) -> bool | None:
    """Whether ``similarity_fct`` (with ``model``'s own similarity when it is None, as sentence-transformers 6.3
    scores by default) is MeanMaxSim (True) or MaxSim (False); None for any other score (XTR's, ``xtr``, or a custom
    callable)."""
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


def maxsim(similarity_fct: object, model: object) -> tuple[dict[str, object], dict[str, object]] | None:
    """The MaxSim score's ``scorer``: ``similarity`` ``"maxsim"`` or ``"mean_maxsim"`` (``maxsim_normalization``) for
    sentence-transformers' MaxSim and MeanMaxSim, in every form it takes; ``chunk_elements`` only bounds
    sentence-transformers' memory, and is checked (the fused stage's is ``block_bytes``)."""
    length_normalize = maxsim_normalization(similarity_fct, model)
    if length_normalize is None:
        return None
    if isinstance(similarity_fct, functools.partial):
        check_optional_size("chunk_elements", similarity_fct.keywords.get("chunk_elements"))
    return {"similarity": "mean_maxsim" if length_normalize else "maxsim"}, {}


def xtr(similarity_fct: object, model: object) -> tuple[dict[str, object], dict[str, object]] | None:
    """The XTR score's ``scorer``: ``similarity="xtr"`` and its ``top_k`` for ``xtr_scores`` (its default ``top_k``),
    a ``functools.partial`` of it binding ``top_k`` or ``chunk_elements``, or an ``XTRScores``."""
    if type(similarity_fct) is XTRScores:
        check_optional_size("chunk_elements", similarity_fct.chunk_elements)
        top_k = similarity_fct.top_k
    elif similarity_fct is xtr_scores:
        top_k = _XTR_TOP_K
    elif isinstance(similarity_fct, functools.partial) and similarity_fct.func is xtr_scores:
        keywords = similarity_fct.keywords
        if similarity_fct.args or not set(keywords) <= _XTR_BINDABLE:
            return None
        check_optional_size("chunk_elements", keywords.get("chunk_elements"))
        top_k = keywords.get("top_k", _XTR_TOP_K)
    else:
        return None
    return {"similarity": "xtr", "score_options": {"top_k": top_k}}, {}


def scorer_settings(scorer: object) -> tuple:
    """What a score's settings on ``scorer`` read (an ``XTRScores``' ``top_k``, a MaxSim scorer's
    ``length_normalize``, a ``functools.partial``'s keywords): its keywords and its attributes of plain values, by
    name, each with its type, so that a drop-in rebuilds its options when one changes."""
    values = scorer.keywords if isinstance(scorer, functools.partial) else getattr(scorer, "__dict__", {})
    return tuple(sorted((name, type(value), value) for name, value in values.items()
                        if value is None or isinstance(value, (bool, int, float, str))))


def check_optional_size(name: str, value: object) -> None:
    """``value``, None or a positive int, else an error that names it ``name``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
