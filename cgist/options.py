"""``GistOptions``: the options of one GIST loss computation, validated once and passed as one object.

``FusedCachedGISTLoss`` and ``gist_loss`` build it; the autograd Function and both backends (the PyTorch
streaming path and the Triton launcher) read it. It imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Literal

__all__ = ["MARGIN_STRATEGIES", "GistOptions"]

MARGIN_STRATEGIES = ("absolute", "relative")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


@dataclass(frozen=True)
class GistOptions:
    """The loss options of ``CachedGISTEmbedLoss`` and the offset of this rank's labels.

    Args:
        temperature: divides the cosine similarities before the softmax; positive and finite.
        margin: finite; with ``margin_strategy`` it sets the guide threshold ``T_i`` of anchor i.
        margin_strategy: ``"absolute"`` (``T_i = theta_i - margin``) or ``"relative"``
            (``T_i = theta_i - |theta_i| * margin``).
        contrast_anchors: add the anchor-anchor block.
        contrast_positives: add the positive-positive block.
        offset: anchor i's positive is candidate ``offset + i`` (``rank * B`` when candidates are gathered).
            Its range, ``[0, N - B]``, depends on the shapes and is checked with them.

    Raises:
        TypeError, ValueError: naming the first bad option.
    """

    temperature: float = 0.01
    margin: float = 0.0
    margin_strategy: Literal["absolute", "relative"] = "absolute"
    contrast_anchors: bool = True
    contrast_positives: bool = True
    offset: int = 0

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        _check_real("margin", self.margin)
        if not math.isfinite(self.margin):
            raise ValueError(f"margin must be a finite number, got {self.margin!r}")
        if not isinstance(self.margin_strategy, str) or self.margin_strategy not in MARGIN_STRATEGIES:
            raise ValueError(f"margin_strategy must be one of {MARGIN_STRATEGIES}, got {self.margin_strategy!r}")
        for name in ("contrast_anchors", "contrast_positives"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, numbers.Integral):
            raise TypeError(f"offset must be an int, got {type(self.offset).__name__}")
        # Plain Python numbers from here on (numpy scalars and the like are accepted above).
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "margin", float(self.margin))
        object.__setattr__(self, "offset", int(self.offset))

    @property
    def relative(self) -> bool:
        """True for the relative margin strategy."""
        return self.margin_strategy == "relative"

    def replace(self, **changes: object) -> GistOptions:
        """A validated copy with ``changes`` applied (``options.replace(offset=rank * B)``)."""
        return dataclasses.replace(self, **changes)
