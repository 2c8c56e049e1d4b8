"""Directions under ``gather_across_devices=True``: two gloo processes over 127.0.0.1.

Each rank holds its slice of the batch. For every case it runs sentence-transformers'
``CachedMultipleNegativesRankingLoss`` and ``FusedCachedMultipleNegativesRankingLoss`` on its texts (loss and every
parameter gradient must be equal on that rank: both gather the anchors too, for the directions that read them),
and ``FusedCachedGISTLoss`` with a guide and directions on random embeddings, which the test side compares with the
dense oracle: rank r's loss is the oracle's for its anchors against every rank's candidates and anchors, and the
gradients the ranks receive, put together, are those of the sum of the ranks' losses (see test_distributed).
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import LOCAL, MINI, ROOT, WORLD, _bench, _free_port, _offline_env, _wait

from cgist import GistOptions
from cgist.stage.reference import gist_loss_reference

DIM, DIM_GUIDE = 16, 12


@dataclass(frozen=True)
class Case:
    directions: tuple[str, ...]
    partition_mode: str = "joint"
    hardness_mode: str | None = None
    hardness_strength: float = 0.0

    @property
    def id(self) -> str:
        short = {"query_to_doc": "q2d", "query_to_query": "q2q", "doc_to_query": "d2q", "doc_to_doc": "d2d"}
        hard = f"-{self.hardness_mode}{self.hardness_strength:g}" if self.hardness_mode else ""
        return "+".join(short[d] for d in self.directions) + f"-{self.partition_mode}{hard}"

    @property
    def kwargs(self) -> dict:
        return dict(directions=self.directions, partition_mode=self.partition_mode, hardness_mode=self.hardness_mode,
                    hardness_strength=self.hardness_strength)


CASES = [
    Case(("query_to_doc",)),
    Case(("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")),
    Case(("query_to_doc", "doc_to_query"), "per_direction"),
    Case(("query_to_doc", "query_to_query"), hardness_mode="in_batch_negatives", hardness_strength=5.0),
    Case(("query_to_doc", "doc_to_doc"), hardness_mode="hard_negatives", hardness_strength=9.0),
]


def _options(case: Case, rank: int) -> GistOptions:
    return GistOptions(temperature=0.05, margin=0.05, contrast_anchors=False, contrast_positives=False,
                       offset=rank * LOCAL, **case.kwargs)


def _embeddings(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full-batch (W*B rows) student and guide columns [anchor, positive, negative], the same on every process."""
    gen = torch.Generator().manual_seed(CASES.index(case))
    rows = WORLD * LOCAL
    student = [torch.randn(rows, DIM, generator=gen, dtype=torch.float64) for _ in range(3)]
    anchor_guide = torch.randn(rows, DIM_GUIDE, generator=gen, dtype=torch.float64)
    guide = [anchor_guide] + [anchor_guide + 0.8 * torch.randn(rows, DIM_GUIDE, generator=gen, dtype=torch.float64)
                              for _ in range(2)]
    return student, guide


def _texts(rank: int) -> list[list[str]]:
    """This rank's rows of the first W*B triplets with distinct texts."""
    triplets, seen = [], set()
    for triplet in _bench().TRIPLETS:
        if not seen & set(triplet):
            seen |= set(triplet)
            triplets.append(triplet)
    rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
    return [list(column[rows]) for column in zip(*triplets[: WORLD * LOCAL])]


# ----------------------------------------------------------------------------------------------
# Worker side: run as ``python tests/test_distributed_directions.py RANK PORT WORKDIR``.


def _model_step(loss_fn, student, rank: int) -> dict:
    from helpers_models import computed_on  # a drop-in that fell back would compare sentence-transformers with itself

    student.zero_grad(set_to_none=True)
    with computed_on(loss_fn):
        loss = loss_fn([student.preprocess(column) for column in _texts(rank)], None)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in student.named_parameters()
                                             if p.grad is not None}}


