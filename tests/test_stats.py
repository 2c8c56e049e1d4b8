"""cgist.stage.stats and the statistics of the loss stage: ``gist_loss(return_stats=True)``, ``last_stats``,
``GuideStatsCallback`` and the positive-only warning.

The counts must equal, exactly and block by block, those of the test oracle (``helpers.oracle_stats``, counted on the
-inf entries of the dense oracle's column groups, ``cgist.stage.reference.score_groups``: the masking rules of
docs/design.md#column-groups), with ties, offsets and every flag, in one pass and in two; the directions' blocks (QQ,
DQ, DD) on both backends, the kernels under the interpreter without CUDA.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from datasets import Dataset
from helpers import DEVICE, Tol, assert_close, make_inputs, oracle_stats
from torch.overrides import TorchFunctionMode

import cgist
from cgist import GistOptions, GistStats

#: The tolerance of theta's and T_i's means (float64); the counts in the same statistics compare exactly.
MEANS = Tol(atol=1e-12)

CASES = [  # B, N, D, Dg, k, options
    pytest.param(13, 26, 40, 24, 1, dict(offset=13, margin=0.1), id="B13-N26-k1-o13-m0.1"),
    pytest.param(13, 39, 40, 24, 2, dict(offset=20, margin=0.3, margin_strategy="relative"), id="B13-N39-k2-o20-rel"),
    pytest.param(9, 9, 16, 12, 0, dict(margin=-0.3), id="B9-N9-k0-m-0.3"),  # masks nothing, self-pairs kept
    pytest.param(9, 18, 16, 12, 1, dict(offset=9, margin=3.0), id="B9-N18-k1-m3"),  # masks all but the positive
    pytest.param(11, 22, 16, 12, 1, dict(offset=5, margin=0.05, contrast_anchors=False), id="B11-N22-k1-noAA"),
    pytest.param(11, 22, 16, 12, 2, dict(offset=11, margin=0.05, contrast_positives=False), id="B11-N22-k2-noPP"),
    pytest.param(7, 7, 16, 12, 1, dict(contrast_anchors=False, contrast_positives=False, margin=0.1), id="B7-k1-AP+AN"),
]


def _with_ties(guide: list[torch.Tensor], offset: int) -> list[torch.Tensor]:
    """Copies of positives among the other columns (exact ties with theta at margin 0)."""
    guide = [g.clone() for g in guide]
    guide[0][1] = guide[1][offset + 4]
    guide[1][0] = guide[1][offset + 2]
    if len(guide) > 2:
        guide[2][3] = guide[1][offset + 3]
    return guide


@pytest.mark.parametrize("block_bytes", [None, 1], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("B, N, D, Dg, k, options", CASES)
def test_counts_equal_the_oracle(B, N, D, Dg, k, options, block_bytes):
    student, guide = make_inputs(B, N, D, Dg, k, seed=B + N + k)
    guide = _with_ties(guide, options.get("offset", 0))
    _, stats = cgist.gist_loss(student, guide, backend="torch", return_stats=True, block_bytes=block_bytes, **options)
    assert_close("stats", oracle_stats(student, guide, GistOptions(**options)), stats, MEANS)


def test_the_cases_cover_partial_full_and_empty_masks():
    """The catalogue exercises what it claims: some rows with only their positive, and blocks masked in part."""
    seen_positive_only = seen_partial = False
    for case in CASES:
        B, N, D, Dg, k, options = case.values
        student, guide = make_inputs(B, N, D, Dg, k, seed=B + N + k)
        stats = oracle_stats(student, _with_ties(guide, options.get("offset", 0)), GistOptions(**options))
        seen_positive_only |= stats.positive_only == B
        seen_partial |= any(0 < stats.masked[key] < stats.candidates[key] for key in stats.masked)
    assert seen_positive_only and seen_partial


# The directions' blocks, exactly, on both backends ----------------------------------------------------------

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
NO_GIST = dict(contrast_anchors=False, contrast_positives=False)
#: id: (directions, ranks (this one is rank 1 of them, or the only one), guide source, ties, options).
DIRECTION_CASES = {
    "q2d+q2q+d2q+d2d-rank1of3-m0-ties": (ALL, 3, "guide", True, dict(margin=0.0, **NO_GIST)),
    "q2d+q2q+d2q+d2d-rank1of3-m0.05": (ALL, 3, "guide", False, dict(margin=0.05, **NO_GIST)),
    "q2d+q2q+d2d-local-mask_self-m0.1": (ALL[:2] + ALL[3:], 1, "guide", False, dict(margin=0.1, mask_self=True,
                                                                                 **NO_GIST)),
    "q2d+d2q-per_direction-rank1of2-rel0-ties": (ALL[::2], 2, "guide", True, dict(
        margin=0.0, margin_strategy="relative", partition_mode="per_direction", hardness_mode="all_negatives",
        hardness_strength=5.0, **NO_GIST)),
    "q2d+d2q-AA+PP-rank1of2-m0.05-ties": (ALL[::2], 2, "guide", True, dict(margin=0.05)),
    # With text ids, texts decide the ties (a copied guide vector of another text is no tie): none copied here.
    "q2d+q2q+d2q+d2d-rank1of2-duplicates-m0": (ALL, 2, "guide", False, dict(margin=0.0, mask_duplicates=True,
                                                                         **NO_GIST)),
    "q2d+q2q+d2q+d2d-rank1of2-self-m-0.1": (ALL, 2, "self", False, dict(margin=-0.1, mask_self=True, **NO_GIST)),
    "q2d+q2q+d2q+d2d-rank1of2-noguide-duplicates": (ALL, 2, "none", False, dict(mask_duplicates=True, **NO_GIST)),
    "q2d+q2q+d2d-rank1of2-m3-matryoshka": (ALL[:2] + ALL[3:], 2, "guide", False, dict(
        margin=3.0, matryoshka_dims=(12, 5), **NO_GIST)),  # every entry but the label masked: every row
}
BATCH = 5


def _direction_inputs(name: str):
    """Columns ``[anchor, positive, negative 1, negative 2, every rank's anchors]`` of this rank (rank 1 when there
    are several: offset B), their guide (or "self", or None), text ids and the options of ``gist_loss``.

    With ties, guide rows copy a row's partner (the positive ``offset + i`` for anchor rows, anchor i for positive
    rows, bitwise once normalised): in AN, in QQ (an anchor of this rank and one of another rank), in DQ (another
    rank's anchor) and in DD (a positive and a negative). The text ids repeat an anchor's text among the negatives
    and the anchors of another rank, and a positive's among the positives and negatives."""
    directions, world, source, ties, options = DIRECTION_CASES[name]
    n_cand = BATCH * world
    offset = BATCH if world > 1 else 0
    student, guide = make_inputs(n_cand, n_cand, 12, 8, 2, seed=len(name))
    if ties:
        guide[2][3] = 2.0 * guide[1][offset + 1]  # AN: anchor 1's positive, scaled
        guide[0][offset + 4] = guide[1][offset + 2]  # QQ (and AQ's anchor 4): anchor 2's positive
        guide[0][(offset + BATCH) % n_cand] = guide[1][offset + 3] if world > 1 else guide[0][0]  # QQ: another rank's
        if world > 1:
            guide[0][(offset + BATCH + 1) % n_cand] = 0.5 * guide[0][offset]  # DQ row 0: anchor 0, another rank's
        guide[1][0] = guide[0][offset + 3]  # DD row 3: anchor 3
        guide[2][offset + 7 if n_cand > offset + 7 else 1] = guide[0][offset + 2]  # DD (negatives) row 2: anchor 2
    texts = [torch.arange(n_cand), torch.arange(n_cand) + 100, torch.arange(n_cand) + 200, torch.arange(n_cand) + 300]
    texts[2][4] = texts[0][offset + 1]
    texts[0][(offset + BATCH) % n_cand] = texts[0][offset + 2]
    texts[1][1] = texts[2][2] = texts[1][offset + 3]
    rows = slice(offset, offset + BATCH)
    local = [student[0][rows], *student[1:]]
    local_guide = {"guide": [guide[0][rows], *guide[1:]], "self": "self", "none": None}[source]
    kwargs = dict(temperature=0.05, directions=directions, offset=offset, **options)
    if {"query_to_query", "doc_to_query"} & set(directions):
        kwargs.update(all_anchors=student[0], all_anchors_guide=guide[0], all_anchors_text_ids=texts[0])
    if options.get("mask_duplicates"):
        kwargs["text_ids"] = [texts[0][rows], *texts[1:]]
    return local, local_guide, kwargs


def _oracle_inputs(name: str, **overrides):
    """The oracle's view of a direction case: all columns (every rank's anchors last), the guide's, the options and
    the text ids (None without ``mask_duplicates``)."""
    local, guide, kwargs = _direction_inputs(name)
    everyone = "all_anchors" in kwargs
    columns = local + [kwargs["all_anchors"]] * everyone
    if guide == "self":
        guide = columns
    elif guide is not None:
        guide = guide + [kwargs["all_anchors_guide"]] * everyone
    texts = kwargs["text_ids"] + [kwargs["all_anchors_text_ids"]] * everyone if "text_ids" in kwargs else None
    fields = {f.name for f in dataclasses.fields(GistOptions)} - {"all_anchors", "block_bytes"}
    options = GistOptions(all_anchors=everyone, **{k: v for k, v in {**kwargs, **overrides}.items() if k in fields})
    return columns, guide, options, texts


@pytest.mark.parametrize("run", ["torch", "torch-two-pass", "triton"])
@pytest.mark.parametrize("name", list(DIRECTION_CASES))
def test_direction_counts_equal_the_oracle(name, run):
    """Every block's masked and candidate counts, the positive-only rows and the means of theta and T_i, from the
    PyTorch path (one pass and two) and the kernels, against the oracle: exactly, QQ, DQ and DD included."""
    local, guide, kwargs = _direction_inputs(name)
    if run == "torch-two-pass":
        kwargs["block_bytes"] = 1
    to = {"all_anchors": DEVICE, "all_anchors_guide": DEVICE, "all_anchors_text_ids": DEVICE}
    kwargs = {k: v.to(to[k]) if k in to else v for k, v in kwargs.items()}
    if "text_ids" in kwargs:
        kwargs["text_ids"] = [t.to(DEVICE) for t in kwargs["text_ids"]]
    _, stats = cgist.gist_loss([s.to(DEVICE) for s in local], guide if not isinstance(guide, list) else
                               [g.to(DEVICE) for g in guide], backend=run.removesuffix("-two-pass"),
                               return_stats=True, **kwargs)
    assert_close("stats", oracle_stats(*_oracle_inputs(name)), stats, MEANS)


def test_the_direction_cases_exercise_their_blocks():
    """The catalogue is not vacuous: each block is masked in part somewhere and every row keeps only its label in
    one case; the ties are ties in AN, QQ, DQ and DD: kept at margin 0, masked at a margin of 1e-12."""
    partial, full, tied = set(), False, set()
    for name, (_, _, _, ties, options) in DIRECTION_CASES.items():
        stats = oracle_stats(*_oracle_inputs(name))
        partial |= {k for k in stats.masked if 0 < stats.masked[k] < stats.candidates[k]}
        full |= stats.positive_only == BATCH
        if ties and options["margin"] == 0.0:
            above = oracle_stats(*_oracle_inputs(name, margin=1e-12))
            tied |= {k for k in stats.masked if above.masked[k] > stats.masked[k]}
    assert {"ap", "aa", "pp", "an", "qq", "dq", "dd"} <= partial and full
    assert {"an", "qq", "dq", "dd"} <= tied


def test_blocks_switched_off_are_absent():
    student, guide = make_inputs(5, 5, 8, 8, 0, seed=2)
    _, stats = cgist.gist_loss(student, guide, contrast_anchors=False, return_stats=True)
    assert set(stats.masked) == set(stats.candidates) == {"ap", "pp"}
    assert stats.candidates == {"ap": 5 * 4, "pp": 5 * 5}


def test_matryoshka_counts_the_shared_mask_once():
    student, guide = make_inputs(9, 18, 24, 12, 1, seed=3)
    _, flat = cgist.gist_loss(student, guide, offset=9, margin=0.1, return_stats=True)
    _, nested = cgist.gist_loss(student, guide, offset=9, margin=0.1, matryoshka_dims=(24, 12, 6), return_stats=True)
    assert nested == flat


class _CountSyncs(TorchFunctionMode):
    SYNCING = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "numpy", "cpu", "equal"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.SYNCING
        return func(*args, **(kwargs or {}))


def test_statistics_cost_one_host_sync():
    student, guide = make_inputs(13, 26, 16, 12, 1, seed=4)
    counts = []
    for return_stats in (False, True):
        with _CountSyncs() as syncs:
            cgist.gist_loss(student, guide, offset=13, margin=0.1, return_stats=return_stats)
        counts.append(syncs.count)
    assert counts[1] - counts[0] == 1


def test_mean_weights_by_anchors_and_sums_counts():
    a = GistStats(masked={"ap": 3, "an": 1}, candidates={"ap": 10, "an": 20}, positive_only=1, anchors=2,
                  theta_mean=0.5, threshold_mean=0.4)
    b = GistStats(masked={"ap": 1, "aa": 2}, candidates={"ap": 30, "aa": 9}, positive_only=0, anchors=6,
                  theta_mean=0.1, threshold_mean=0.0)
    mean = GistStats.mean([a, b])
    assert mean.masked == {"ap": 4, "aa": 2, "an": 1} and mean.candidates == {"ap": 40, "aa": 9, "an": 20}
    assert mean.positive_only == 1 and mean.anchors == 8
    assert mean.theta_mean == pytest.approx((0.5 * 2 + 0.1 * 6) / 8) and mean.threshold_mean == pytest.approx(0.1)
    assert mean.masked_fraction("ap") == pytest.approx(0.1) and mean.positive_only_fraction == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match="at least one"):
        GistStats.mean([])


