"""``gist_loss``: the GIST loss over embeddings, as a ``torch.autograd.Function``.

The forward computes the loss and, when any student embedding needs a gradient, the embedding
gradients in the same pass (GradCache needs them at once anyway). The backward only scales those
stored gradients by ``grad_output``. Validation happens here, once, before any backend runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import streaming
from .numerics import compute_dtype
from .options import GistOptions
from .stats import GistStats

__all__ = ["BACKENDS", "GistLossFunction", "check_embeddings", "gist_loss", "gist_loss_with_options"]

BACKENDS = ("auto", "torch", "triton")

#: A backend: ``(embeddings, guide_embeddings, options, *, need_grads, need_stats)`` ->
#: ``(loss, grads or None, counters or None)``, counters as in ``cgist.numerics.STATS_FIELDS``. Each column
#: is a tensor or a list of row chunks; each gradient is its whole column's.
Backend = Callable[..., tuple[Tensor, "list[Tensor] | None", "Tensor | None"]]


def column_name(index: int) -> str:
    """Human name of column ``index`` of ``[anchor, positive, *negatives]``."""
    return ("anchor", "positive")[index] if index < 2 else f"negative {index - 1}"


def _where(arg: str, i: int) -> str:
    """``embeddings[2] (student negative 1)``: how messages name a column."""
    return f"{arg}[{i}] ({'student' if arg == 'embeddings' else 'guide'} {column_name(i)})"


def _check_group(columns: object, arg: str) -> list[list[Tensor]]:
    """One side's columns as lists of row chunks, checked: 2-D, non-empty, floating, one dtype, one dim,
    negatives as tall as the positives.

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
    for i, column in enumerate(columns):
        where = _where(arg, i)
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


