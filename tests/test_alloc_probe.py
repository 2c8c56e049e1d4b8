"""Memory of the loss stage: no single allocation exceeds the score budget or O((B + N) * max(D, Dg)) elements.

A ``TorchDispatchMode`` sees the outputs of every torch op the loss stage runs (``torch.empty`` and the
like included). An output whose storage is not an input's is a new allocation; each must hold at most
``block_bytes`` bytes or at most ``(B + N) * max(D, Dg)`` elements, where the dense score matrix of
the case below has B * C = 5.6 times more elements than the latter and 10 times more bytes than the
budget, so a backend that materialised all the scores of a block, or of one anchor chunk against every
column, would fail. Both backends run;
the Triton one under the interpreter without CUDA (whose copies of kernel arguments are torch ops too).
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, make_inputs, one_thread  # noqa: F401  (one_thread: autouse)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cgist import GistOptions, streaming
from cgist.kernels import gist_loss_and_grads

BATCH, N_CAND, DIM, DIM_G, K = 48, 96, 20, 12, 1
BUDGET = 6144


class AllocationProbe(TorchDispatchMode):
    """Records every new storage an op returns: (bytes, elements, op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.allocations.append((t.untyped_storage().nbytes(), t.numel(), str(func)))
        return out


def _run(backend, student, guide, options):
    if backend == "torch":
        return streaming.gist_loss_and_grads(student, guide, options, need_grads=True, need_stats=True)
    return gist_loss_and_grads(student, guide, options, need_grads=True, need_stats=True)


@pytest.mark.parametrize("matryoshka", [None, (20, 12, 5)], ids=["one-dim", "dims20.12.5"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_allocation_exceeds_the_budget_or_the_embeddings(backend, matryoshka):
    student, guide = make_inputs(BATCH, N_CAND, DIM, DIM_G, K, torch.float32, seed=0)
    student, guide = [s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide]
    options = GistOptions(temperature=0.05, margin=0.05, offset=40, block_bytes=BUDGET, matryoshka_dims=matryoshka)
    n_score_cols = N_CAND + BATCH + N_CAND + K * N_CAND
    embedding_bound = (BATCH + N_CAND) * max(DIM, DIM_G)
    assert BATCH * n_score_cols > 5 * embedding_bound and BATCH * n_score_cols * 4 > 10 * BUDGET

    _run(backend, student, guide, options)  # compile, tune and cache outside the probe
    with AllocationProbe() as probe:
        loss, grads, counters = _run(backend, student, guide, options)
    assert probe.allocations, "the probe saw nothing"
    offenders = [a for a in probe.allocations if a[0] > BUDGET and a[1] > embedding_bound]
    assert not offenders, f"allocations over the budget and the embeddings' size: {offenders[:5]}"
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads) and counters is not None
