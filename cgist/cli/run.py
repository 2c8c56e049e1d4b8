"""One ``cgist train`` run: load the models, score, train, score again and publish the output directory.

:func:`run_train` is the command: it builds the run's :class:`~.config.RunConfig` from the parsed arguments, runs
:func:`train`, and prints the summary table, or the exit code and message of a run that stopped early.
:func:`train` is the run as its stages (:func:`_load_models`, :func:`_score_before`, :func:`_build_trainer`,
:func:`_fit`, :func:`_publish_run`); each takes the configuration and what the stages before it built.
"""

from __future__ import annotations

import argparse
import gc
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

from .common import UsageError
from .config import RunConfig, output_dir, resume_command
from .output import (
    CHECKPOINTS_DIR,
    checkpoint_step,
    discard,
    is_final,
    latest_checkpoint,
    list_checkpoints,
    publish,
    remove_stale,
)
from .report import METRICS, StageTimer, cpu_seconds, format_summary, peak_memory

if TYPE_CHECKING:
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments

    from ..losses.callbacks import GuideStatsCallback
    from ..losses.guided import GuidedFamily
    from .trainer import CheckpointTrainer, NonFiniteLoss, StopRequest

__all__ = ["SUMMARY_NAME", "Stopped", "guide_embeddings", "load_model", "resume_hint", "run_train", "train"]

#: The run's summary, saved next to the model.
SUMMARY_NAME = "cgist_train.json"


def load_model(option: str, path: str, device: torch.device, max_seq_length: int | None = None,
               multi_vector: bool = False) -> SentenceTransformer:
    """A SentenceTransformer (``multi_vector``: a MultiVectorEncoder, converted by sentence-transformers from a
    SentenceTransformer) from a directory or Hub id; UsageError naming the option if it cannot be loaded."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoder

    if not Path(path).exists() and (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1):
        raise UsageError(f"{option}: {path} does not exist")
    model_class = MultiVectorEncoder if multi_vector else SentenceTransformer
    try:
        model = model_class(path, device=str(device))
    except Exception as err:  # the loaders raise OSError, ValueError, KeyError, ... for a bad model
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{option}: cannot load a {model_class.__name__} from {path!r} ({reason})") from None
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length
    return model


class Stopped(Exception):
    """The run ended without publishing a model: ``status`` is the exit code, the message one line for stderr."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def guide_embeddings(config: RunConfig, model: SentenceTransformer, train_set: Dataset) -> tuple[Dataset, dict]:
    """The training split with the guide's embeddings as its label column, for ``--guide-mode precomputed``.

    They come from the cache entry of this guide, split, student tokenizer and --max-seq-length when it holds a
    usable one; otherwise the guide model is loaded, embeds the split as the live guide would see it
    (``cgist.add_guide_embeddings(train_set, guide, model=model)``), is freed, and the result is cached. Returns
    the split and what happened (``entry``, ``cached``, ``seconds``) for the summary.
    """
    import torch

    from ..losses.precompute import add_guide_embeddings
    from .guide_cache import cache_key, entry_path, guide_directory, load_entry, store_entry

    start = time.perf_counter()
    guide_path, device = config.guide, config.device
    guide = None
    files = guide_directory(guide_path)
    if files is None:  # a Hub id that has not been downloaded: loading the guide fetches its files
        guide = load_model("--guide", guide_path, device)
        files = guide_directory(guide_path)
        if files is None:
            raise UsageError(f"--guide-mode precomputed keys its cache by the guide's files, but the files of "
                             f"{guide_path!r} are not in a local directory or the Hugging Face cache; pass a local "
                             "directory as --guide")
    key = cache_key(config.guide_id, files, train_set, model.tokenizer, config.max_seq_length)
    entry = entry_path(config.guide_cache, key)
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
    labelled = add_guide_embeddings(train_set, guide, model=model, batch_size=config.mini_batch_size)
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


def resume_hint(checkpoints: Path, command: str) -> str:
    """Where the newest checkpoint in ``checkpoints`` is and the command that continues from it (or that nothing
    was saved)."""
    checkpoint = latest_checkpoint(checkpoints)
    if checkpoint is None:
        return "no checkpoint had been written, so start the run again"
    return f"checkpoint: {checkpoint}; resume with: {command}"


