"""Differential fuzz: cgist's drop-ins against the installed sentence-transformers' own classes.

Hypothesis draws batches of texts and the options sentence-transformers accepts, then runs the same step through
sentence-transformers' class and cgist's drop-in on one tiny float64 model: the loss and the gradient of every
parameter must agree. It runs under whichever release is installed (CI runs it under the newest release in the
range, and ``.ci/parity-oldest`` again under the oldest), so a release that moves a rule fails here first.

* **Classes**: ``CachedGISTEmbedLoss``, ``CachedMultipleNegativesRankingLoss``,
  ``CachedMultipleNegativesSymmetricRankingLoss`` and the plain ``GISTEmbedLoss``, ``MultipleNegativesRankingLoss``
  and ``MultipleNegativesSymmetricRankingLoss``, each alone or inside ``MatryoshkaLoss`` (dimensions, weights and
  ``n_dims_per_step`` drawn).
* **What real data has and grids miss**: an anchor equal to its positive, repeated anchors, repeated positives, a
  negative equal to another row's positive (or to its own), any of them at once; margins of 0 (the default, where a
  duplicate of the positive ties with the threshold), of either sign and of both strategies; each contrast flag;
  0 to 3 negative columns; mini-batches that do not divide the batch; dropout; every direction set, partition and
  hardness setting ``CachedMultipleNegativesRankingLoss`` accepts; ``cos_sim`` and ``dot_score``.
* **Ties are exact here, by construction.** At margin 0 a duplicate of the positive ties with theta_i, and
  sentence-transformers decides it by comparing two of its own cosines, which are equal only when both were
  computed without rounding apart. The same text embedded at another place of a batch, or padded to another
  width, can differ in its last bits (a CPU's matrix products round a row by where it sits in the product, and
  not alike on every CPU), and so can the cosines of one vector against two places of another product; then
  sentence-transformers' own result is decided by that rounding, where cgist decides by the texts
  (``cgist.stage.ties.tie_ids``). So the guide's embeddings lie on a lattice (``LatticeGuide``): 16 entries of
  +-1/4 by the sign of the tiny BERT's, a norm of exactly 1, every cosine a multiple of 1/16 that every order of
  summation gives exactly. A text's vector is its own whatever the rounding of the model below it, and every tie,
  of a duplicate or of two texts that score alike, is exact on both sides, on every CPU. Every text of an example
  also has the same number of tokens (words that are one token each). cgist's rule where the two part is pinned
  apart (``test_a_duplicate_ties_by_its_text_whatever_its_rounding``, ``test_the_mini_batches_do_not_move_the_loss``).

Profiles: "ci" (the default) replays a fixed set of ``CI_EXAMPLES`` examples per class on every run; "long"
explores afresh:
    CGIST_HYPOTHESIS_PROFILE=long python -m pytest tests/test_differential.py -m slow --hypothesis-show-statistics
A failure prints the drawn batch and options (Hypothesis's falsifying example).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from helpers import Tol, assert_close, one_thread, tolerance  # noqa: F401  (one_thread: autouse)
from helpers_models import run_loss, tiny_model
from hypothesis import HealthCheck, Phase, event, find, given, note, settings
from hypothesis import strategies as st
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    CachedMultipleNegativesSymmetricRankingLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score

from cgist import (
    FusedCachedGISTLoss,
    FusedCachedMultipleNegativesRankingLoss,
    FusedGISTEmbedLoss,
    FusedMultipleNegativesRankingLoss,
    FusedMultipleNegativesSymmetricRankingLoss,
    gist_loss,
)
from cgist.losses.ranking import FusedCachedMultipleNegativesSymmetricRankingLoss

#: Examples per class (plain and Matryoshka together) in the "ci" profile: with the ">=" guide mask or a margin
#: of 0 counted as positive, the first failing example is among them; the long profile explores beyond.
CI_EXAMPLES = 75
#: A failure is shrunk to a small batch (minutes: every example runs two models), not explained (more minutes).
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
settings.register_profile("differential-ci", max_examples=CI_EXAMPLES, derandomize=True, deadline=None,
                          print_blob=True, phases=_PHASES,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("differential-long", max_examples=2_000, deadline=None, print_blob=True, phases=_PHASES,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CI = settings.get_profile("differential-ci")
LONG = settings.get_profile(f"differential-{os.environ.get('CGIST_HYPOTHESIS_PROFILE', 'long')}")

#: One token each in the tiny models' (all-MiniLM-L6-v2's) vocabulary: texts of n words are n tokens, unpadded.
WORDS = tuple(
    "the a cat dog river bank money loan rain cloud sky blue green old new quick slow fox jumps over lazy warm "
    "mat music song plays loud quiet city street car train station ticket price cheap red book tree house water "
    "fire stone road".split()
)
STUDENT_DIM = 16
MATRYOSHKA_DIMS = (16, 8, 4)
#: The edits that make a batch look like real data (``Batch.edits``).
EDITS = ("anchor=positive", "repeated anchor", "repeated positive", "negative=other positive", "negative=own positive")


@dataclass(frozen=True)
class Batch:
    """Columns ``[anchor, positive, *negatives]`` of texts of one token length, the edits that made duplicates, and
    the mini-batch size of the embedding stage."""

    columns: tuple[tuple[str, ...], ...]
    mini_batch_size: int
    edits: tuple[tuple[str, int, int], ...] = field(default=())

    def __repr__(self) -> str:
        names = ["anchor", "positive", *(f"negative {c}" for c in range(1, len(self.columns) - 1))]
        rows = "; ".join(f"{name}: {list(column)}" for name, column in zip(names, self.columns))
        return f"Batch(B={len(self.columns[0])}, mini_batch_size={self.mini_batch_size}, edits={list(self.edits)}; {rows})"

    @property
    def features(self) -> set[str]:
        """What the batch holds, for the statistics and the check that the strategy draws it."""
        found = {kind for kind, _, _ in self.edits}
        anchors, positives = self.columns[0], self.columns[1]
        if any(a == p for a, p in zip(anchors, positives)):
            found.add("anchor=positive")
        if len(self.columns) > 2:
            found.add(f"k={len(self.columns) - 2}")
        if len(anchors) % self.mini_batch_size:
            found.add("uneven mini-batches")
        return found


@st.composite
def batches(draw) -> Batch:
    size = draw(st.integers(2, 8))
    length = draw(st.integers(1, 4))
    n_columns = 2 + draw(st.integers(0, 3))
    # A small pool of texts, so that chance duplicates occur beside the drawn ones.
    pool = draw(st.lists(st.tuples(*[st.sampled_from(WORDS)] * length).map(" ".join), min_size=size + 2,
                         max_size=3 * size * n_columns, unique=True))
    columns = [[draw(st.sampled_from(pool)) for _ in range(size)] for _ in range(n_columns)]
    edits = []
    for kind in draw(st.lists(st.sampled_from(EDITS if n_columns > 2 else EDITS[:3]), max_size=4)):
        i, j = draw(st.integers(0, size - 1)), draw(st.integers(0, size - 1))
        negative = draw(st.integers(2, n_columns - 1)) if kind.startswith("negative") else 0
        if kind == "anchor=positive":
            columns[0][i] = columns[1][i]
        elif kind == "repeated anchor":
            columns[0][j] = columns[0][i]
        elif kind == "repeated positive":
            columns[1][j] = columns[1][i]
        elif kind == "negative=other positive":
            columns[negative][j] = columns[1][i]
        else:
            columns[negative][i] = columns[1][i]
        edits.append((kind, i, j))
    mini_batch_size = draw(st.integers(1, size))
    return Batch(tuple(tuple(c) for c in columns), mini_batch_size, tuple(edits))


#: Positive margins below this lower no threshold of these batches in float64 (``theta_i - margin`` rounds back to
#: ``theta_i``): sentence-transformers' comparison then keeps a tie, cgist's rule masks it (docs/design.md#ties), which
#: ``test_a_tie_is_masked_at_any_positive_margin`` pins.
ROUNDED_AWAY = 1e-12


def margins() -> st.SearchStrategy[float]:
    """0 (the default: ties kept), small margins of both signs, and any in [-0.5, 0.5] but the positive margins that
    the threshold's rounding erases (``ROUNDED_AWAY``)."""
    return st.one_of(st.sampled_from([0.0, 0.0, 0.1, -0.1, 0.3, -0.3]),
                     st.floats(-0.5, 0.5).filter(lambda m: not 0 < m < ROUNDED_AWAY))


