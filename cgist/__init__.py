"""cgist: a fused, streaming drop-in for sentence-transformers' CachedGISTEmbedLoss."""

from .function import gist_loss
from .loss import FusedCachedGISTLoss

__version__ = "0.1.0"
__all__ = ["FusedCachedGISTLoss", "gist_loss", "__version__"]
