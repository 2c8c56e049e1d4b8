"""cgist: fused, streaming drop-ins for sentence-transformers' contrastive losses: GISTEmbed and the
MultipleNegativesRanking family over embeddings (the dense score, cosine or dot product), and the multi-vector
(late-interaction) ranking losses and their guided form over token embeddings (the MaxSim score, MaxSim or MeanMaxSim),
cached or not. One loss stage computes them all; a score is a plug-in of it (``register_score``, ``cgist.scores``:
docs/design.md#adding-a-score).

``gist_loss`` (the dense score), ``maxsim_loss`` (MaxSim), ``GistOptions`` and ``GistStats`` need only torch. The
drop-ins subclass sentence-transformers losses, ``GuideStatsCallback`` a transformers callback, and
``add_guide_embeddings`` runs a sentence-transformers model over a ``datasets.Dataset``, so they (and with them
sentence-transformers) are imported on first use.

The layers: ``losses/`` (the drop-ins) -> ``function`` and ``maxsim`` (the functional forms, thin entry points) ->
``stage/`` (the loss stage: its specification and registry of scores, its one autograd node, dispatch, the PyTorch and
Triton backends, one module per score, and the oracle) -> ``cgist.kernels`` (the Triton kernels, device code only).
``cli/`` is the ``cgist`` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compat import check_sentence_transformers
from .function import gist_loss
from .maxsim import maxsim_loss
from .stage.spec.options import GistOptions
from .stage.spec.scores import Score, register_score
from .stage.stats import GistStats

# One clear ImportError, naming the version found and the range needed, for a sentence-transformers older than
# cgist supports (read from its metadata, without importing it).
check_sentence_transformers()

if TYPE_CHECKING:
    from .losses.callbacks import GuideStatsCallback
    from .losses.gist import FusedCachedGISTLoss, FusedGISTEmbedLoss
    from .losses.multi_vector import (
        FusedCachedMultiVectorMultipleNegativesRankingLoss,
        FusedMultiVectorMultipleNegativesRankingLoss,
    )
    from .losses.multi_vector_gist import FusedCachedMultiVectorGISTLoss, FusedMultiVectorGISTLoss
    from .losses.precompute import add_guide_embeddings
    from .losses.ranking import (
        FusedCachedMultipleNegativesRankingLoss,
        FusedCachedMultipleNegativesSymmetricRankingLoss,
        FusedMultipleNegativesRankingLoss,
        FusedMultipleNegativesSymmetricRankingLoss,
    )

__version__ = "0.1.0"
__all__ = [
    "FusedCachedGISTLoss", "FusedCachedMultipleNegativesRankingLoss", "FusedCachedMultipleNegativesSymmetricRankingLoss",
    "FusedCachedMultiVectorGISTLoss", "FusedCachedMultiVectorMultipleNegativesRankingLoss", "FusedGISTEmbedLoss",
    "FusedMultiVectorGISTLoss", "FusedMultiVectorMultipleNegativesRankingLoss",
    "FusedMultipleNegativesRankingLoss", "FusedMultipleNegativesSymmetricRankingLoss",
    "GistOptions", "GistStats", "GuideStatsCallback", "Score",
    "add_guide_embeddings", "gist_loss", "maxsim_loss", "register_score", "__version__",
]

#: Names that need sentence-transformers or transformers, imported on first use.
_LAZY = {"FusedCachedGISTLoss": "losses.gist", "FusedGISTEmbedLoss": "losses.gist",
         "FusedCachedMultipleNegativesRankingLoss": "losses.ranking", "FusedMultipleNegativesRankingLoss": "losses.ranking",
         "FusedCachedMultipleNegativesSymmetricRankingLoss": "losses.ranking",
         "FusedMultipleNegativesSymmetricRankingLoss": "losses.ranking", "GuideStatsCallback": "losses.callbacks",
         "add_guide_embeddings": "losses.precompute",
         "FusedCachedMultiVectorMultipleNegativesRankingLoss": "losses.multi_vector",
         "FusedMultiVectorMultipleNegativesRankingLoss": "losses.multi_vector",
         "FusedCachedMultiVectorGISTLoss": "losses.multi_vector_gist", "FusedMultiVectorGISTLoss": "losses.multi_vector_gist"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