def check_embeddings(
    embeddings: object, guide_embeddings: object, options: GistOptions
) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
    """Validate shapes, dtypes, devices, finiteness, the offset's range and the Matryoshka dimensions.

    Returns both groups as lists of columns, each a list of row chunks (one for a column given whole).

    Costs one host sync (the finiteness test), however many columns and chunks there are.
    """
    student = _check_group(embeddings, "embeddings")
    guide = _check_group(guide_embeddings, "guide_embeddings")
    if len(guide) != len(student):
        raise ValueError(
            f"guide_embeddings has {len(guide)} columns but embeddings has {len(student)}; they must hold the same columns"
        )
    for i, (s, g) in enumerate(zip(student, guide)):
        if rows(g) != rows(s):
            raise ValueError(f"{_where('guide_embeddings', i)} has {rows(g)} rows, but embeddings[{i}] has {rows(s)}")
    named = [(_where(arg, i) + (f" chunk {j}" if len(column) > 1 else ""), t)
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
    # One host sync for all columns and chunks: a NaN or an infinity makes its chunk's sum non-finite (one
    # fast reduction per chunk). A sum can also overflow, so only a chunk with a non-finite sum gets the
    # exact test, which names it. Each side's chunks share a dtype, so each side's sums stack as they are.
    with torch.no_grad():
        n_student = sum(map(len, student))
        sums = [torch.stack([t.sum(dtype=compute_dtype(t.dtype)) for _, t in side]).to(torch.float64)
                for side in (named[:n_student], named[n_student:])]
    suspect = ~torch.cat(sums).isfinite()
    if bool(suspect.any()):
        for where, t in (named[i] for i in suspect.nonzero().flatten().tolist()):
            if not bool(t.isfinite().all()):
                raise ValueError(f"{where} contains NaN or infinite values")
    return student, guide


def _triton_backend() -> Backend:
    """The Triton launcher, or a RuntimeError saying why it cannot run here."""
    try:
        from .kernels import gist_loss_and_grads
    except ImportError as err:
        raise RuntimeError(f"backend='triton' is unavailable: {err}") from err
    return gist_loss_and_grads


def select_backend(backend: object, device: torch.device) -> Backend:
    """'auto' picks Triton for CUDA tensors and the PyTorch streaming path elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return streaming.gist_loss_and_grads
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before importing "
            "cgist, or use backend='torch'"
        )
    if backend == "auto":
        try:
            return _triton_backend()
        except RuntimeError:
            return streaming.gist_loss_and_grads
    return _triton_backend()


class GistLossFunction(torch.autograd.Function):
    """Autograd node: forward returns the loss (and the mask counters); backward scales the kept gradients.

    ``tensors`` are the row chunks of the student columns, then of the guide columns; ``layout`` gives each
    column's number of chunks, student columns first (``n_cols`` of them). The backends take the columns
    as lists of chunks, and each chunk gets its rows of its column's gradient.
    """

    @staticmethod
    def forward(ctx, backend: Backend, options: GistOptions, layout: tuple[int, ...], n_cols: int, need_grads: bool,
                need_stats: bool, *tensors: Tensor) -> tuple[Tensor, Tensor]:
        columns, start = [], 0
        for n in layout:
            columns.append(list(tensors[start : start + n]))
            start += n
        loss, grads, counters = backend(columns[:n_cols], columns[n_cols:], options, need_grads=need_grads,
                                        need_stats=need_stats)
        ctx.chunk_rows = [[t.shape[0] for t in column] for column in columns[:n_cols]]
        ctx.n_guide_chunks = sum(layout[n_cols:])
        if grads is not None:
            ctx.save_for_backward(*grads)
        counters = counters if counters is not None else loss.new_zeros(0)
        ctx.mark_non_differentiable(counters)
        return loss, counters

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor, _grad_counters: Tensor) -> tuple[Tensor | None, ...]:
        grads = [chunk for g, sizes in zip(ctx.saved_tensors, ctx.chunk_rows)
                 for chunk in (g * grad_output.to(g.dtype)).split(sizes)]
        return (None,) * 6 + (*grads, *([None] * ctx.n_guide_chunks))


def gist_loss_with_options(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]],
    options: GistOptions,
    *,
    backend: str = "auto",
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, GistStats]:
    """``gist_loss`` with its loss options given as one validated ``GistOptions``."""
    student, guide = check_embeddings(embeddings, guide_embeddings, options)
    run = select_backend(backend, student[0][0].device)
    need_grads = torch.is_grad_enabled() and any(t.requires_grad for column in student for t in column)
    guide = [[g.detach() for g in column] for column in guide]
    layout = tuple(len(column) for column in student + guide)
    flat = [t for column in student + guide for t in column]
    loss, counters = GistLossFunction.apply(run, options, layout, len(student), need_grads, return_stats, *flat)
    if not return_stats:
        return loss
    stats = GistStats.from_counters(counters, batch=rows(student[0]), n_cand=rows(student[1]),
                                    n_negatives=len(student) - 2, options=options)
    return loss, stats


def gist_loss(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]],
    *,
    temperature: float = 0.01,
    margin: float = 0.0,
    margin_strategy: str = "absolute",
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    offset: int = 0,
    matryoshka_dims: Sequence[int] | None = None,
    matryoshka_weights: Sequence[float] | None = None,
    block_bytes: int | None = None,
    backend: str = "auto",
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, GistStats]:
    """GIST loss of sentence-transformers' ``CachedGISTEmbedLoss``, over embeddings.

    Args:
        embeddings: ``[anchor (B x D), positive (N x D), *negatives (N x D)]`` from the student. A column
            may also be a list of tensors stacked by rows (GradCache's mini-batches): it is never
            concatenated into a copy on the PyTorch path, and each chunk gets its rows of the gradient.
        guide_embeddings: the same columns embedded by the guide, in any dimension Dg. Never differentiated.
        temperature: divides the cosine similarities before the softmax.
        margin, margin_strategy: candidate j of anchor i is masked when its guide score is strictly greater
            than ``theta_i - margin`` ("absolute") or ``theta_i - |theta_i| * margin`` ("relative"), where
            ``theta_i`` is the guide score of anchor i with its positive.
        contrast_anchors, contrast_positives: add the anchor-anchor and positive-positive blocks.
        offset: global row of this rank's first anchor among the candidates; anchor i's positive is
            candidate ``offset + i`` (``rank * B`` when candidates are gathered across ranks).
        matryoshka_dims, matryoshka_weights: the loss ``sum_d w_d * L_d`` of sentence-transformers'
            ``MatryoshkaLoss`` over these dimensions (student truncated to d and renormalised, guide as is),
            computed in one pass: the guide's scores and mask once, the student's from prefixes.
        block_bytes: bytes of score buffers held at once (None: a default for the device).
        backend: "auto" (Triton on CUDA, PyTorch streaming elsewhere), "torch" or "triton".
        return_stats: also return a ``GistStats`` of what the guide masked (one more host sync).

    Returns:
        The mean loss over anchors as a 0-dim tensor (float64 for float64 inputs, else float32),
        differentiable with respect to ``embeddings``; with ``return_stats``, ``(loss, stats)``.
    """
    options = GistOptions(
        temperature=temperature,
        margin=margin,
        margin_strategy=margin_strategy,
        contrast_anchors=contrast_anchors,
        contrast_positives=contrast_positives,
        offset=offset,
        matryoshka_dims=matryoshka_dims,
        matryoshka_weights=matryoshka_weights,
        block_bytes=block_bytes,
    )
    return gist_loss_with_options(embeddings, guide_embeddings, options, backend=backend, return_stats=return_stats)
