"""The plain drop-ins (no GradCache): ``FusedGISTEmbedLoss``, ``FusedMultipleNegativesRankingLoss`` and
``FusedMultipleNegativesSymmetricRankingLoss`` against sentence-transformers' ``GISTEmbedLoss``,
``MultipleNegativesRankingLoss`` and ``MultipleNegativesSymmetricRankingLoss``.

On real models in float64 (the all-MiniLM-L6-v2 guide, a tiny BERT student): the loss and every parameter gradient,
dropout off and on, every GIST option, the ranking losses' directions, partitions, hardness and similarities, with
duplicate texts; ``MatryoshkaLoss`` around each (one loss stage per step, ``n_dims_per_step``); the guide sources, a
guide that retokenises (padded and packed batches); gathering across ranks (simulated); the trainer with the guide's
statistics in its logs.
"""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from datasets import Dataset
from helpers import LossStageCalls, assert_close, one_thread, tolerance  # noqa: F401  (one_thread: autouse)
from helpers_models import computed_on, guide_model, packed_features, run_loss, tiny_model
from sentence_transformers import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.sentence_transformer.losses import gist_embed as st_gist_module
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
from sentence_transformers.util import dot_score

import cgist
import cgist.losses.columns
from cgist.compat import release_rules
from cgist import FusedGISTEmbedLoss, FusedMultipleNegativesRankingLoss, FusedMultipleNegativesSymmetricRankingLoss
from cgist.losses.matryoshka import FusedMatryoshka
from cgist.stage.reference import gist_loss_reference
from cgist.stage.ties import token_fingerprints

pytestmark = pytest.mark.filterwarnings("ignore:.*MultipleNegativesSymmetricRankingLoss is deprecated:DeprecationWarning")

BATCH = 10
WORDS = ("the a cat dog river bank money loan rain cloud sky blue green old new quick slow fox jumps over lazy sleeps "
         "under warm mat music song plays loud quiet city street car train station ticket price cheap").split()
MODELS = tolerance("models", "fp64")


def _texts(negatives: int, seed: int = 0) -> list[list[str]]:
    """Columns [anchor, positive, *negatives] of BATCH sentences of uneven length, with what real data has: anchor 3
    is its own positive, anchor 6 repeats anchor 2, positive 8 repeats positive 1, and the last negative of row 4 is
    positive 0.

    Anchor 3 is its own positive only under a release that excludes the self-pairs (6.3 on): before, GISTEmbedLoss
    masks AA[3, 3] and PP[3, 3] when the guide scores them above theta_3, which for that row compares the cosine of
    two embeddings of one text made in separate forward passes, so its answer is the rounding of those passes
    (docs/design.md#ties), which differs between builds of the libraries."""
    rng = random.Random(seed)
    columns = [[" ".join(rng.choices(WORDS, k=rng.randint(2, 9))) for _ in range(BATCH)] for _ in range(2 + negatives)]
    if release_rules().self_pairs_excluded:
        columns[0][3] = columns[1][3]
    columns[0][6] = columns[0][2]
    columns[1][8] = columns[1][1]
    if negatives:
        columns[-1][4] = columns[1][0]
    return columns


def _compare(make, student, columns, *, train: bool = False, seed: int = 7, matryoshka: dict | None = None):
    """``make(fused)`` builds sentence-transformers' loss (False) or the drop-in (True), wrapped in ``MatryoshkaLoss``
    if asked; both give the same loss and every parameter gradient. Returns the drop-in."""
    results = []
    student.train(train)
    try:
        for fused in (False, True):
            loss = make(fused)
            outer = MatryoshkaLoss(student, loss, **matryoshka) if matryoshka else loss
            results.append((loss, *run_loss(outer, student, columns, seed=seed)))
    finally:
        student.eval()
    (_, want, want_grads), (ours, got, grads) = results
    assert torch.isfinite(got) and any(g.abs().max() > 0 for g in want_grads.values())
    assert_close("drop-in vs sentence-transformers", (want, want_grads), (got, grads), MODELS)
    return ours


