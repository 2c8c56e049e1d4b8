"""The guide statistics' cost, measured in one process: calls with and without them, alternating.

    python bench/stats_overhead.py [--device cpu] [--threads 2] [--batch 1024] [--dim 384] [--pairs 100]

``loss_stage.py`` compares ``cgist-torch`` with ``cgist-torch-nostats`` in separate processes, whose
run-to-run spread on a small machine (a few percent) is as large as the cost itself. Here both kinds
of call run on the same inputs in one process, in pairs whose order alternates, so drift and warm-up
hit both alike; the report gives both medians and the median of the paired differences. The call is
the PyTorch streaming path's loss and gradients (``cgist.stage.dispatch.direct.loss_and_grads``, ``need_stats``
on and off), margin 0.05, one negative column, N = B, float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import torch

from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.spec.options import GistOptions


def measure(batch: int, dim: int, pairs: int, device: torch.device) -> tuple[float, float, float]:
    """Medians (seconds) with and without statistics, and the median paired difference."""
    student, guide = common.make_embeddings(batch, batch, dim, dim, 1, seed=0, device=device)
    options = GistOptions(margin=0.05)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def call(stats: bool) -> float:
        sync()
        start = time.perf_counter()
        loss_and_grads("torch", student, guide, options, need_grads=True, need_stats=stats)
        sync()
        return time.perf_counter() - start

    for _ in range(3):
        call(True), call(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(pairs):
        for stats in ((True, False) if i % 2 else (False, True)):
            times[stats].append(call(stats))
    differences = [a - b for a, b in zip(times[True], times[False])]
    return statistics.median(times[True]), statistics.median(times[False]), statistics.median(differences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--pairs", type=int, default=100)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with_stats, without, paired = measure(args.batch, args.dim, args.pairs, torch.device(args.device))
    print(f"B={args.batch}, D=Dg={args.dim}, k=1, {args.pairs} alternating pairs on {args.device} "
          f"({torch.get_num_threads()} threads): with statistics {with_stats * 1e3:.1f} ms, without "
          f"{without * 1e3:.1f} ms, medians {100 * (with_stats / without - 1):+.1f}%, "
          f"median paired difference {100 * paired / without:+.1f}%")


if __name__ == "__main__":
    main()
