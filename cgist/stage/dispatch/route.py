"""Which backend runs a loss-stage call: the one place that reaches the Triton backend (``cgist.stage.triton``, the
host side of the kernels in ``cgist.kernels``).

``"auto"`` (the default) takes the kernels on NVIDIA GPUs of sm_80 and newer and the PyTorch streaming path
elsewhere (``auto_route``); it checks each kernel variant against the streaming path on its first use
(``cgist.stage.dispatch.selfcheck``) and falls back to the streaming path, for the rest of the process, where a
kernel fails to build or launch or disagrees (the two process-wide caches ``_TRITON_FAILURES`` and ``_SELF_CHECKS``,
read through ``kernel_failures`` and ``first_use_checks``, forgotten by ``reset``). Each reason for leaving the
kernels on a GPU they serve is logged once. ``"torch"`` and ``"triton"`` force a backend; ``$CGIST_BACKEND``
overrides ``"auto"``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import torch
from torch import Tensor

from .. import devices
from ..devices import OLDEST_CHECKED_TRITON, device_kind, gpu_arch
from ..pytorch import streaming
from ..spec.options import GistOptions
from . import selfcheck

__all__ = ["BACKENDS", "BACKEND_ENV", "Backend", "MaxSimStage", "auto_route", "check_backend", "check_kernels",
           "check_maxsim_kernels", "first_use_checks", "kernel_failures", "kernel_tiles", "requested_backend", "reset",
           "select_backend", "select_maxsim_stage"]

logger = logging.getLogger(__name__)


BACKENDS = ("auto", "torch", "triton")


#: A backend: ``(embeddings, guide_embeddings, options, *, need_grads, need_stats)`` ->
#: ``(loss, grads or None, counters or None)``, counters ``(counts, sums)`` as in ``cgist.stage.stats.COUNT_FIELDS``
#: and ``SUM_FIELDS``. Each column
#: is a tensor or a list of row chunks; each gradient is its whole column's.
Backend = Callable[..., tuple[Tensor, "list[Tensor] | None", "Tensor | None"]]


def _triton_backend() -> Backend:
    """The Triton launcher, or a RuntimeError saying why it cannot run here (from the ImportError)."""
    try:
        from ..triton import gist_loss_and_grads
    except ImportError as err:
        raise RuntimeError(f"backend='triton' is unavailable: {err}") from err
    return gist_loss_and_grads


#: ``(device, student dtype, guide dtype)`` -> the error with which the Triton kernels failed there: "auto" then
#: takes the PyTorch streaming path for that pair on that device, for the rest of the process.
_TRITON_FAILURES: dict[tuple[str, torch.dtype, torch.dtype], str] = {}
#: The notices "auto" has logged in this process, each once.
_NOTICES: set[str] = set()


def _notice(message: str) -> None:
    """Log ``message`` (one line) once per process."""
    if message not in _NOTICES:
        _NOTICES.add(message)
        logger.warning("cgist: %s", message)


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
    Triton or the kernels cannot be imported (logged once per cause, with the fix) or Triton is older than the
    compile check covers (``cgist.stage.devices.unchecked_triton``, logged once).
    """
    route = _device_route(device)
    if route[0] == "torch":
        return route
    failure = _TRITON_FAILURES.get((_device_key(device), dtype, guide_dtype))
    if failure is not None:
        return "torch", f"the Triton kernels failed here earlier ({failure})"
    if (why := devices.unchecked_triton()) is not None:
        return "torch", why
    try:
        _triton_backend()
    except RuntimeError as err:
        oldest = ".".join(map(str, OLDEST_CHECKED_TRITON))
        _notice(f"the Triton kernels cannot be imported ({err.__cause__}), so backend='auto' runs the PyTorch "
                f"streaming path on CUDA devices; for the kernels, install Triton {oldest} or newer "
                f"(pip install 'triton>={oldest}', or the release the CUDA build of torch pins)")
        return "torch", str(err).replace("backend='triton' is", "Triton is")
    return route


#: The first-use check of each kernel variant (``cgist.stage.dispatch.selfcheck.Variant``) in this process: a variant whose check
#: failed takes the PyTorch streaming path under "auto" from then on; one that passed is not checked again.
_SELF_CHECKS: dict[selfcheck.Variant, selfcheck.Check] = {}


def kernel_failures() -> dict[tuple[str, torch.dtype, torch.dtype], str]:
    """The kernels' build and launch failures "auto" remembers: ``(device, student dtype, guide dtype)`` -> the
    error (a copy)."""
    return dict(_TRITON_FAILURES)


