"""The trainer of ``cgist train``: atomic checkpoints, a clean stop on SIGINT or SIGTERM, and a guard against
non-finite losses.

It imports sentence-transformers, so ``cgist.cli.run`` imports it only once training is about to start.
"""

from __future__ import annotations

import math
import shutil
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from sentence_transformers import SentenceTransformerTrainer
from sentence_transformers.multi_vector_encoder import MultiVectorEncoderTrainer
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..losses.guided import GuidedFamily
from .output import commit_checkpoint, new_staging, write_record

__all__ = ["CheckpointTrainer", "MultiVectorCheckpointTrainer", "NonFiniteGuard", "NonFiniteLoss", "StopNow",
           "StopRequest"]


class _AtomicCheckpoints:
    """A sentence-transformers trainer whose checkpoints appear whole or not at all.

    Each checkpoint is written by the Trainer (model, optimizer, scheduler, RNG states, trainer state) into a
    staging directory, gets ``record`` beside those files, and is renamed into ``args.output_dir``; then all
    but the ``keep`` newest checkpoints are deleted. It also saves at the end of every epoch.
    """

    def __init__(self, *args: Any, record: dict, keep: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record, self.keep = record, keep
        self.checkpoint_s = 0.0  # time spent writing checkpoints
        self.add_callback(_SaveAtEpochEnd())

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        directory = Path(self.args.output_dir)
        name = f"checkpoint-{self.state.global_step}"
        if (directory / name).exists():  # the end of an epoch right after a save, or a stop right after one
            return
        start = time.perf_counter()
        staging = new_staging(directory)
        try:
            self.args.output_dir = str(staging)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.output_dir = str(directory)
            write_record(staging / name, {**self.record, "step": self.state.global_step})
            commit_checkpoint(staging / name, directory, self.keep)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # left only if the save failed
            self.checkpoint_s += time.perf_counter() - start


class CheckpointTrainer(_AtomicCheckpoints, SentenceTransformerTrainer):
    """``SentenceTransformerTrainer`` with atomic checkpoints (``_AtomicCheckpoints``)."""


class MultiVectorCheckpointTrainer(_AtomicCheckpoints, MultiVectorEncoderTrainer):
    """``MultiVectorEncoderTrainer`` (a MultiVectorEncoder's queries and documents embedded as such) with atomic
    checkpoints (``_AtomicCheckpoints``)."""


class _SaveAtEpochEnd(TrainerCallback):
    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        control.should_save = True


class StopNow(BaseException):
    """A second SIGINT or SIGTERM while training: stop where the program is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """While active (a context manager), the first SIGINT or SIGTERM asks training to stop after the step in
    progress, saving a checkpoint; a second one raises :class:`StopNow`. The previous handlers come back on exit.

    Pass ``callback`` to the trainer; ``signum`` is the signal that asked for the stop, or None.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self.callback = _StopCallback(self)

    def __enter__(self) -> StopRequest:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise StopNow(signum)
        self.signum = signum
        print(f"\ncgist train: {signal.Signals(signum).name}: finishing the current step and saving a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)


class _StopCallback(TrainerCallback):
    def __init__(self, request: StopRequest) -> None:
        self.request = request

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.request.signum is not None:
            control.should_save = control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.request.signum is not None:  # the signal came while this step's checkpoint was being written
            control.should_training_stop = True


class NonFiniteLoss(Exception):
    """Training met a NaN or infinite value; raised before the optimizer could apply it."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(f"{what} is {value} at step {step}")
        self.step, self.what, self.value = step, what, value


def _first_bad(tensors: list[torch.Tensor]) -> float | None:
    """The first NaN or infinite element among ``tensors`` (one host sync when all are finite), else None."""
    if not tensors or bool(torch.stack([t.isfinite().all() for t in tensors]).all()):
        return None
    bad = next(t for t in tensors if not bool(t.isfinite().all()))
    return float(bad.detach()[~bad.isfinite()][0])


class NonFiniteGuard(TrainerCallback):
    """Raises :class:`NonFiniteLoss` when the loss stage meets or makes a NaN or infinity.

    Checked in every training step, before the optimizer step: the embeddings that enter
    ``loss.calculate_loss`` (a multi-vector loss's second argument is its masks, not guide embeddings), the loss it returns, the mean guide scores of ``loss.last_stats`` (the
    ``cgist.GistStats`` of that call, when the loss keeps one) and the student's gradients after clipping. So no
    update is ever made from a non-finite value, and no checkpoint holds one. Pass the guard to the trainer as a
    callback.
    """

    def __init__(self, loss: GuidedFamily, model: torch.nn.Module) -> None:
        self.step = 1
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        calculate_loss = loss.calculate_loss

        def checked_calculate_loss(reps: list[list[torch.Tensor]], reps_guided: list[list[torch.Tensor]],
                                   *args: Any, **kwargs: Any) -> torch.Tensor:
            for what, columns in (("a student embedding", reps), ("a guide embedding", reps_guided)):
                value = _first_bad([t for column in columns for t in column if t.is_floating_point()])
                if value is not None:
                    raise NonFiniteLoss(self.step, what, value)
            result = calculate_loss(reps, reps_guided, *args, **kwargs)
            value = float(result.detach())
            if not math.isfinite(value):
                raise NonFiniteLoss(self.step, "the training loss", value)
            stats = getattr(loss, "last_stats", None)  # a cgist.GistStats of this call, where the loss keeps one
            for what in ("theta_mean", "threshold_mean"):
                value = getattr(stats, what, None)
                if value is not None and not math.isfinite(value):
                    raise NonFiniteLoss(self.step, f"the loss stage's {what}", value)
            return result

        loss.calculate_loss = checked_calculate_loss

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.step = state.global_step + 1

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            if not bool(norm.isfinite()):
                raise NonFiniteLoss(self.step, "the gradient norm", float(norm))
