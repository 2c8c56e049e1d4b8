"""The checks every score's door shares (``cgist.stage.spec.dense``, ``cgist.stage.spec.maxsim``): a column given as
a tensor or its row chunks, NaN and infinity found with one host sync and no copy, and the texts' ids. Each error names
the argument."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..numerics import compute_dtype
from ..ties import rank_ids

__all__ = ["as_chunks", "check_finite", "check_text_ids", "rows"]


def rows(chunks: Sequence[Tensor]) -> int:
    """Rows of a column given as row chunks."""
    return sum(t.shape[0] for t in chunks)


def as_chunks(value: object, name: str) -> list[Tensor]:
    """A column given as a tensor or a non-empty list of tensors (row chunks, GradCache's mini-batches), as a list;
    else a TypeError naming ``name``."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value \
            or not all(isinstance(v, Tensor) for v in value):
        raise TypeError(f"{name} must be a torch.Tensor or a non-empty list of them (row chunks), "
                        f"got {type(value).__name__}")
    return list(value)


def check_finite(named: Sequence[tuple[str, Tensor] | tuple[str, Tensor, Tensor]]) -> set[str]:
    """Raise a ValueError naming the first tensor of ``named`` that holds a NaN or an infinity, with one host sync and
    no copy of any tensor. An entry is ``(name, tensor)``, or ``(name, token embeddings, mask)``, whose masked
    (padding) tokens are never scored: a NaN or an infinity there is no error, and its name is returned, for the
    caller to zero them.

    A NaN or an infinity makes its tensor's sum non-finite (one fast reduction each, in its compute dtype). A sum can
    also overflow, so only a tensor whose sum is not finite gets the exact test. The sums meet in the widest of their
    dtypes (float64 only when an input is float64)."""
    named = [entry for entry in named if entry[1].numel()]
    if not named:
        return set()
    with torch.no_grad():
        wide = functools.reduce(torch.promote_types, (compute_dtype(t.dtype) for _, t, *_ in named))
        sums = torch.stack([t.sum(dtype=compute_dtype(t.dtype)).to(wide) for _, t, *_ in named])
    padded = set()
    suspect = ~sums.isfinite()
    if bool(suspect.any()):
        for where, t, *mask in (named[i] for i in suspect.nonzero().flatten().tolist()):
            finite = t.isfinite()
            if bool(finite.all()):
                continue
            if not mask or not bool(finite[mask[0]].all()):
                raise ValueError(f"{where} contains NaN or infinite values" + (" at a real token" if mask else ""))
            padded.add(where)
    return padded


def check_text_ids(text_ids: object, heights: Sequence[int], name: Callable[[int], str],
                   device: torch.device) -> list[Tensor]:
    """``text_ids`` checked: a list of one integer tensor per column, one id per row (``heights``), on ``device``;
    ``name(i)`` names column i's ids in messages. Returns them as int32 ids, equal exactly where the given ids are
    equal (``cgist.stage.ties.rank_ids``)."""
    if isinstance(text_ids, (Tensor, str, bytes)) or not isinstance(text_ids, Sequence):
        raise TypeError(f"text_ids must be a list of 1-D integer tensors, one per column, got {type(text_ids).__name__}")
    text_ids = list(text_ids)
    if len(text_ids) != len(heights):
        raise ValueError(f"text_ids has {len(text_ids)} columns but there are {len(heights)} columns")
    for i, (ids, height) in enumerate(zip(text_ids, heights)):
        where = name(i)
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{where} must be an integer tensor, got "
                            f"{ids.dtype if isinstance(ids, Tensor) else type(ids).__name__}")
        if ids.shape != (height,):
            raise ValueError(f"{where} must hold one id per row, shape ({height},), got {tuple(ids.shape)}")
        if ids.device != device:
            raise ValueError(f"{where} is on {ids.device}, but the embeddings are on {device}")
    return rank_ids([ids.to(torch.int64) for ids in text_ids])