def _non_finite_message(err: NonFiniteLoss, config: RunConfig, dtype: torch.dtype) -> str:
    import torch

    checkpoint = latest_checkpoint(config.checkpoints)
    kept = f"the newest checkpoint, from before it: {checkpoint}" if checkpoint else "no checkpoint had been written"
    float32 = f", a float32 student (it is {str(dtype).removeprefix('torch.')})" if dtype != torch.float32 else ""
    return (f"error: {err.what} is {err.value} at step {err.step}; training stopped before that update and no model "
            f"was saved ({kept}); try a lower --lr (now {config.lr:g}){float32}, or check --margin "
            f"(now {config.loss_options['margin']:g})")


def _trainer_arguments(config: RunConfig) -> SentenceTransformerTrainingArguments:
    """The Trainer's arguments (a MultiVectorEncoder's with --multi-vector): the schedule, a checkpoint every
    --save-steps, a log every step."""
    from sentence_transformers import SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers
    from sentence_transformers.multi_vector_encoder import MultiVectorEncoderTrainingArguments

    arguments = MultiVectorEncoderTrainingArguments if config.multi_vector else SentenceTransformerTrainingArguments
    return arguments(
        output_dir=str(config.checkpoints),
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.batch_size,
        learning_rate=config.lr,
        warmup_steps=config.warmup_ratio,
        seed=config.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="steps",
        save_steps=config.save_steps,
        eval_strategy="no",
        logging_steps=1,
        logging_nan_inf_filter=False,  # the guard must see a non-finite loss, not an average in its place
        report_to="none",
        use_cpu=config.device.type == "cpu",
        disable_tqdm=False,
    )


