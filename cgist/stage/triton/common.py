"""What every score's launcher of the Triton backend shares: the accumulation dtypes as Triton types, the product
precision of fp32 operands, the device's architecture, small constants on the device and the current CUDA device
while launching. It imports only torch, triton and ``cgist.stage.devices``."""

from __future__ import annotations

import contextlib
import functools

import torch
import triton.language as tl
from torch import Tensor

from cgist.stage.devices import Arch, gpu_arch

__all__ = ["TL_DTYPES", "arch_of", "device_constant", "input_precision", "launch_device"]

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
    """The device's architecture on CUDA; None elsewhere (the interpreter), which ``input_precision`` reads as
    tensor cores."""
    return gpu_arch(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=64)
def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small constant tensor on ``device``, made once: a copy from host memory waits for the stream, so
    each call would otherwise cost a host synchronisation. Read only."""
    return torch.tensor(values, dtype=dtype, device=device)


def launch_device(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