GIST_CASES = [
    pytest.param(dict(), 1, False, id="k1-m0-eval"),
    pytest.param(dict(), 1, True, id="k1-m0-dropout"),
    pytest.param(dict(margin=0.1), 0, False, id="k0-m0.1"),
    pytest.param(dict(margin=0.05, margin_strategy="relative", temperature=0.05), 1, True, id="k1-rel0.05-t0.05-dropout"),
    pytest.param(dict(margin=-0.1, contrast_anchors=False), 1, False, id="k1-m-0.1-noAA"),
    pytest.param(dict(margin=0.1, contrast_positives=False, contrast_anchors=False), 0, False, id="k0-m0.1-noAA-noPP"),
]


@pytest.mark.parametrize("options, negatives, train", GIST_CASES)
def test_gist_matches_sentence_transformers(options, negatives, train, student, guide):
    loss = _compare(lambda fused: (FusedGISTEmbedLoss if fused else GISTEmbedLoss)(student, guide, **options),
                    student, _texts(negatives), train=train)
    assert loss.last_stats is not None and loss.last_stats.candidates["ap"] == BATCH * (BATCH - 1)


RANKING_CASES = [
    pytest.param(dict(), 1, id="q2d-cos"),
    pytest.param(dict(similarity_fct=dot_score, scale=2.0), 2, id="q2d-dot-k2"),
    pytest.param(dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"), 0,
                 id="q2d+d2q-per_direction"),
    pytest.param(dict(directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")), 1, id="all-joint"),
    pytest.param(dict(hardness_mode="hard_negatives", hardness_strength=5.0), 1, id="hard_negatives-5"),
    pytest.param(dict(hardness_mode="in_batch_negatives", hardness_strength=9.0, scale=50.0), 1, id="in_batch-9-s50"),
]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "dropout"])
@pytest.mark.parametrize("options, negatives", RANKING_CASES)
def test_ranking_matches_sentence_transformers(options, negatives, train, student):
    _compare(lambda fused: (FusedMultipleNegativesRankingLoss if fused else MultipleNegativesRankingLoss)(
        student, **options), student, _texts(negatives), train=train)


@pytest.mark.parametrize("similarity", ["cos", "dot"])
def test_symmetric_ranking_matches_sentence_transformers(similarity, student):
    options = dict(similarity_fct=dot_score, scale=3.0) if similarity == "dot" else {}
    _compare(lambda fused: (FusedMultipleNegativesSymmetricRankingLoss if fused else
                            MultipleNegativesSymmetricRankingLoss)(student, **options), student, _texts(0))


# MatryoshkaLoss: every dimension in one loss stage ----------------------------------------------------------------

MATRYOSHKA_CASES = [
    pytest.param(dict(matryoshka_dims=[32, 16, 8]), False, id="d32-16-8"),
    pytest.param(dict(matryoshka_dims=[32, 24, 8], matryoshka_weights=[1.0, 0.5, 2.0], n_dims_per_step=2), True,
                 id="d32-24-8-weighted-n2-dropout"),
]


@pytest.mark.parametrize("matryoshka, train", MATRYOSHKA_CASES)
@pytest.mark.parametrize("pair", ["gist", "mnrl", "symmetric"])
def test_matryoshka_is_one_loss_stage_with_sentence_transformers_loss(pair, matryoshka, train, student, guide,
                                                                      monkeypatch):
    """MatryoshkaLoss's loop over dimensions (a patched model, the loss once per dimension, the guide once per
    dimension) against the drop-in's one loss stage: the same loss and gradients, the same sampled dimensions."""
    classes = {"gist": (GISTEmbedLoss, FusedGISTEmbedLoss), "mnrl": (MultipleNegativesRankingLoss,
               FusedMultipleNegativesRankingLoss), "symmetric": (MultipleNegativesSymmetricRankingLoss,
               FusedMultipleNegativesSymmetricRankingLoss)}[pair]
    options = dict(margin=0.05) if pair == "gist" else {}
    counting = LossStageCalls(monkeypatch)
    arguments = (student, guide) if pair == "gist" else (student,)
    loss = _compare(lambda fused: classes[fused](*arguments, **options), student,
                    _texts(0 if pair == "symmetric" else 1), train=train, matryoshka=matryoshka)
    assert isinstance(loss.calculate_loss, FusedMatryoshka)
    assert counting.calls == 1


