"""What a device offers the loss stage: its kind, and for an NVIDIA GPU the architecture its tiles are chosen by.

The Triton kernels' tile configs depend on three properties of a GPU: the largest shared memory one block may
use, whether Triton emits tensor-core instructions for it (``mma``; Triton 3.x emits none below sm_80, where
``tl.dot`` becomes FMA loops: see the PTX in ``bench/aot_compile.py``), and which compile-checked tile table its
architecture family uses. ``gpu_arch`` reads them off a CUDA device; ``arch_for`` builds them from a compute
capability, for the compile check and for tests. ``unchecked_triton`` tells whether the installed Triton is one the
compile check covers. This module imports only torch (and Triton, only in ``unchecked_triton``).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass

import torch

__all__ = ["KNOWN_ARCHS", "OLDEST_CHECKED_TRITON", "Arch", "arch_for", "device_kind", "gpu_arch", "reset_notices",
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


def gpu_arch(device: torch.device) -> Arch | None:
    """The ``Arch`` of a CUDA device (read once per device), or None for one older than every known capability."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gpu_arch(index)


def device_kind(device: torch.device) -> str:
    """``"cuda"`` (NVIDIA), ``"rocm"`` (an AMD GPU, which torch also calls cuda), or the device type itself."""
    if device.type == "cuda":
        return "rocm" if torch.version.hip is not None else "cuda"
    return device.type


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
