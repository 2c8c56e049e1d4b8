"""``GistOptions``: the options of one GIST loss computation, validated once and passed as one object.

``FusedCachedGISTLoss`` and ``gist_loss`` build it; the autograd Function and both backends (the PyTorch
streaming path and the Triton launcher) read it. It imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
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
        mask_self: always exclude the self-pairs AA[i, i] and PP[i, offset + i] (otherwise they drop out only when
            the guide scores them above the threshold, as in sentence-transformers).
        mask_duplicates: exclude every candidate whose text is anchor i's or its positive's, whatever the scores
            (the call then needs a text id per row); the label stays.
        offset: anchor i's positive is candidate ``offset + i`` (``rank * B`` when candidates are gathered).
            Its range, ``[0, N - B]``, depends on the shapes and is checked with them.
        matryoshka_dims: if given, the loss is ``sum_d w_d * L_d`` over these student dimensions, where
            ``L_d`` scores the student embeddings truncated to their first d components (each renormalised)
            and the guide is untouched. Distinct positive ints, in any order; at most the student dimension
            (checked with the shapes).
        matryoshka_weights: the weights ``w_d``, one finite number per dimension (default: all 1).
        block_bytes: bytes of score buffers the loss stage may hold at once, a positive int; None picks a
            default for the device (see ``cgist.streaming.plan``).

    Raises:
        TypeError, ValueError: naming the first bad option.
    """

    temperature: float = 0.01
    margin: float = 0.0
    margin_strategy: Literal["absolute", "relative"] = "absolute"
    contrast_anchors: bool = True
    contrast_positives: bool = True
    mask_self: bool = False
    mask_duplicates: bool = False
    offset: int = 0
    matryoshka_dims: tuple[int, ...] | None = None
    matryoshka_weights: tuple[float, ...] | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        _check_real("margin", self.margin)
        if not math.isfinite(self.margin):
            raise ValueError(f"margin must be a finite number, got {self.margin!r}")
        if not isinstance(self.margin_strategy, str) or self.margin_strategy not in MARGIN_STRATEGIES:
            raise ValueError(f"margin_strategy must be one of {MARGIN_STRATEGIES}, got {self.margin_strategy!r}")
        for name in ("contrast_anchors", "contrast_positives", "mask_self", "mask_duplicates"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, numbers.Integral):
            raise TypeError(f"offset must be an int, got {type(self.offset).__name__}")
        if self.block_bytes is not None:
            if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, numbers.Integral):
                raise TypeError(f"block_bytes must be an int or None, got {type(self.block_bytes).__name__}")
            if self.block_bytes < 1:
                raise ValueError(f"block_bytes must be at least 1, got {self.block_bytes}")
            object.__setattr__(self, "block_bytes", int(self.block_bytes))
        self._check_matryoshka()
        # Plain Python numbers from here on (numpy scalars and the like are accepted above).
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "margin", float(self.margin))
        object.__setattr__(self, "offset", int(self.offset))

    def _check_matryoshka(self) -> None:
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if dims is None:
            if weights is not None:
                raise ValueError("matryoshka_weights needs matryoshka_dims")
            return
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
            raise TypeError(f"matryoshka_dims must be a non-empty sequence of ints, got {dims!r}")
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, numbers.Integral):
                raise TypeError(f"matryoshka_dims must hold ints, got {type(d).__name__} {d!r}")
            if d < 1:
                raise ValueError(f"matryoshka_dims must be positive, got {d}")
        if len(set(dims)) != len(dims):
            repeated = sorted({d for d in dims if list(dims).count(d) > 1})
            raise ValueError(f"matryoshka_dims must be distinct, got {list(dims)} (repeated: {repeated})")
        if weights is None:
            weights = [1.0] * len(dims)
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != len(dims):
            raise ValueError(f"matryoshka_weights must have one weight per dimension ({len(dims)}), got {weights!r}")
        for w in weights:
            _check_real("matryoshka_weights", w)
            if not math.isfinite(w):
                raise ValueError(f"matryoshka_weights must be finite, got {w!r}")
        object.__setattr__(self, "matryoshka_dims", tuple(int(d) for d in dims))
        object.__setattr__(self, "matryoshka_weights", tuple(float(w) for w in weights))

    def dims(self, full_dim: int) -> tuple[tuple[int, float], ...]:
        """``(d, w_d)`` pairs in decreasing d: ``((full_dim, 1.0),)`` without Matryoshka."""
        if self.matryoshka_dims is None:
            return ((full_dim, 1.0),)
        return tuple(sorted(zip(self.matryoshka_dims, self.matryoshka_weights), reverse=True))

    @property
    def relative(self) -> bool:
        """True for the relative margin strategy."""
        return self.margin_strategy == "relative"

    def replace(self, **changes: object) -> GistOptions:
        """A validated copy with ``changes`` applied (``options.replace(offset=rank * B)``)."""
        return dataclasses.replace(self, **changes)