def test_matryoshka_guide_runs_once(student, guide, monkeypatch):
    """One guide pass per step under MatryoshkaLoss (sentence-transformers' loop runs the guide once per dimension)."""
    calls = []
    forward = guide.forward
    monkeypatch.setattr(guide, "forward", lambda features, *a, **k: calls.append(1) or forward(features, *a, **k))
    run_loss(MatryoshkaLoss(student, FusedGISTEmbedLoss(student, guide), [32, 16, 8]), student, _texts(1), seed=1)
    fused_calls, calls[:] = len(calls), []
    run_loss(MatryoshkaLoss(student, GISTEmbedLoss(student, guide), [32, 16, 8]), student, _texts(1), seed=1)
    assert fused_calls * 3 == len(calls) and fused_calls >= 1


# Guide sources, gathering, the trainer ---------------------------------------------------------------------------

def test_label_guide_equals_the_live_guide(student, guide):
    """``guide="labels"``: the guide's embeddings carried by the batch give the live guide's loss and gradients."""
    columns = _texts(1, seed=3)
    labels = torch.stack([guide.encode(texts, convert_to_tensor=True) for texts in columns], dim=1)
    live = run_loss(FusedGISTEmbedLoss(student, guide, margin=0.05), student, columns, seed=2)
    precomputed = run_loss(FusedGISTEmbedLoss(student, "labels", margin=0.05), student, columns, seed=2, labels=labels)
    assert_close("labels vs live guide", live, precomputed, MODELS)


def test_a_guide_that_retokenises_reads_the_texts_as_sentence_transformers(student, tiny_guide):
    """A guide that reads fewer tokens than the student (``must_retokenize``) embeds the texts decoded from the
    student's tokens and tokenised again, cut where the guide stops reading (8 tokens: most of these texts); a packed
    batch (one row of every text's tokens, cut at ``cu_seq_lens_q``: ``helpers_models.packed_features``) is decoded
    text by text. The loss and every parameter gradient of ``GISTEmbedLoss`` on the same features, and the packed
    batch's are the padded batch's."""
    guide = copy.deepcopy(tiny_guide)
    guide.max_seq_length = 8
    columns = _texts(1, seed=10)
    results = {}
    for form, make in (("padded", student.preprocess), ("packed", functools.partial(packed_features, student))):
        for fused in (False, True):
            loss = (FusedGISTEmbedLoss if fused else GISTEmbedLoss)(student, guide, margin=0.05)
            assert loss.must_retokenize
            student.zero_grad(set_to_none=True)
            with computed_on(loss):
                value = loss([make(texts) for texts in columns], None)
            value.backward()
            results[form, fused] = (value.detach(), {name: p.grad.clone() for name, p in student.named_parameters()
                                                     if p.grad is not None})
            student.zero_grad(set_to_none=True)
        assert_close(f"{form}: drop-in vs sentence-transformers", results[form, False], results[form, True], MODELS)
    assert_close("packed vs padded", results["padded", True], results["packed", True], MODELS)


def _oracle_run(student, columns, options, guide) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The dense oracle's loss and every parameter gradient on the student's embeddings of ``columns``, its texts'
    ids and the guide's embeddings: a guide model's, the student's own (``"self"``) or none."""
    features = [student.preprocess(texts) for texts in columns]
    embeddings = [student(f)["sentence_embedding"] for f in features]
    text_ids = [token_fingerprints(f["input_ids"], f["attention_mask"]) for f in features]
    if guide == "self":
        guide_embeddings = [e.detach() for e in embeddings]
    elif guide is not None:
        with torch.no_grad():
            guide_embeddings = [guide(student.preprocess(texts))["sentence_embedding"] for texts in columns]
    else:
        guide_embeddings = None
    reference = gist_loss_reference(embeddings, guide_embeddings, options, text_ids)
    reference.backward()
    grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
    student.zero_grad(set_to_none=True)
    return reference.detach(), grads


@pytest.mark.parametrize("guide_kind", ["self", None], ids=["self", "none"])
def test_self_and_no_guide_equal_the_oracle(guide_kind, student):
    """``"self"`` (the student's embeddings, detached, as the guide) and None (no guide) against the dense oracle on
    the student's own embeddings, with the masks they default to (self-pairs; duplicates by text)."""
    columns = _texts(1, seed=4)
    loss = FusedGISTEmbedLoss(student, guide_kind, margin=-0.1)
    value, grads = run_loss(loss, student, columns, seed=0)
    assert loss.options.mask_self and loss.options.mask_duplicates
    assert_close("self/none vs oracle", _oracle_run(student, columns, loss.options, guide_kind), (value, grads), MODELS)


