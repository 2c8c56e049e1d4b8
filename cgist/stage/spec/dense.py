"""The dense score's part of the problem model (``similarity`` ``"cos"`` or ``"dot"``, over embeddings): its call
(``DenseCall``) and its door, the arguments checked once before any backend runs: the columns of the student and of
the guide (shapes, dtypes, devices, finiteness, as whole tensors or row chunks), the offset's range, the Matryoshka
dimensions, and the text ids. Each error names the argument and the column, and whether it is the student's or the
guide's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .call import StageCall, learned
from .checks import check_finite, check_text_ids, rows
from .guide import kind_of
from .options import GistOptions

__all__ = ["MARGIN", "MIN_TEMPERATURE", "DenseCall", "DenseVariant", "check_embeddings", "check_inputs", "check_problem",
           "column_name", "dense_call", "door", "make_variant", "sample_calls", "variant_of"]


@dataclass(frozen=True)
class DenseCall(StageCall):
    """A dense call: the student's columns ``[anchor, positive, *negatives]`` (and with ``options.all_anchors`` every
    rank's anchors last), each ``(rows, D)`` row chunks; ``guide``: the guide's columns likewise in its own dimension
    (detached; the student's own for ``"self"``), or None (no guide mask); ``text_ids``: one int32 id per row of each
    column, equal for equal texts (None: equal guide vectors tie)."""

    guide: Sequence[Sequence[Tensor]] | None = None
    text_ids: Sequence[Tensor] | None = None

    @property
    def guided(self) -> bool:
        return self.guide is not None


def dense_call(embeddings: object, guide_embeddings: object, options: GistOptions, *,
               text_ids: Sequence[Tensor] | None = None, temperature: Tensor | None = None) -> DenseCall:
    """The call of ``gist_loss``'s arguments, checked (``check_embeddings``; the text ids' shapes), the guide's
    columns detached: ``guide_embeddings`` the guide's columns, ``"self"`` or None."""
    if options.score.tokens:
        raise ValueError(f"similarity={options.similarity!r} scores token embeddings: cgist.maxsim_loss takes them")
    source = kind_of(guide_embeddings)
    student, guide = check_embeddings(embeddings, guide_embeddings if source == "embeddings" else None, options)
    if options.mask_duplicates and text_ids is None:
        raise ValueError("mask_duplicates=True needs text_ids: one id per row of each column, equal for equal texts")
    ids = None
    if text_ids is not None:  # they decide the guide's ties (cgist.stage.ties.tie_ids) and mask_duplicates' texts
        last = len(student) - 1 if options.all_anchors else None
        ids = check_text_ids(text_ids, [rows(c) for c in student],
                             lambda i: _ALL_ANCHORS["text_ids"] if i == last else f"text_ids[{i}] ({column_name(i)})",
                             student[0][0].device)
    if source == "self":  # the student's own vectors, detached, are the guide
        guide = student
    guide = None if guide is None else [[g.detach() for g in column] for column in guide]
    return DenseCall(options, student, None if guide is None else guide[0][0].dtype, learned(temperature), guide,
                     ids)


#: The registry's door of the dense score (``Score.door``).
door = dense_call


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


# The first-use check of the kernels (cgist.stage.dispatch.selfcheck) ---------------------------------------------

#: The check's margin, at the call's strategy: every guide score of the problem lies at least 0.15 from its
#: row's threshold (``check_inputs``), far beyond any rounding, so the mask counts must agree exactly.
MARGIN = 0.35
#: The lowest temperature of the check. The temperature is a runtime value of the kernels, not part of what they
#: compile; at 0.01 a rounding of a score in the last bit of bf16 moves its logit by 0.03, which alone would take
#: up most of bf16's tolerance.
MIN_TEMPERATURE = 0.05


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DenseVariant:
    """What selects the kernels a call compiles and the launches it runs: one first-use check each, once per
    process."""

    device: str
    dtype: torch.dtype
    guide_dtype: torch.dtype | None  # None: no guide masking
    precision: str  # torch.get_float32_matmul_precision() when an operand is fp32, else ""
    dim: int
    dim_g: int  # 0 without a guide
    n_dims: int  # Matryoshka dimensions (1 without)
    directions: tuple[str, ...]
    partition_mode: str

    def describe(self) -> str:
        """``bf16 embeddings (D=768) with a bf16 guide (Dg=384), 1 dimension, directions query_to_doc, joint``."""
        guide = f"a {_name(self.guide_dtype)} guide (Dg={self.dim_g})" if self.guide_dtype else "no guide"
        precision = f", fp32 products at {self.precision!r}" if self.precision else ""
        dims = f"{self.n_dims} Matryoshka dimensions" if self.n_dims > 1 else "1 dimension"
        return (f"{_name(self.dtype)} embeddings (D={self.dim}) with {guide}{precision}, {dims}, directions "
                f"{'+'.join(self.directions)}, {self.partition_mode} partition")


def make_variant(device: str, dtype: torch.dtype, guide_dtype: torch.dtype | None, dim: int, dim_g: int,
                 options: GistOptions) -> DenseVariant:
    """The variant of a call on ``device`` (a device key, ``cuda:0``) with these dtypes (guide None: no guide),
    dimensions and options, at the current fp32 matmul precision."""
    fp32 = torch.float32 in (dtype, guide_dtype)
    return DenseVariant(
        device=device, dtype=dtype, guide_dtype=guide_dtype,
        precision=torch.get_float32_matmul_precision() if fp32 else "", dim=dim,
        dim_g=dim_g if guide_dtype is not None else 0, n_dims=len(options.matryoshka_dims or (0,)),
        directions=tuple(options.directions), partition_mode=options.partition_mode,
    )


