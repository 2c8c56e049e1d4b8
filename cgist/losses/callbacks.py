"""``GuideStatsCallback``: the guide's false-negative statistics in the trainer's logs, as ``guide/...``."""

from __future__ import annotations

import gc

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from ..stage.stats import BLOCKS, GistStats
from .guided import GuidedFamily

__all__ = ["GuideStatsCallback", "stats_logs"]


def stats_logs(stats: GistStats) -> dict[str, float]:
    """The ``guide/...`` log entries of ``stats``: masked fractions per block, positive-only share, mean theta (with
    a guide)."""
    logs = {f"guide/masked_{block}": stats.masked_fraction(block) for block in BLOCKS if block in stats.candidates}
    logs["guide/positive_only"] = stats.positive_only_fraction
    if stats.theta_mean is not None:
        logs["guide/theta_mean"] = stats.theta_mean
    return logs


class GuideStatsCallback(TrainerCallback):
    """Adds the loss stage's guide statistics to the trainer's logs at every logging step.

    The entries are ``guide/masked_ap``, ``guide/masked_aa``, ``guide/masked_pp``, ``guide/masked_an`` (the share of
    each block's entries the guide masked; a multi-vector loss has ``masked_ap`` and ``masked_an``, and ``masked_aa``
    and ``masked_pp`` with its contrast blocks),
    ``guide/positive_only`` (the share of anchors left with only their positive) and ``guide/theta_mean``, over the
    training steps since the previous log. With ``gather_across_devices`` they are summed over ranks first. They reach every reporting integration
    (TensorBoard, W&B, ...) like the loss: at the start of training the callback moves itself ahead of them.

    Example:
        ::

            loss = cgist.FusedCachedGISTLoss(model, guide, mini_batch_size=64, margin=0.05)
            trainer = SentenceTransformerTrainer(model=model, train_dataset=ds, loss=loss,
                                                 callbacks=[cgist.GuideStatsCallback(loss)])
    """

    def __init__(self, loss: GuidedFamily) -> None:
        if not isinstance(loss, GuidedFamily):
            raise TypeError("loss must be a guided drop-in (FusedCachedGISTLoss, FusedGISTEmbedLoss, "
                            f"FusedCachedMultiVectorGISTLoss or FusedMultiVectorGISTLoss), got {type(loss).__name__}")
        self.loss = loss
        #: The statistics of every logged training step so far, as one.
        self.total: GistStats | None = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._run_first()
        self.loss.pop_training_stats()  # statistics of calls before training (evaluation) do not count

    def _run_first(self) -> None:
        """Move this callback to the front of its trainer's callback list, ahead of the reporting integrations.

        The trainer calls its callbacks in list order and puts the integrations first, so a callback added by the
        user sees the logs only after they have been reported. The list is found as the one that holds this
        callback and belongs to a ``CallbackHandler``.
        """
        for holder in gc.get_referrers(self):
            if not isinstance(holder, list):
                continue
            if any(isinstance(owner, CallbackHandler) and owner.callbacks is holder for owner in gc.get_referrers(holder)):
                holder.remove(self)
                holder.insert(0, self)
                return

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        stats = self.loss.pop_training_stats()
        if logs is None or not stats:
            return
        merged = GistStats.mean(stats)
        if self.loss.gather_across_devices and dist.is_available() and dist.is_initialized():
            merged = merged.sum_over_ranks(self.loss.model.device)
        self.total = merged if self.total is None else GistStats.mean([self.total, merged])
        entries = stats_logs(merged)
        logs.update(entries)
        # The trainer recorded a copy of these logs in its history before calling the callbacks.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(entries)

