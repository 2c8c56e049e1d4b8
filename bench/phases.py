"""Where one call of the PyTorch streaming path spends its time, beside the bare GEMMs of the same shapes.

    python bench/phases.py [--threads 2] [--batch 1024 4096] [--dim 384] [--calls 10]

The call is the PyTorch backend's contract ``forward`` (``cgist.stage.dispatch.direct.loss_and_grads("torch", ...)``)
on whole columns (loss, gradients and statistics; margin 0.05, one negative column, N = B, float32), as
``loss_stage.py``'s ``cgist-torch-core`` runs it.
Its phases are timed by wrapping them with ``perf_counter``: the set-up (``_StreamingRun``: normalised
copies, norms, tie ids; work that grows with B x D), the row blocks (``_row_block``: the score tiles'
GEMMs and element-wise passes, growing with B x N), the gradients (``_StreamingRun.gradients``: the
normalisation's backward) and the rest (the door's input checks, planning, the workspace, the loss). ``gemm`` is
``loss_stage.gemm_step`` in the same process: the products any loss stage must do. Each phase is
also given as a fraction of the GEMM time, which is what a "time / GEMMs" target allows the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from unittest import mock

import common
import loss_stage
import torch

from cgist.stage.pytorch import dense as pytorch_dense

#: The timed phases: (label, owner, attribute).
PHASES = (("set-up", pytorch_dense._StreamingRun, "__init__"), ("row blocks", pytorch_dense, "_row_block"),
          ("gradients", pytorch_dense._StreamingRun, "gradients"))


@contextlib.contextmanager
def timing_phases(seconds: dict[str, float]) -> Iterator[None]:
    """Within the block, every call of a phase adds its duration to ``seconds[label]``."""

    def timed(label: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start

        return wrapper

    with contextlib.ExitStack() as stack:
        for label, owner, name in PHASES:
            stack.enter_context(mock.patch.object(owner, name, timed(label, getattr(owner, name))))
        yield


def measure(batch: int, dim: int, calls: int) -> dict[str, float]:
    """Median ms of the whole call and of the GEMMs, and the mean ms of each phase, over ``calls`` calls."""
    student, guide = common.make_embeddings(batch, batch, dim, loss_stage.GUIDE_DIM, 1, seed=0)
    call = loss_stage.core_step(student, guide)
    gemm = loss_stage.gemm_step(student, guide)
    for _ in range(3):
        call(), gemm()
    totals, gemms, seconds = [], [], {}
    with timing_phases(seconds):
        for _ in range(calls):
            for fn, times in ((call, totals), (gemm, gemms)):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
    out = {"call": statistics.median(totals) * 1e3, "gemm": statistics.median(gemms) * 1e3}
    out.update({label: seconds.get(label, 0.0) / calls * 1e3 for label, *_ in PHASES})
    out["rest"] = sum(totals) / calls * 1e3 - sum(out[label] for label, *_ in PHASES)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    labels = [label for label, *_ in PHASES] + ["rest"]
    print(f"D={args.dim}, Dg={loss_stage.GUIDE_DIM}, k=1, N=B, float32, {torch.get_num_threads()} threads, "
          f"{args.calls} calls; ms (fraction of the GEMMs' time)")
    print("| B | call | GEMMs | call / GEMMs | " + " | ".join(labels) + " |")
    print("|---:" * (4 + len(labels)) + "|")
    for batch in args.batch:
        m = measure(batch, args.dim, args.calls)
        parts = " | ".join(f"{m[label]:.1f} ({m[label] / m['gemm']:.0%})" for label in labels)
        print(f"| {batch} | {m['call']:.1f} | {m['gemm']:.1f} | {m['call'] / m['gemm']:.2f}x | {parts} |", flush=True)


if __name__ == "__main__":
    main()
