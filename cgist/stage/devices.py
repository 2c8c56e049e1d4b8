"""Everything cgist asks of a device, in one place: its kind, its name, and for an NVIDIA GPU the architecture its
tiles are chosen by; its free memory, whether it multiplies bf16 on tensor cores, waiting for it and making it
current; and whether the installed Triton is one the compile check covers.

The Triton kernels' tile configs depend on three properties of a GPU: the largest shared memory one block may
use, whether Triton emits tensor-core instructions for it (``mma``; Triton 3.x emits none below sm_80, where
``tl.dot`` becomes FMA loops: see the PTX in ``bench/aot_compile.py``), and which compile-checked tile table its
architecture family uses. ``gpu_arch`` reads them off a CUDA device; ``arch_for`` builds them from a compute
capability, for the compile check and for tests.

**A simulated device.** ``CGIST_SIMULATE_DEVICE=ARCH`` (a key of ``SIMULATED``: ``sm_70`` to ``sm_120``, a future
``sm_130``, ``rocm``, ``mps``) makes CPU tensors answer every question here as that device would, so that the router,
the tile tables and their pruning, the launchers, the first-use check, the fallback, the statistics and ``cgist
doctor`` take the path they take there, with the kernels under the Triton interpreter (``TRITON_INTERPRET=1``, which
an NVIDIA one needs). What only a real GPU does is named at the end of this module (docs/devices.md#simulated-devices).
This module imports only torch (and Triton, only in ``unchecked_triton`` and ``_shared_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from dataclasses import dataclass

import torch

__all__ = ["KNOWN_ARCHS", "OLDEST_CHECKED_TRITON", "SIMULATED", "SIMULATE_ENV", "Arch", "Simulated", "arch_for",
           "bf16_tensor_cores", "describe", "device_key", "device_kind", "device_name", "free_bytes", "gpu_arch",
           "interpreted", "is_gpu", "launch_context", "reset_devices", "reset_notices", "simulated", "synchronize",
           "triton_release", "unchecked_triton"]

logger = logging.getLogger(__name__)

#: The oldest Triton release (major, minor) under which the compile check builds every kernel with the tile configs the
#: launcher picks there, spill-free (bench/results/aot_compile_triton-*.txt, one per release; CI compiles a small
#: table under it too). "auto" runs the kernels only under it and newer releases.
OLDEST_CHECKED_TRITON = (3, 4)

#: Compute capability -> (tile family, shared memory per block in KiB, opt-in), for the capabilities the tiles
#: know. The family is the compile-checked architecture whose tile table a capability uses; the shared memory
#: is the per-block maximum of the CUDA C++ Programming Guide's table of technical specifications per compute
#: capability. sm_87 (Jetson Orin) shares sm_86's SM design with more shared memory; sm_103 and sm_121 are
#: variants of sm_100 and sm_120.
KNOWN_ARCHS: dict[tuple[int, int], tuple[int, int]] = {
    (7, 0): (75, 96),
    (7, 5): (75, 64),
    (8, 0): (80, 163),
    (8, 6): (86, 99),
    (8, 7): (86, 163),
    (8, 9): (89, 99),
    (9, 0): (90, 227),
    (10, 0): (100, 227),
    (10, 3): (100, 227),
    (12, 0): (120, 99),
    (12, 1): (120, 99),
}


@dataclass(frozen=True)
class Arch:
    """An NVIDIA GPU architecture as the kernels' tiles see it.

    Attributes:
        capability: the compute capability, ``(major, minor)``.
        family: the compile-checked architecture whose tile table this one uses (75, 80, 86, 89, 90, 100, 120).
        shared_bytes: the largest shared memory one block may use (opt-in), in bytes.
        known: whether the capability is in ``KNOWN_ARCHS``; an unknown one takes the nearest known capability
            below it (for a future GPU, the newest family), with tiles pruned to its own shared memory.
    """

    capability: tuple[int, int]
    family: int
    shared_bytes: int
    known: bool = True

    @property
    def name(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def mma(self) -> bool:
        """Whether Triton's ``tl.dot`` runs on the tensor cores here (sm_80 and newer)."""
        return self.capability >= (8, 0)

    @property
    def wgmma(self) -> bool:
        """Whether the tiles may use Hopper's warpgroup MMA (sm_90 only: sm_100 has its own MMA, sm_120 none)."""
        return self.family == 90


def arch_for(capability: tuple[int, int], shared_bytes: int | None = None) -> Arch | None:
    """The ``Arch`` of a compute capability, or None below every known one (no Triton tiles there).

    ``shared_bytes`` (read off the device where it can be) overrides the table's value.
    """
    capability = (int(capability[0]), int(capability[1]))
    below = [c for c in KNOWN_ARCHS if c <= capability]
    if not below:
        return None
    nearest = max(below)
    family, shared_kib = KNOWN_ARCHS[nearest]
    return Arch(capability, family, shared_bytes if shared_bytes else shared_kib * 1024, nearest == capability)