@st.composite
def matryoshka(draw) -> dict | None:
    """None (the loss alone) or ``MatryoshkaLoss``'s dimensions, weights and ``n_dims_per_step``."""
    if not draw(st.booleans()):
        return None
    dims = draw(st.lists(st.sampled_from(MATRYOSHKA_DIMS), min_size=1, max_size=3, unique=True))
    weights = draw(st.lists(st.sampled_from([1.0, 0.5, 2.0, 0.25]), min_size=len(dims), max_size=len(dims)))
    n_dims_per_step = draw(st.sampled_from([-1, -1, 1, 2]))
    return dict(matryoshka_dims=dims, matryoshka_weights=weights, n_dims_per_step=n_dims_per_step)


@st.composite
def gist_options(draw) -> dict:
    return dict(temperature=draw(st.sampled_from([0.01, 0.05, 0.1, 1.0])), margin=draw(margins()),
                margin_strategy=draw(st.sampled_from(["absolute", "relative"])),
                contrast_anchors=draw(st.booleans()), contrast_positives=draw(st.booleans()))


@st.composite
def ranking_options(draw) -> dict:
    """Every direction set, partition and hardness setting ``CachedMultipleNegativesRankingLoss`` accepts."""
    extra = draw(st.lists(st.sampled_from(["query_to_query", "doc_to_query", "doc_to_doc"]), unique=True))
    directions = ("query_to_doc", *extra)
    per_direction = set(directions) <= {"query_to_doc", "doc_to_query"} and draw(st.booleans())
    hardness_mode = draw(st.sampled_from([None, "in_batch_negatives", "hard_negatives", "all_negatives"]))
    return dict(scale=draw(st.sampled_from([1.0, 20.0, 50.0])), similarity_fct=draw(st.sampled_from([cos_sim, dot_score])),
                directions=directions, partition_mode="per_direction" if per_direction else "joint",
                hardness_mode=hardness_mode,
                hardness_strength=draw(st.sampled_from([0.0, 5.0, 9.0])) if hardness_mode else 0.0)


