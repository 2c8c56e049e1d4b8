"""``StageCall``: one call of the loss stage, validated, whatever its score (docs/design.md#adding-a-score).

What every score's call holds and the stage reads: the options (``GistOptions``: the score, the guide's rule, the
contrast blocks and directions, the offset, the budget), the student's columns (the inputs whose gradients the call
returns, each a list of row chunks), the guide's dtype, and a learned temperature. A score's spec module builds its
subclass (``cgist.stage.spec.dense.DenseCall``, ``cgist.stage.spec.maxsim.MaxSimCall``) from the user's arguments,
checked once, and its backends read the rest of it (the guide's columns, the masks, the text ids). It imports only
torch and the spec's options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .options import GistOptions

__all__ = ["StageCall"]


@dataclass(frozen=True)
class StageCall:
    """One loss-stage call. ``columns``: the student's columns, each its row chunks, in the order of the gradients
    the call returns (``tensors``); ``guide_dtype``: the guide's dtype (None without guide columns); ``temperature``:
    a 0-dim tensor that requires a gradient (a learned temperature, whose value is ``options.temperature``), or None.
    """

    options: GistOptions
    columns: Sequence[Sequence[Tensor]]
    guide_dtype: torch.dtype | None
    temperature: Tensor | None

    @property
    def tensors(self) -> list[Tensor]:
        """Every chunk of every column, column after column: the inputs the call differentiates."""
        return [t for column in self.columns for t in column]

    @property
    def first(self) -> Tensor:
        return self.columns[0][0]

    @property
    def device(self) -> torch.device:
        return self.first.device

    @property
    def dtype(self) -> torch.dtype:
        return self.first.dtype

    @property
    def guided(self) -> bool:
        """Whether a guide scores the candidates (the statistics then have means of theta and the threshold)."""
        raise NotImplementedError

    @property
    def sizes(self) -> list[int]:
        """The rows of each column."""
        return [sum(t.shape[0] for t in column) for column in self.columns]