def first_use_checks() -> dict[selfcheck.Variant, selfcheck.Check]:
    """The first-use checks "auto" has run in this process, by kernel variant (a copy)."""
    return dict(_SELF_CHECKS)


def reset() -> None:
    """Forget what "auto" has learnt in this process: the kernels' build and launch failures, the first-use checks
    and their verdicts, and which notices were logged (``cgist.stage.devices``'s too). The next call then routes,
    checks and notifies as the process's first did.

    Call it where a remembered verdict no longer holds: in a test, before and after one that fakes a device or a
    failure, and in a long-lived process after its Triton, driver or GPU changed. Not thread-safe against calls
    running at the same time.
    """
    _TRITON_FAILURES.clear()
    _SELF_CHECKS.clear()
    _MAXSIM_CHECKS.clear()
    _NOTICES.clear()
    devices.reset_notices()


def _first_use_check(run: Backend, device: torch.device, embeddings, guide_embeddings, options: GistOptions) -> bool:
    """Whether "auto" may use the kernels ``run`` for this call's variant: checked on its first call
    (``cgist.stage.dispatch.selfcheck``), the result remembered; a disagreement is logged once. Reads no value on the host
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


def kernel_tiles(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype) -> str:
    """The tile configs the kernels' forward autotunes over for this dtype pair on ``device`` (``cgist doctor``)."""
    from ..triton.launch import input_precision
    from ..triton.tiles import tile_configs

    arch = gpu_arch(device)
    configs = tile_configs(dtype, input_precision(dtype, arch), guide_dtype, input_precision(guide_dtype, arch),
                           arch=arch, interpret=False)
    return ", ".join("{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}"
                     for c in configs)


def check_kernels(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype, rows: int, dim: int,
                  dim_g: int, k: int) -> selfcheck.Check:
    """The first-use check (``selfcheck``) of the kernels for this dtype pair on ``device``, with the default options
    (``cgist doctor``)."""
    options = GistOptions()
    variant = selfcheck.make_variant(_device_key(device), dtype, guide_dtype, dim, dim_g, options)
    return selfcheck.check_call(_triton_backend(), streaming.gist_loss_and_grads, variant, options, 2 + k, device,
                                rows)


# The MaxSim (late-interaction) stage ------------------------------------------------------------------------------

#: The MaxSim stage of a backend: ``(forward, backward)`` with the contract of ``cgist.stage.pytorch.maxsim``'s
#: ``maxsim_forward`` (``(call, with_grad) -> (loss, state)``) and ``maxsim_backward``
#: (``(call, state, grad_output) -> (query gradients, document gradients)``); ``forward(call, True)``'s state serves
#: one backward.
MaxSimStage = tuple[Callable, Callable]

#: ``(device, dtype)`` -> None where "auto" may use the MaxSim kernels (their first-use check passed, or checks are
#: off), else why not (a failure, or a disagreement with the PyTorch stage).
_MAXSIM_CHECKS: dict[tuple[str, torch.dtype], str | None] = {}


def _pytorch_maxsim() -> MaxSimStage:
    from ..pytorch import maxsim

    return maxsim.maxsim_forward, maxsim.maxsim_backward


def _triton_maxsim(guided: bool = False) -> MaxSimStage:
    """The MaxSim kernels' launchers, as a stage whose state is each query's softmax normaliser (the backward
    recomputes the rest), or for a ``guided`` call (GIST's mask) the gradients, made in the forward as the PyTorch
    stage's are; or a RuntimeError saying why they cannot run here."""
    try:
        from ..triton.maxsim import maxsim_backward_triton, maxsim_forward_triton, maxsim_guided_triton
    except ImportError as err:
        raise RuntimeError(f"backend='triton' is unavailable: {err}") from err
    if guided:
        from ..pytorch.maxsim import block_softmax, folded, maxsim_backward

        def guided_forward(call, with_grad):
            loss, parts = maxsim_guided_triton(call, with_grad, block_softmax)
            return loss, None if parts is None else folded(call, parts)

        return guided_forward, maxsim_backward

    def forward(call, with_grad):
        loss, peak, total = maxsim_forward_triton(call)
        return loss, (peak, total)

    def backward(call, state, grad_output):
        return maxsim_backward_triton(call, *state, grad_output)

    return forward, backward


