"""Throughput of the Triton kernels, and the loss-stage comparison of the GPU check.

GEMM units: over the C score columns of a batch (AP, AA, PP and each AN block), the forward runs one
student GEMM (2·B·C·D flops) and one guide GEMM (2·B·C·Dg). The backward recomputes both in its row
pass and again in its column pass, then adds dQ and dK (2·B·C·D each). Rates are TFLOP/s of that
work and its fraction of torch.mm's rate on 8192³ in the same dtype (the measured ceiling).

    python bench/kernel_bench.py                      # kernels: fwd and bwd apart, B = 4k and 16k
    python bench/kernel_bench.py --suite check --out OUTDIR
        # the GPU check: GEMM ceiling, copy bandwidth, fused vs streaming vs sentence-transformers at
        # B = 4k, 16k, 64k, peak memory; CSV and table into OUTDIR, table printed last

Rows follow bench/common.py's schema; ``note`` carries the GEMM-unit rate and its fraction of the ceiling.
Every row is built from ``common.make_embeddings``, so speed and memory describe the same inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch

#: On a GPU the real kernels run; without one (a smoke test of this script, tiny sizes only) the
#: Triton interpreter runs them on the CPU and the numbers mean nothing.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    make_embeddings, measure_once, split_detached, split_leaves, time_cpu, time_cuda, write_csv,
)

import cgist  # noqa: E402
from cgist import streaming  # noqa: E402
from cgist.options import GistOptions  # noqa: E402
from cgist.kernels.launch import gist_backward, gist_forward, gist_loss_and_grads  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPTIONS = GistOptions(temperature=0.01, margin=0.05)
#: Largest batch at which sentence-transformers' loss stage is timed (it is O(B·N·D) in memory per
#: mini-batch and its runtime grows as B²; beyond this it takes minutes per call).
ST_MAX_BATCH = 4096
ST_MINI_BATCH = 32


def score_columns(batch: int, n_cand: int, k: int) -> int:
    """Columns C of all score blocks: AP + AA + PP + k·AN (both contrast flags on)."""
    return n_cand + batch + n_cand + k * n_cand


def gemm_flops(op: str, batch: int, n_cand: int, dim: int, dim_g: int, k: int) -> float:
    """Flops of GEMM work in ``op`` ("fwd", "bwd" or "fwd+bwd"), as in the module docstring."""
    unit = 2.0 * batch * score_columns(batch, n_cand, k)
    fwd = unit * (dim + dim_g)
    bwd = 2 * fwd + 2 * unit * dim
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[op]


def timed(fn: Callable[[], object], quick: bool = False) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms: ``do_bench`` on a GPU (``quick``: shorter, for calls of seconds)."""
    if DEVICE.type != "cuda":
        fn()
        return time_cpu(fn, repeats=2)
    return time_cuda(fn, warmup_ms=1, rep_ms=50) if quick else time_cuda(fn)


