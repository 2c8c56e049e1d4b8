"""``FusedMatryoshka``: the takeover of ``MatryoshkaLoss``'s decoration of a drop-in's ``calculate_loss``, every
dimension of a step in one loss stage (docs/design.md#the-drop-in-protocol, docs/design.md#matryoshka)."""

from __future__ import annotations

import random

import torch
from torch import Tensor

__all__ = ["FusedMatryoshka"]


class FusedMatryoshka:
    """``calculate_loss`` of a fused drop-in (``cgist.losses.base.FusedDropIn``, which installs it; this module imports
    no drop-in) under ``MatryoshkaLoss``: every dimension in one pass.

    It stands in for sentence-transformers' ``CachedLossDecorator`` and reads its attributes (``fn``,
    ``matryoshka_dims``, ``matryoshka_weights``, ``n_dims_per_step``) at each call. Each call picks the dimensions
    with the same random call as that decorator (``random.sample`` over the dimension indices when
    ``n_dims_per_step`` is below their number), then computes ``sum_d w_d * L_d`` and its gradients in one loss-stage
    call. When the loss's attributes ask for what the fused stage does not compute, the decorator itself runs, a
    loss per dimension, as in sentence-transformers.
    """

    def __init__(self, loss: torch.nn.Module, decorator: object) -> None:
        self.loss = loss
        self.decorator = decorator

    def __getattr__(self, name: str) -> object:
        if name in ("fn", "matryoshka_dims", "matryoshka_weights", "n_dims_per_step"):
            return getattr(self.decorator, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @staticmethod
    def take_over(loss: torch.nn.Module, value: object) -> object:
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
                and getattr(fn, "__func__", None) is getattr(type(loss), "calculate_loss", None)
                and all(hasattr(value, a) for a in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"))):
            return value
        return FusedMatryoshka(loss, value)

    def __call__(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]] | Tensor | None = None, *,
                 with_backward: bool = False) -> Tensor:
        """``calculate_loss`` over the sampled dimensions; ``reps_guided`` is the GIST loss's guide embeddings, or the
        labels of the ranking losses (unused)."""
        if self.loss.resolve() is None and (with_backward or not torch.is_grad_enabled()):
            return self.decorator(reps, reps_guided, with_backward=with_backward)
        dims, weights = self.decorator.matryoshka_dims, self.decorator.matryoshka_weights
        indices: range | list[int] = range(len(dims))
        if 0 < self.decorator.n_dims_per_step < len(indices):
            indices = random.sample(indices, self.decorator.n_dims_per_step)
        chosen = tuple((dims[i], float(weights[i])) for i in indices)
        if self.loss.resolve() is None:
            return self._per_dimension(reps, reps_guided, chosen)
        return self.loss.loss_stage(reps, reps_guided, with_backward=with_backward, dims=chosen)

    def _per_dimension(self, reps: list[list[Tensor]], reps_guided: object,
                       chosen: tuple[tuple[int, float], ...]) -> Tensor:
        """A plain drop-in's unfused loss under ``MatryoshkaLoss``, differentiable: sentence-transformers' loop over
        the dimensions (ascending, as it sorts the sampled ones), each on the embeddings truncated and normalised by
        its ``shrink``. (Its cached-loss decorator expects each dimension's gradients in the leaves instead.)"""
        from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

        loss = 0.0
        for dim, weight in sorted(chosen, key=lambda pair: self.decorator.matryoshka_dims.index(pair[0])):
            truncated = [[shrink(r, dim) for r in column] for column in reps]
            loss = loss + weight * self.fn(truncated, reps_guided)
        return loss
