"""cgist: a fused, streaming drop-in for sentence-transformers' CachedGISTEmbedLoss.

``gist_loss``, ``GistOptions`` and ``GistStats`` need only torch. ``FusedCachedGISTLoss`` and
``FusedCachedMultipleNegativesRankingLoss`` subclass sentence-transformers losses, ``GuideStatsCallback`` a
transformers callback, and ``add_guide_embeddings`` runs a sentence-transformers model over a ``datasets.Dataset``,
so they (and with them sentence-transformers) are imported on first use.

A call reads downward: ``options`` (what was asked: ``GistOptions`` and its column groups) -> ``problem`` (the groups
bound to the call's columns, the Matryoshka dimensions, and how each row's softmax ends, written once) -> one
backend, ``streaming`` (with ``workspace``) or ``kernels.launch`` over ``kernels.gist``, which scores tiles and
accumulates. ``numerics`` holds the rules every path shares (threshold, guide mask, tie ids, half products). The
README's Layout section lists each concept with the module that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compat import check_sentence_transformers
from .function import gist_loss
from .options import GistOptions
from .stats import GistStats

# One clear ImportError, naming the version found and the range needed, for a sentence-transformers older than
# cgist supports (read from its metadata, without importing it).
check_sentence_transformers()

if TYPE_CHECKING:
    from .callbacks import GuideStatsCallback
    from .loss import FusedCachedGISTLoss
    from .ranking import FusedCachedMultipleNegativesRankingLoss, FusedCachedMultipleNegativesSymmetricRankingLoss
    from .precompute import add_guide_embeddings

__version__ = "0.1.0"
__all__ = [
    "FusedCachedGISTLoss", "FusedCachedMultipleNegativesRankingLoss", "FusedCachedMultipleNegativesSymmetricRankingLoss",
    "GistOptions", "GistStats", "GuideStatsCallback",
    "add_guide_embeddings", "gist_loss", "__version__",
]

#: Names that need sentence-transformers or transformers, imported on first use.
_LAZY = {"FusedCachedGISTLoss": "loss", "FusedCachedMultipleNegativesRankingLoss": "ranking",
         "FusedCachedMultipleNegativesSymmetricRankingLoss": "ranking", "GuideStatsCallback": "callbacks",
         "add_guide_embeddings": "precompute"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