# In the trainer ---------------------------------------------------------------------------------------------


def _dataset(n: int = 16) -> Dataset:
    words = "river bank money loan rain cloud city street car train song music old new quick slow".split()
    anchors = [" ".join(words[(i * 3 + j) % len(words)] for j in range(4)) for i in range(n)]
    positives = [" ".join(words[(i * 5 + j) % len(words)] for j in range(6)) for i in range(n)]
    return Dataset.from_dict({"anchor": anchors, "positive": positives})


def test_last_stats_of_a_training_call(student32, tiny_guide32):
    model, guide = student32, tiny_guide32
    loss = cgist.FusedCachedGISTLoss(model, guide, mini_batch_size=4, margin=0.05)
    features = [model.preprocess(texts) for texts in (_dataset(8)["anchor"], _dataset(8)["positive"])]
    loss(features, None).backward()
    assert isinstance(loss.last_stats, GistStats) and loss.last_stats.anchors == 8
    assert set(loss.last_stats.candidates) == {"ap", "aa", "pp"}
    assert len(loss.pop_training_stats()) == 1 and loss.pop_training_stats() == []
    with torch.no_grad():  # evaluation: last_stats follows, the training statistics do not
        loss(features, None)
    assert loss.pop_training_stats() == []


def test_callback_logs_guide_keys_ahead_of_reporting(student32, tiny_guide32, tmp_path):
    """A 2-step trainer run: the guide/ keys are in the log history, and a reporting callback listed before the
    guide callback (as the trainer lists its integrations) sees them too."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    seen = []

    class Reporter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    model, guide = student32, tiny_guide32  # trains this module's student
    loss = cgist.FusedCachedGISTLoss(model, guide, mini_batch_size=4, margin=0.05)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=_dataset(), loss=loss,
                                         callbacks=[Reporter(), cgist.GuideStatsCallback(loss)])
    trainer.train()
    keys = {"guide/masked_ap", "guide/masked_aa", "guide/masked_pp", "guide/positive_only", "guide/theta_mean"}
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(keys <= set(entry) for entry in logged)
    assert [keys <= set(entry) for entry in seen if "loss" in entry] == [True, True]
    assert all(0.0 <= entry["guide/masked_aa"] <= 1.0 for entry in logged)


def test_callback_needs_a_fused_loss():
    with pytest.raises(TypeError, match="loss must be a guided drop-in .*, got str"):
        cgist.GuideStatsCallback("loss")


def test_warns_once_when_most_anchors_keep_only_their_positive(student32, tiny_guide32, caplog):
    model, guide = student32, tiny_guide32
    loss = cgist.FusedCachedGISTLoss(model, guide, mini_batch_size=4, margin=5.0)  # masks every candidate
    features = [model.preprocess(texts) for texts in (_dataset(8)["anchor"], _dataset(8)["positive"])]
    with caplog.at_level(logging.WARNING, logger="cgist.losses.guided"):
        for _ in range(2):
            loss(features, None).backward()
    warnings = [r for r in caplog.records if "have every candidate but their positive masked" in r.getMessage()]
    assert len(warnings) == 1 and "100%" in warnings[0].getMessage()
    assert loss.last_stats.positive_only == 8
