"""What every score's launcher of the Triton backend shares: the accumulation dtypes as Triton types, the product
precision of fp32 operands, the device's architecture and small constants on the device. It imports only torch,
triton and ``cgist.stage.devices``."""

from __future__ import annotations

import functools

import torch
import triton.language as tl
from torch import Tensor

from cgist.stage.devices import Arch, describe, device_kind, gpu_arch

__all__ = ["TL_DTYPES", "arch_of", "device_constant", "input_precision"]

#: The accumulation dtypes (``cgist.stage.numerics.compute_dtype``) as the kernels' ``ACC``.
TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def input_precision(dtype: torch.dtype, arch: Arch | None = None) -> str:
    """``tl.dot`` input precision: fp32 follows ``torch.get_float32_matmul_precision()``.

    "highest" is tf32x3 (a split into tf32 high and low parts, three tensor-core products, about fp32
    accuracy; see ``cgist.stage.triton.dense.split_tf32``), "high"/"medium" tf32. On an ``arch`` without
    tensor-core instructions (below sm_80) fp32 is "ieee": no tf32 there. Other dtypes ignore it.
    """
    if dtype == torch.float32 and (arch is None or arch.mma):
        return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return "ieee"


def arch_of(device: torch.device) -> Arch | None:
    """The architecture whose tiles a launch on ``device`` takes: an NVIDIA GPU's (a simulated one's too,
    ``cgist.stage.devices``); None for CPU tensors under the interpreter, which ``input_precision`` reads as tensor
    cores. A RuntimeError for a GPU older than every known architecture."""
    if device_kind(device) != "cuda":
        return None
    arch = gpu_arch(device)
    if arch is None:
        raise RuntimeError(f"{describe(device)} is older than every architecture the Triton tile configs know "
                           "(sm_70 and newer)")
    return arch


@functools.lru_cache(maxsize=64)
def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small constant tensor on ``device``, made once: a copy from host memory waits for the stream, so
    each call would otherwise cost a host synchronisation. Read only."""
    return torch.tensor(values, dtype=dtype, device=device)