@st.composite
def symmetric_options(draw) -> dict:
    return dict(scale=draw(st.sampled_from([1.0, 20.0, 50.0])), similarity_fct=draw(st.sampled_from([cos_sim, dot_score])))


class LatticeGuide(torch.nn.Module):
    """The guide's last module: each embedding becomes +-1/4 per entry by its sign (16 entries: a norm of exactly 1),
    so every guide cosine is a sum of +-1/16 that no order of summation rounds (module docstring)."""

    def forward(self, features: dict) -> dict:
        embedding = features["sentence_embedding"]
        assert embedding.shape[-1] == 16, "16 entries of 1/4 make a unit vector"
        features["sentence_embedding"] = torch.where(embedding >= 0, 0.25, -0.25).to(embedding.dtype)
        return features


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student, guide): tiny float64 BERTs sharing all-MiniLM-L6-v2's tokenizer (no retokenisation), dropout 0.1;
    the guide's embeddings on the lattice of ``LatticeGuide``."""
    root = tmp_path_factory.mktemp("differential")
    student = tiny_model(root / "student", hidden_size=STUDENT_DIM, num_layers=1, seed=0)
    guide = tiny_model(root / "guide", hidden_size=16, num_layers=1, seed=1)
    guide.append(LatticeGuide())
    return student, guide


def _compare(make, student, batch: Batch, wrap: dict | None, train: bool,
             logit_bound: Callable[[float], float]) -> None:
    """``make(fused)`` builds sentence-transformers' loss (False) or cgist's (True); both, wrapped in
    ``MatryoshkaLoss`` if ``wrap``, give the same loss and every parameter gradient on ``batch`` (``_tolerance``)."""
    note(f"{batch!r}; matryoshka={wrap}; dropout={'on' if train else 'off'}")
    for feature in sorted(batch.features):
        event(feature)
    event(f"matryoshka={'yes' if wrap else 'no'}")
    columns = [list(c) for c in batch.columns]
    results = []
    student.train(train)
    try:
        for fused in (False, True):
            loss = make(fused)
            if wrap is not None:
                loss = MatryoshkaLoss(student, loss, **wrap)
            results.append(run_loss(loss, student, columns, seed=len(columns[0])))
    finally:
        student.eval()
    (expected_loss, expected), (loss, grads) = results
    assert torch.isfinite(expected_loss), "sentence-transformers' loss is not finite on this batch"
    assert set(grads) == set(expected)
    assert_close("cgist vs sentence-transformers", (expected_loss, expected), (loss, grads),
                 _tolerance(student, columns, logit_bound))


