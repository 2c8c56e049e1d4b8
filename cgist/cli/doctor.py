"""``cgist doctor``: what cgist does on this machine, checked in under a minute.

It prints the device and its capability, the backend and the tiles that ``backend="auto"`` takes for each dtype
pair, the first-use check that ``backend="auto"`` runs before it uses a kernel variant (``cgist.stage.dispatch.selfcheck``: a
small problem through the Triton kernels and the PyTorch streaming path on the device, comparing the loss, the
gradients and the guide's mask counts) for each dtype pair, a loss-stage timing beside the PyTorch path, and a
verdict line. The exit status is 1 when the kernels disagree with the PyTorch path, else 0.

Without a CUDA device the kernels run only under the Triton interpreter (``TRITON_INTERPRET=1 cgist doctor``);
otherwise the doctor says that they were not checked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .common import resolve_device

if TYPE_CHECKING:
    from ..stage.dispatch.selfcheck import Check

__all__ = ["PAIRS", "add_parser", "run_doctor"]

#: The dtype pairs users train with: (name, student dtype, guide dtype).
PAIRS = (
    ("fp32", torch.float32, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp16", torch.float16, torch.float16),
    ("bf16 + fp32 guide", torch.bfloat16, torch.float32),
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``doctor`` command and its option with the ``cgist`` parser's ``commands``."""
    doctor = commands.add_parser(
        "doctor", help="check what cgist runs on this machine, and that its kernels agree with the PyTorch path",
        description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1].replace("\n", " "),
    )
    doctor.add_argument("--device", help="torch device to check (default: cuda if available, else cpu)")


def _describe_device(device: torch.device) -> str:
    from ..stage.devices import device_kind, gpu_arch

    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        versions += ", triton not installed"
    if device_kind(device) == "cuda":
        arch = gpu_arch(device)
        shape = (f"{arch.name}, {arch.shared_bytes // 1024} KiB shared memory per block"
                 + ("" if arch.known else f", unknown to cgist: tiles of sm_{arch.family}") if arch
                 else "compute capability %d.%d" % torch.cuda.get_device_capability(device))
        return f"device: {device} {torch.cuda.get_device_name(device)} ({shape}); {versions}"
    if device_kind(device) == "rocm":
        return f"device: {device} {torch.cuda.get_device_name(device)} (ROCm {torch.version.hip}); {versions}"
    return f"device: {device}; {versions}"


def sentence_transformers_line() -> str:
    """The installed sentence-transformers, where it lies against the releases cgist is tested with, and the rules
    the drop-ins follow (``cgist.compat``)."""
    from ..compat import (
        NEWEST_TESTED,
        SENTENCE_TRANSFORMERS,
        SENTENCE_TRANSFORMERS_OLDEST,
        installed_version,
        release_rules,
        tested_range_status,
    )

    version = installed_version("sentence-transformers")
    status = tested_range_status(version)
    tested = f"tested: {SENTENCE_TRANSFORMERS_OLDEST} to {NEWEST_TESTED}, supported: {SENTENCE_TRANSFORMERS}"
    if version is None:
        return f"sentence-transformers: not installed ({tested}); the drop-ins need it, gist_loss does not"
    rule = "always excluded" if release_rules(version).self_pairs_excluded else "left to the guide"
    note = {"tested": "in the tested range",
            "newer than tested": f"newer than the newest tested ({NEWEST_TESTED}): the drop-ins follow its rules, "
                                 "and a loss changed upstream since would not be matched",
            "beyond the range": "beyond the supported range: not expected to match",
            "older than supported": "older than supported: import cgist fails"}[status]
    return (f"sentence-transformers {version}: {note} ({tested}); GIST self-pairs {rule} "
            "(cgist.compat.RELEASE_RULES)")


def _routes(device: torch.device) -> list[str]:
    from ..stage.dispatch.route import auto_route, kernel_tiles
    from ..stage.numerics import half_products

    lines = ['backend "auto" per dtype pair (student, guide):']
    for name, dtype, guide_dtype in PAIRS:
        backend, why = auto_route(device, dtype, guide_dtype)
        if backend == "triton":
            how = f"tiles {kernel_tiles(device, dtype, guide_dtype)}"
        else:
            products = [half_products(device, d) for d in (dtype, guide_dtype)]
            how = "score products in " + " and ".join(dict.fromkeys(
                str(p or torch.float32).removeprefix("torch.") for p in products))
        lines.append(f"  {name:<18} {backend:<6} ({why}); {how}")
    return lines


