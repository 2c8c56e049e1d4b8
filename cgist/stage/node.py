"""The loss stage's one autograd node, for every score and backend: ``run`` takes a validated call
(``cgist.stage.spec.call.StageCall``), has the router pick its backend (``cgist.stage.dispatch.route``) and applies
``StageFunction`` (docs/design.md#the-drop-in-protocol: the Function's contract).

A backend's forward computes the loss and, when an input needs a gradient, either the gradients themselves
(GradCache needs them at once, and a loss stage's backward follows its forward at once) or what its backward needs to
make them; its backward scales them by the loss's incoming gradient. A learned temperature (``StageCall.temperature``)
is one more input: a backend returns ``R = sum_ij dL/dz_ij z_ij`` over the logits ``z = s / temperature``, and the
temperature's gradient is ``-R / temperature`` (a learned ``scale = 1 / temperature`` gets its own through autograd).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .dispatch.route import Stage, select_stage
from .spec.call import StageCall
from .stats import COUNT_FIELDS, SUM_FIELDS, GistStats

__all__ = ["StageFunction", "run"]


class StageFunction(torch.autograd.Function):
    """Autograd node over the call's inputs (``StageCall.tensors``, then its learned temperature): the forward
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
        ctx.dtypes = [t.dtype for t in inputs]
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
        grads, radial = ctx.stage.backward(call, state, grad_output)
        out = [g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        if call.temperature is not None:
            out.append((-radial / call.options.temperature).to(call.temperature.dtype).reshape(
                call.temperature.shape))
        return (None, None, None, None, *out)


def run(call: StageCall, backend: str = "auto", return_stats: bool = False) -> Tensor | tuple[Tensor, GistStats]:
    """The loss of ``call`` on ``backend`` (``"auto"``, ``"torch"``, ``"triton"``), differentiable with respect to its
    inputs (and its learned temperature); with ``return_stats`` also a ``GistStats`` of what the guide masked (one
    host sync, which also reads whether the loss is finite: a ValueError for a loss that overflowed, as the inputs are
    finite and the logits were not)."""
    stage = select_stage(call, backend)
    inputs = [*call.tensors, *([call.temperature] if call.temperature is not None else [])]
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
