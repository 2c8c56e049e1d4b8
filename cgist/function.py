"""``gist_loss``: the GIST loss over embeddings, as a ``torch.autograd.Function``.

The forward computes the loss and, when any student embedding needs a gradient, the embedding
gradients in the same pass (GradCache needs them at once anyway). The backward only scales those
stored gradients by ``grad_output``. Validation happens here, once, before any backend runs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import selfcheck, streaming
from .devices import device_kind, gpu_arch
from .numerics import compute_dtype, rank_ids
from .guide import kind_of, masks
from .options import ANCHOR_DIRECTIONS, GistOptions
from .stats import GistStats

__all__ = [
    "BACKENDS", "BACKEND_ENV", "GistLossFunction", "auto_route", "check_backend", "check_embeddings", "gist_loss",
    "gist_loss_with_options", "requested_backend", "select_backend",
]

BACKENDS = ("auto", "torch", "triton")

logger = logging.getLogger(__name__)

#: A backend: ``(embeddings, guide_embeddings, options, *, need_grads, need_stats)`` ->
#: ``(loss, grads or None, counters or None)``, counters ``(counts, sums)`` as in ``cgist.numerics.COUNT_FIELDS``
#: and ``SUM_FIELDS``. Each column
#: is a tensor or a list of row chunks; each gradient is its whole column's.
Backend = Callable[..., tuple[Tensor, "list[Tensor] | None", "Tensor | None"]]


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
    # One host sync for all columns and chunks: a NaN or an infinity makes its chunk's sum non-finite (one
    # fast reduction per chunk). A sum can also overflow, so only a chunk with a non-finite sum gets the
    # exact test, which names it. Each side's chunks share a dtype, so each side's sums stack as they are, and
    # the two sides meet in the wider of their sums' dtypes (float64 only when an input is float64).
    with torch.no_grad():
        n_student = sum(map(len, student))
        sides = [side for side in (named[:n_student], named[n_student:]) if side]
        wide = functools.reduce(torch.promote_types, (compute_dtype(side[0][1].dtype) for side in sides))
        sums = [torch.stack([t.sum(dtype=compute_dtype(t.dtype)) for _, t in side]).to(wide) for side in sides]
    suspect = ~torch.cat(sums).isfinite()
    if bool(suspect.any()):
        for where, t in (named[i] for i in suspect.nonzero().flatten().tolist()):
            if not bool(t.isfinite().all()):
                raise ValueError(f"{where} contains NaN or infinite values")


def _triton_backend() -> Backend:
    """The Triton launcher, or a RuntimeError saying why it cannot run here."""
    try:
        from .kernels import gist_loss_and_grads
    except ImportError as err:
        raise RuntimeError(f"backend='triton' is unavailable: {err}") from err
    return gist_loss_and_grads


#: ``(device, student dtype, guide dtype)`` -> the error with which the Triton kernels failed there: "auto" then
#: takes the PyTorch streaming path for that pair on that device, for the rest of the process.
_TRITON_FAILURES: dict[tuple[str, torch.dtype, torch.dtype], str] = {}


def _device_key(device: torch.device) -> str:
    """``cuda:0`` for ``cuda`` too: one key per physical device."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA A100-SXM4-80GB, sm_80)``, or the device itself off CUDA."""
    if device.type != "cuda":
        return str(device)
    arch = gpu_arch(device)
    return f"{_device_key(device)} ({torch.cuda.get_device_name(device)}, {arch.name if arch else 'unknown capability'})"


def _device_route(device: torch.device) -> tuple[str, str]:
    """``auto_route`` by the device alone."""
    kind = device_kind(device)
    if kind == "rocm":
        return "torch", "ROCm: the Triton kernels are untested on AMD GPUs"
    if kind != "cuda":
        return "torch", f"{device.type} tensors"
    arch = gpu_arch(device)
    if arch is None or not arch.mma:
        name = arch.name if arch else "this GPU"
        return "torch", f"{name}: Triton has no tensor-core instructions below sm_80, cuBLAS products are faster"
    return "triton", f"{arch.name}: Triton kernels"


