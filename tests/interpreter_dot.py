"""The Triton interpreter's ``tl.dot`` with bf16 operands multiplied as the numbers they are.

What the interpreter does wrong: it carries a bf16 tensor as a numpy uint16 array of its bit patterns (numpy has no
bf16), and its dot builder hands those arrays to ``np.matmul`` as they are, so it multiplies the 16-bit integers: a
16 x 32 bf16 product comes out ~5e10 off. fp16 is carried as numpy's float16 and multiplied correctly, and fp32 and
fp64 are untouched.

The fix: before the interpreter's own builder runs, each bf16 operand's bit pattern becomes the float32 of the same
value (the 16 bits are the top half of that float32). The interpreter then multiplies in float32 and accumulates
into the float32 accumulator, as the tensor cores do: a bf16 x bf16 product has at most 16 significant bits, so it
is exact in float32, and only the order of the float32 sums may differ from a GPU's. It cannot hide a kernel bug:
it changes how one builder op multiplies, not what the kernel feeds it. The operands, masks, accumulator and every
other op of the kernel run as the interpreter runs them, and a kernel that passed a wrong tile, pointer or dtype to
``tl.dot`` gets the same wrong product as on a GPU. ``test_kernels_dtypes`` checks that a small bf16 dot is wrong
without the fix and, with it, equals the exact product of the same values up to float32 summation.

One more difference the fix leaves alone: the interpreter casts fp32 to bf16 by truncation, where a GPU rounds to
nearest. That only makes the interpreter's bf16 roundings up to twice as large, which the tolerances allow for.

tf32: the interpreter multiplies fp32 operands in float32 whatever the input precision, so a tf32 ``tl.dot`` there is
more exact than a GPU's. ``emulated_tf32_dot`` (a test's choice, not installed for the run) rounds the operands of a
dot at input precision "tf32" with fp32 operands to tf32, as a tensor core reads them ("rn" to nearest, "rz" toward
zero: ``helpers.tf32``), forms their products exactly (float64) and adds them into the float32 accumulator, rounding
once per dot. Other dots ("tf32x3", "ieee", half operands) are left to the builder it wraps.

API:
    exact_bf16_dot(create_dot)    a builder method: ``create_dot`` with bf16 operands given as float32.
    patch_interpreter_dot()       a context manager that installs it on the interpreter's builder (once).
    unpatched_dot()               a context manager that restores the interpreter's own method inside.
    emulated_tf32_dot(mode)       a context manager: tf32 dots on emulated tensor cores inside.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import triton.language as tl
from helpers import tf32
from triton._C.libtriton import ir
from triton.runtime import interpreter


def _as_float32(handle):
    """A bf16 operand (uint16 bit patterns) as a float32 operand of the same values; any other one as it is."""
    if handle.dtype != tl.bfloat16:
        return handle
    values = (handle.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return interpreter.TensorHandle(values, tl.float32)


def exact_bf16_dot(create_dot):
    """``create_dot`` (the interpreter builder's method) with its bf16 operands converted by value to float32."""

    def exact_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, _as_float32(a), _as_float32(b), d, input_precision, max_num_imprecise_acc)

    exact_create_dot.interpreter_create_dot = create_dot
    return exact_create_dot


@contextmanager
def patch_interpreter_dot() -> Iterator[None]:
    """Install ``exact_bf16_dot`` on the interpreter's builder inside (a no-op if it is installed already)."""
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if hasattr(original, "interpreter_create_dot"):
        yield
        return
    builder.create_dot = exact_bf16_dot(original)
    try:
        yield
    finally:
        builder.create_dot = original


@contextmanager
def unpatched_dot() -> Iterator[None]:
    """The interpreter's own ``create_dot`` inside, whether or not the fix is installed."""
    builder = interpreter.InterpreterBuilder
    current = builder.create_dot
    builder.create_dot = getattr(current, "interpreter_create_dot", current)
    try:
        yield
    finally:
        builder.create_dot = current


def _tf32_values(data: np.ndarray, mode: str) -> np.ndarray:
    """float32 ``data`` rounded to tf32 (``helpers.tf32``), as float64."""
    return tf32(torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)), mode).double().numpy()


def tf32_tensor_core_dot(create_dot, mode: str):
    """``create_dot`` with its tf32 dots of fp32 operands on emulated tensor cores (``emulated_tf32_dot``)."""

    def tf32_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision != ir.INPUT_PRECISION.TF32 or a.dtype != tl.float32 or b.dtype != tl.float32:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(_tf32_values(a.data, mode), _tf32_values(b.data, mode))
        return interpreter.TensorHandle((product + d.data).astype(d.data.dtype), d.dtype.scalar)

    tf32_create_dot.interpreter_create_dot = getattr(create_dot, "interpreter_create_dot", create_dot)
    return tf32_create_dot


@contextmanager
def emulated_tf32_dot(mode: str) -> Iterator[None]:
    """The interpreter's tf32 dots of fp32 operands on emulated tensor cores inside (``mode``: "rn" or "rz")."""
    builder = interpreter.InterpreterBuilder
    current = builder.create_dot
    builder.create_dot = tf32_tensor_core_dot(current, mode)
    try:
        yield
    finally:
        builder.create_dot = current
