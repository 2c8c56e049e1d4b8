"""The loss stage's one autograd node, for every score and backend: ``run`` takes a validated call
(``cgist.stage.spec.call.StageCall``), has the router pick its backend (``cgist.stage.dispatch.route``) and applies
``StageFunction`` (docs/design.md#the-drop-in-protocol: the Function's contract).

A backend's forward computes the loss and, when an input needs a gradient, either the gradients themselves
(``Grads``: GradCache needs them at once, and a loss stage's backward follows its forward at once), which the node
scales by the loss's incoming gradient (``Grads.scaled``, without a copy at 1), or a saved state of its own, which its
backward turns into them. A call's learned parameters (``StageCall.parameters``: a learned temperature, a score's own)
are inputs too, after the columns' chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .dispatch.route import Stage, select_stage
from .spec.call import StageCall, gradients
from .stats import COUNT_FIELDS, SUM_FIELDS, GistStats

__all__ = ["StageFunction", "run"]


class StageFunction(torch.autograd.Function):
    """Autograd node over the call's inputs (``StageCall.tensors``, then its learned parameters): the forward
    returns the loss and the mask counters ``(counts, sums)``; the backward hands over the backend's gradients,
    scaled by the incoming gradient (without a copy where it is 1, so autograd keeps them as the inputs' ``.grad``),
    and a second backward through a retained graph recomputes them."""

    @staticmethod
    def forward(ctx, call: StageCall, stage: Stage, need_stats: bool, with_grad: bool,
                *inputs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ctx.call, ctx.stage = call, stage
        loss, ctx.state, counters = stage.forward(call, with_grad, need_stats)
        if not with_grad:
            ctx.state = None  # a backward (of inputs that need no gradient here) makes its own
        ctx.inputs = [(t.dtype, t.shape) for t in inputs]
        counts, sums = counters if counters is not None else (loss.new_zeros(0, dtype=torch.int64), loss.new_zeros(0))
        ctx.mark_non_differentiable(counts, sums)
        return loss, counts, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor, _counts: Tensor, _sums: Tensor) -> tuple[Tensor | None, ...]:
        call, state = ctx.call, ctx.state
        ctx.state = None  # the gradients are handed over; a second backward recomputes them
        if state is None:
            state = ctx.stage.forward(call, True, False)[1]
        grads = gradients(ctx.stage, call, state, grad_output)
        if grads.parameters.keys() != call.parameters.keys():
            raise RuntimeError(f"the {call.options.score.name} score's backend returned gradients of the parameters "
                               f"{sorted(grads.parameters)}, not of the call's {sorted(call.parameters)}")
        out = [*grads.inputs, *(grads.parameters[name] for name in call.parameters)]
        out = [g.to(dtype).reshape(shape) for g, (dtype, shape) in zip(out, ctx.inputs)]
        return (None, None, None, None, *out)


def run(call: StageCall, backend: str = "auto", return_stats: bool = False) -> Tensor | tuple[Tensor, GistStats]:
    """The loss of ``call`` on ``backend`` (``"auto"``, ``"torch"``, ``"triton"``), differentiable with respect to its
    inputs (and its learned parameters); with ``return_stats`` also a ``GistStats`` of what the guide masked (one
    host sync, which also reads whether the loss is finite: a ValueError for a loss that overflowed, as the inputs are
    finite and the logits were not)."""
    stage = select_stage(call, backend)
    inputs = [*call.tensors, *call.parameters.values()]
    with_grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    loss, counts, sums = StageFunction.apply(call, stage, return_stats, with_grad, *inputs)
    if not return_stats:
        return loss
    if counts.numel() == 0:  # nothing masks: the backend kept no counters
        counts = torch.zeros(len(COUNT_FIELDS), dtype=torch.int64, device=loss.device)
        sums = loss.new_zeros(len(SUM_FIELDS))
    finite = loss.detach().isfinite().reshape(1).to(torch.int64)  # read with the counters: the same host sync
    stats, (finite,) = GistStats.from_counters(counts, sums, sizes=call.sizes, options=call.options,
                                               guided=call.guided, flags=finite)
    if not finite:  # the door let only finite inputs in: the logits overflowed
        raise ValueError(f"the loss is {float(loss.detach())}: scale (1 / temperature) = "
                         f"{1 / call.options.temperature:g} times the scores overflows {call.dtype}; lower the scale "
                         "(or the embeddings' magnitude)")
    return loss, stats