def auto_route(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype) -> tuple[str, str]:
    """The backend ``"auto"`` takes for this device and dtype pair, ``"triton"`` or ``"torch"``, and why.

    Triton runs on NVIDIA GPUs of sm_80 and newer. Below sm_80 Triton emits no tensor-core instructions
    (its ``tl.dot`` becomes FMA loops), so the streaming path's cuBLAS products are at least as fast there;
    ROCm devices, where the kernels are untested, and every other device type take the streaming path too,
    as does a pair whose kernels failed on this device before (``_TRITON_FAILURES``), and every pair when
    Triton cannot be imported or is older than the compile check covers (``cgist.devices.unchecked_triton``).
    """
    route = _device_route(device)
    if route[0] == "torch":
        return route
    failure = _TRITON_FAILURES.get((_device_key(device), dtype, guide_dtype))
    if failure is not None:
        return "torch", f"the Triton kernels failed here earlier ({failure})"
    from .devices import unchecked_triton  # a Triton older than the compile check covers: logged once

    if (why := unchecked_triton()) is not None:
        return "torch", why
    try:
        _triton_backend()
    except RuntimeError as err:
        return "torch", str(err).replace("backend='triton' is", "Triton is")
    return route


#: The first-use check of each kernel variant (``cgist.selfcheck.Variant``) in this process: a variant whose check
#: failed takes the PyTorch streaming path under "auto" from then on; one that passed is not checked again.
_SELF_CHECKS: dict[selfcheck.Variant, selfcheck.Check] = {}


def _first_use_check(run: Backend, device: torch.device, embeddings, guide_embeddings, options: GistOptions) -> bool:
    """Whether "auto" may use the kernels ``run`` for this call's variant: checked on its first call
    (``cgist.selfcheck``), the result remembered; a disagreement is logged once. Reads no value on the host
    once the variant is known."""
    variant = selfcheck.variant_of(_device_key(device), embeddings, guide_embeddings, options)
    check = _SELF_CHECKS.get(variant)
    if check is None:
        check = selfcheck.check_call(run, streaming.gist_loss_and_grads, variant, options, len(embeddings), device,
                                     selfcheck.ROWS)
        _SELF_CHECKS[variant] = check
        if not check.ok:
            logger.warning(
                "cgist: the Triton kernels disagree with the PyTorch path on %s for %s (first-use check, %d rows): "
                "%s; this and later calls of this variant use the PyTorch streaming path; run `cgist doctor` on "
                "this machine and report its output",
                _describe(device), variant.describe(), check.rows, check.numbers(),
            )
    return check.ok


