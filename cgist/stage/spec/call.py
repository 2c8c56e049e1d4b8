"""The typed contract between the loss stage's layers (docs/design.md#dispatch): ``StageCall``, one call of the loss
stage, validated, whatever its score, and ``Grads``, what a backend hands back for it.

What every score's call holds and the stage reads: the options (``GistOptions``: the score, the guide's rule, the
contrast blocks and directions, the offset, the budget), the student's columns (the inputs whose gradients the call
returns, each a list of row chunks), the guide's dtype, and the call's learned parameters (a learned temperature, a
score's own). A score's spec module builds its subclass (``cgist.stage.spec.dense.DenseCall``,
``cgist.stage.spec.maxsim.MaxSimCall``) from the user's arguments, checked once, and its backends read the rest of it
(the guide's columns, the masks, the text ids). It imports only torch and the spec's options.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .options import GistOptions

__all__ = ["TEMPERATURE", "Grads", "StageCall", "gradients", "learned"]

#: The name of a learned temperature among a call's parameters (``StageCall.parameters``).
TEMPERATURE = "temperature"


def learned(temperature: Tensor | None = None, **parameters: Tensor) -> dict[str, Tensor]:
    """A call's learned parameters from a door's arguments: a learned ``temperature`` (None: a fixed one, whose value
    is ``options.temperature``) and a score's own, by name."""
    return {**({TEMPERATURE: temperature} if temperature is not None else {}), **parameters}


@dataclass(frozen=True)
class Grads:
    """A backend's gradients of one call's loss: ``inputs``, one per chunk of the call's columns (``StageCall.tensors``,
    each in its chunk's dtype, the guide's tensors get none), and ``parameters``, one per learned parameter of the
    call (``StageCall.parameters``, by name)."""

    inputs: list[Tensor]
    parameters: Mapping[str, Tensor] = field(default_factory=dict)

    def scaled(self, grad_output: Tensor) -> Grads:
        """The gradients of ``grad_output`` times the loss: the one scaling of every backend whose forward made the
        gradients. Where ``grad_output`` is 1 (a loss stage's own backward) they are handed over as they are, without
        a copy: autograd then keeps each as its input's ``.grad``."""
        scale = float(grad_output)
        if scale == 1.0:
            return self
        return Grads([g * scale for g in self.inputs], {name: g * scale for name, g in self.parameters.items()})

    @property
    def every(self) -> list[Tensor]:
        """Every gradient: the inputs', then the parameters'."""
        return [*self.inputs, *self.parameters.values()]


@dataclass(frozen=True)
class StageCall:
    """One loss-stage call. ``columns``: the student's columns, each its row chunks, in the order of the gradients
    the call returns (``tensors``); ``guide_dtype``: the guide's dtype (None without guide columns); ``parameters``:
    the call's learned parameters by name, each a tensor that requires a gradient (``learned``: a learned temperature,
    ``TEMPERATURE``, whose value is ``options.temperature``, and a score's own).
    """

    options: GistOptions
    columns: Sequence[Sequence[Tensor]]
    guide_dtype: torch.dtype | None
    parameters: Mapping[str, Tensor]

    @property
    def tensors(self) -> list[Tensor]:
        """Every chunk of every column, column after column: the inputs the call differentiates."""
        return [t for column in self.columns for t in column]

    @property
    def temperature(self) -> Tensor | None:
        """The learned temperature (0-dim), or None."""
        return self.parameters.get(TEMPERATURE)

    def grads(self, inputs: Iterable[Tensor], share: Tensor | None = None, **parameters: Tensor) -> Grads:
        """A backend's ``Grads``: the inputs' gradients, a score's own parameters' by name, and with a learned
        temperature its gradient from ``share``, ``sum_ij dL/dz_ij z_ij`` over the logits ``z = s / temperature``:
        ``-share / temperature`` (a learned ``scale = 1 / temperature`` gets its own through autograd)."""
        if self.temperature is not None:
            parameters[TEMPERATURE] = -share / self.options.temperature
        return Grads(list(inputs), parameters)

    def split(self, column_grads: Iterable[Tensor]) -> list[Tensor]:
        """Gradients of whole columns (one per column, rows after rows) as one per chunk of the call's columns
        (views)."""
        return [piece for grad, column in zip(column_grads, self.columns)
                for piece in grad.split([t.shape[0] for t in column])]

    @property
    def first(self) -> Tensor:
        return self.columns[0][0]

    @property
    def device(self) -> torch.device:
        return self.first.device

    @property
    def dtype(self) -> torch.dtype:
        return self.first.dtype

    @property
    def guided(self) -> bool:
        """Whether a guide scores the candidates (the statistics then have means of theta and the threshold)."""
        raise NotImplementedError

    @property
    def sizes(self) -> list[int]:
        """The rows of each column."""
        return [sum(t.shape[0] for t in column) for column in self.columns]


def gradients(stage: object, call: StageCall, state: object, grad_output: Tensor) -> Grads:
    """The gradients of ``grad_output`` times the loss from the state of a backend's forward (the backend contract,
    ``cgist.stage.dispatch.route.Stage``): its ``Grads`` scaled (``Grads.scaled``), or its own saved state through
    ``stage``'s backward."""
    return state.scaled(grad_output) if isinstance(state, Grads) else stage.backward(call, state, grad_output)
