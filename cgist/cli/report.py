"""What ``cgist train`` reports: step and loss-stage timing, peak memory and the summary table."""

from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..losses.guided import GuidedFamily

__all__ = ["METRICS", "StageTimer", "cpu_seconds", "format_guide", "format_guide_mode", "format_loss", "format_summary",
           "peak_memory"]

# Metric key suffixes of InformationRetrievalEvaluator and their names in the summary table.
METRICS = {"mrr@10": "MRR@10", "recall@1": "Recall@1", "ndcg@10": "NDCG@10"}


class StageTimer:
    """Times training steps (trainer callbacks) and the ``calculate_loss`` calls made inside them.

    Pass ``timer.callback`` to the trainer; ``steps``, ``step_s`` and ``loss_s`` accumulate over the run.
    """

    def __init__(self, loss: GuidedFamily, device: torch.device) -> None:
        import torch
        from transformers import TrainerCallback

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.step_s = self.loss_s = 0.0
        self.steps = 0
        self.in_step = False
        calculate_loss = loss.calculate_loss

        def timed_calculate_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
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

    def timing(self) -> dict[str, float]:
        """``steps``, ``step_s``, ``loss_s`` and ``loss_share`` (the loss stage's share of step time)."""
        return {
            "steps": self.steps,
            "step_s": self.step_s,
            "loss_s": self.loss_s,
            "loss_share": self.loss_s / self.step_s if self.step_s else 0.0,
        }


def cpu_seconds() -> float:
    """User plus system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak resident set size of this process and, on CUDA, the peak allocated device memory, in MiB."""
    import torch

    peak = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    if device.type == "cuda":
        peak["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return peak


def format_guide(guide: dict[str, float]) -> str:
    """The run's mean guide statistics as one line: masked share per block, positive-only share, mean theta."""
    blocks = ", ".join(f"{key.removeprefix('guide/masked_').upper()} {100 * value:.1f}%"
                       for key, value in guide.items() if key.startswith("guide/masked_"))
    theta = f"; mean theta {guide['guide/theta_mean']:.3f}" if "guide/theta_mean" in guide else ""
    return (f"guide (mean over the run's steps): masked {blocks}; only the positive left for "
            f"{100 * guide['guide/positive_only']:.1f}% of anchors{theta}")


def format_loss(summary: dict) -> str:
    """Which drop-in trained, as one line: with GradCache (mini-batches) or without."""
    if summary["mini_batch_size"] is None:
        return (f"loss: {summary['loss']} (no GradCache: the student embedded each batch of {summary['batch_size']} "
                "at once)")
    return f"loss: {summary['loss']} (GradCache: mini-batches of {summary['mini_batch_size']})"


def format_guide_mode(summary: dict) -> str:
    """Where the run's guide masks came from, as one line."""
    mode = summary["guide_mode"]
    if mode == "precomputed":
        source = summary["guide_embeddings"]
        how = "loaded from the cache" if source["cached"] else "computed and cached"
        return (f"guide mode: precomputed (the guide's embeddings of the training split, {how} in "
                f"{source['seconds']:.1f} s: {source['entry']})")
    return "guide mode: " + {
        "model": "model (the guide model ran on every batch)",
        "self": "self (the student's own first-pass embeddings; no guide model)",
        "none": "none (no guide masking; no guide model)",
    }[mode]


def format_summary(summary: dict) -> str:
    """The before/after metric table and the timing, memory and output lines of a finished run."""
    rows = [("metric (held-out)", "before", "after")]
    rows += [(name, f"{summary['before'][name]:.4f}", f"{summary['after'][name]:.4f}") for name in METRICS.values()]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}} -> {r[2]:>{width[2]}}" for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    timing = summary["timing"]
    resumed = summary["resumed_after"]
    steps = f"{summary['steps']} steps of batch {summary['batch_size']}"
    if resumed is not None:
        steps += f" (resumed after step {resumed}: {timing['steps']} steps in this run)"
    lines += [
        "",
        f"pairs: {summary['train_pairs']} train, {summary['eval_pairs']} held out; {steps}",
        format_loss(summary),
        format_guide_mode(summary),
        f"wall time: {timing['wall_s']:.1f} s total, {timing['train_s']:.1f} s training; "
        f"CPU time {timing['cpu_s']:.0f} s",
        f"throughput: {timing['samples_per_s']:.1f} samples/s",
        f"loss stage: {100 * timing['loss_share']:.1f}% of step time "
        f"({timing['loss_s']:.2f} s of {timing['step_s']:.1f} s in {summary['loss']}.calculate_loss)",
        "peak memory: " + ", ".join(f"{k.removeprefix('peak_').removesuffix('_mib')} {v:.0f} MiB"
                                    for k, v in summary["memory"].items()),
        *([format_guide(summary["guide"])] if summary.get("guide") else []),
        f"saved to: {summary['output_dir']}",
        f"checkpoints: {', '.join(summary['checkpoints'])} in {summary['output_dir']}/checkpoints "
        f"({timing['checkpoint_s']:.1f} s spent writing checkpoints)",
    ]
    return "\n".join(lines)