def _with_fallback(run: Backend, device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype) -> Backend:
    """``run`` (the Triton launcher), falling back to the streaming path when a kernel fails to build or launch, or
    disagrees with the streaming path on the first use of its variant (``_first_use_check``, unless
    ``CGIST_SELF_CHECK=0``).

    A build or launch failure is logged once, naming the device, the dtype pair and the error, and remembered, so
    that later calls with this pair on this device go straight to the streaming path; a disagreement likewise, for
    its variant. Running out of GPU memory is not a kernel failure and is raised as it is.
    """

    def run_or_fall_back(embeddings, guide_embeddings, options, **kwargs):
        check = selfcheck.enabled()  # a bad value is the caller's error, raised here
        try:
            if not check or _first_use_check(run, device, embeddings, guide_embeddings, options):
                return run(embeddings, guide_embeddings, options, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - any build or launch error: keep training on the PyTorch path
            message = f"{type(err).__name__}: {err}".strip()
            _TRITON_FAILURES[(_device_key(device), dtype, guide_dtype)] = message.splitlines()[0][:300]
            logger.warning(
                "cgist: the Triton kernels failed on %s for %s embeddings with a %s guide (%s); this and later calls "
                "with these dtypes on this device use the PyTorch streaming path (backend='triton' raises instead)",
                _describe(device), _dtype_name(dtype), _dtype_name(guide_dtype), message,
            )
        return streaming.gist_loss_and_grads(embeddings, guide_embeddings, options, **kwargs)

    return run_or_fall_back


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: The environment variable that overrides ``backend="auto"``.
BACKEND_ENV = "CGIST_BACKEND"


def check_backend(backend: object, name: str = "backend") -> str:
    """``backend`` if it is one of ``BACKENDS``, else a ValueError that calls it ``name`` (an argument, a flag)."""
    if backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {backend!r}")
    return backend


def requested_backend(backend: object) -> str:
    """``backend``, validated; ``"auto"`` becomes ``$CGIST_BACKEND`` when that is set (``torch``/``triton``)."""
    backend = check_backend(backend)
    if backend == "auto":
        override = os.environ.get(BACKEND_ENV, "").strip()
        if override:
            if override not in BACKENDS:
                raise ValueError(f"the environment variable {BACKEND_ENV} must be one of {BACKENDS} (or unset), "
                                 f"got {override!r}")
            return override
    return backend


def select_backend(backend: object, device: torch.device, dtype: torch.dtype = torch.float32,
                   guide_dtype: torch.dtype | None = None) -> Backend:
    """The backend function for ``backend`` on ``device`` with this dtype pair (see ``auto_route`` for "auto").

    ``"triton"`` raises when the launcher cannot run here, and is never checked; ``"auto"`` never raises, checks
    each kernel variant against the streaming path on its first use, and falls back to the streaming path if a
    kernel fails or disagrees (``_with_fallback``).
    """
    backend = requested_backend(backend)
    guide_dtype = dtype if guide_dtype is None else guide_dtype
    if backend == "torch":
        return streaming.gist_loss_and_grads
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing cgist, or use backend='torch'"
            )
        return _triton_backend()
    if auto_route(device, dtype, guide_dtype)[0] == "torch":
        return streaming.gist_loss_and_grads
    return _with_fallback(_triton_backend(), device, dtype, guide_dtype)


class GistLossFunction(torch.autograd.Function):
    """Autograd node: forward returns the loss and the mask counters (counts, sums); backward scales the kept
    gradients.

    ``tensors`` are the row chunks of the student columns, then of the guide columns; ``layout`` gives each
    column's number of chunks, student columns first (``n_cols`` of them). The backends take the columns
    as lists of chunks, and each chunk gets its rows of its column's gradient.
    """

    @staticmethod
    def forward(ctx, backend: Backend, options: GistOptions, layout: tuple[int, ...], n_cols: int, need_grads: bool,
                need_stats: bool, *tensors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        columns, start = [], 0
        for n in layout:
            columns.append(list(tensors[start : start + n]))
            start += n
        guide = columns[n_cols:] or None  # no guide columns: no guide masking
        loss, grads, counters = backend(columns[:n_cols], guide, options, need_grads=need_grads, need_stats=need_stats)
        ctx.chunk_rows = [[t.shape[0] for t in column] for column in columns[:n_cols]]
        ctx.n_guide_chunks = sum(layout[n_cols:])
        if grads is not None:
            ctx.save_for_backward(*grads)
        counts, sums = counters if counters is not None else (loss.new_zeros(0, dtype=torch.int64), loss.new_zeros(0))
        ctx.mark_non_differentiable(counts, sums)
        return loss, counts, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor, _grad_counts: Tensor, _grad_sums: Tensor) -> tuple[Tensor | None, ...]:
        grads = [chunk for g, sizes in zip(ctx.saved_tensors, ctx.chunk_rows)
                 for chunk in (g * grad_output.to(g.dtype)).split(sizes)]
        return (None,) * 6 + (*grads, *([None] * ctx.n_guide_chunks))