def test_no_guide_without_contrast_blocks_is_mnrl(student):
    """Without a guide, the contrast blocks and the duplicates' mask (which MNRL does not have), it is MNRL."""
    columns = _texts(1, seed=5)
    want = run_loss(MultipleNegativesRankingLoss(student, scale=20.0), student, columns, seed=0)
    got = run_loss(FusedGISTEmbedLoss(student, None, temperature=0.05, contrast_anchors=False,
                                      contrast_positives=False, mask_duplicates=False), student, columns, seed=0)
    assert_close("guide=None vs MNRL", want, got, MODELS)


def test_gathered_candidates_on_another_rank(student, guide, monkeypatch):
    """Rank 1 of 2 with ``gather_across_devices`` (the other rank's candidates simulated): the label, theta and the
    never-masked column sit at offset + i, also with a positive margin."""
    columns = _texts(1, seed=6)
    gen = torch.Generator().manual_seed(0)
    others, calls = {}, []

    def fake_gather(local):
        # The other rank's rows: the same for the same call (in call order within a step) in both losses.
        index = len(calls) % 4
        calls.append(index)
        other = others.setdefault((index, local.shape), torch.randn(local.shape, dtype=local.dtype, generator=gen))
        return torch.cat([other, local])

    for module in (st_gist_module, cgist.losses.columns):
        monkeypatch.setattr(module, "all_gather_with_grad", fake_gather)
        monkeypatch.setattr(module, "get_rank", lambda: 1)
    # The other rank's texts: ids of their own (no duplicates of this rank's texts among them).
    monkeypatch.setattr(cgist.losses.columns, "all_gather", lambda ids: torch.cat([ids + 2**40, ids]))
    _compare(lambda fused: (FusedGISTEmbedLoss if fused else GISTEmbedLoss)(student, guide, margin=0.1,
                                                                            gather_across_devices=True),
             student, columns)


def test_trainer_logs_the_guide_statistics(student, guide, tmp_path):
    """A SentenceTransformerTrainer run with the plain drop-in and ``GuideStatsCallback``: the weights move and the
    logs carry ``guide/...``."""
    model = tiny_model(tmp_path / "model", dtype=torch.float32)
    columns = _texts(1, seed=8)
    dataset = Dataset.from_dict({"anchor": columns[0], "positive": columns[1], "negative": columns[2]})
    loss = FusedGISTEmbedLoss(model, guide_model(torch.float32), margin=0.05)
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1,
                                                per_device_train_batch_size=5, save_strategy="no", report_to="none",
                                                use_cpu=True, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss,
                                         callbacks=[cgist.GuideStatsCallback(loss)])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "guide/masked_ap" in entry]
    assert len(logged) == 2 and all(0.0 <= entry["guide/masked_ap"] <= 1.0 for entry in logged)
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, model.parameters()))


@pytest.mark.parametrize("negatives", [2, 3])
def test_more_negative_columns_than_sentence_transformers_takes(negatives, student, guide):
    """sentence-transformers' plain GIST loss takes at most one negative column; the drop-in takes any number, with
    the loss and gradients of sentence-transformers' cached class in one mini-batch (which takes any number: the same
    loss) and of the dense oracle on the same embeddings."""
    columns = _texts(negatives, seed=9)
    with pytest.raises(ValueError, match=f"Expected 2 or 3 embeddings, got {2 + negatives}"):
        run_loss(GISTEmbedLoss(student, guide), student, columns, seed=0)
    options = dict(margin=0.05, contrast_anchors=negatives == 2)
    loss = FusedGISTEmbedLoss(student, guide, **options)
    got = run_loss(loss, student, columns, seed=0)
    want = run_loss(CachedGISTEmbedLoss(student, guide, mini_batch_size=BATCH, **options), student, columns, seed=0)
    assert_close("k > 1 vs sentence-transformers' cached class", want, got, MODELS)
    assert_close("k > 1 vs the oracle", _oracle_run(student, columns, loss.options, guide), got, MODELS)