def _worker(rank: int, port: int, workdir: Path) -> None:
    import conftest  # the same NaN-poisoned allocations as in the test process

    torch.empty, torch.empty_like = conftest._nan_empty, conftest._nan_empty_like
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        CachedMultipleNegativesSymmetricRankingLoss,
        MatryoshkaLoss,
    )

    from helpers_models import computed_on

    import cgist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=90))
    student = SentenceTransformer(str(workdir / "student"), device="cpu").double().eval()
    results = {}
    for case in CASES:
        kw = dict(mini_batch_size=MINI, gather_across_devices=True, **case.kwargs)
        st = _model_step(CachedMultipleNegativesRankingLoss(student, **kw), student, rank)
        fused = _model_step(cgist.FusedCachedMultipleNegativesRankingLoss(student, backend="torch", **kw), student, rank)
        # the guided loss on embeddings
        embeddings, guide_embeddings = _embeddings(case)
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        reps = [[x.clone().requires_grad_() for x in e[rows].split(MINI)] for e in embeddings]
        reps_guided = [list(g[rows].split(MINI)) for g in guide_embeddings]
        gist = cgist.FusedCachedGISTLoss(student, student, temperature=0.05, margin=0.05, mini_batch_size=MINI,
                                         contrast_anchors=False, contrast_positives=False, gather_across_devices=True,
                                         backend="torch", **case.kwargs)
        with computed_on(gist):
            emb_loss = gist.calculate_loss(reps, reps_guided, with_backward=True)
        results[case.id] = {"st": st, "cgist": fused, "emb_loss": emb_loss.detach(),
                            "emb_grads": [torch.cat([x.grad for x in column]) for column in reps]}
    # The symmetric drop-in (query-to-document and document-to-query, per direction), plain and under MatryoshkaLoss.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for matryoshka in (False, True):
            pair = [cls(student, mini_batch_size=MINI, gather_across_devices=True, **backend)
                    for cls, backend in ((CachedMultipleNegativesSymmetricRankingLoss, {}),
                                         (cgist.FusedCachedMultipleNegativesSymmetricRankingLoss, {"backend": "torch"}))]
            if matryoshka:
                pair = [MatryoshkaLoss(student, loss, matryoshka_dims=[32, 16]) for loss in pair]
            results[f"symmetric-{'matryoshka' if matryoshka else 'plain'}"] = {
                "st": _model_step(pair[0], student, rank), "cgist": _model_step(pair[1], student, rank)}
    torch.save(results, workdir / f"rank{rank}.pt")
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Test side.


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    import subprocess

    workdir = tmp_path_factory.mktemp("distributed-directions")
    _bench().build_student(workdir / "student")
    port = _free_port()
    logs = [workdir / f"rank{rank}.log" for rank in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(workdir)], stdout=log.open("w"),
                              stderr=subprocess.STDOUT, env=_offline_env(), cwd=ROOT)
             for rank, log in enumerate(logs)]
    _wait(procs, logs, "two-process gloo run")
    return [torch.load(workdir / f"rank{rank}.pt") for rank in range(WORLD)]


TIGHT = dict(rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("key", [case.id for case in CASES] + ["symmetric-plain", "symmetric-matryoshka"])
def test_fused_ranking_losses_equal_sentence_transformers_on_every_rank(runs, key):
    for rank in range(WORLD):
        st, fused = runs[rank][key]["st"], runs[rank][key]["cgist"]
        torch.testing.assert_close(fused["loss"], st["loss"], **TIGHT)
        assert sorted(fused["grads"]) == sorted(st["grads"])
        for name in st["grads"]:
            torch.testing.assert_close(fused["grads"][name], st["grads"][name], **TIGHT)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_guided_directions_equal_the_oracle_across_ranks(runs, case):
    """Rank r: its anchors against every rank's candidates and anchors; the ranks' gradients together are those of
    the sum of their losses."""
    embeddings, guide_embeddings = _embeddings(case)
    leaves = [e.clone().requires_grad_() for e in embeddings]
    losses = []
    for rank in range(WORLD):
        rows = slice(rank * LOCAL, (rank + 1) * LOCAL)
        options = _options(case, rank).replace(all_anchors=bool({"query_to_query", "doc_to_query"} & set(case.directions)))
        student = [leaves[0][rows], *leaves[1:]] + ([leaves[0]] if options.all_anchors else [])
        guide = [guide_embeddings[0][rows], *guide_embeddings[1:]] + ([guide_embeddings[0]] if options.all_anchors else [])
        losses.append(gist_loss_reference(student, guide, options))
        torch.testing.assert_close(runs[rank][case.id]["emb_loss"], losses[-1].detach(), **TIGHT)
    torch.stack(losses).sum().backward()
    for column, leaf in enumerate(leaves):
        received = torch.cat([runs[rank][case.id]["emb_grads"][column] for rank in range(WORLD)])
        torch.testing.assert_close(received, leaf.grad, **TIGHT)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
