"""cgist: a fused, streaming drop-in for sentence-transformers' CachedGISTEmbedLoss.

``gist_loss`` and ``GistOptions`` need only torch. ``FusedCachedGISTLoss`` subclasses a
sentence-transformers loss, so it (and with it sentence-transformers) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .function import gist_loss
from .options import GistOptions

if TYPE_CHECKING:
    from .loss import FusedCachedGISTLoss

__version__ = "0.1.0"
__all__ = ["FusedCachedGISTLoss", "GistOptions", "gist_loss", "__version__"]


def __getattr__(name: str):
    if name == "FusedCachedGISTLoss":
        from .loss import FusedCachedGISTLoss

        return FusedCachedGISTLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