def gist_loss_with_options(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]] | str | None,
    options: GistOptions,
    *,
    backend: str = "auto",
    return_stats: bool = False,
    text_ids: Sequence[Tensor] | None = None,
) -> Tensor | tuple[Tensor, GistStats]:
    """``gist_loss`` with its loss options given as one validated ``GistOptions`` (the masks already decided)."""
    source = kind_of(guide_embeddings)
    student, guide = check_embeddings(embeddings, guide_embeddings if source == "embeddings" else None, options)
    if options.mask_duplicates and text_ids is None:
        raise ValueError("mask_duplicates=True needs text_ids: one id per row of each column, equal for equal texts")
    # Text ids decide the guide's ties (cgist.numerics.tie_ids) as well as the duplicates that mask_duplicates masks.
    ids = check_text_ids(text_ids, student, options.all_anchors) if text_ids is not None else None
    if source == "self":  # the student's own vectors, detached, are the guide
        guide = student
    guide_dtype = guide[0][0].dtype if guide is not None else student[0][0].dtype
    run = select_backend(backend, student[0][0].device, student[0][0].dtype, guide_dtype)
    if ids is not None:
        run = functools.partial(run, text_ids=ids)
    need_grads = torch.is_grad_enabled() and any(t.requires_grad for column in student for t in column)
    guide = [[g.detach() for g in column] for column in guide or []]
    layout = tuple(len(column) for column in student + guide)
    flat = [t for column in student + guide for t in column]
    loss, counts, sums = GistLossFunction.apply(run, options, layout, len(student), need_grads, return_stats, *flat)
    if not return_stats:
        return loss
    stats = GistStats.from_counters(counts, sums, batch=rows(student[0]), n_cand=rows(student[1]),
                                    n_negatives=len(student) - 2 - options.all_anchors, options=options,
                                    guided=bool(guide), n_anchors=rows(student[-1] if options.all_anchors else student[0]))
    return loss, stats