def _tolerance(student, columns: list[list[str]], logit_bound: Callable[[float], float]) -> tuple[Tol, Tol]:
    """The float64 models' tolerance, with an absolute floor for what cancels.

    Where a batch's texts repeat, terms of a gradient cancel (every text the same: the gradient is nothing but
    rounding), and what is left is the rounding of the logits, ``eps * L`` for logits up to ``L``, carried through
    the model's Jacobian (``J``: the largest parameter gradient of the sum of the batch's embeddings). Measured at
    52 ``eps * L * J`` in such a batch (every text "the river", ``dot_score``, scale 50); the floor is 256 of them.
    ``logit_bound(largest squared norm of an embedding)`` gives ``L``."""
    model_tol = tolerance("models", torch.float64)
    with torch.enable_grad():
        embeddings = torch.cat([student(student.preprocess(texts))["sentence_embedding"] for texts in columns])
        jacobian = torch.autograd.grad(embeddings.sum(), [p for p in student.parameters() if p.requires_grad],
                                       allow_unused=True)
    scale = max(float(g.abs().max()) for g in jacobian if g is not None)
    squared_norm = float(embeddings.detach().square().sum(dim=1).max())
    floor = 256 * torch.finfo(torch.float64).eps * logit_bound(squared_norm)
    return (Tol(model_tol[0].rtol, max(model_tol[0].atol, floor)), Tol(model_tol[1].rtol, max(model_tol[1].atol, floor * scale)))


def _gist(batch: Batch, options: dict, models, wrap: dict | None, train: bool, plain: bool = False) -> None:
    student, guide = models

    def make(fused: bool):
        extra = dict(backend="torch") if fused else {}
        if plain and (fused or len(batch.columns) <= 3):
            return (FusedGISTEmbedLoss if fused else GISTEmbedLoss)(student, guide, **options, **extra)
        # sentence-transformers' plain GIST loss takes at most one negative column; for more, the plain drop-in is
        # held to its cached class in one mini-batch, the same loss (without dropout, below)
        mini_batch_size = len(batch.columns[0]) if plain else batch.mini_batch_size
        cls = FusedCachedGISTLoss if fused else CachedGISTEmbedLoss
        return cls(student, guide, mini_batch_size=mini_batch_size, **options, **extra)

    if plain and len(batch.columns) > 3:
        # The cached class draws other dropout masks than a plain forward from the same seed (its own plain and cached
        # classes differ there too), so that comparison is made in eval mode.
        train = False
    event(f"margin {'0' if options['margin'] == 0 else '<0' if options['margin'] < 0 else '>0'}, "
          f"{options['margin_strategy']}")
    _compare(make, student, batch, wrap, train, lambda _: 1.0 / options["temperature"])


def _ranking(cls, fused_cls, batch: Batch, options: dict, student, wrap: dict | None, train: bool) -> None:
    """``cls`` (sentence-transformers') against ``fused_cls``; the cached ones embed in ``batch``'s mini-batches."""
    cached = "mini_batch_size" in inspect.signature(cls).parameters

    def make(fused: bool):
        extra = dict(backend="torch") if fused else {}
        if cached:
            extra["mini_batch_size"] = batch.mini_batch_size
        return (fused_cls if fused else cls)(student, **options, **extra)

    def logit_bound(squared_norm: float) -> float:  # a cosine is at most 1 (also under MatryoshkaLoss), a dot product not
        dot = options["similarity_fct"] is dot_score and wrap is None
        return options["scale"] * (squared_norm if dot else 1.0) + options.get("hardness_strength", 0.0)

    _compare(make, student, batch, wrap, train, logit_bound)


@CI
@given(batch=batches(), options=gist_options(), wrap=matryoshka(), train=st.booleans())
def test_gist_matches_sentence_transformers(batch, options, wrap, train, models):
    _gist(batch, options, models, wrap, train)