# The device seam: everything cgist asks of a device ------------------------------------------------------------

#: The environment variable that makes CPU tensors stand in for a GPU (``SIMULATED``'s keys).
SIMULATE_ENV = "CGIST_SIMULATE_DEVICE"


@dataclass(frozen=True)
class Simulated:
    """A device that CPU tensors stand in for (``CGIST_SIMULATE_DEVICE``): what cgist would read off it.

    Attributes:
        key: the name ``CGIST_SIMULATE_DEVICE`` and ``cgist doctor --simulate`` take (``sm_90``, ``rocm``, ``mps``).
        kind: ``device_kind``'s answer (``"cuda"``, ``"rocm"``, ``"mps"``).
        name: the device name a real one of its kind reports.
        arch: its ``Arch`` (NVIDIA only).
    """

    key: str
    kind: str
    name: str
    arch: Arch | None = None

    @property
    def interpreted(self) -> bool:
        """Whether the kernels may run on it: under the Triton interpreter, on the CPU tensors (NVIDIA only)."""
        return self.kind == "cuda"


def _nvidia(capability: tuple[int, int], name: str, shared_kib: int | None = None) -> Simulated:
    arch = arch_for(capability, shared_kib * 1024 if shared_kib else None)
    return Simulated(arch.name, "cuda", name, arch)


#: Every device docs/devices.md's table names, by ``Simulated.key``. sm_130 is a GPU newer than every known
#: capability: the newest family's tiles, pruned to the 64 KiB it reports (less than every family's own, so that the
#: pruning has configs to remove).
SIMULATED: dict[str, Simulated] = {s.key: s for s in (
    _nvidia((7, 0), "Tesla V100-SXM2-32GB"),
    _nvidia((7, 5), "Tesla T4"),
    _nvidia((8, 0), "NVIDIA A100-SXM4-80GB"),
    _nvidia((8, 6), "NVIDIA A10"),
    _nvidia((8, 9), "NVIDIA L4"),
    _nvidia((9, 0), "NVIDIA H100 80GB HBM3"),
    _nvidia((10, 0), "NVIDIA B200"),
    _nvidia((12, 0), "NVIDIA GeForce RTX 5090"),
    _nvidia((13, 0), "a future NVIDIA GPU", shared_kib=64),
    Simulated("rocm", "rocm", "AMD Instinct MI300X"),
    Simulated("mps", "mps", "Apple M3 Max"),
)}


def simulated(device: torch.device | None = None) -> Simulated | None:
    """The device that ``CGIST_SIMULATE_DEVICE`` names (None when it is unset), for CPU tensors (``device``'s type
    ``cpu``, or any when None); a GPU's own tensors are never simulated. Read at each call: a ValueError names a value
    that is not a key of ``SIMULATED``, a RuntimeError an NVIDIA one without ``TRITON_INTERPRET=1``."""
    value = os.environ.get(SIMULATE_ENV, "").strip()
    if not value or (device is not None and device.type != "cpu"):
        return None
    if value not in SIMULATED:
        raise ValueError(f"the environment variable {SIMULATE_ENV} must be one of {', '.join(SIMULATED)} (or unset), "
                         f"got {value!r}")
    found = SIMULATED[value]
    if found.interpreted and not interpreted():
        raise RuntimeError(f"{SIMULATE_ENV}={value} runs the kernels under the Triton interpreter: set "
                           "TRITON_INTERPRET=1 too, before anything imports them")
    return found


def interpreted() -> bool:
    """Whether the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_kind(device: torch.device) -> str:
    """``"cuda"`` (NVIDIA), ``"rocm"`` (an AMD GPU, which torch also calls cuda), or the device type itself; for CPU
    tensors under ``CGIST_SIMULATE_DEVICE``, the simulated device's."""
    if (sim := simulated(device)) is not None:
        return sim.kind
    if device.type == "cuda":
        return "rocm" if torch.version.hip is not None else "cuda"
    return device.type


def is_gpu(device: torch.device) -> bool:
    """Whether ``device`` is (or stands in for) a CUDA or ROCm GPU."""
    return device_kind(device) in ("cuda", "rocm")


def gpu_arch(device: torch.device) -> Arch | None:
    """The ``Arch`` of an NVIDIA device (read once per device; a simulated one's), None for any other device or one
    older than every known capability."""
    if (sim := simulated(device)) is not None:
        return sim.arch
    if device_kind(device) != "cuda":
        return None
    return _gpu_arch(_index(device))


