"""The first-use check of the Triton kernels: a small problem through the kernels and the PyTorch path, for every
score.

A build or launch error shows itself; a kernel that runs and returns a wrong number (a miscompile, a driver or
Triton bug, a tile config that is wrong on a GPU never run) does not. So before ``backend="auto"`` uses a kernel
variant on a device, the router (``cgist.stage.dispatch.route``) runs ``check_call``: the score's check problem for
that variant (its spec module's ``check_problem``), through the kernels and through the PyTorch path on that device,
by the backend contract. The loss and every gradient must agree within the tolerance of the student's score
precision (``TOLERANCE``) and the guide's mask counts exactly. ``cgist doctor`` runs the same check and prints it.
``CGIST_SELF_CHECK=0`` skips it.

A variant is what one check vouches for, a hashable value of the score's spec module (``variant_of``): what selects
the compiled kernels and their tiles (the device, the dtypes, the fp32 matmul precision, the dimensions) and the
launches they run.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from ..spec.call import StageCall, gradients
from ..stats import COUNT_FIELDS

__all__ = ["ENV", "ROWS", "TOLERANCE", "Check", "check_call", "enabled", "score_precision"]

#: The environment variable that turns the check off (``0``) or on (``1``, the default).
ENV = "CGIST_SELF_CHECK"
#: Rows of a check problem (a score's spec may take fewer where each row costs more).
ROWS = 256
#: Largest difference between the kernels and the PyTorch path allowed, relative to the loss and, for each
#: gradient, to that gradient's largest entry, by the student's score precision (``score_precision``). Each is
#: about 8 times what the two paths may differ by rounding alone: the tests' bounds of each path against the
#: float64 oracle (``tests/helpers.py``, ``TOL``), added. fp32: the kernels' tf32x3 products (1.2e-6 of the
#: products' magnitude) and fp32 sums over D and N beside the streaming path's fp32 products. tf32 (fp32 at
#: "high"/"medium"): each path rounds the operands to 10 mantissa bits (2^-11). bf16 and fp16: the kernels
#: multiply the inputs exactly and round the score gradients to the student's dtype (2^-8 and 2^-11); the
#: streaming path on a GPU multiplies the normalised rows rounded to that dtype. A kernel that drops, doubles or
#: misplaces one tile of a check problem moves the loss or a gradient by far more.
TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4, "tf32": 3e-2, "bf16": 4e-2, "fp16": 8e-3}


def enabled() -> bool:
    """Whether ``backend="auto"`` checks each kernel variant before using it (``CGIST_SELF_CHECK``, default on)."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"the environment variable {ENV} must be 0 or 1 (or unset), got {value!r}")
    return value != "0"


def score_precision(dtype: torch.dtype) -> str:
    """The precision of the student's score products for ``dtype`` ("tf32" for fp32 at "high" or "medium")."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    names = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise TypeError(f"the kernels take float64, float32, bfloat16 or float16 embeddings, got {dtype}")
    return names[dtype]


@dataclass
class Check:
    """The kernels against the PyTorch path on one problem."""

    variant: object
    rows: int
    loss_diff: float  # relative to the PyTorch path's loss
    grad_diff: float  # the largest over the gradients, each relative to its largest entry
    counts: dict[str, tuple[int, int]]  # field: (kernels, PyTorch path)
    tolerance: float
    seconds: float

    @property
    def count_mismatches(self) -> dict[str, tuple[int, int]]:
        return {field: pair for field, pair in self.counts.items() if pair[0] != pair[1]}

    @property
    def ok(self) -> bool:
        return self.loss_diff <= self.tolerance and self.grad_diff <= self.tolerance and not self.count_mismatches

    def numbers(self) -> str:
        """``loss 2.1e-07, gradients 3.4e-06 (relative; allowed 1e-04), mask counts equal (5 masked)``."""
        mismatches = self.count_mismatches
        counts = (", ".join(f"{field} {k} vs {s}" for field, (k, s) in mismatches.items()) if mismatches
                  else f"equal ({sum(s for f, (_, s) in self.counts.items() if f.startswith('masked'))} masked)")
        return (f"loss {self.loss_diff:.1e}, gradients {self.grad_diff:.1e} (relative; allowed "
                f"{self.tolerance:.0e}), mask counts {counts}")


def _relative(a: Tensor, b: Tensor) -> Tensor:
    """``max |a - b| / max |b|`` in float64, infinite unless both are finite."""
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).abs().max() / b.abs().max().clamp_min(1e-300)
    finite = torch.isfinite(a).all() & torch.isfinite(b).all()
    return torch.where(finite, diff, torch.full_like(diff, math.inf))


def _results(stage: ModuleType, call: StageCall) -> tuple[Tensor, list[Tensor], Tensor]:
    """A stage's loss, gradients (every input's, then every learned parameter's: ``Grads.every``) and mask counts."""
    loss, state, counters = stage.forward(call, True, True)
    grads = gradients(stage, call, state, torch.ones((), dtype=loss.dtype, device=loss.device)).every
    counts = counters[0] if counters is not None else torch.zeros(len(COUNT_FIELDS), dtype=torch.int64,
                                                                  device=loss.device)
    return loss, grads, counts


def check_call(kernels: ModuleType, pytorch: ModuleType, call: StageCall, variant: object) -> Check:
    """Run ``call`` (a score's check problem for ``variant``) through ``kernels`` and ``pytorch`` (backend modules:
    the contract's ``forward`` and ``backward``) and compare them; one host synchronisation, at the end.

    Errors of the kernels propagate (the caller treats them as a build or launch failure).
    """
    start = time.perf_counter()
    (loss_k, grads_k, counts_k), (loss_s, grads_s, counts_s) = (_results(stage, call) for stage in (kernels, pytorch))
    diffs = torch.stack([_relative(loss_k, loss_s), *(_relative(a, b) for a, b in zip(grads_k, grads_s))])
    values = torch.cat([diffs, counts_k.double(), counts_s.double()]).tolist()  # the one host sync
    n = len(diffs)
    counts = {field: (int(k), int(s)) for field, k, s in
              zip(COUNT_FIELDS, values[n : n + len(COUNT_FIELDS)], values[n + len(COUNT_FIELDS) :])}
    return Check(variant, call.sizes[0], values[0], max(values[1:n]), counts, TOLERANCE[score_precision(call.dtype)],
                 time.perf_counter() - start)
