"""Which backend runs a loss-stage call, for every score: the one router, and the one place that reaches the Triton
backend (``cgist.stage.triton``, the host side of the kernels in ``cgist.kernels``).

A backend registers per (score, backend) in the registry of scores (``cgist.stage.spec.scores``): a module with the
backend contract (``Stage``), imported here on a call's first use of it. ``"auto"`` (the default) takes the kernels on
NVIDIA GPUs of sm_80 and newer and the PyTorch path elsewhere (``auto_route``); it checks each kernel variant against
the PyTorch path on its first use (``cgist.stage.dispatch.selfcheck``, with the score's check problem) and falls back
to the PyTorch path, for the rest of the process, where a kernel fails to build or launch (in a forward or a backward)
or disagrees (the two process-wide caches ``_TRITON_FAILURES`` and ``_SELF_CHECKS``, read through
``kernel_failures`` and ``first_use_checks``, forgotten by ``reset``). Each reason for leaving the kernels on a GPU
they serve is logged once. ``"torch"`` and ``"triton"`` force a backend; ``$CGIST_BACKEND`` overrides ``"auto"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor

from .. import devices
from ..devices import OLDEST_CHECKED_TRITON, describe, device_key, device_kind, gpu_arch
from ..spec.call import TEMPERATURE, Grads, StageCall, gradients
from ..spec.scores import DENSE, Score
from . import selfcheck

__all__ = ["BACKENDS", "BACKEND_ENV", "Stage", "auto_route", "backend_module", "check_backend", "check_kernels",
           "first_use_checks", "kernel_failures", "kernel_tiles", "requested_backend", "reset", "select_stage"]

logger = logging.getLogger(__name__)


BACKENDS = ("auto", "torch", "triton")


class Stage(Protocol):
    """The backend contract (docs/design.md#dispatch): a module of a score's backend, or ``"auto"``'s fallback over
    two of them.

    ``forward(call, with_grad, need_stats) -> (loss, state, counters)``: the loss (0-dim, float64 for float64 inputs,
    else float32); with ``with_grad`` the state of the backward: the gradients themselves (``Grads``, made in the
    forward as GradCache needs them), or a saved state of the backend's own; and with ``need_stats`` the guide's
    counters ``(counts, sums)`` in the layout of ``cgist.stage.stats`` (None where nothing masks).
    ``backward(call, state, grad_output) -> Grads``: the gradients of ``grad_output`` times the loss from a saved
    state of the backend's own (a backend whose forward always makes ``Grads`` needs none: the node scales them,
    ``Grads.scaled``, ``cgist.stage.spec.call.gradients``). ``Grads`` hold one gradient per input chunk (``StageCall.tensors``) and one per learned
    parameter (``StageCall.parameters``); the guide's tensors get none.
    """

    def forward(self, call: StageCall, with_grad: bool, need_stats: bool) -> tuple[Tensor, object, object]: ...

    def backward(self, call: StageCall, state: object, grad_output: Tensor) -> Grads: ...


def backend_module(score: Score, backend: str) -> ModuleType:
    """The module of ``score``'s ``backend`` (``"torch"``, ``"triton"``), imported on first use; for the Triton
    backend, a RuntimeError saying why it cannot run here: the ImportError, or a score that registers no Triton
    backend."""
    if backend == "triton" and backend not in score.backends:
        raise RuntimeError(f"backend='triton' is unavailable: the {score.name} score has no Triton kernels")
    try:
        return importlib.import_module(score.backend(backend))
    except ImportError as err:
        if backend != "triton":
            raise
        raise RuntimeError(f"backend='triton' is unavailable: {err}") from err


#: ``(score, device, student dtype, guide dtype)`` -> the error with which that score's Triton kernels failed there:
#: "auto" then takes the PyTorch path for that pair on that device, for the rest of the process.
_TRITON_FAILURES: dict[tuple[str, str, torch.dtype, torch.dtype | None], str] = {}


#: The notices "auto" has logged in this process, each once.
_NOTICES: set[str] = set()


def _notice(message: str) -> None:
    """Log ``message`` (one line) once per process."""
    if message not in _NOTICES:
        _NOTICES.add(message)
        logger.warning("cgist: %s", message)


def _device_route(device: torch.device) -> tuple[str, str]:
    """``auto_route`` by the device alone."""
    kind = device_kind(device)
    if kind == "rocm":
        return "torch", "ROCm: the Triton kernels are untested on AMD GPUs"
    if kind != "cuda":
        return "torch", f"{kind} tensors"
    arch = gpu_arch(device)
    if arch is None or not arch.mma:
        name = arch.name if arch else "this GPU"
        return "torch", f"{name}: Triton has no tensor-core instructions below sm_80, cuBLAS products are faster"
    return "triton", f"{arch.name}: Triton kernels"


def auto_route(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype | None,
               score: Score = DENSE) -> tuple[str, str]:
    """The backend ``"auto"`` takes for this device and dtype pair of ``score``, ``"triton"`` or ``"torch"``, and
    why.

    Triton runs on NVIDIA GPUs of sm_80 and newer. Below sm_80 Triton emits no tensor-core instructions
    (its ``tl.dot`` becomes FMA loops), so the PyTorch path's cuBLAS products are at least as fast there;
    ROCm devices, where the kernels are untested, and every other device type take the PyTorch path too,
    as does a pair whose kernels (``score``'s) failed on this device before (``_TRITON_FAILURES``), and every pair when
    Triton or the kernels cannot be imported (logged once per cause, with the fix) or Triton is older than the
    compile check covers (``cgist.stage.devices.unchecked_triton``, logged once).
    """
    route = _device_route(device)
    if route[0] == "torch":
        return route
    failure = _TRITON_FAILURES.get((score.name, device_key(device), dtype, guide_dtype))
    if failure is not None:
        return "torch", f"the Triton kernels failed here earlier ({failure})"
    if (why := devices.unchecked_triton()) is not None:
        return "torch", why
    try:
        backend_module(score, "triton")
    except RuntimeError as err:
        if err.__cause__ is None:  # the score has no kernels: nothing to install
            return "torch", str(err).replace("backend='triton' is unavailable: ", "")
        oldest = ".".join(map(str, OLDEST_CHECKED_TRITON))
        _notice(f"the Triton kernels cannot be imported ({err.__cause__}), so backend='auto' runs the PyTorch "
                f"path on CUDA devices; for the kernels, install Triton {oldest} or newer "
                f"(pip install 'triton>={oldest}', or the release the CUDA build of torch pins)")
        return "torch", str(err).replace("backend='triton' is", "Triton is")
    return route


#: The first-use check of each kernel variant (a score's ``variant_of``) in this process: a variant whose check failed
#: takes the PyTorch path under "auto" from then on; one that passed is not checked again.
_SELF_CHECKS: dict[object, selfcheck.Check] = {}


def kernel_failures() -> dict[tuple[str, str, torch.dtype, torch.dtype | None], str]:
    """The kernels' build and launch failures "auto" remembers: ``(score, device, student dtype, guide dtype)`` -> the
    error (a copy)."""
    return dict(_TRITON_FAILURES)


def first_use_checks() -> dict[object, selfcheck.Check]:
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
    _NOTICES.clear()
    devices.reset_notices()


def _spec(score: Score) -> ModuleType:
    return importlib.import_module(score.spec)


def _first_use_check(call: StageCall) -> bool:
    """Whether "auto" may use the kernels for this call's variant: checked on its first call (``check_kernels``), the
    result remembered; a disagreement is logged once. Reads no value on the host once the variant is known."""
    variant = _spec(call.options.score).variant_of(call, device_key(call.device))
    check = _SELF_CHECKS.get(variant)
    if check is None:
        check = _SELF_CHECKS[variant] = check_kernels(call)
        if not check.ok:
            logger.warning(
                "cgist: the Triton kernels disagree with the PyTorch path on %s for %s (first-use check, %d rows): "
                "%s; this and later calls of this variant use the PyTorch path; run `cgist doctor` on "
                "this machine and report its output",
                describe(call.device), variant.describe(), check.rows, check.numbers(),
            )
    return check.ok


def check_kernels(call: StageCall, rows: int | None = None) -> selfcheck.Check:
    """The first-use check of the kernels of ``call``'s variant (its score's ``variant_of``): the score's check problem
    of that variant (``check_problem``, at most ``rows`` rows, None: ``selfcheck.ROWS``) through the kernels and the
    PyTorch path on the call's device (``cgist.stage.dispatch.selfcheck``). Where ``call`` learns its temperature,
    so does the problem (at the problem's value), and the check compares its gradient too. "auto" runs it once per
    variant; ``cgist doctor`` on a small call of each variant of every score (its spec's ``sample_calls``)."""
    score = call.options.score
    spec = _spec(score)
    variant = spec.variant_of(call, device_key(call.device))
    problem = spec.check_problem(call, variant, rows or selfcheck.ROWS)
    if call.temperature is not None and problem.temperature is None:
        learned = torch.tensor(problem.options.temperature, device=call.device, requires_grad=True)
        problem = dataclasses.replace(problem, parameters={**problem.parameters, TEMPERATURE: learned})
    return selfcheck.check_call(backend_module(score, "triton"), backend_module(score, "torch"), problem, variant)


class _WithFallback:
    """``"auto"``'s stage on a device the kernels serve: the kernels, falling back to the PyTorch path when a kernel
    fails to build or launch (in the forward or in the backward), or disagrees with the PyTorch path on the first use
    of its variant (``_first_use_check``, unless ``CGIST_SELF_CHECK=0``), for every score alike.

    A build or launch failure is logged once, naming the score, the device, the dtype pair and the error, and
    remembered, so that later calls with this pair on this device go straight to the PyTorch path; a disagreement
    likewise, for its variant. Running out of GPU memory is not a kernel failure and is raised as it is. A saved
    state of the kernels' own is wrapped (``_KernelState``), so that the backward knows which stage made it."""

    def __init__(self, kernels: ModuleType, pytorch: ModuleType) -> None:
        self.kernels, self.pytorch = kernels, pytorch

    def forward(self, call: StageCall, with_grad: bool, need_stats: bool) -> tuple[Tensor, object, object]:
        check = selfcheck.enabled()  # a bad value is the caller's error, raised here
        try:
            if not check or _first_use_check(call):
                loss, state, counters = self.kernels.forward(call, with_grad, need_stats)
                return loss, state if isinstance(state, Grads) else _KernelState(state), counters
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - any build or launch error: keep training on the PyTorch path
            self._failed(call, err)
        return self.pytorch.forward(call, with_grad, need_stats)

    def backward(self, call: StageCall, state: object, grad_output: Tensor) -> Grads:
        if isinstance(state, _KernelState):
            try:
                return self.kernels.backward(call, state.state, grad_output)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001 - as in the forward: the PyTorch path makes the gradients
                self._failed(call, err)
            state = self.pytorch.forward(call, True, False)[1]
        return gradients(self.pytorch, call, state, grad_output)

    def _failed(self, call: StageCall, err: Exception) -> None:
        score = call.options.score
        message = f"{type(err).__name__}: {err}".strip()
        _TRITON_FAILURES[(score.name, device_key(call.device), call.dtype, call.guide_dtype)] = \
            message.splitlines()[0][:300]
        guide = f"a {_dtype_name(call.guide_dtype)} guide" if call.guide_dtype is not None else "no guide columns"
        logger.warning(
            "cgist: the Triton kernels of the %s score failed on %s for %s embeddings with %s (%s); this and later "
            "calls with these dtypes on this device use the PyTorch path (backend='triton' raises instead)",
            score.name, describe(call.device), _dtype_name(call.dtype), guide, message,
        )


@dataclass(frozen=True)
class _KernelState:
    """The kernels' own saved state (not ``Grads``), as ``_WithFallback``'s forward returns it."""

    state: object


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


def select_stage(call: StageCall, backend: object = "auto") -> Stage:
    """The stage that runs ``call`` on ``backend``: its score's module of that backend (``backend_module``), or for
    ``"auto"`` (see ``auto_route``) the PyTorch module or the kernels with their first-use check and fallback.

    ``"triton"`` raises where the kernels cannot run here, and is never checked; ``"auto"`` never raises.
    """
    backend = requested_backend(backend)
    score, device = call.options.score, call.device
    if backend == "torch":
        return backend_module(score, "torch")
    if backend == "triton":
        if device.type != "cuda" and not devices.interpreted():
            raise RuntimeError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing cgist, or use backend='torch'"
            )
        return backend_module(score, "triton")
    pytorch = backend_module(score, "torch")
    if auto_route(device, call.dtype, call.guide_dtype, score)[0] == "torch":
        return pytorch
    return _WithFallback(backend_module(score, "triton"), pytorch)


def kernel_tiles(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype) -> str:
    """The tiles of the kernels for this dtype pair on ``device`` (``cgist doctor``): the configs the dense forward
    autotunes over, and the token scores' forward launch."""
    from ..triton.common import arch_of, input_precision
    from ..triton.maxsim import launch_configs
    from ..triton.tiles import tile_configs

    arch = arch_of(device)
    configs = tile_configs(dtype, input_precision(dtype, arch), guide_dtype, input_precision(guide_dtype, arch),
                           arch=arch, interpret=False)
    dense = ", ".join("{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}"
                      for c in configs)
    tokens = launch_configs(dtype, arch, 32, 180, 128)["maxsim_fwd_kernel"].tiles
    return f"dense {dense}; token scores {tokens}"