def gist_loss(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]] | str | None,
    *,
    temperature: float = 0.01,
    margin: float = 0.0, margin_strategy: str = "absolute",
    contrast_anchors: bool = True, contrast_positives: bool = True,
    mask_self: bool | None = None, mask_duplicates: bool | None = None, text_ids: Sequence[Tensor] | None = None,
    directions: Sequence[str] = ("query_to_doc",), partition_mode: str = "joint",
    hardness_mode: str | None = None, hardness_strength: float = 0.0,
    similarity: str = "cos",
    all_anchors: Tensor | Sequence[Tensor] | None = None, all_anchors_guide: Tensor | Sequence[Tensor] | None = None,
    all_anchors_text_ids: Tensor | None = None,
    offset: int = 0,
    matryoshka_dims: Sequence[int] | None = None, matryoshka_weights: Sequence[float] | None = None,
    block_bytes: int | None = None,
    backend: str = "auto",
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, GistStats]:
    """GIST loss of sentence-transformers' ``CachedGISTEmbedLoss``, over embeddings.

    Args:
        embeddings: ``[anchor (B x D), positive (N x D), *negatives (N x D)]`` from the student. A column
            may also be a list of tensors stacked by rows (GradCache's mini-batches): it is never
            concatenated into a copy on the PyTorch path, and each chunk gets its rows of the gradient.
        guide_embeddings: what masks false negatives: the same columns embedded by the guide, in any dimension
            Dg (never differentiated); ``"self"``, the student's own embeddings, detached; or None, no guide
            masking (InfoNCE over the chosen blocks).
        temperature: divides the cosine similarities before the softmax.
        margin, margin_strategy: candidate j of anchor i is masked when its guide score is strictly greater
            than ``theta_i - margin`` ("absolute") or ``theta_i - |theta_i| * margin`` ("relative"), where
            ``theta_i`` is the guide score of anchor i with its positive.
        contrast_anchors, contrast_positives: add the anchor-anchor and positive-positive blocks.
        mask_self: always exclude the self-pairs AA[i, i] and PP[i, offset + i] (default: on, the rule of
            sentence-transformers 6.3 and later; False leaves them to the guide, as 6.2 does).
        mask_duplicates: exclude every candidate whose text is that of anchor i or of its positive, whatever the
            scores (the label stays); needs ``text_ids``. Default: on for ``"self"`` and None when ``text_ids``
            are given, else off.
        text_ids: one integer tensor per column, one id per row, equal exactly for equal texts (e.g.
            ``cgist.numerics.token_fingerprints`` of the token ids); gathered like the candidates. When given, they
            also decide the guide's ties: a candidate with the text of theta_i's partner scores theta_i exactly,
            however its guide vector was rounded (``cgist.numerics.tie_ids``); without them, equal guide vectors do.
        directions, partition_mode, hardness_mode, hardness_strength: sentence-transformers'
            ``MultipleNegativesRankingLoss`` options, with the guide's mask on every block: see
            ``cgist.GistOptions``. ``"query_to_query"`` and ``"doc_to_query"`` score against every rank's
            anchors, ``all_anchors`` (N rows, this rank's at ``offset``; with a guide also ``all_anchors_guide``,
            with duplicates masked ``all_anchors_text_ids``), or, without them, against this rank's.
        similarity: ``"cos"`` (cosine) or ``"dot"`` (dot product) for the student; the guide always uses cosines.
        offset: global row of this rank's first anchor among the candidates; anchor i's positive is
            candidate ``offset + i`` (``rank * B`` when candidates are gathered across ranks).
        matryoshka_dims, matryoshka_weights: the loss ``sum_d w_d * L_d`` of sentence-transformers'
            ``MatryoshkaLoss`` over these dimensions (student truncated to d and renormalised, guide as is),
            computed in one pass: the guide's scores and mask once, the student's from prefixes.
        block_bytes: bytes of score buffers held at once (None: a default for the device).
        backend: "auto" (Triton on NVIDIA GPUs of sm_80 and newer, the PyTorch streaming path elsewhere, and
            in place of a kernel that fails to build or launch; the environment variable ``CGIST_BACKEND``
            overrides it), "torch" or "triton" (which raises where the kernels cannot run).
        return_stats: also return a ``GistStats`` of what was masked (one more host sync).

    Returns:
        The mean loss over anchors as a 0-dim tensor (float64 for float64 inputs, else float32),
        differentiable with respect to ``embeddings``; with ``return_stats``, ``(loss, stats)``.
    """
    source = kind_of(guide_embeddings)
    mask_self, mask_duplicates = masks(source, mask_self, mask_duplicates, text_ids is not None)
    if all_anchors is not None:
        embeddings, guide_embeddings, text_ids = _with_all_anchors(
            embeddings, guide_embeddings, text_ids, all_anchors, all_anchors_guide, all_anchors_text_ids,
            source=source, directions=directions)
    options = GistOptions(
        temperature=temperature, margin=margin, margin_strategy=margin_strategy, contrast_anchors=contrast_anchors,
        contrast_positives=contrast_positives, mask_self=mask_self, mask_duplicates=mask_duplicates,
        directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
        hardness_strength=hardness_strength, similarity=similarity, all_anchors=all_anchors is not None,
        offset=offset, matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights, block_bytes=block_bytes,
    )
    return gist_loss_with_options(embeddings, guide_embeddings, options, backend=backend, return_stats=return_stats,
                                  text_ids=text_ids)


def _with_all_anchors(embeddings: Sequence, guide_embeddings: object, text_ids: Sequence[Tensor] | None,
                      all_anchors: object, all_anchors_guide: object, all_anchors_text_ids: Tensor | None, *,
                      source: str | None, directions: Sequence[str]) -> tuple:
    """``gist_loss``'s columns with every rank's anchors appended as the last column, checked: ``all_anchors`` to the
    student's, ``all_anchors_guide`` to the guide's when they are embeddings, ``all_anchors_text_ids`` to the text
    ids when they are given."""
    if not any(direction in ANCHOR_DIRECTIONS for direction in directions):
        raise ValueError(f"all_anchors is only read by the directions {ANCHOR_DIRECTIONS}")
    if source == "embeddings" and all_anchors_guide is None:
        raise ValueError("all_anchors needs all_anchors_guide: the guide's embeddings of the same anchors")
    if text_ids is not None and all_anchors_text_ids is None:
        raise ValueError("all_anchors with text_ids needs all_anchors_text_ids: the text ids of the same anchors")
    embeddings = [*embeddings, all_anchors]
    if source == "embeddings":
        guide_embeddings = [*guide_embeddings, all_anchors_guide]
    if text_ids is not None:
        text_ids = [*text_ids, all_anchors_text_ids]
    return embeddings, guide_embeddings, text_ids
