"""``FusedCachedGISTLoss``: sentence-transformers' ``CachedGISTEmbedLoss`` with a fused loss stage."""

from __future__ import annotations

import logging
import numbers
import random
from typing import Literal

import torch
import torch.distributed as dist
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
from sentence_transformers.util import all_gather_with_grad, get_rank
from torch import Tensor

from .function import BACKENDS, gist_loss_with_options
from .options import GistOptions
from .stats import GistStats

__all__ = ["FusedCachedGISTLoss", "FusedMatryoshka"]

logger = logging.getLogger(__name__)


def check_equal_batches(batch_size: int, device: torch.device) -> None:
    """With gathering, every rank must hold the same number of anchors, or the offsets would be wrong.

    The sizes travel on ``device``, the embeddings' own, which the process group can reach.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    sizes = [torch.zeros((), dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(batch_size, device=device))
    sizes = [int(s) for s in sizes]
    if len(set(sizes)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
        raise ValueError(
            f"gather_across_devices=True needs the same local batch size on every rank, got {listing} rows; "
            "use a sampler that gives every rank full batches (e.g. drop_last / dataloader_drop_last=True)"
        )


class FusedCachedGISTLoss(CachedGISTEmbedLoss):
    """sentence-transformers' ``CachedGISTEmbedLoss`` with a fused, streaming loss stage."""

    def __init__(
        self,
        model: SentenceTransformer,
        guide: SentenceTransformer,
        temperature: float = 0.01,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        margin_strategy: Literal["absolute", "relative"] = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        backend: Literal["auto", "torch", "triton"] = "auto",
        block_bytes: int | None = None,
    ) -> None:
        """
        A drop-in for :class:`CachedGISTEmbedLoss`: the same arguments, the same loss and the same gradients, with
        a loss stage that never forms the B x N similarity matrix.

        The embedding stage is sentence-transformers' own GradCache loop (mini-batches, RandContext replay,
        retokenisation for a guide with another tokenizer, ``mini_batch_num_tokens``, gathering across devices).
        Only ``calculate_loss`` changes: the student and guide similarities are computed as matrix products over
        blocks of anchors, masked against the guide threshold and reduced by a streaming log-sum-exp, and the
        embedding gradients come out of the same pass. On CUDA tensors this runs as Triton kernels; elsewhere as
        a blockwise PyTorch computation.

        For anchor i, a candidate is dropped from the softmax when the guide scores it strictly above
        ``theta_i - margin`` (``"absolute"``) or ``theta_i - |theta_i| * margin`` (``"relative"``), where
        ``theta_i`` is the guide's score of the anchor with its own positive. The positive itself is never dropped.

        Args:
            model: the SentenceTransformer being trained.
            guide: a frozen SentenceTransformer whose similarities decide which in-batch candidates are dropped as
                likely false negatives.
            temperature: divides the cosine similarities before the softmax.
            mini_batch_size: texts embedded at once in the embedding stage; sets memory, not the loss.
            mini_batch_num_tokens: if set, embedding mini-batches are packed by token count instead of
                ``mini_batch_size`` texts.
            show_progress_bar: show a progress bar over the embedding mini-batches.
            margin_strategy: ``"absolute"`` or ``"relative"``, how ``margin`` lowers the threshold.
            margin: how far below ``theta_i`` the threshold lies; 0 drops only candidates the guide ranks above the
                positive.
            contrast_anchors: include the anchor-anchor similarities.
            contrast_positives: include the positive-positive similarities.
            gather_across_devices: score each rank's anchors against the candidates of all ranks (torch.distributed);
                every rank must then hold the same number of anchors.
            backend: ``"auto"`` (Triton for CUDA tensors, PyTorch elsewhere), ``"torch"`` or ``"triton"``.
            block_bytes: bytes of score buffers the loss stage may hold at once; None picks a default for the
                device (at most an eighth of its free memory and 1 GiB).

        With ``MatryoshkaLoss(model, FusedCachedGISTLoss(...), matryoshka_dims=...)`` every dimension of a step is
        computed in one pass (the guide's scores and mask once, the student's from prefixes of one product), with
        the same loss, gradients and ``n_dims_per_step`` sampling as sentence-transformers' loop over dimensions.

        After each training call, ``last_stats`` holds a ``cgist.GistStats`` of what the guide masked; add
        ``cgist.GuideStatsCallback(loss)`` to the trainer's callbacks to log it as ``guide/...``.

        References:
            - GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning,
              https://arxiv.org/abs/2402.16829
            - Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup (GradCache),
              https://arxiv.org/abs/2101.06983

        Inputs:
            +-------------------------------------------------+--------+
            | Texts                                           | Labels |
            +=================================================+========+
            | (anchor, positive) pairs                        | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative) triplets           | none   |
            +-------------------------------------------------+--------+
            | (anchor, positive, negative_1, ..., negative_n) | none   |
            +-------------------------------------------------+--------+

        Raises:
            TypeError, ValueError: for a bad argument, naming it, before anything is computed.

        Example:
            ::

                from datasets import Dataset
                from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
                import cgist

                model = SentenceTransformer("microsoft/mpnet-base")
                guide = SentenceTransformer("all-MiniLM-L6-v2")
                train_dataset = Dataset.from_dict({
                    "anchor": ["how do I reverse a list in python", "boiling point of water"],
                    "positive": ["Use reversed(xs) or xs[::-1].", "Water boils at 100 degrees Celsius at sea level."],
                })
                loss = cgist.FusedCachedGISTLoss(model, guide, mini_batch_size=64, margin=0.05)
                trainer = SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss)
                trainer.train()
        """
        self.options = GistOptions(
            temperature=temperature,
            margin=margin,
            margin_strategy=margin_strategy,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            block_bytes=block_bytes,
        )
        for name, value, expected in (
            ("mini_batch_size", mini_batch_size, "an int"),
            ("mini_batch_num_tokens", mini_batch_num_tokens, "an int or None"),
        ):
            if value is None and name == "mini_batch_num_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not isinstance(gather_across_devices, bool):
            raise TypeError(f"gather_across_devices must be a bool, got {type(gather_across_devices).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, value in (("model", model), ("guide", guide)):
            if not isinstance(value, SentenceTransformer):
                raise TypeError(f"{name} must be a SentenceTransformer, got {type(value).__name__}")
        super().__init__(
            model,
            guide,
            temperature=temperature,
            mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens,
            show_progress_bar=show_progress_bar,
            margin_strategy=margin_strategy,
            margin=margin,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
        )
        self.backend = backend
        self.last_stats: GistStats | None = None
        self._training_stats: list[GistStats] = []
        self._warned_positive_only = False

    def __setattr__(self, name: str, value: object) -> None:
        # MatryoshkaLoss decorates a gradient-cache loss by replacing its ``calculate_loss`` with a loop over
        # dimensions; take that decoration over and compute the dimensions in one pass instead.
        if name == "calculate_loss":
            value = FusedMatryoshka.take_over(self, value)
        super().__setattr__(name, value)

    def calculate_loss(
        self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        """Loss over the cached mini-batch embeddings.

        With ``with_backward`` the embedding gradients are accumulated into ``.grad`` of the leaves in
        ``reps`` and a detached scalar is returned; under ``torch.no_grad`` only the loss is computed.
        """
        return self._loss_stage(reps, reps_guided, with_backward=with_backward)

    def _loss_stage(
        self,
        reps: list[list[Tensor]],
        reps_guided: list[list[Tensor]],
        *,
        with_backward: bool,
        dims: tuple[tuple[int, float], ...] | None = None,
    ) -> Tensor:
        """``calculate_loss``, over ``dims`` (Matryoshka ``(d, w_d)`` pairs) if given."""
        if len(reps) != len(reps_guided):
            raise ValueError(f"reps and reps_guided must have the same length, got {len(reps)} and {len(reps_guided)}")
        # Each column stays a list of its mini-batches: the loss stage takes them as row chunks, so the
        # embeddings are not concatenated into a copy.
        anchors, *candidates = (list(r) for r in reps)
        anchors_guide, *candidates_guide = (list(r) for r in reps_guided)
        options = self.options
        if self.gather_across_devices:
            batch = sum(r.shape[0] for r in anchors)
            check_equal_batches(batch, anchors[0].device)
            candidates = [all_gather_with_grad(torch.cat(c)) for c in candidates]
            candidates_guide = [all_gather_with_grad(torch.cat(c)) for c in candidates_guide]
            options = options.replace(offset=get_rank() * batch)
        if dims is not None:
            options = options.replace(matryoshka_dims=tuple(d for d, _ in dims),
                                      matryoshka_weights=tuple(w for _, w in dims))
        training = with_backward and torch.is_grad_enabled()
        loss, stats = gist_loss_with_options(
            [anchors, *candidates], [anchors_guide, *candidates_guide], options, backend=self.backend,
            return_stats=True,
        )
        self.last_stats = stats
        if training:
            self._training_stats.append(stats)
            self._check_positive_only(stats)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def _check_positive_only(self, stats: GistStats) -> None:
        """Warn once when more than half of a step's anchors are left with only their positive."""
        if self._warned_positive_only or stats.positive_only_fraction <= 0.5:
            return
        self._warned_positive_only = True
        logger.warning(
            "%.0f%% of this step's anchors have every candidate but their positive masked by the guide "
            "(margin=%s, margin_strategy=%r): their loss carries no contrast. The margin masks too much for this "
            "guide; lower it (this warning is shown once).",
            100 * stats.positive_only_fraction, self.options.margin, self.options.margin_strategy,
        )

    def pop_training_stats(self) -> list[GistStats]:
        """The statistics of the training calls since the last call of this method (for logging)."""
        stats, self._training_stats = self._training_stats, []
        return stats

    def get_config_dict(self) -> dict:
        config = {**super().get_config_dict(), "backend": self.backend}
        if self.options.block_bytes is not None:
            config["block_bytes"] = self.options.block_bytes
        return config

    @property
    def citation(self) -> str:
        return """
@misc{solatorio2024gistembed,
    title={GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning},
    author={Aivin V. Solatorio},
    year={2024},
    eprint={2402.16829},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}

@misc{gao2021scaling,
    title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
    author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
    year={2021},
    eprint={2101.06983},
    archivePrefix={arXiv},
    primaryClass={cs.LG}
}
"""


class FusedMatryoshka:
    """``calculate_loss`` of a ``FusedCachedGISTLoss`` under ``MatryoshkaLoss``: every dimension in one pass.

    It stands in for sentence-transformers' ``CachedLossDecorator`` and keeps its attributes (``fn``,
    ``matryoshka_dims``, ``matryoshka_weights``, ``n_dims_per_step``). Each call picks the dimensions with the
    same random call as that decorator (``random.sample`` over the dimension indices when ``n_dims_per_step``
    is below their number), then computes ``sum_d w_d * L_d`` and its gradients in one loss-stage call.
    """

    def __init__(self, loss: FusedCachedGISTLoss, decorator: object) -> None:
        self.loss = loss
        self.fn = decorator.fn
        self.matryoshka_dims = tuple(decorator.matryoshka_dims)
        self.matryoshka_weights = tuple(decorator.matryoshka_weights)
        self.n_dims_per_step = decorator.n_dims_per_step

    @staticmethod
    def take_over(loss: FusedCachedGISTLoss, value: object) -> object:
        """``value`` replaced by a ``FusedMatryoshka`` if it is the Matryoshka decoration of ``loss``'s own method.

        Anything else (another wrapper, or a decorator whose shape has changed) is kept as it is: the loss then
        runs once per dimension, as in sentence-transformers, which is slower but the same.
        """
        try:
            from sentence_transformers.sentence_transformer.losses.matryoshka import CachedLossDecorator
        except ImportError:
            return value
        fn = getattr(value, "fn", None)
        if not (isinstance(value, CachedLossDecorator) and getattr(fn, "__self__", None) is loss
                and getattr(fn, "__func__", None) is FusedCachedGISTLoss.calculate_loss
                and all(hasattr(value, a) for a in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"))):
            return value
        return FusedMatryoshka(loss, value)

    def __call__(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *, with_backward: bool = False
                 ) -> Tensor:
        indices: range | list[int] = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(indices):
            indices = random.sample(indices, self.n_dims_per_step)
        dims = tuple((self.matryoshka_dims[i], float(self.matryoshka_weights[i])) for i in indices)
        return self.loss._loss_stage(reps, reps_guided, with_backward=with_backward, dims=dims)
