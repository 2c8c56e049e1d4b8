"""The scores of the loss stage: what a tile computes from a tile of rows and a tile of columns, one registry entry
each (docs/design.md#adding-a-score). It imports only the standard library.

Everything around a score (the column groups, the guide's mask, the softmax, the budget, the router, the first-use
check, the fallback, the statistics) belongs to the stage and is written once. A score is one module per layer, named
by its entry: its part of the problem model and its checks (``spec``), each backend's tile code (``backends``: a module
with the backend contract, ``forward`` and ``backward``, docs/design.md#dispatch) and its kernels (``kernels``). The
modules are named, not imported: a backend is imported on a call's first use of it, by the router alone.

* ``dense`` (``similarity`` ``"cos"`` or ``"dot"``): dot products of rows of vectors (normalised first for ``"cos"``);
* ``maxsim`` (``"maxsim"`` or ``"mean_maxsim"``): MaxSim over token vectors, per query token the largest dot product
  with a real document token, summed (``"mean_maxsim"``: divided by the query's real token count);
* ``xtr`` (``"xtr"``): XTR over token vectors, MaxSim's per-token maxima kept where the token retrieved the document
  (its ``top_k`` largest similarities over every real document token of the call), summed and divided by how many
  query tokens retrieved it. It shares MaxSim's tiles and kernels: only the tile's reduction of the maxima differs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["BACKEND_NAMES", "DENSE", "MAXSIM", "SCORES", "XTR", "Score", "guide_similarities", "register_score",
           "score_of", "similarities", "token_score_taking"]

#: The backends a score may register, each a module with ``forward`` and ``backward`` (docs/design.md#dispatch).
BACKEND_NAMES = ("torch", "triton")


@dataclass(frozen=True)
class Score:
    """One score of the loss stage and the modules that compute it.

    ``similarities`` are the values of ``GistOptions.similarity`` it computes; ``tokens``: its columns are token
    embeddings ``(rows, tokens, dim)`` with masks (else embeddings ``(rows, dim)``); ``options``: the
    ``GistOptions`` fields beyond the common ones that it takes (a call of another score leaves them at their
    defaults); ``score_options``: its own options, by name, with their defaults (``GistOptions.score_options``,
    checked by its spec module's ``check_options``; no other score takes them); ``spec``, ``backends`` and
    ``kernels``: the modules of each layer; ``guide_similarities``: the values of ``GistOptions.guide_similarity``
    it scores a guide's columns with (none: it is no guide's score); ``scorer``: ``"module:function"``, the
    function that recognises the score in a multi-vector drop-in's ``similarity_fct``
    (``function(similarity_fct, model)``: None, or the ``GistOptions`` fields of the score and the door's keyword
    arguments, ``(fields, arguments)``: a learned parameter of the ``similarity_fct``, for one), or None (no drop-in
    fuses it)."""

    name: str
    similarities: tuple[str, ...]
    tokens: bool
    options: tuple[str, ...]
    spec: str
    score_options: Mapping[str, object] = field(default_factory=dict)
    backends: Mapping[str, str] = field(default_factory=dict)
    kernels: str | None = None
    guide_similarities: tuple[str, ...] = ()
    scorer: str | None = None

    def backend(self, name: str) -> str:
        """The module of backend ``name`` (``BACKEND_NAMES``)."""
        return self.backends[name]

    def door(self) -> Callable[..., object]:
        """The score's door: its spec module's ``door``, which builds the checked call from a user's arguments (the
        token scores': ``queries, query_mask, documents, document_masks, options, **arguments``)."""
        return importlib.import_module(self.spec).door

    def check_options(self, options: object) -> dict[str, object]:
        """Check ``options``' ``score_options`` (its spec module's ``check_options``, if it has one: an error that
        names the option, or the options' normalised values by name)."""
        check = getattr(importlib.import_module(self.spec), "check_options", None)
        return {} if check is None else check(options)

    def match(self, similarity_fct: object, model: object) -> tuple[dict[str, object], dict[str, object]] | None:
        """``scorer``'s answer for a drop-in's ``similarity_fct`` (None where the score has no scorer)."""
        if self.scorer is None:
            return None
        module, name = self.scorer.split(":")
        return getattr(importlib.import_module(module), name)(similarity_fct, model)


