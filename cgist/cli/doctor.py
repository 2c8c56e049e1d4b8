"""``cgist doctor``: what cgist does on this machine, checked in under a minute.

It prints the device and its capability, the backend and the tiles that ``backend="auto"`` takes for each dtype
pair, the first-use check that ``backend="auto"`` runs before it uses a kernel variant (``cgist.stage.dispatch.selfcheck``: a
small problem through the Triton kernels and the PyTorch streaming path on the device, comparing the loss, the
gradients and the guide's mask counts) for every score's kernels (dense, MaxSim, XTR) and dtype, a loss-stage timing
beside the PyTorch path, and a verdict line. The exit status is 1 when the kernels disagree with the PyTorch path,
else 0.

Without a CUDA device the kernels run only under the Triton interpreter (``TRITON_INTERPRET=1 cgist doctor``);
otherwise the doctor says that they were not checked. ``--simulate ARCH`` (or ``CGIST_SIMULATE_DEVICE=ARCH``) shows
what cgist would do on that GPU, with the CPU's tensors standing in for it and the kernels under the interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ..stage import devices
from .common import UsageError, resolve_device

if TYPE_CHECKING:
    from ..stage.dispatch.selfcheck import Check

__all__ = ["INTERPRETED_PAIRS", "INTERPRETED_ROWS", "PAIRS", "add_parser", "run_doctor"]

#: The dtype pairs users train with: (name, student dtype, guide dtype).
PAIRS = (
    ("fp32", torch.float32, torch.float32),
    ("bf16", torch.bfloat16, torch.bfloat16),
    ("fp16", torch.float16, torch.float16),
    ("bf16 + fp32 guide", torch.bfloat16, torch.float32),
)
#: The pairs checked under the interpreter: bf16 products are wrong there (its ``tl.dot`` multiplies their bit
#: patterns), and fp64 is the exact reference.
INTERPRETED_PAIRS = (("fp64", torch.float64, torch.float64), PAIRS[0])
#: Rows of the check problems under the interpreter, where each kernel program runs in NumPy: a few seconds a
#: score (on a GPU, ``cgist.stage.dispatch.selfcheck.ROWS`` at most, as "auto" checks).
INTERPRETED_ROWS = 4


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``doctor`` command and its options with the ``cgist`` parser's ``commands``."""
    doctor = commands.add_parser(
        "doctor", help="check what cgist runs on this machine, and that its kernels agree with the PyTorch path",
        description=__doc__.split("\n\n")[0] + " " + __doc__.split("\n\n")[1].replace("\n", " "),
    )
    doctor.add_argument("--device", help="torch device to check (default: cuda if available, else cpu)")
    doctor.add_argument("--simulate", metavar="ARCH", choices=list(devices.SIMULATED),
                        help="show what cgist would do on this GPU, simulated on the CPU with the kernels under the "
                             f"Triton interpreter: one of {', '.join(devices.SIMULATED)}")


@contextlib.contextmanager
def _simulating(arch: str | None) -> Iterator[None]:
    """``CGIST_SIMULATE_DEVICE=arch`` (and for an NVIDIA one ``TRITON_INTERPRET=1``) while the doctor runs; nothing
    without ``arch``. The kernels must not have been imported without the interpreter."""
    if arch is None:
        yield
        return
    setting = {devices.SIMULATE_ENV: arch}
    if devices.SIMULATED[arch].interpreted:
        tiles = sys.modules.get("cgist.stage.triton.tiles")
        if tiles is not None and not tiles.INTERPRET:
            raise UsageError("--simulate: the Triton kernels were imported without the interpreter in this process; "
                             "run cgist doctor --simulate in a new one")
        setting["TRITON_INTERPRET"] = "1"
    saved = {name: os.environ.get(name) for name in setting}
    os.environ.update(setting)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _describe_device(device: torch.device) -> str:
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        versions += ", triton not installed"
    arch = devices.gpu_arch(device)
    if arch is not None:
        shape = (f", {arch.shared_bytes // 1024} KiB shared memory per block"
                 + ("" if arch.known else f", unknown to cgist: tiles of sm_{arch.family}"))
        return f"device: {devices.describe(device)}{shape}; {versions}"
    return f"device: {devices.describe(device)}; {versions}"


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
    fn()
    devices.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        devices.synchronize(device)
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

    if devices.simulated(device) is not None:
        return "loss stage timing: not measured (a simulated device's time would be the CPU's)"
    if device.type == "cuda":
        batch = 16384 if devices.free_bytes(device) > 8 * 2**30 else 4096
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