def run_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``cgist train``: the run's configuration, the run, then its summary table; the exit status of a run that
    stopped early.

    ``argv`` are the command-line words, from which the stop message's resume command is made. A UsageError is
    left to the entry point.
    """
    try:
        config = RunConfig.from_args(args, argv)
    except KeyboardInterrupt:  # before the run starts (the data may take a while to load): nothing was written
        return _interrupted(output_dir(args).resolve() / CHECKPOINTS_DIR, resume_command(argv))
    try:
        summary = train(config)
    except Stopped as stop:  # on a line of its own: training may have left a progress bar mid-line
        print(f"\ncgist train: {stop}", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:  # outside training, where SIGINT keeps its usual meaning
        return _interrupted(config.checkpoints, config.resume_command)
    print()
    print(format_summary(summary))
    return 0


def _interrupted(checkpoints: Path, command: str) -> int:
    """Ctrl-C outside training stops at once: one line saying how to go on, and the status of a SIGINT."""
    print(f"\ncgist train: interrupted; {resume_hint(checkpoints, command)}", file=sys.stderr)
    return 128 + signal.SIGINT


def train(config: RunConfig) -> dict:
    """The whole run; returns the summary (also written to ``cgist_train.json`` in the output directory).

    Raises UsageError for the bad input that shows only while loading (data too small to split, a model that does
    not load), and Stopped when training stops early (a signal, a non-finite loss).
    """
    start = time.perf_counter()
    models = _load_models(config)
    evaluate, before = _score_before(config, models)
    training = _build_trainer(config, models, before)
    fitted = _fit(config, models, training)
    print("Scoring the held-out split after training...")
    scores = {"before": before, "after": evaluate()}
    return _publish_run(config, models, training, fitted, scores, start)


@dataclass
class _Models:
    """The data splits, the student and its loss."""

    train_set: Dataset
    eval_set: Dataset
    model: SentenceTransformer  # a MultiVectorEncoder with --multi-vector
    loss: GuidedFamily  # FusedCachedGISTLoss or FusedGISTEmbedLoss; with --multi-vector their multi-vector forms
    precomputed: dict | None  # what guide_embeddings did, for --guide-mode precomputed


def _load_models(config: RunConfig) -> _Models:
    """The split, the guide (a model, its cached embeddings, the student itself or none), the student and the loss."""
    import torch

    from ..losses.gist import FusedCachedGISTLoss, FusedGISTEmbedLoss
    from ..losses.multi_vector_gist import FusedCachedMultiVectorGISTLoss, FusedMultiVectorGISTLoss
    from .data import DataError, split_pairs

    try:
        train_set, eval_set = split_pairs(config.pairs, config.eval_fraction, config.seed)
    except DataError as err:
        raise UsageError(str(err)) from None

    source = config.guide_source
    guide: SentenceTransformer | str | None = source.argument  # the loss's guide argument
    if source.runs_model:
        guide = load_model("--guide", config.guide, config.device)
        guide.eval().requires_grad_(False)
    torch.manual_seed(config.seed)
    model = load_model("--model", config.student, config.device, config.max_seq_length, config.multi_vector)
    precomputed = None
    if source.reads_labels:
        train_set, precomputed = guide_embeddings(config, model, train_set)
    # RunConfig.from_args has checked the loss options and the backend.
    cached, plain = ((FusedCachedMultiVectorGISTLoss, FusedMultiVectorGISTLoss) if config.multi_vector
                     else (FusedCachedGISTLoss, FusedGISTEmbedLoss))
    if config.gradient_cache:
        loss = cached(model, guide, mini_batch_size=config.mini_batch_size, backend=config.backend,
                      **config.loss_options)
    else:  # the whole batch in one forward pass: GradCache's second pass would only cost time
        loss = plain(model, guide, backend=config.backend, **config.loss_options)
    return _Models(train_set, eval_set, model, loss, precomputed)


def _score_before(config: RunConfig, models: _Models) -> tuple[Callable[[], dict[str, float]], dict[str, float]]:
    """The held-out scorer (MaxSim's with --multi-vector) and the scores before training (on a resume, those its
    checkpoint recorded)."""
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from .data import retrieval_task

    queries, corpus, relevant = retrieval_task(models.eval_set)
    evaluator_class = MultiVectorInformationRetrievalEvaluator if config.multi_vector else InformationRetrievalEvaluator
    evaluator = evaluator_class(
        queries, corpus, relevant, name="held-out", mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1],
        precision_recall_at_k=[1], map_at_k=[10], batch_size=config.mini_batch_size * 4, write_csv=False,
    )

    def evaluate() -> dict[str, float]:
        scores = evaluator(models.model)
        prefix = f"held-out_{models.model.similarity_fn_name}_"
        return {name: scores[prefix + key] for key, name in METRICS.items()}

    if config.resume_from is None:
        print(f"Scoring the held-out split ({len(queries)} queries, {len(corpus)} documents) before training...")
        return evaluate, evaluate()
    print(f"Resuming from {config.resume_from} (scores before training as recorded there)")
    return evaluate, dict(config.scores_before)


@dataclass
class _Training:
    """The trainer and the callbacks whose results the run reads afterwards."""

    trainer: CheckpointTrainer
    timer: StageTimer
    stop: StopRequest
    guide_stats: GuideStatsCallback
    created: bool  # the output directory did not exist before the run


def _build_trainer(config: RunConfig, models: _Models, before: dict[str, float]) -> _Training:
    """The checkpoint directory made ready (emptied unless resuming) and the trainer with its callbacks."""
    from ..losses.callbacks import GuideStatsCallback
    from .trainer import CheckpointTrainer, MultiVectorCheckpointTrainer, NonFiniteGuard, StopRequest

    created = not config.output.exists()
    if config.resume_from is None:
        discard(config.checkpoints)  # an earlier run's: with --overwrite, or what --resume auto may start over
    config.checkpoints.mkdir(parents=True, exist_ok=True)
    remove_stale(config.checkpoints)
    timer = StageTimer(models.loss, config.device)
    guard = NonFiniteGuard(models.loss, models.model)  # wraps the timed loss, so the checks stay out of its time
    stop = StopRequest()
    guide_stats = GuideStatsCallback(models.loss)
    trainer_class = MultiVectorCheckpointTrainer if config.multi_vector else CheckpointTrainer
    trainer = trainer_class(
        model=models.model, args=_trainer_arguments(config), train_dataset=models.train_set, loss=models.loss,
        callbacks=[timer.callback, guard, stop.callback, guide_stats],
        record={"options": dict(config.options), "before": before}, keep=config.save_total_limit,
    )
    return _Training(trainer, timer, stop, guide_stats, created)


@dataclass
class _Fitted:
    """What training did: its steps, the Trainer's metrics and its time."""

    steps: int
    metrics: dict[str, float]
    train_s: float