def check_maxsim_kernels(device: torch.device, dtype: torch.dtype) -> float:
    """The MaxSim kernels against the PyTorch stage on a small ragged problem on ``device`` (``dtype`` inputs), without
    a guide and with one (a single-vector guide's mask, GIST's contrast blocks): the largest difference of the loss
    and the gradients, each relative to its largest entry. Errors of the kernels propagate."""
    from ..pytorch.maxsim import GUIDE_COUNTERS, MaxSimCall, MaxSimGuide

    gen = torch.Generator().manual_seed(0)
    rows, lq, ld, dim = 8, 8, 40, 32
    queries = torch.nn.functional.normalize(torch.randn(rows, lq, dim, generator=gen), dim=-1).to(device, dtype)
    documents = [torch.nn.functional.normalize(torch.randn(rows, ld, dim, generator=gen), dim=-1).to(device, dtype)
                 for _ in range(2)]
    lengths = torch.randint(1, ld + 1, (2, rows), generator=gen)
    masks = [(torch.arange(ld) < lengths[n, :, None]).to(device) for n in range(2)]
    query_mask = torch.ones(rows, lq, dtype=torch.bool, device=device)
    call = MaxSimCall([queries], [query_mask], [[d] for d in documents], [[m] for m in masks], scale=4.0,
                      length_normalize=False, offset=0, budget_bytes=2**20)
    # The guided call: a single-vector guide, whose scores are the host's on either path (so the two masks are one,
    # whatever the rounding of the student's scores), and GIST's AA and PP blocks (the PP part's own launches).
    vectors = torch.nn.functional.normalize(torch.randn(3 * rows, 16, generator=gen), dim=-1).to(device)
    guide = MaxSimGuide("vectors", margin=0.1, relative=False, vectors=(vectors[:rows], vectors[rows:]),
                        counters=torch.zeros(len(GUIDE_COUNTERS), dtype=torch.int64, device=device),
                        sums=torch.zeros(2, dtype=vectors.dtype, device=device))
    guided_call = MaxSimCall.with_contrast(call.queries, call.query_masks, call.documents, call.document_masks,
                                           call.scale, False, 0, call.budget_bytes, guide, True, True)
    diffs = []
    for checked, guided in ((call, False), (guided_call, True)):
        results = []
        for forward, backward in (_triton_maxsim(guided), _pytorch_maxsim()):
            loss, state = forward(checked, True)
            q_grads, d_grads = backward(checked, state, 1.0)
            results.append([loss, *q_grads, *(g for column in d_grads for g in column)])
        diffs += [(a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)
                  for a, b in zip(*results)]
    return float(torch.stack(diffs).nan_to_num(math.inf).max())


def select_maxsim_stage(backend: object, device: torch.device, dtype: torch.dtype,
                        guided: bool = False) -> MaxSimStage:
    """The MaxSim stage for ``backend`` on ``device``, for a ``guided`` call (GIST's mask) or not: ``"torch"`` the
    PyTorch stage; ``"triton"`` the kernels (CUDA, or CPU tensors under the Triton interpreter), never checked;
    ``"auto"`` the kernels where the dense stage's would run (``auto_route``) once their first-use check on this
    device and dtype passed (``check_maxsim_kernels``, within ``selfcheck.TOLERANCE``), else the PyTorch stage, with
    one notice saying why."""
    backend = requested_backend(backend)
    if backend == "torch":
        return _pytorch_maxsim()
    if backend == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                               "before importing cgist, or use backend='torch'")
        return _triton_maxsim(guided)
    if auto_route(device, dtype, dtype)[0] == "torch":
        return _pytorch_maxsim()
    key = (_device_key(device), dtype)
    if key not in _MAXSIM_CHECKS:
        failure = None
        if selfcheck.enabled():
            allowed = selfcheck.TOLERANCE[selfcheck.score_precision(dtype)]
            try:
                diff = check_maxsim_kernels(device, dtype)
                if not diff <= allowed:
                    failure = f"they disagree with the PyTorch stage by {diff:.1e} (allowed {allowed:.0e})"
            except Exception as err:  # a build or launch failure: the PyTorch stage runs instead
                failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        _MAXSIM_CHECKS[key] = failure
    failure = _MAXSIM_CHECKS[key]
    if failure is not None:
        _notice(f"the MaxSim kernels are not used on {_describe(device)} for {dtype} ({failure}); backend='auto' runs "
                "the PyTorch MaxSim stage there")
        return _pytorch_maxsim()
    return _triton_maxsim(guided)
