"""Memory of the loss stage: no single allocation exceeds the score budget or O((B + N) * max(D, Dg)) elements,
and through ``FusedCachedGISTLoss`` the memory held at once stays within one copy of the embeddings, their
gradients, the budget and O(rows).

A ``TorchDispatchMode`` sees the outputs of every torch op the loss stage runs (``torch.empty`` and the
like included). An output whose storage is not an input's is a new allocation; each must hold at most
``block_bytes`` bytes or at most ``(B + N) * max(D, Dg)`` elements, where the dense score matrix of
the case below has B * C = 5.6 times more elements than the latter and 10 times more bytes than the
budget, so a backend that materialised all the scores of a block, or of one anchor chunk against every
column, would fail. Both backends run;
the Triton one under the interpreter without CUDA (whose copies of kernel arguments are torch ops too).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import DEVICE, AllocationProbe, make_inputs, one_thread  # noqa: F401  (one_thread: autouse)
from helpers_models import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cgist
from cgist import GistOptions
from cgist.stage import budget
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.pytorch import workspace

BATCH, N_CAND, DIM, DIM_G, K = 48, 96, 20, 12, 1
BUDGET = 6144
#: The budget of the held-memory test: row blocks of 8 rows still, and less than one copy of any column's embeddings.
HELD_BUDGET = 16384


def _run(backend, student, guide, options):
    if backend == "torch":
        return loss_and_grads("torch", student, guide, options, need_grads=True, need_stats=True)
    return loss_and_grads("triton", student, guide, options, need_grads=True, need_stats=True)


@pytest.mark.parametrize("matryoshka", [None, (20, 12, 5)], ids=["one-dim", "dims20.12.5"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_allocation_exceeds_the_budget_or_the_embeddings(backend, matryoshka):
    workspace.release_workspace()  # so that this call allocates its workspace where the probe sees it
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


class LiveBytesProbe(TorchDispatchMode):
    """The peak, over the ops run, of the bytes held by storages that ops allocated (inputs' storages excluded).

    A storage counts as held while any tensor that an op returned on it is alive (tensors kept by autograd
    included: their Python objects live as long as they do).
    """

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.held = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.held -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.refs:
                if key in seen or not storage.nbytes():
                    continue
                self.refs[key], self.sizes[key] = 0, storage.nbytes()
                self.held += storage.nbytes()
                self.peak = max(self.peak, self.held)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


@pytest.fixture(scope="module")
def models(tmp_path_factory, guide32):
    """(student, guide): a float32 student 64 wide, and all-MiniLM-L6-v2 in float32."""
    return tiny_model(tmp_path_factory.mktemp("student"), dtype=torch.float32, hidden_size=64), guide32


@pytest.mark.parametrize("dim", [64, 256])
def test_loss_stage_holds_one_copy_of_the_embeddings(models, monkeypatch, dim):
    """``calculate_loss`` over mini-batches, with backward: at most the normalised copy of the embeddings
    (student and guide), their gradients, the budget (which holds the row blocks' operands) and 48 bytes
    per row.

    Concatenating the mini-batches into a copy first, or a rows x dim temporary in the normalisation
    backward, exceeds it. Rows per block are lowered to 8, so that B is many row blocks.
    """
    monkeypatch.setattr(budget, "ROW_FLOOR", 8)
    workspace.release_workspace()  # a larger one kept from another test would count as held
    mini, dim_g = 16, 48
    loss = cgist.FusedCachedGISTLoss(*models, mini_batch_size=mini, margin=0.05, block_bytes=HELD_BUDGET, backend="torch")
    generator = torch.Generator().manual_seed(0)

    def column(rows: int, width: int, grad: bool) -> list[torch.Tensor]:
        return [torch.randn(mini, width, generator=generator).requires_grad_(grad) for _ in range(rows // mini)]

    sizes = (BATCH, N_CAND, N_CAND)
    reps = [column(n, dim, True) for n in sizes]
    reps_guided = [column(n, dim_g, False) for n in sizes]
    loss.calculate_loss(reps, reps_guided, with_backward=True)
    for part in (p for r in reps for p in r):
        part.grad = None
    with LiveBytesProbe() as probe:
        loss.calculate_loss(reps, reps_guided, with_backward=True)
    assert all(p.grad is not None for r in reps for p in r)
    rows = sum(sizes)
    embeddings, gradients = 4 * rows * (dim + dim_g), 4 * rows * dim
    bound = embeddings + gradients + HELD_BUDGET + 48 * rows  # the row blocks' operands are in the budget
    assert 4 * rows * min(dim, dim_g) > HELD_BUDGET + 48 * rows, "a copy of the embeddings must exceed the bound"
    assert probe.peak <= bound, f"held {probe.peak} bytes at once, more than {bound} ({probe.peak - bound} over)"