@CI
@given(batch=batches(), options=ranking_options(), wrap=matryoshka(), train=st.booleans())
def test_ranking_matches_sentence_transformers(batch, options, wrap, train, models):
    event("directions=" + "+".join(d.split("_to_")[0][0] + "2" + d.split("_to_")[1][0] for d in options["directions"]))
    event(f"partition={options['partition_mode']}, hardness={options['hardness_mode']}")
    _ranking(CachedMultipleNegativesRankingLoss, FusedCachedMultipleNegativesRankingLoss, batch, options, models[0],
             wrap, train)


@CI
@pytest.mark.filterwarnings("ignore:.*CachedMultipleNegativesSymmetricRankingLoss is deprecated:DeprecationWarning")
@given(batch=batches(), options=symmetric_options(), wrap=matryoshka(), train=st.booleans())
def test_symmetric_ranking_matches_sentence_transformers(batch, options, wrap, train, models):
    _ranking(CachedMultipleNegativesSymmetricRankingLoss, FusedCachedMultipleNegativesSymmetricRankingLoss, batch,
             options, models[0], wrap, train)


# The plain losses (no GradCache).

@CI
@given(batch=batches(), options=gist_options(), wrap=matryoshka(), train=st.booleans())
def test_plain_gist_matches_sentence_transformers(batch, options, wrap, train, models):
    _gist(batch, options, models, wrap, train, plain=True)


@CI
@given(batch=batches(), options=ranking_options(), wrap=matryoshka(), train=st.booleans())
def test_plain_ranking_matches_sentence_transformers(batch, options, wrap, train, models):
    _ranking(MultipleNegativesRankingLoss, FusedMultipleNegativesRankingLoss, batch, options, models[0], wrap, train)


@CI
@pytest.mark.filterwarnings("ignore:.*MultipleNegativesSymmetricRankingLoss is deprecated:DeprecationWarning")
@given(batch=batches(), options=symmetric_options(), wrap=matryoshka(), train=st.booleans())
def test_plain_symmetric_ranking_matches_sentence_transformers(batch, options, wrap, train, models):
    _ranking(MultipleNegativesSymmetricRankingLoss, FusedMultipleNegativesSymmetricRankingLoss, batch, options,
             models[0], wrap, train)


@pytest.mark.slow
@LONG
@given(batch=batches(), options=gist_options(), wrap=matryoshka(), train=st.booleans())
def test_gist_matches_sentence_transformers_long(batch, options, wrap, train, models):
    _gist(batch, options, models, wrap, train)


@pytest.mark.slow
@LONG
@given(batch=batches(), options=ranking_options(), wrap=matryoshka(), train=st.booleans())
def test_ranking_matches_sentence_transformers_long(batch, options, wrap, train, models):
    _ranking(CachedMultipleNegativesRankingLoss, FusedCachedMultipleNegativesRankingLoss, batch, options, models[0],
             wrap, train)


@pytest.mark.slow
@LONG
@pytest.mark.filterwarnings("ignore:.*CachedMultipleNegativesSymmetricRankingLoss is deprecated:DeprecationWarning")
@given(batch=batches(), options=symmetric_options(), wrap=matryoshka(), train=st.booleans())
def test_symmetric_ranking_matches_sentence_transformers_long(batch, options, wrap, train, models):
    _ranking(CachedMultipleNegativesSymmetricRankingLoss, FusedCachedMultipleNegativesSymmetricRankingLoss, batch,
             options, models[0], wrap, train)