def mm_ceiling(dtype: torch.dtype, size: int) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms of torch.mm on size³ in ``dtype``."""
    a = torch.randn(size, size, device=DEVICE, dtype=dtype)
    b = torch.randn(size, size, device=DEVICE, dtype=dtype)
    return timed(lambda: torch.mm(a, b))


def copy_times(nbytes: int) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms of a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src))


def _row(impl, op, batch, n_cand, dim, dim_g, k, dtype_name, times, peak_mb, note="", impl_version=None):
    median, p20, p80 = times
    return dict(impl=impl, op=op, B=batch, N=n_cand, D=dim, Dg=dim_g, k=k, dtype=dtype_name, device=_device_name(),
                median_ms=median, p20_ms=p20, p80_ms=p80, peak_mb=peak_mb,
                version=impl_version or f"cgist {cgist.__version__}", note=note)


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (interpreter smoke test)"


def _rate_note(op, batch, n_cand, dim, dim_g, k, median_ms, ceiling_tflops) -> str:
    tflops = gemm_flops(op, batch, n_cand, dim, dim_g, k) / (median_ms * 1e-3) / 1e12
    return f"gemm_tflops={tflops:.1f} of_mm={tflops / ceiling_tflops:.2f}"


def st_loss_stage(mini_batch_size: int = ST_MINI_BATCH):
    """sentence-transformers' CachedGISTEmbedLoss with only the attributes its ``calculate_loss`` reads.

    The loss stage needs no model, so none is built (that would need network or model files).
    """
    from sentence_transformers.sentence_transformer.losses.cached_gist_embed import CachedGISTEmbedLoss

    loss = CachedGISTEmbedLoss.__new__(CachedGISTEmbedLoss)
    torch.nn.Module.__init__(loss)
    loss.__dict__.update(
        temperature=OPTIONS.temperature, margin=OPTIONS.margin, margin_strategy=OPTIONS.margin_strategy,
        contrast_anchors=OPTIONS.contrast_anchors, contrast_positives=OPTIONS.contrast_positives,
        gather_across_devices=False, mini_batch_size=mini_batch_size, show_progress_bar=False,
    )
    loss.similarity_fct = torch.nn.CosineSimilarity(dim=-1)
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
    return loss


def loss_stage_fns(batch, n_cand, dim, dim_g, k, dtype) -> dict[str, Callable[[], object]]:
    """fwd+bwd of the loss stage per implementation, on one set of inputs from ``make_embeddings``."""
    student, guide = make_embeddings(batch, n_cand, dim, dim_g, k, device=DEVICE, dtype=dtype)
    fns = {
        "triton": lambda: gist_loss_and_grads(student, guide, OPTIONS, need_grads=True),
        "streaming": lambda: streaming.gist_loss_and_grads(student, guide, OPTIONS, need_grads=True),
    }
    if batch <= ST_MAX_BATCH:
        st = st_loss_stage()
        reps, reps_guided = split_leaves(student, ST_MINI_BATCH), split_detached(guide, ST_MINI_BATCH)
        fns["sentence-transformers"] = lambda: st.calculate_loss(reps, reps_guided, with_backward=True)
    return fns


def kernel_rows(batch, n_cand, dim, dim_g, k, dtype_name, ceiling) -> list[dict]:
    """fwd and bwd of the Triton kernels timed apart (bwd reuses one forward's state)."""
    dtype = DTYPES[dtype_name]
    student, guide = make_embeddings(batch, n_cand, dim, dim_g, k, device=DEVICE, dtype=dtype)
    forward = lambda: gist_forward(student, guide, OPTIONS)  # noqa: E731
    _, state = forward()
    rows = []
    for op, fn in (("fwd", forward), ("bwd", lambda: gist_backward(state))):
        times = timed(fn)
        _, peak = measure_once(fn, DEVICE)
        note = _rate_note(op, batch, n_cand, dim, dim_g, k, times[0], ceiling[dtype_name])
        rows.append(_row("triton", op, batch, n_cand, dim, dim_g, k, dtype_name, times, peak, note))
    return rows


def check_rows(batch, n_cand, dim, dim_g, k, dtype_name, ceiling) -> list[dict]:
    """fwd+bwd of each loss-stage implementation at one size, with peak memory."""
    rows = []
    for impl, fn in loss_stage_fns(batch, n_cand, dim, dim_g, k, DTYPES[dtype_name]).items():
        fn()  # compile / autotune outside the measurements
        _, peak = measure_once(fn, DEVICE)
        times = timed(fn, quick=True)
        note = _rate_note("fwd+bwd", batch, n_cand, dim, dim_g, k, times[0], ceiling[dtype_name])
        impl_version = f"sentence-transformers {version('sentence-transformers')}" if impl.startswith("sent") else None
        rows.append(_row(impl, "fwd+bwd", batch, n_cand, dim, dim_g, k, dtype_name, times, peak, note, impl_version))
        print(_format([rows[-1]], header=False), flush=True)
    return rows


def ceiling_rows(dtype_names: list[str], size: int, nbytes: int) -> tuple[list[dict], dict[str, float]]:
    """torch.mm size³ per dtype and a copy of ``nbytes``; returns the rows and the mm TFLOP/s per dtype."""
    rows, ceiling = [], {}
    for name in dtype_names:
        times = mm_ceiling(DTYPES[name], size)
        ceiling[name] = 2 * size**3 / (times[0] * 1e-3) / 1e12
        rows.append(dict(impl="torch.mm", op=f"gemm {size}^3", B=size, N=size, D=size, Dg=0, k=0, dtype=name,
                         device=_device_name(), median_ms=times[0], p20_ms=times[1], p80_ms=times[2], peak_mb=0.0,
                         version=f"torch {torch.__version__}", note=f"tflops={ceiling[name]:.1f}"))
    times = copy_times(nbytes)
    rows.append(dict(impl="copy", op=f"d2d {nbytes / 2**20:.0f}MiB", B=0, N=0, D=0, Dg=0, k=0, dtype="uint8",
                     device=_device_name(), median_ms=times[0], p20_ms=times[1], p80_ms=times[2], peak_mb=0.0,
                     version=f"torch {torch.__version__}",
                     note=f"GB/s={2 * nbytes / (times[0] * 1e-3) / 1e9:.1f} (read+write)"))
    return rows, ceiling


def _format(rows: list[dict], header: bool = True) -> str:
    cols = ["impl", "op", "B", "N", "D", "Dg", "k", "dtype", "median_ms", "peak_mb", "note"]
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [" ".join(c.ljust(w) for c, w in zip(cols, widths))] if header else []
    lines += [" ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["kernels", "check"], default="kernels")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--guide-dim", type=int, default=384)
    parser.add_argument("--negatives", type=int, default=1)
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--mm-size", type=int, default=8192, help="side of the torch.mm ceiling GEMM")
    parser.add_argument("--copy-mib", type=int, default=1024, help="MiB copied for the bandwidth row")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if DEVICE.type != "cuda":
        print("no CUDA GPU: smoke test under the Triton interpreter, the numbers mean nothing", file=sys.stderr)

    rows, ceiling = ceiling_rows(args.dtype, args.mm_size, args.copy_mib * 2**20)
    print(_format(rows), flush=True)
    batches = args.batch or ([4096, 16384, 65536] if args.suite == "check" else [4096, 16384])
    for dtype_name in args.dtype:
        for batch in batches:
            measure = check_rows if args.suite == "check" else kernel_rows
            rows += measure(batch, batch, args.dim, args.guide_dim, args.negatives, dtype_name, ceiling)
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()

    name = "gpu_check" if args.suite == "check" else "kernel_bench"
    path = write_csv(args.out / f"{name}.csv", rows)
    table = _format(rows)
    (args.out / f"{name}.txt").write_text(table + "\n")
    print(f"\nwrote {path}\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
