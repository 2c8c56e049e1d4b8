"""The first-use check of the Triton kernels: a small problem through the kernels and the PyTorch path.

A build or launch error shows itself; a kernel that runs and returns a wrong number (a miscompile, a driver or
Triton bug, a tile config that is wrong on a GPU never run) does not. So before ``backend="auto"`` uses a kernel
variant on a device, the router (``cgist.stage.dispatch.route``) runs ``check_call``: a problem of ``ROWS`` anchors
with the call's dimensions, dtypes and options, through the kernels and through the streaming path on that device.
The loss and every gradient must agree within the tolerance of the student's score precision (``TOLERANCE``) and the
guide's mask counts exactly. ``cgist doctor`` runs the same check and prints it. ``CGIST_SELF_CHECK=0`` skips it.

A variant (``Variant``) is what one check vouches for: what selects the compiled kernels and their tiles (the
device, the dtype pair, the fp32 matmul precision where an fp32 operand is multiplied (tf32 or tf32x3), the
dimensions D and Dg (autotuning keys), the number of Matryoshka dimensions (``N_DIMS``)), and what selects the
launches they run: whether a guide masks, the directions and the partition, which reach the kernels as runtime bits
of each column group's rules (the same binaries, other branches and column groups).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..numerics import row_chunks
from ..spec.options import GistOptions
from ..stats import COUNT_FIELDS

__all__ = ["ENV", "ROWS", "TOLERANCE", "Check", "Variant", "check_call", "check_inputs", "enabled", "make_variant",
           "score_precision", "variant_of"]

#: The environment variable that turns the check off (``0``) or on (``1``, the default).
ENV = "CGIST_SELF_CHECK"
#: Anchors (and candidates) of the check's problem.
ROWS = 256
#: The check's margin, at the call's strategy: every guide score of the problem lies at least 0.15 from its
#: row's threshold (``check_inputs``), far beyond any rounding, so the mask counts must agree exactly.
MARGIN = 0.35
#: The lowest temperature of the check. The temperature is a runtime value of the kernels, not part of what they
#: compile; at 0.01 a rounding of a score in the last bit of bf16 moves its logit by 0.03, which alone would take
#: up most of bf16's tolerance.
MIN_TEMPERATURE = 0.05
#: Largest difference between the kernels and the PyTorch path allowed, relative to the loss and, for each
#: gradient, to that gradient's largest entry, by the student's score precision (``score_precision``). Each is
#: about 8 times what the two paths may differ by rounding alone: the tests' bounds of each path against the
#: float64 oracle (``tests/helpers.py``, ``TOL``), added. fp32: the kernels' tf32x3 products (1.2e-6 of the
#: products' magnitude) and fp32 sums over D and N beside the streaming path's fp32 products. tf32 (fp32 at
#: "high"/"medium"): each path rounds the operands to 10 mantissa bits (2^-11). bf16 and fp16: the kernels
#: multiply the inputs exactly and round the score gradients to the student's dtype (2^-8 and 2^-11); the
#: streaming path on a GPU multiplies the normalised rows rounded to that dtype. A kernel that drops, doubles or
#: misplaces one tile of a 256-row problem moves the loss or a gradient by far more.
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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Variant:
    """What selects the kernels a call compiles and the launches it runs: one first-use check each, once per
    process."""

    device: str
    dtype: torch.dtype
    guide_dtype: torch.dtype | None  # None: no guide masking
    precision: str  # torch.get_float32_matmul_precision() when an operand is fp32, else ""
    dim: int
    dim_g: int  # 0 without a guide
    n_dims: int  # Matryoshka dimensions (1 without)
    directions: tuple[str, ...]
    partition_mode: str

    def describe(self) -> str:
        """``bf16 embeddings (D=768) with a bf16 guide (Dg=384), 1 dimension, directions query_to_doc, joint``."""
        guide = f"a {_name(self.guide_dtype)} guide (Dg={self.dim_g})" if self.guide_dtype else "no guide"
        precision = f", fp32 products at {self.precision!r}" if self.precision else ""
        dims = f"{self.n_dims} Matryoshka dimensions" if self.n_dims > 1 else "1 dimension"
        return (f"{_name(self.dtype)} embeddings (D={self.dim}) with {guide}{precision}, {dims}, directions "
                f"{'+'.join(self.directions)}, {self.partition_mode} partition")


def make_variant(device: str, dtype: torch.dtype, guide_dtype: torch.dtype | None, dim: int, dim_g: int,
                 options: GistOptions) -> Variant:
    """The variant of a call on ``device`` (a device key, ``cuda:0``) with these dtypes (guide None: no guide),
    dimensions and options, at the current fp32 matmul precision."""
    fp32 = torch.float32 in (dtype, guide_dtype)
    return Variant(
        device=device, dtype=dtype, guide_dtype=guide_dtype,
        precision=torch.get_float32_matmul_precision() if fp32 else "", dim=dim,
        dim_g=dim_g if guide_dtype is not None else 0, n_dims=len(options.matryoshka_dims or (0,)),
        directions=tuple(options.directions), partition_mode=options.partition_mode,
    )


def variant_of(device: str, embeddings: Sequence, guide_embeddings: Sequence | None, options: GistOptions) -> Variant:
    """The variant of a call to a backend (columns as tensors or row chunks); reads only shapes and dtypes."""
    x = row_chunks(embeddings[0])[0]
    g = row_chunks(guide_embeddings[0])[0] if guide_embeddings is not None else None
    return make_variant(device, x.dtype, g.dtype if g is not None else None, x.shape[1],
                        g.shape[1] if g is not None else 0, options)


def _rows(gen: torch.Generator, n: int, dim: int) -> Tensor:
    """``n`` Gaussian rows of ``dim`` with norms spread over [0.5, 2]."""
    x = torch.randn(n, dim, generator=gen)
    return x / x.norm(dim=1, keepdim=True) * (0.5 + 1.5 * torch.rand(n, 1, generator=gen))


def _topic_rows(gen: torch.Generator, topics: Tensor, centers: Tensor, noise: float = 0.05) -> Tensor:
    """Row r: the unit vector ``centers[topics[r]]`` plus noise of norm ``noise``, scaled into [0.5, 2]."""
    x = torch.randn(len(topics), centers.shape[1], generator=gen)
    x = centers[topics] + noise * x / x.norm(dim=1, keepdim=True)
    return x * (0.5 + 1.5 * torch.rand(len(topics), 1, generator=gen))


def check_inputs(
    variant: Variant, options: GistOptions, n_columns: int, device: torch.device, rows: int = ROWS, seed: int = 0,
) -> tuple[list[Tensor], list[Tensor] | None, GistOptions, list[Tensor] | None]:
    """The inputs of the check for ``variant``: student and guide columns, options and text ids (with
    ``options.mask_duplicates``), ``rows`` anchors against ``rows`` candidates, on ``device``.

    ``n_columns`` counts the call's columns (anchor, positive, negatives, and every rank's anchors with
    ``options.all_anchors``, here the anchors themselves). The options are the call's with offset 0, no chunk
    budget, ``MARGIN`` and at least ``MIN_TEMPERATURE``. The rows are drawn in float32 on the CPU, the same on every
    device. The student rows are Gaussian. The guide rows are ``min(Dg, 8)`` topics (distinct signed axes) plus
    noise of norm 0.05 (an anchor's positive in its topic): two rows of one topic score at least
    (1 - 0.1 - 0.0025) / 1.05^2 = 0.81, of two topics at most 0.1025 / 0.95^2 = 0.114, and rounding the guide to
    bf16 moves a score by less than 0.01. Each threshold, theta_i - 0.35 or theta_i * 0.65 with theta_i in
    [0.8, 1], then lies in [0.45, 0.65]: no score within 0.15 of it, so the two paths' masks agree entry by entry,
    and about one entry in 8 of every block is masked. Text ids are drawn from ``rows`` values, so some texts
    repeat.
    """
    gen = torch.Generator().manual_seed(seed)
    n_negatives = n_columns - 2 - options.all_anchors
    student = [_rows(gen, rows, variant.dim) for _ in range(2 + n_negatives)]
    guide = None
    if variant.guide_dtype is not None:
        n_topics = min(variant.dim_g, 8)
        axes = torch.randperm(variant.dim_g, generator=gen)[:n_topics]  # orthonormal: distinct signed axes
        signs = torch.randint(2, (n_topics,), generator=gen) * 2.0 - 1.0
        centers = torch.zeros(n_topics, variant.dim_g).index_put_((torch.arange(n_topics), axes), signs)
        topics = [torch.randint(n_topics, (rows,), generator=gen) for _ in range(2 + n_negatives)]
        topics[1] = topics[0]  # positive i shares anchor i's topic: theta_i >= 0.81
        guide = [_topic_rows(gen, t, centers).to(device, variant.guide_dtype) for t in topics]
    student = [s.to(device, variant.dtype) for s in student]
    text_ids = None
    if options.mask_duplicates:
        text_ids = [torch.randint(rows, (rows,), generator=gen, dtype=torch.int32).to(device)
                    for _ in range(2 + n_negatives)]
    if options.all_anchors:  # every rank's anchors: this rank's alone, at offset 0
        student.append(student[0])
        guide = guide and [*guide, guide[0]]
        text_ids = text_ids and [*text_ids, text_ids[0]]
    options = options.replace(offset=0, block_bytes=None, margin=MARGIN,
                              temperature=max(options.temperature, MIN_TEMPERATURE))
    return student, guide, options, text_ids


@dataclass
class Check:
    """The kernels against the PyTorch path on one problem."""

    variant: Variant
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
        """``loss 2.1e-07, gradients 3.4e-06 (relative; allowed 1e-04), mask counts equal (5 fields)``."""
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


def check_call(kernels: Callable, streaming: Callable, variant: Variant, options: GistOptions, n_columns: int,
               device: torch.device, rows: int = ROWS) -> Check:
    """Run ``check_inputs`` through ``kernels`` and ``streaming`` (backends with the signature of
    ``cgist.stage.pytorch.streaming.gist_loss_and_grads``) and compare them; one host synchronisation, at the end.

    Errors of the kernels propagate (the caller treats them as a build or launch failure).
    """
    start = time.perf_counter()
    student, guide, options, text_ids = check_inputs(variant, options, n_columns, device, rows)
    extra = {"text_ids": text_ids} if text_ids is not None else {}
    results = [run(student, guide, options, need_grads=True, need_stats=True, **extra) for run in (kernels, streaming)]
    (loss_k, grads_k, (counts_k, _)), (loss_s, grads_s, (counts_s, _)) = results
    diffs = torch.stack([_relative(loss_k, loss_s), *(_relative(a, b) for a, b in zip(grads_k, grads_s))])
    values = torch.cat([diffs, counts_k.double(), counts_s.double()]).tolist()  # the one host sync
    n = len(diffs)
    counts = {field: (int(k), int(s)) for field, k, s in
              zip(COUNT_FIELDS, values[n : n + len(COUNT_FIELDS)], values[n + len(COUNT_FIELDS) :])}
    return Check(variant, rows, values[0], max(values[1:n]), counts, TOLERANCE[score_precision(variant.dtype)],
                 time.perf_counter() - start)