DENSE = Score(
    "dense", ("cos", "dot"), tokens=False,
    options=("directions", "partition_mode", "hardness_mode", "hardness_strength", "all_anchors", "matryoshka_dims",
             "matryoshka_weights"),
    spec="cgist.stage.spec.dense",
    backends={"torch": "cgist.stage.pytorch.dense", "triton": "cgist.stage.triton.dense"},
    kernels="cgist.kernels.gist",
    guide_similarities=("cos",),
)
MAXSIM = Score(
    "maxsim", ("maxsim", "mean_maxsim"), tokens=True, options=("guide_similarity",),
    spec="cgist.stage.spec.maxsim",
    backends={"torch": "cgist.stage.pytorch.maxsim", "triton": "cgist.stage.triton.maxsim"},
    kernels="cgist.kernels.maxsim",
    guide_similarities=("maxsim", "mean_maxsim"),
    scorer="cgist.losses.scorers:maxsim",
)
XTR = Score(
    "xtr", ("xtr",), tokens=True, options=("guide_similarity",),
    spec="cgist.stage.spec.xtr", score_options={"top_k": None},
    backends={"torch": "cgist.stage.pytorch.xtr", "triton": "cgist.stage.triton.xtr"},
    kernels="cgist.kernels.maxsim",
    scorer="cgist.losses.scorers:xtr",
)
#: Every score, in the order the documentation lists them, then those registered (``register_score``).
SCORES: list[Score] = [DENSE, MAXSIM, XTR]


def similarities() -> tuple[str, ...]:
    """Every value of ``GistOptions.similarity``: every registered score's."""
    return tuple(name for score in SCORES for name in score.similarities)


def guide_similarities() -> tuple[str, ...]:
    """Every value of ``GistOptions.guide_similarity``: the guide's cosine, or a multi-vector guide's MaxSim or
    MeanMaxSim (every registered score's ``guide_similarities``)."""
    return tuple(name for score in SCORES for name in score.guide_similarities)


def register_score(score: Score) -> Score:
    """Add ``score`` to the registry (docs/design.md#adding-a-score): from then on ``GistOptions(similarity=...)``
    takes its similarities, the router runs its backends (a PyTorch one is required; without a Triton one ``"auto"``
    takes the PyTorch path everywhere), ``cgist doctor`` checks it, and a multi-vector drop-in fuses the
    ``similarity_fct`` its ``scorer`` recognises. Registering the same entry again does nothing; a ValueError names
    a name or a similarity that another score has, or a backend that is missing or unknown."""
    if not isinstance(score, Score):
        raise TypeError(f"score must be a cgist Score, got {type(score).__name__}")
    if score in SCORES:
        return score
    for other in SCORES:
        if other.name == score.name:
            raise ValueError(f"a score named {score.name!r} is registered already")
        taken = set(score.similarities) & set(other.similarities + other.guide_similarities)
        taken |= set(score.guide_similarities) & set(other.similarities + other.guide_similarities)
        if taken:
            raise ValueError(f"similarity {sorted(taken)[0]!r} is the {other.name} score's")
    if "torch" not in score.backends or not set(score.backends) <= set(BACKEND_NAMES):
        raise ValueError(f"backends must name a module for 'torch' (and may for 'triton'), got {dict(score.backends)}")
    if not score.similarities:
        raise ValueError("similarities must name at least one value of GistOptions.similarity")
    SCORES.append(score)
    return score


def score_of(similarity: str) -> Score:
    """The score that computes ``similarity`` (one of ``similarities()``)."""
    for score in SCORES:
        if similarity in score.similarities:
            return score
    raise ValueError(f"similarity must be one of {similarities()}, got {similarity!r}")


def token_score_taking(options: tuple[str, ...]) -> Score:
    """The first registered token score whose ``score_options`` include every one of ``options``
    (``cgist.maxsim_loss`` picks its score by the score options it is given: none, MaxSim)."""
    for score in SCORES:
        if score.tokens and set(options) <= set(score.score_options):
            return score
    own = "; ".join(f"{score.name}: {sorted(score.score_options)}" for score in SCORES if score.tokens)
    raise ValueError(f"no registered token score takes {sorted(options)} together (the token scores' own options: "
                     f"{own})")
