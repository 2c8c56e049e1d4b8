"""The arguments of a loss-stage call, checked once before any backend runs: the columns of the student and of the
guide (shapes, dtypes, devices, finiteness, as whole tensors or row chunks), the offset's range, the Matryoshka
dimensions, and the text ids. Each error names the argument and the column, and whether it is the student's or the
guide's."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from ..numerics import compute_dtype
from ..ties import rank_ids
from .options import GistOptions

__all__ = ["check_embeddings", "check_finite", "check_text_ids", "column_name", "rows"]


def column_name(index: int) -> str:
    """Human name of column ``index`` of ``[anchor, positive, *negatives]``."""
    return ("anchor", "positive")[index] if index < 2 else f"negative {index - 1}"


#: The arguments that hold every rank's anchors (``gist_loss``), by the argument of the other columns.
_ALL_ANCHORS = {"embeddings": "all_anchors", "guide_embeddings": "all_anchors_guide", "text_ids": "all_anchors_text_ids"}


def _where(arg: str, i: int, all_anchors: int | None = None) -> str:
    """``embeddings[2] (student negative 1)``: how messages name a column; column ``all_anchors`` (if given) is the
    one that ``gist_loss`` takes as ``all_anchors`` (or ``all_anchors_guide``)."""
    if i == all_anchors:
        return _ALL_ANCHORS[arg]
    return f"{arg}[{i}] ({'student' if arg == 'embeddings' else 'guide'} {column_name(i)})"


def _check_group(columns: object, arg: str, all_anchors: bool = False) -> list[list[Tensor]]:
    """One side's columns as lists of row chunks, checked: 2-D, non-empty, floating, one dtype, one dim,
    negatives (and with ``all_anchors`` the last column, every rank's anchors) as tall as the positives.

    A column is a 2-D tensor, or a list of them stacked by rows (GradCache's mini-batches), each chunk
    checked as a column would be; messages name a chunk by its index when a column has several, as the
    finiteness test does.
    """
    if isinstance(columns, (Tensor, str, bytes)) or not isinstance(columns, Sequence):
        raise TypeError(f"{arg} must be a list of 2-D tensors [anchor, positive, *negatives], got {type(columns).__name__}")
    columns = list(columns)
    if len(columns) < 2:
        raise ValueError(f"{arg} needs at least two columns (anchor, positive), got {len(columns)}")
    out: list[list[Tensor]] = []
    last = len(columns) - 1 if all_anchors else None
    for i, column in enumerate(columns):
        where = _where(arg, i, last)
        whole = isinstance(column, Tensor)
        if not whole and (isinstance(column, (str, bytes)) or not isinstance(column, Sequence) or not column):
            raise TypeError(f"{where} must be a torch.Tensor or a non-empty list of them (row chunks), "
                            f"got {type(column).__name__}")
        chunks = [column] if whole else list(column)
        first = out[0][0] if out else chunks[0]
        for j, t in enumerate(chunks):
            name = where if len(chunks) == 1 else f"{where} chunk {j}"
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D (rows x dim), got shape {tuple(t.shape)}")
            if t.shape[0] == 0 or t.shape[1] == 0:
                raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")
            if t.dtype != first.dtype:
                raise TypeError(f"{name} has dtype {t.dtype}, but {arg}[0] has {first.dtype}")
            if t.shape[1] != first.shape[1]:
                raise ValueError(f"{name} has dim {t.shape[1]}, but {arg}[0] has dim {first.shape[1]}")
        if i >= 2 and rows(chunks) != rows(out[1]):
            raise ValueError(f"{where} has {rows(chunks)} rows, but the positives have {rows(out[1])}")
        out.append(chunks)
    return out


def rows(chunks: Sequence[Tensor]) -> int:
    """Rows of a column given as row chunks."""
    return sum(t.shape[0] for t in chunks)


def check_finite(named: Sequence[tuple[str, Tensor]]) -> None:
    """Raise a ValueError naming the first tensor of ``named`` (``(name, tensor)`` pairs) that holds a NaN or an
    infinity, with one host sync and no copy of any tensor.

    A NaN or an infinity makes its tensor's sum non-finite (one fast reduction each, in its compute dtype). A sum can
    also overflow, so only a tensor whose sum is not finite gets the exact test. The sums meet in the widest of their
    dtypes (float64 only when an input is float64)."""
    with torch.no_grad():
        wide = functools.reduce(torch.promote_types, (compute_dtype(t.dtype) for _, t in named))
        sums = torch.stack([t.sum(dtype=compute_dtype(t.dtype)).to(wide) for _, t in named])
    suspect = ~sums.isfinite()
    if bool(suspect.any()):
        for where, t in (named[i] for i in suspect.nonzero().flatten().tolist()):
            if not bool(t.isfinite().all()):
                raise ValueError(f"{where} contains NaN or infinite values")


def check_text_ids(text_ids: object, student: list[list[Tensor]], all_anchors: bool = False) -> list[Tensor]:
    """``text_ids`` checked against the student columns: one integer tensor of one id per row for each column, on
    the embeddings' device. Returns them as int32 ids, equal exactly where the given ids are equal."""
    if isinstance(text_ids, (Tensor, str, bytes)) or not isinstance(text_ids, Sequence):
        raise TypeError(f"text_ids must be a list of 1-D integer tensors, one per column, got {type(text_ids).__name__}")
    text_ids = list(text_ids)
    if len(text_ids) != len(student):
        raise ValueError(f"text_ids has {len(text_ids)} columns but embeddings has {len(student)}")
    device = student[0][0].device
    last = len(student) - 1 if all_anchors else None
    for i, (ids, column) in enumerate(zip(text_ids, student)):
        where = _ALL_ANCHORS["text_ids"] if i == last else f"text_ids[{i}] ({column_name(i)})"
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{where} must be an integer tensor, got "
                            f"{ids.dtype if isinstance(ids, Tensor) else type(ids).__name__}")
        if ids.shape != (rows(column),):
            raise ValueError(f"{where} must hold one id per row, shape ({rows(column)},), got {tuple(ids.shape)}")
        if ids.device != device:
            raise ValueError(f"{where} is on {ids.device}, but the embeddings are on {device}")
    return rank_ids([ids.to(torch.int64) for ids in text_ids])


def check_embeddings(
    embeddings: object, guide_embeddings: object, options: GistOptions
) -> tuple[list[list[Tensor]], list[list[Tensor]] | None]:
    """Validate shapes, dtypes, devices, finiteness, the offset's range and the Matryoshka dimensions.

    Returns both groups as lists of columns, each a list of row chunks (one for a column given whole); the guide
    is None when ``guide_embeddings`` is (no guide masking).

    Costs one host sync (the finiteness test), however many columns and chunks there are.
    """
    student = _check_group(embeddings, "embeddings", options.all_anchors)
    if guide_embeddings is None:
        _check_finite_and_shapes(student, [], options)
        return student, None
    guide = _check_group(guide_embeddings, "guide_embeddings", options.all_anchors)
    if len(guide) != len(student):
        raise ValueError(
            f"guide_embeddings has {len(guide)} columns but embeddings has {len(student)}; they must hold the same columns"
        )
    last = len(student) - 1 if options.all_anchors else None
    for i, (s, g) in enumerate(zip(student, guide)):
        if rows(g) != rows(s):
            raise ValueError(f"{_where('guide_embeddings', i, last)} has {rows(g)} rows, but "
                             f"{_where('embeddings', i, last)} has {rows(s)}")
    _check_finite_and_shapes(student, guide, options)
    return student, guide


def _check_finite_and_shapes(student: list[list[Tensor]], guide: list[list[Tensor]], options: GistOptions) -> None:
    """One device, N >= B, the offset's range, the Matryoshka dimensions, and no NaN or infinity anywhere."""
    last = len(student) - 1 if options.all_anchors else None
    named = [(_where(arg, i, last) + (f" chunk {j}" if len(column) > 1 else ""), t)
             for arg, group in (("embeddings", student), ("guide_embeddings", guide))
             for i, column in enumerate(group) for j, t in enumerate(column)]
    device = student[0][0].device
    for where, t in named:
        if t.device != device:
            raise ValueError(
                f"{where} is on {t.device}, but embeddings[0] (student anchor) is on {device}; "
                "all embeddings must be on one device"
            )
    batch, n_cand = rows(student[0]), rows(student[1])
    if n_cand < batch:
        raise ValueError(
            f"embeddings[1] (student positive) has {n_cand} rows, fewer than the {batch} anchors; "
            "anchor i's positive is candidate offset + i, so there must be N >= B candidates"
        )
    offset = options.offset
    if not 0 <= offset <= n_cand - batch:
        raise ValueError(
            f"offset must be in [0, N - B] = [0, {n_cand - batch}] so that labels offset..offset+B-1 are candidates "
            f"(B={batch} anchors, N={n_cand} candidates), got {offset}"
        )
    dim = student[0][0].shape[1]
    too_large = [d for d in options.matryoshka_dims or () if d > dim]
    if too_large:
        raise ValueError(
            f"matryoshka_dims {too_large} exceed the student embedding dimension D={dim} of embeddings[0]"
        )
    check_finite(named)