@pytest.mark.parametrize("feature", [*EDITS, "k=3", "uneven mini-batches"])
def test_the_strategy_draws_what_real_data_has(feature):
    """Not vacuous: every kind of duplicate, three negatives and uneven mini-batches are drawn."""
    find(batches(), lambda batch: feature in batch.features,
         settings=settings(database=None, max_examples=2_000, phases=[Phase.generate]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_duplicate_ties_by_its_text_whatever_its_rounding(backend):
    """Where sentence-transformers' result is decided by rounding, cgist decides by the texts.

    Positive 3 repeats positive 0's text, but its guide vector differs by the rounding of other padding (here
    1e-9 towards anchor 0, so that its guide score is above theta_0). With text ids it is a tie, exactly as a
    bitwise equal vector is: kept at margin 0, masked at any positive margin. Without them the rounding decides."""
    gen = torch.Generator().manual_seed(3)
    student = [torch.randn(6, 8, dtype=torch.float64, generator=gen) for _ in range(2)]
    guide = [torch.randn(6, 5, dtype=torch.float64, generator=gen) for _ in range(2)]
    exact = [guide[0], guide[1].clone()]
    exact[1][3] = exact[1][0]
    rounded = [guide[0], exact[1].clone()]
    rounded[1][3] += 1e-9 * guide[0][0]
    texts = [torch.arange(6), torch.tensor([10, 11, 12, 10, 14, 15])]

    def loss(guide_embeddings, margin, text_ids=None):
        return gist_loss(student, guide_embeddings, margin=margin, text_ids=text_ids, backend=backend,
                         return_stats=True)

    for margin in (0.0, 0.05):
        by_vector, vector_stats = loss(exact, margin)
        by_text, text_stats = loss(rounded, margin, texts)
        assert_close(f"margin {margin}", by_vector, by_text, tolerance("models", torch.float64)[0])
        assert text_stats.masked == vector_stats.masked
    by_rounding, stats = loss(rounded, 0.0)
    assert stats.masked["ap"] == loss(exact, 0.0)[1].masked["ap"] + 1  # the duplicate, masked by its rounding


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("strategy", ["absolute", "relative"])
def test_a_tie_is_masked_at_any_positive_margin(backend, strategy):
    """A candidate with the text of the positive ties with theta_i: masked exactly when the margin lowers ``T_i``
    below theta_i, decided from the margin, not from ``theta_i > theta_i - margin``, which a margin of 1e-300 (or, in
    float32, one far below theta's ulp) rounds to false. sentence-transformers' comparison rounds so and keeps the
    tie; cgist masks it as at any positive margin. A negative margin keeps it."""
    gen = torch.Generator().manual_seed(4)
    student = [torch.randn(5, 8, dtype=torch.float64, generator=gen) for _ in range(2)]
    guide = [torch.randn(5, 6, dtype=torch.float64, generator=gen) for _ in range(2)]
    guide[1][3] = guide[1][0]
    texts = [torch.arange(5), torch.tensor([10, 11, 12, 10, 14])]  # positive 3 is positive 0's text
    masked = {}
    for margin in (0.0, 1e-300, 0.05, -1e-300):
        _, stats = gist_loss(student, guide, margin=margin, margin_strategy=strategy, text_ids=texts,
                             backend=backend, return_stats=True, contrast_anchors=False, contrast_positives=False)
        masked[margin] = stats.masked["ap"]
    # rows 0 and 3 each see the other's copy of their positive
    assert masked[1e-300] == masked[0.0] + 2 and masked[-1e-300] == masked[0.0]
    assert masked[0.05] >= masked[1e-300]


def test_the_mini_batches_do_not_move_the_loss(guide32, tmp_path):
    """The same texts cut into other mini-batches, so each padded to another width and embedded by the guide
    (all-MiniLM-L6-v2, float32) with another rounding: the same entries masked and the same loss, at margin 0 where
    positive 3 repeats positive 0 and ties with theta_0. With ties decided by the guide's vectors, this batch's masks
    moved with the mini-batch size."""
    student, guide = tiny_model(tmp_path / "student", dtype=torch.float32, hidden_size=16, num_layers=1), guide32
    columns = [["money old", "new river money song loan warm over", "the blue mat river sky cloud", "bank old green dog",
                "old", "mat the jumps money cloud slow song"],
               ["mat", "old dog money", "money sky fox", "mat", "old bank dog over over river song",
                "the bank lazy sky mat"]]
    results = {}
    for mini_batch_size in (1, 2, 3, 6):
        loss = FusedCachedGISTLoss(student, guide, mini_batch_size=mini_batch_size, backend="torch")
        value, grads = run_loss(loss, student, columns, seed=0)
        results[mini_batch_size] = value, grads, loss.last_stats.masked
    for mini_batch_size, (value, grads, masked) in results.items():
        assert masked == results[1][2], f"mini_batch_size={mini_batch_size}"
        assert_close(f"mini_batch_size={mini_batch_size}", results[1][:2], (value, grads),
                     tolerance("models", torch.float32))