def _inputs(batch: int, n_cand: int, dim: int, dim_g: int, k: int, dtype: torch.dtype, guide_dtype: torch.dtype,
            device: torch.device, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random student and guide columns [anchor, positive, *k negatives], the positives close to their anchors."""
    gen = torch.Generator().manual_seed(seed)
    anchor = torch.randn(batch, dim, generator=gen)
    guide_anchor = torch.randn(batch, dim_g, generator=gen)
    student = [anchor, torch.randn(n_cand, dim, generator=gen)]
    guide = [guide_anchor, torch.randn(n_cand, dim_g, generator=gen)]
    student[1][:batch] += 2.0 * anchor
    guide[1][:batch] += 2.0 * guide_anchor
    student += [torch.randn(n_cand, dim, generator=gen) for _ in range(k)]
    guide += [torch.randn(n_cand, dim_g, generator=gen) for _ in range(k)]
    return ([s.to(device, dtype) for s in student], [g.to(device, guide_dtype) for g in guide])


def _run(backend: str, student: list[torch.Tensor], guide: list[torch.Tensor]):
    from .. import gist_loss

    leaves = [s.detach().requires_grad_() for s in student]
    loss, stats = gist_loss(leaves, guide, temperature=0.05, margin=0.05, offset=0, backend=backend,
                            return_stats=True)
    loss.backward()
    return loss.detach().double(), [s.grad.double() for s in leaves], stats


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bare_gemms(student: list[torch.Tensor], guide: list[torch.Tensor], rows: int) -> Callable[[], None]:
    """The loss stage's four products per row block of ``rows`` anchors (guide and student scores, the two
    gradient products) against every column, in the compute dtype: the speed limit of the PyTorch path."""
    a, columns = student[0].float(), torch.cat([student[1], student[0], *student[1:]]).float()
    ga, guide_columns = guide[0].float(), torch.cat([guide[1], guide[0], *guide[1:]]).float()

    def run() -> None:
        for lo in range(0, a.shape[0], rows):
            scores = a[lo : lo + rows] @ columns.T
            ga[lo : lo + rows] @ guide_columns.T
            scores @ columns
            scores.T @ a[lo : lo + rows]

    return run


def timing(device: torch.device, use_triton: bool) -> str:
    """The loss stage (forward and backward) at a size that fits the device, on each path it has."""
    from ..stage.budget import ROW_TARGET
    from ..stage.dispatch.route import auto_route

    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        batch = 16384 if free > 8 * 2**30 else 4096
        dtype = torch.bfloat16 if auto_route(device, torch.bfloat16, torch.bfloat16)[0] == "triton" else torch.float32
        sizes, repeats = (batch, batch, 768, 384, 1), 5
    else:
        dtype, sizes, repeats = torch.float32, (1024, 1024, 384, 384, 1), 3
    student, guide = _inputs(*sizes, dtype, dtype, device, seed=1)
    label = f"B=N={sizes[0]}, D={sizes[2]}, Dg={sizes[3]}, k={sizes[4]}, {str(dtype).removeprefix('torch.')}"
    torch_s = _median_seconds(lambda: _run("torch", student, guide), device, repeats)
    parts = [f"PyTorch path {torch_s * 1e3:.1f} ms"]
    if use_triton:
        triton_s = _median_seconds(lambda: _run("triton", student, guide), device, repeats)
        parts.insert(0, f"Triton {triton_s * 1e3:.1f} ms ({torch_s / triton_s:.1f}x the PyTorch path)")
    else:
        gemm_s = _median_seconds(_bare_gemms(student, guide, ROW_TARGET), device, repeats)
        parts.append(f"{torch_s / gemm_s:.2f}x its bare GEMMs ({gemm_s * 1e3:.1f} ms)")
    return f"loss stage, forward and backward ({label}): " + ", ".join(parts)


def run_doctor(args: argparse.Namespace) -> int:
    """Print the report; 0 when everything that ran agrees, 1 when the kernels disagree with the PyTorch path."""
    from ..stage.dispatch.route import auto_route, check_kernels

    start = time.perf_counter()
    device = resolve_device(args.device)
    print(_describe_device(device))
    print(sentence_transformers_line())
    for line in _routes(device):
        print(line)

    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    runs_kernels = auto_route(device, torch.float32, torch.float32)[0] == "triton" or interpreted
    checks: list[tuple[str, Check]] = []
    if runs_kernels:
        from ..stage.dispatch.selfcheck import ROWS

        where = "under the Triton interpreter" if interpreted else f"on {device}"
        rows, dim, dim_g, k = (13, 40, 24, 1) if interpreted else (ROWS, 768, 384, 1)
        # bf16 and fp16 products are broken in the interpreter; on a GPU they are the point
        pairs = [("fp64", torch.float64, torch.float64), *PAIRS[:1]] if interpreted else \
            [("fp64", torch.float64, torch.float64), *PAIRS]
        print(f"first-use check, kernels against the PyTorch path {where} (B=N={rows}, D={dim}, Dg={dim_g}, k={k}; "
              'backend="auto" runs it before using each kernel variant):')
        for name, dtype, guide_dtype in pairs:
            check = check_kernels(device, dtype, guide_dtype, rows, dim, dim_g, k)
            checks.append((name, check))
            print(f"  {name:<18} {'agree' if check.ok else 'DISAGREE'}: {check.numbers()} "
                  f"({check.seconds * 1e3:.0f} ms, compiling included)")
    else:
        why = auto_route(device, torch.float32, torch.float32)[1]
        hint = "; TRITON_INTERPRET=1 cgist doctor runs them on the CPU under the Triton interpreter" \
            if device.type == "cpu" else ""
        print(f"kernels: not run ({why}{hint})")
    print(timing(device, runs_kernels and not interpreted))

    failed = [name for name, check in checks if not check.ok]
    elapsed = f"({time.perf_counter() - start:.0f} s)"
    if failed:
        print(f"verdict: FAIL: the kernels disagree with the PyTorch path on {device} for {', '.join(failed)}; "
              f"train with backend='torch' (or CGIST_BACKEND=torch) and report this output {elapsed}")
        return 1
    if checks:
        checked = ", ".join(name for name, _ in checks)
        where = "under the Triton interpreter" if interpreted else f"on {device}"
        print(f"verdict: ok: the kernels agree with the PyTorch path {where} ({checked}) {elapsed}")
    else:
        print(f"verdict: ok: the PyTorch path runs on {device}; the Triton kernels were not checked {elapsed}")
    return 0
