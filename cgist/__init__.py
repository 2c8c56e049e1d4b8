"""cgist: a fused, streaming drop-in for sentence-transformers' CachedGISTEmbedLoss.

``gist_loss``, ``GistOptions`` and ``GistStats`` need only torch. ``FusedCachedGISTLoss`` subclasses a
sentence-transformers loss and ``GuideStatsCallback`` a transformers callback, so they (and with them
sentence-transformers) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .function import gist_loss
from .options import GistOptions
from .stats import GistStats

if TYPE_CHECKING:
    from .callbacks import GuideStatsCallback
    from .loss import FusedCachedGISTLoss

__version__ = "0.1.0"
__all__ = ["FusedCachedGISTLoss", "GistOptions", "GistStats", "GuideStatsCallback", "gist_loss", "__version__"]

#: Names that need sentence-transformers or transformers, imported on first use.
_LAZY = {"FusedCachedGISTLoss": "loss", "GuideStatsCallback": "callbacks"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