def _checks(device: torch.device, interpreted: bool) -> list[tuple[str, Check]]:
    """The first-use check of every score's kernels (the registry's, ``cgist.stage.spec.scores``) for each dtype,
    printed as they run: fp64 and fp32 under the interpreter, every pair users train with on a GPU."""
    from ..stage.dispatch.route import check_kernels
    from ..stage.dispatch.selfcheck import ROWS
    from ..stage.spec.scores import SCORES

    rows, dim, guide_dim, token_dim = (INTERPRETED_ROWS, 40, 24, 16) if interpreted else (ROWS, 768, 384, 128)
    pairs = INTERPRETED_PAIRS if interpreted else (INTERPRETED_PAIRS[0], *PAIRS)
    where = "under the Triton interpreter" if interpreted else f"on {device}"
    print(f"first-use check of every score's kernels against the PyTorch path {where} (at most {rows} rows; "
          'backend="auto" runs it before using each kernel variant):')
    checks = []
    for score in SCORES:
        if "triton" not in score.backends:
            print(f"  {score.name:<24} no Triton kernels: the PyTorch path")
            continue
        spec = importlib.import_module(score.spec)
        # a token score's guide is its check problem's own: one check per student dtype
        by_dtype: dict[object, tuple] = {}
        for name, dtype, guide_dtype in pairs:
            by_dtype.setdefault(dtype if score.tokens else (dtype, guide_dtype),
                                (name.split()[0] if score.tokens else name, dtype, guide_dtype))
        for name, dtype, guide_dtype in by_dtype.values():
            calls = spec.sample_calls(device, dtype, guide_dtype, token_dim if score.tokens else dim, guide_dim)
            for label, call in calls.items():
                check = check_kernels(call, rows)
                checks.append((f"{label} {name}", check))
                print(f"  {label + ' ' + name:<24} {'agree' if check.ok else 'DISAGREE'}: {check.numbers()} "
                      f"({check.seconds * 1e3:.0f} ms, compiling included)")
    return checks


def run_doctor(args: argparse.Namespace) -> int:
    """Print the report; 0 when everything that ran agrees, 1 when the kernels disagree with the PyTorch path."""
    if args.simulate is not None and args.device not in (None, "cpu"):
        raise UsageError("--simulate: a simulated device's tensors are the CPU's; leave --device out")
    with _simulating(args.simulate):
        return _report(resolve_device("cpu" if args.simulate else args.device))


def _report(device: torch.device) -> int:
    from ..stage.dispatch.route import auto_route

    start = time.perf_counter()
    print(_describe_device(device))
    print(sentence_transformers_line())
    for line in _routes(device):
        print(line)

    simulated = devices.simulated(device) is not None
    interpreted = device.type == "cpu" and devices.interpreted()
    route, why = auto_route(device, torch.float32, torch.float32)
    checks: list[tuple[str, Check]] = []
    if route == "triton" or (interpreted and not simulated):
        checks = _checks(device, interpreted)
    else:
        hint = "; TRITON_INTERPRET=1 cgist doctor runs them on the CPU under the Triton interpreter" \
            if device.type == "cpu" and not simulated else ""
        print(f"kernels: not run ({why}{hint})")
    print(timing(device, route == "triton" and not interpreted))

    failed = [name for name, check in checks if not check.ok]
    elapsed = f"({time.perf_counter() - start:.0f} s)"
    where = "under the Triton interpreter" if interpreted else f"on {device}"
    if simulated:
        where += f", {devices.describe(device)}"
    if failed:
        print(f"verdict: FAIL: the kernels disagree with the PyTorch path {where} for {', '.join(failed)}; "
              f"train with backend='torch' (or CGIST_BACKEND=torch) and report this output {elapsed}")
        return 1
    if checks:
        print(f"verdict: ok: the kernels agree with the PyTorch path {where} ({len(checks)} checks: "
              f"{', '.join(name for name, _ in checks)}) {elapsed}")
    else:
        print(f"verdict: ok: the PyTorch path runs {where}; the Triton kernels were not checked {elapsed}")
    return 0