def _fit(config: RunConfig, models: _Models, training: _Training) -> _Fitted:
    """Train (or, from a final checkpoint, load its weights); Stopped on a signal or a non-finite loss."""
    from .trainer import NonFiniteLoss, StopNow

    resume_from, checkpoints, trainer = config.resume_from, config.checkpoints, training.trainer
    train_start = time.perf_counter()
    try:
        with training.stop:
            if resume_from is not None and is_final(resume_from):
                final = load_model("--resume", str(resume_from), config.device, None, config.multi_vector)
                models.model.load_state_dict(final.state_dict())
                steps, metrics = checkpoint_step(resume_from), {}
            else:
                result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
                steps, metrics = trainer.state.global_step, result.metrics
    except NonFiniteLoss as err:
        raise Stopped(3, _non_finite_message(err, config, models.model.dtype)) from None
    except StopNow as err:
        raise Stopped(128 + err.signum, f"stopped at once by a second {err}; the checkpoints saved before are "
                      f"intact; {resume_hint(checkpoints, config.resume_command)}") from None
    finally:
        if latest_checkpoint(checkpoints) is None:  # stopped before the first checkpoint: leave no empty folders
            with suppress(OSError):
                checkpoints.rmdir()
                if training.created:
                    config.output.rmdir()
    if training.stop.signum is not None:
        raise Stopped(128 + training.stop.signum, f"stopped by {signal.Signals(training.stop.signum).name} after "
                      f"step {trainer.state.global_step}; {resume_hint(checkpoints, config.resume_command)}")
    return _Fitted(steps, metrics, time.perf_counter() - train_start)


def _publish_run(config: RunConfig, models: _Models, training: _Training, fitted: _Fitted,
                 scores: dict[str, dict[str, float]], start: float) -> dict:
    """Save the model and its summary in a staging directory, then publish it as the output directory."""
    staging = Path(tempfile.mkdtemp(prefix=f".{config.output.name}-", dir=config.output.parent))
    try:
        models.model.save(str(staging))
        summary = _summary(config, models, training, fitted, scores, start)
        (staging / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
        publish(staging, config.output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _summary(config: RunConfig, models: _Models, training: _Training, fitted: _Fitted,
             scores: dict[str, dict[str, float]], start: float) -> dict:
    """The run's summary: the scores, the data, the steps, the checkpoints, time, memory and the guide's numbers."""
    from ..losses.callbacks import stats_logs

    guide_stats = training.guide_stats
    return {
        **scores,
        "train_pairs": len(models.train_set),
        "eval_pairs": len(models.eval_set),
        "batch_size": config.batch_size,
        "loss": type(models.loss).__name__,
        "multi_vector": config.multi_vector,
        "mini_batch_size": config.mini_batch_size if config.gradient_cache else None,
        "guide_mode": config.guide_source.cli,
        "guide_embeddings": models.precomputed,
        "steps": fitted.steps,
        "resumed_after": checkpoint_step(config.resume_from) if config.resume_from else None,
        "checkpoints": [p.name for p in list_checkpoints(config.checkpoints)],
        "timing": {
            "wall_s": time.perf_counter() - start,
            "train_s": fitted.train_s,
            "cpu_s": cpu_seconds(),
            "samples_per_s": fitted.metrics.get("train_samples_per_second", 0.0),
            "checkpoint_s": training.trainer.checkpoint_s,
            **training.timer.timing(),
        },
        "memory": peak_memory(config.device),
        "guide": stats_logs(guide_stats.total) if guide_stats.total is not None else {},
        "output_dir": str(config.output),
        "args": dict(config.given),
    }
