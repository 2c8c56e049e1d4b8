"""One dense backend's contract ``forward`` run directly on raw columns, through the score's door, with no autograd:
the loss, the gradients and the counters as tensors, for tests and benchmarks that compare or time a backend by name.
The differentiable call is ``cgist.stage.node.run``'s (``cgist.gist_loss``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..spec.dense import dense_call
from ..spec.options import GistOptions
from ..spec.scores import DENSE
from .route import backend_module

__all__ = ["loss_and_grads"]


def loss_and_grads(
    backend: str, columns: object, guide: object, options: GistOptions, *, need_grads: bool, need_stats: bool = False,
    text_ids: Sequence[Tensor] | None = None, **backend_options: object,
) -> tuple[Tensor, list[Tensor] | None, tuple[Tensor, Tensor] | None]:
    """The loss, d(loss)/d(columns) if ``need_grads`` and the guide's counters if ``need_stats``, from the dense
    score's ``backend`` (``"torch"``, ``"triton"``; no fallback, no first-use check): its contract's ``forward``,
    without autograd, on the call that the door (``cgist.stage.spec.dense.dense_call``) builds and checks.

    ``columns = [anchor, positive, *negatives]`` (each a tensor or a list of row chunks), ``guide`` likewise, ``"self"``
    or None, and ``text_ids``, as ``cgist.gist_loss`` takes them; ``backend_options``: the backend's own keywords of
    its ``forward`` (the PyTorch backend's ``products``). The loss is float64 for float64 inputs, else float32; the
    gradients are one per column, its chunks' joined by rows, in its dtype; the counters are ``(counts, sums)``
    (``cgist.stage.stats.COUNT_FIELDS``, ``SUM_FIELDS``).
    """
    call = dense_call(columns, guide, options, text_ids=text_ids)
    with torch.no_grad():
        loss, grads, counters = backend_module(DENSE, backend).forward(call, need_grads, need_stats, **backend_options)
    if grads is None:
        return loss, None, counters
    chunks = iter(grads.inputs)  # one per chunk of each column, column after column (``StageCall.split``)
    columns = [[next(chunks) for _ in column] for column in call.columns]
    return loss, [pieces[0] if len(pieces) == 1 else torch.cat(pieces) for pieces in columns], counters
