"""What reading the drop-ins' options off their attributes costs per call, beside the loss stage it precedes.

    python bench/options_cost.py [--calls 10000] [--batch 1024] [--dim 384]

Each drop-in reads sentence-transformers' hyperparameters (and cgist's own) off its attributes at every call and
rebuilds its ``GistOptions`` only when one changed (``FusedDropIn.resolve``). This times, on a tiny student, the
call when nothing changed (the usual case) and the call after an assignment (a rebuild), each as the median of
``--calls`` calls, beside one loss-stage call of ``FusedCachedGISTLoss`` at ``--batch`` anchors (PyTorch path,
float32, one negative column) for scale.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import common
import torch
from torchrun_train import build_student


def _median_us(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=384)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    import cgist

    with tempfile.TemporaryDirectory() as directory:
        build_student(Path(directory) / "student")
        model = SentenceTransformer(str(Path(directory) / "student"), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        losses = {
            "FusedCachedGISTLoss": (cgist.FusedCachedGISTLoss(model, model, backend="torch"), "temperature", (0.01, 0.02)),
            "FusedCachedMultipleNegativesRankingLoss": (cgist.FusedCachedMultipleNegativesRankingLoss(model), "scale",
                                                        (20.0, 21.0)),
            "FusedCachedMultipleNegativesSymmetricRankingLoss": (
                cgist.FusedCachedMultipleNegativesSymmetricRankingLoss(model), "scale", (20.0, 21.0)),
        }
    print(f"{'drop-in':<50} {'unchanged, us':>14} {'after an assignment, us':>24}")
    for name, (loss, attribute, values) in losses.items():
        unchanged = _median_us(loss.resolve, args.calls)
        flip = iter(values * args.calls)

        def assigned() -> None:
            setattr(loss, attribute, next(flip))
            loss.resolve()

        print(f"{name:<50} {unchanged:>14.1f} {_median_us(assigned, args.calls):>24.1f}")

    student, guide = common.make_embeddings(args.batch, args.batch, args.dim, args.dim, 1, seed=0,
                                            device=torch.device("cpu"))
    stage = cgist.FusedCachedGISTLoss(model, model, backend="torch")
    reps = [[x.requires_grad_()] for x in student]
    reps_guided = [[g] for g in guide]
    stage.calculate_loss(reps, reps_guided, with_backward=True)
    start = time.perf_counter()
    stage.calculate_loss(reps, reps_guided, with_backward=True)
    print(f"one loss-stage call, B = N = {args.batch}, D = {args.dim}, k = 1: "
          f"{(time.perf_counter() - start) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