def variant_of(call: DenseCall, device: str) -> DenseVariant:
    """The variant of a call on ``device`` (a device key, ``cuda:0``); reads only shapes and dtypes."""
    x = call.first
    g = call.guide[0][0] if call.guide is not None else None
    return make_variant(device, x.dtype, g.dtype if g is not None else None, x.shape[1],
                        g.shape[1] if g is not None else 0, call.options)


def _rows(gen: torch.Generator, n: int, dim: int) -> Tensor:
    """``n`` Gaussian rows of ``dim`` with norms spread over [0.5, 2]."""
    x = torch.randn(n, dim, generator=gen)
    return x / x.norm(dim=1, keepdim=True) * (0.5 + 1.5 * torch.rand(n, 1, generator=gen))


def _topic_rows(gen: torch.Generator, topics: Tensor, centers: Tensor, noise: float = 0.05) -> Tensor:
    """Row r: the unit vector ``centers[topics[r]]`` plus noise of norm ``noise``, scaled into [0.5, 2]."""
    x = torch.randn(len(topics), centers.shape[1], generator=gen)
    x = centers[topics] + noise * x / x.norm(dim=1, keepdim=True)
    return x * (0.5 + 1.5 * torch.rand(len(topics), 1, generator=gen))


def check_inputs(
    variant: DenseVariant, options: GistOptions, n_columns: int, device: torch.device, rows: int = 256, seed: int = 0,
) -> tuple[list[Tensor], list[Tensor] | None, GistOptions, list[Tensor] | None]:
    """The inputs of the check for ``variant``: student and guide columns, options and text ids (with
    ``options.mask_duplicates``), ``rows`` anchors against ``rows`` candidates, on ``device``.

    ``n_columns`` counts the call's columns (anchor, positive, negatives, and every rank's anchors with
    ``options.all_anchors``, here the anchors themselves). The options are the call's with offset 0, no chunk
    budget, ``MARGIN`` and at least ``MIN_TEMPERATURE``. The rows are drawn in float32 on the CPU, the same on every
    device. The student rows are Gaussian. The guide rows are ``min(Dg, 8)`` topics (distinct signed axes) plus
    noise of norm 0.05 (an anchor's positive in its topic): two rows of one topic score at least
    (1 - 0.1 - 0.0025) / 1.05^2 = 0.81, of two topics at most 0.1025 / 0.95^2 = 0.114, and rounding the guide to
    bf16 moves a score by less than 0.01. Each threshold, theta_i - 0.35 or theta_i * 0.65 with theta_i in
    [0.8, 1], then lies in [0.45, 0.65]: no score within 0.15 of it, so the two paths' masks agree entry by entry,
    and about one entry in 8 of every block is masked. Text ids are drawn from ``rows`` values, so some texts
    repeat.
    """
    gen = torch.Generator().manual_seed(seed)
    n_negatives = n_columns - 2 - options.all_anchors
    student = [_rows(gen, rows, variant.dim) for _ in range(2 + n_negatives)]
    guide = None
    if variant.guide_dtype is not None:
        n_topics = min(variant.dim_g, 8)
        axes = torch.randperm(variant.dim_g, generator=gen)[:n_topics]  # orthonormal: distinct signed axes
        signs = torch.randint(2, (n_topics,), generator=gen) * 2.0 - 1.0
        centers = torch.zeros(n_topics, variant.dim_g).index_put_((torch.arange(n_topics), axes), signs)
        topics = [torch.randint(n_topics, (rows,), generator=gen) for _ in range(2 + n_negatives)]
        topics[1] = topics[0]  # positive i shares anchor i's topic: theta_i >= 0.81
        guide = [_topic_rows(gen, t, centers).to(device, variant.guide_dtype) for t in topics]
    student = [s.to(device, variant.dtype) for s in student]
    text_ids = None
    if options.mask_duplicates:
        text_ids = [torch.randint(rows, (rows,), generator=gen, dtype=torch.int32).to(device)
                    for _ in range(2 + n_negatives)]
    if options.all_anchors:  # every rank's anchors: this rank's alone, at offset 0
        student.append(student[0])
        guide = guide and [*guide, guide[0]]
        text_ids = text_ids and [*text_ids, text_ids[0]]
    options = options.replace(offset=0, block_bytes=None, margin=MARGIN,
                              temperature=max(options.temperature, MIN_TEMPERATURE))
    return student, guide, options, text_ids


def check_problem(call: DenseCall, variant: DenseVariant, rows: int) -> DenseCall:
    """The first-use check's call for ``variant`` (``cgist.stage.dispatch.selfcheck``): ``check_inputs`` with the
    options and the columns of ``call``, on its device, every input differentiated."""
    student, guide, options, text_ids = check_inputs(variant, call.options, len(call.columns), call.device, rows)
    return dense_call([[s] for s in student], guide, options, text_ids=text_ids)


def sample_calls(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype, dim: int,
                 guide_dim: int) -> dict[str, DenseCall]:
    """A small call of each kernel variant of the score for these dtypes and dimensions, on ``device``, by name: the
    GIST loss with a guide and a negative column. ``cgist doctor`` runs the first-use check of each (its problem is
    ``check_problem``'s, whatever the call's rows)."""
    gen = torch.Generator().manual_seed(0)
    student = [torch.randn(2, dim, generator=gen).to(device, dtype) for _ in range(3)]
    guide = [torch.randn(2, guide_dim, generator=gen).to(device, guide_dtype) for _ in range(3)]
    return {"dense": dense_call(student, guide, GistOptions())}