def device_key(device: torch.device) -> str:
    """One key per physical device: ``cuda:0`` for ``cuda`` too; ``cpu@sm_90`` for CPU tensors simulating sm_90, so
    that what "auto" remembers of one simulated device is not another's."""
    if (sim := simulated(device)) is not None:
        return f"{device}@{sim.key}"
    return f"cuda:{_index(device)}" if device.type == "cuda" else str(device)


def device_name(device: torch.device) -> str:
    """The name a GPU reports (a simulated one's), else the device type."""
    if (sim := simulated(device)) is not None:
        return sim.name
    return _cuda_name(device) if device.type == "cuda" else device.type


def describe(device: torch.device) -> str:
    """``cuda:0 (NVIDIA A100-SXM4-80GB, sm_80)``, ``cpu simulating NVIDIA H100 80GB HBM3 (sm_90)``, ``cuda:0 (AMD
    Instinct MI300X, ROCm)``, or the device itself where it is no GPU."""
    kind, arch, sim = device_kind(device), gpu_arch(device), simulated(device)
    shape = arch.name if arch else {"cuda": "older than sm_70", "rocm": "ROCm"}.get(kind, kind)
    if sim is not None:
        return f"{device} simulating {sim.name} ({shape})"
    return f"{device_key(device)} ({device_name(device)}, {shape})" if is_gpu(device) else str(device)


def free_bytes(device: torch.device) -> int:
    """Free memory on ``device``: a GPU's own (CUDA's free memory), else the host's MemAvailable (its physical memory
    where /proc/meminfo is missing), which is where a simulated device's tensors are."""
    if device.type == "cuda":
        return _cuda_free(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def bf16_tensor_cores(device: torch.device) -> bool:
    """Whether a GPU multiplies bf16 on its tensor cores (NVIDIA sm_80 and newer, every ROCm GPU torch supports)."""
    if (sim := simulated(device)) is not None:
        return sim.kind == "rocm" or (sim.arch is not None and sim.arch.mma)
    return device.type == "cuda" and _cuda_bf16(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's stream; nothing elsewhere)."""
    if device.type == "cuda":
        _cuda_synchronize(device)


def launch_context(device: torch.device):
    """Make a GPU current while launching (Triton launches on the current CUDA device); nothing elsewhere."""
    return _cuda_context(device) if device.type == "cuda" else contextlib.nullcontext()


# What only a real GPU answers ------------------------------------------------------------------------------------
# A simulated device (CPU tensors, the kernels under the interpreter) takes every branch above as the GPU it stands in
# for; what it cannot do is here, each a line: read a real device's properties, wait for a stream, make a device
# current. The tests call these with torch.cuda's functions replaced, so that a renamed import or a wrong argument
# fails on the CPU; a real compile and real timings are Triton's (``cgist.stage.triton.tiles``: a simulated device's
# autotuner takes the first config).


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _shared_bytes(index: int) -> int | None:
    """Opt-in shared memory per block of CUDA device ``index``, from Triton's driver or torch, else None."""
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - Triton absent, or a driver without this query: fall back
        pass
    value = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    return int(value) if value else None


@functools.lru_cache(maxsize=None)
def _gpu_arch(index: int) -> Arch | None:
    return arch_for(torch.cuda.get_device_capability(index), _shared_bytes(index))


def _cuda_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _cuda_free(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def _cuda_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def _cuda_synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def _cuda_context(device: torch.device):
    return torch.cuda.device(device)


def reset_devices() -> None:
    """Forget the architectures read off real devices (a long-lived process whose GPU changed)."""
    _gpu_arch.cache_clear()


def triton_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string such as ``"3.6.0"`` or ``"3.5.0+git1a2b3c"``."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a Triton version: {version!r}")
    return int(found[1]), int(found[2])


@functools.lru_cache(maxsize=None)
def _notice(version: str, why: str) -> None:
    """Log ``why`` once per process (and per Triton version)."""
    logger.warning("cgist: %s", why)


def reset_notices() -> None:
    """Forget which notices ``unchecked_triton`` has logged, so that the next one is logged again
    (``cgist.stage.dispatch.route.reset``)."""
    _notice.cache_clear()


def unchecked_triton() -> str | None:
    """Why "auto" keeps the Triton kernels off under the installed Triton, or None when the compile check covers it
    (or Triton is absent, which the caller finds out itself).

    A release older than ``OLDEST_CHECKED_TRITON`` gets a notice, once, naming the version found and the oldest
    checked.
    """
    try:
        import triton
    except ImportError:
        return None
    version = str(getattr(triton, "__version__", "unknown"))
    try:
        release = triton_release(version)
    except ValueError:
        release = None
    if release is not None and release >= OLDEST_CHECKED_TRITON:
        return None
    why = (f"Triton {version} is older than every release the kernels' compile check covers (the oldest is "
           f"{'.'.join(map(str, OLDEST_CHECKED_TRITON))}): backend='auto' uses the PyTorch streaming path")
    _notice(version, why)
    return why
