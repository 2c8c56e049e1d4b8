"""The drop-in contract: each fused loss behaves as sentence-transformers' class it replaces, attribute for attribute.

- A hyperparameter assigned after construction takes effect on the next call (loss and every parameter gradient equal
  to sentence-transformers' loss object after the same assignment), with and without ``MatryoshkaLoss``.
- A bad assigned value gets the constructor's error at the next call.
- What the fused stage does not compute (another similarity function, a custom cross-entropy, a negative
  temperature) runs sentence-transformers' own loss computation, with its loss and gradients and one warning.
- sentence-transformers' own argument checks keep its exception types and messages.
- ``get_config_dict`` is sentence-transformers' at the defaults; cgist's keys appear only when changed.
- A loss built as sentence-transformers' regression tests build one (``__new__``, attributes by hand) works.

Every model runs in float64 (a tiny BERT student, all-MiniLM-L6-v2 as the guide), so the loss stage is the only
difference.
"""

from __future__ import annotations

import functools
import inspect
import logging

import pytest
import torch
from helpers import assert_close, one_thread, tolerance  # noqa: F401  (one_thread: autouse, the module on one thread)
from helpers_models import computed_on, random_texts, run_loss
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    CachedMultipleNegativesSymmetricRankingLoss,
    GISTEmbedLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    MultipleNegativesSymmetricRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score, euclidean_sim, manhattan_sim

import cgist
from cgist import (
    FusedCachedGISTLoss,
    FusedCachedMultipleNegativesRankingLoss,
    FusedGISTEmbedLoss,
    FusedMultipleNegativesRankingLoss,
    FusedMultipleNegativesSymmetricRankingLoss,
)
from cgist.compat import release_rules
from cgist.losses.base import FUSED
from cgist.losses.base import UNFUSED as UNFUSED_PATH  # UNFUSED below: the settings that are not fused
from cgist.losses.ranking import FusedCachedMultipleNegativesSymmetricRankingLoss

MATRYOSHKA = dict(matryoshka_dims=[32, 16, 8], matryoshka_weights=[1.0, 0.5, 0.25])

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODELS = tolerance("models", "fp64")


#: The texts of the comparisons: ``short_texts(negatives)``, columns of 9 short sentences (3 to 9 words from the
#: first 21 of WORDS) without duplicates.
short_texts = functools.partial(random_texts, batch=9, duplicates=False, vocabulary=21, max_words=9)


#: Each drop-in beside sentence-transformers' class: (name, theirs, ours, needs a guide).
PAIRS = {
    "gist": (CachedGISTEmbedLoss, FusedCachedGISTLoss, True),
    "cmnrl": (CachedMultipleNegativesRankingLoss, FusedCachedMultipleNegativesRankingLoss, False),
    "symmetric": (CachedMultipleNegativesSymmetricRankingLoss, FusedCachedMultipleNegativesSymmetricRankingLoss, False),
    "plain-gist": (GISTEmbedLoss, FusedGISTEmbedLoss, True),
    "mnrl": (MultipleNegativesRankingLoss, FusedMultipleNegativesRankingLoss, False),
    "plain-symmetric": (MultipleNegativesSymmetricRankingLoss, FusedMultipleNegativesSymmetricRankingLoss, False),
}
#: The plain pairs: no GradCache, so no mini-batch arguments.
PLAIN = ("plain-gist", "mnrl", "plain-symmetric")
CACHED = [pair for pair in PAIRS if pair not in PLAIN]


def _build(pair: str, fused: bool, student, guide, matryoshka: bool = False, **kw):
    theirs, ours, guided = PAIRS[pair]
    if pair in PLAIN:  # the tests give the cached losses their mini-batches; the plain ones have none
        kw = {k: v for k, v in kw.items() if k not in ("mini_batch_size", "mini_batch_num_tokens")}
    cls = ours if fused else theirs
    loss = cls(student, guide, **kw) if guided else cls(student, **kw)
    return MatryoshkaLoss(student, loss, **MATRYOSHKA) if matryoshka else loss


def _inner(loss):
    return loss.loss if isinstance(loss, MatryoshkaLoss) else loss


def _assert_same(got, want) -> None:
    """Loss and every parameter gradient of two ``run_loss`` results, at the float64 model tolerance."""
    assert want[1], "no parameter has a gradient"
    assert_close("model", want, got, MODELS)


def _run(loss, student, columns, path: str = FUSED):
    return run_loss(loss, student, columns, seed=7, path=path)


# Assigned hyperparameters take effect ---------------------------------------------------------------------------

#: (drop-in, attribute, value assigned after construction, constructor keywords, columns).
ASSIGNMENTS = [
    ("gist", "temperature", 0.05, {}, 2),
    ("gist", "margin", 0.3, {}, 3),
    ("gist", "margin_strategy", "relative", dict(margin=0.1), 2),
    ("gist", "contrast_anchors", False, {}, 2),
    ("gist", "contrast_positives", False, {}, 3),
    ("gist", "mini_batch_size", 2, {}, 2),
    ("gist", "mini_batch_num_tokens", 24, {}, 2),
    ("gist", "gather_across_devices", True, dict(margin=0.1), 2),
    ("cmnrl", "scale", 5.0, {}, 3),
    ("cmnrl", "similarity_fct", dot_score, dict(scale=1.0), 2),
    ("cmnrl", "directions", ("query_to_doc", "query_to_query", "doc_to_doc"), {}, 3),
    ("cmnrl", "partition_mode", "per_direction", dict(directions=("query_to_doc", "doc_to_query")), 2),
    ("cmnrl", "hardness_mode", "all_negatives", dict(hardness_strength=5.0), 3),
    ("cmnrl", "hardness_strength", 9.0, dict(hardness_mode="hard_negatives"), 3),
    ("cmnrl", "mini_batch_size", 2, {}, 2),
    ("cmnrl", "mini_batch_num_tokens", 24, {}, 2),
    ("cmnrl", "gather_across_devices", True, dict(directions=("query_to_doc", "doc_to_query")), 2),
    ("symmetric", "scale", 5.0, {}, 2),
    ("symmetric", "similarity_fct", dot_score, dict(scale=1.0), 3),
    ("symmetric", "mini_batch_size", 2, {}, 2),
    ("plain-gist", "temperature", 0.05, {}, 2),
    ("plain-gist", "margin", 0.3, {}, 3),
    ("plain-gist", "margin_strategy", "relative", dict(margin=0.1), 2),
    ("plain-gist", "contrast_positives", False, {}, 3),
    ("plain-gist", "gather_across_devices", True, dict(margin=0.1), 2),
    ("mnrl", "scale", 5.0, {}, 3),
    ("mnrl", "similarity_fct", dot_score, dict(scale=1.0), 2),
    ("mnrl", "directions", ("query_to_doc", "query_to_query", "doc_to_doc"), {}, 3),
    ("mnrl", "hardness_mode", "all_negatives", dict(hardness_strength=5.0), 3),
    ("plain-symmetric", "scale", 5.0, {}, 2),
]


def _assignment_params() -> list:
    """Each assignment once, bare or inside MatryoshkaLoss by turns within its drop-in (starting bare or wrapped by
    turns across the drop-ins; a drop-in with one assignment takes both), so that every drop-in runs both ways and
    every attribute at least once: whether the wrapper forwards an assignment to the inner loss does not depend on
    which attribute it is."""
    params = []
    for turn, pair in enumerate(dict.fromkeys(case[0] for case in ASSIGNMENTS)):
        cases = [case for case in ASSIGNMENTS if case[0] == pair]
        ways = [(case, (i + turn) % 2 == 1) for i, case in enumerate(cases)] if len(cases) > 1 else \
            [(cases[0], False), (cases[0], True)]
        for case, matryoshka in ways:
            _, name, value, _, columns = case
            shown = getattr(value, "__name__", value if not isinstance(value, tuple) else "+".join(v[:5] for v in value))
            way = "matryoshka" if matryoshka else "plain"
            params.append(pytest.param(case, matryoshka, id=f"{pair}-{name}={shown}-k{columns - 2}-{way}"))
    return params


def test_the_assignments_run_every_drop_in_both_ways_and_every_attribute():
    runs = [param.values for param in _assignment_params()]
    assert sorted({case[:2] for case, _ in runs}) == sorted({case[:2] for case in ASSIGNMENTS})
    assert {(case[0], matryoshka) for case, matryoshka in runs} == {(pair, m) for pair in PAIRS for m in (False, True)}
    # the one attribute whose assignment should keep the loss under the wrapper (and change it bare) runs both ways
    assert {matryoshka for case, matryoshka in runs if case[1] == "similarity_fct"} == {False, True}


@pytest.mark.parametrize(("case", "matryoshka"), _assignment_params())
def test_an_assigned_hyperparameter_takes_effect(case, matryoshka, student, guide):
    pair, name, value, kw, columns = case
    texts = short_texts(columns - 2)
    theirs = _build(pair, False, student, guide, matryoshka, mini_batch_size=4, **kw)
    ours = _build(pair, True, student, guide, matryoshka, mini_batch_size=4, backend="torch", **kw)
    before = _run(ours, student, texts)
    setattr(_inner(theirs), name, value)
    setattr(_inner(ours), name, value)
    assert getattr(_inner(ours), name) == value
    after = _run(ours, student, texts)
    _assert_same(after, _run(theirs, student, texts))
    # The embedding stage's settings keep the loss, and so does dot_score under MatryoshkaLoss, which normalises
    # each truncated embedding (dot products of unit vectors are cosines); the rest must change it.
    keeps = name in ("mini_batch_size", "mini_batch_num_tokens", "gather_across_devices")
    if not (keeps or (matryoshka and name == "similarity_fct")):
        assert not torch.isclose(after[0], before[0]), "the assignment should change the loss"


# cgist's own options: the table ----------------------------------------------------------------------------------

#: The base of each drop-in in the options walk: GIST guided by its own embeddings without the contrast blocks (so
#: every example is valid) and with a margin below -1 (only the masks drop the self-pairs and the duplicate).
OWN_BASE = {"gist": dict(contrast_anchors=False, contrast_positives=False, margin=-1.5), "ranking": {}}
OWN_CASES = [(pair, option.name) for pair, (_, ours, _) in PAIRS.items() for option in ours.own_options()]


def _stage_arguments(loss, student, texts, monkeypatch) -> tuple[object, tuple]:
    """The loss stage's arguments of one step of ``loss`` (its options and backend), and the step's loss and
    gradients."""
    seen = []
    real = cgist.losses.base.run
    monkeypatch.setattr(cgist.losses.base, "run", lambda call, backend, **k: seen.append((call.options, backend))
                        or real(call, backend, **k))
    result = _run(loss, student, texts)
    monkeypatch.setattr(cgist.losses.base, "run", real)
    (arguments,) = seen
    return arguments, result


@pytest.mark.parametrize(("pair", "name"), OWN_CASES, ids=[f"{pair}-{name}" for pair, name in OWN_CASES])
def test_every_own_option_assigned_equals_it_passed_to_the_constructor(pair, name, student, monkeypatch):
    """Every option of the table (``cgist.losses.options.OPTIONS``), on every drop-in that takes it: assigned after
    construction, the next step's loss stage gets the arguments, loss and gradients of a drop-in built with it, and
    not those of the default."""
    _, ours, guided = PAIRS[pair]
    option = next(o for o in ours.own_options() if o.name == name)
    texts = short_texts(1)
    texts[0][5] = texts[0][1]  # a duplicate anchor: mask_duplicates has something to mask
    base = OWN_BASE[ours.family]

    def build(**kw):
        return _build(pair, True, student, "self" if guided else None, mini_batch_size=4, **base, **kw)

    assigned, default = build(), build()
    setattr(assigned, name, option.example)
    assert getattr(assigned, name) == option.example
    want, want_result = _stage_arguments(build(**{name: option.example}), student, texts, monkeypatch)
    got, got_result = _stage_arguments(assigned, student, texts, monkeypatch)
    assert got == want
    assert got != _stage_arguments(default, student, texts, monkeypatch)[0], f"{name}={option.example!r} is the default"
    _assert_same(got_result, want_result)


@pytest.mark.parametrize("pair", PAIRS)
def test_the_constructor_is_sentence_transformers_then_the_own_options_keyword_only(pair):
    theirs, ours, _ = PAIRS[pair]
    parameters = list(inspect.signature(ours.__init__).parameters.values())
    expected = list(inspect.signature(theirs.__init__).parameters.values())
    assert [(p.name, p.default, p.kind) for p in parameters[:len(expected)]] == \
        [(p.name, p.default, p.kind) for p in expected]
    assert [(p.name, p.default, p.kind) for p in parameters[len(expected):]] == \
        [(o.name, o.default, inspect.Parameter.KEYWORD_ONLY) for o in ours.own_options()]


def test_an_unknown_keyword_names_itself_and_the_class(student):
    with pytest.raises(TypeError, match="^FusedCachedGISTLoss\\(\\): .*mask_selff"):
        FusedCachedGISTLoss(student, "self", mask_selff=True)
    with pytest.raises(TypeError, match="^FusedCachedMultipleNegativesRankingLoss\\(\\): .*mask_self"):
        FusedCachedMultipleNegativesRankingLoss(student, mask_self=True)  # a GIST option, not a ranking one
    with pytest.raises(TypeError, match="^FusedCachedGISTLoss\\(\\): .*guide"):
        FusedCachedGISTLoss(student)


def test_the_first_bad_argument_is_the_familys_then_the_embedding_stages(student):
    """The family's arguments are checked first, as before the protocol: a bad guide before a bad mini-batch."""
    with pytest.raises(ValueError, match="guide must be"):
        FusedCachedGISTLoss(student, "bogus", mini_batch_size=0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        FusedCachedMultipleNegativesRankingLoss(student, scale="20", mini_batch_size=0)


def test_a_sentence_transformers_class_taking_an_own_option_itself_is_refused():
    """A sentence-transformers release whose class takes one of cgist's own options itself (here ``block_bytes``)
    would give the argument two meanings: the drop-in class over it is refused where it is defined, naming the
    options; a parameter of another name is sentence-transformers' own, as any."""
    from cgist.losses.ranking import RankingFamily
    from cgist.losses.steps import CachedStep

    class WithBlocks(CachedMultipleNegativesRankingLoss):
        def __init__(self, model, scale: float = 20.0, block_bytes: int | None = None) -> None:
            super().__init__(model, scale=scale)

    class WithChunks(CachedMultipleNegativesRankingLoss):
        def __init__(self, model, scale: float = 20.0, chunk_bytes: int | None = None) -> None:
            super().__init__(model, scale=scale)

    with pytest.raises(TypeError, match=r"^WithBlocks takes \['block_bytes'\] itself, which are also options of "
                                        r"cgist's table \(cgist.losses.options\): this sentence-transformers release "
                                        "is not supported by this cgist$"):
        class FusedWithBlocks(RankingFamily, CachedStep, WithBlocks):
            pass

    class FusedWithChunks(RankingFamily, CachedStep, WithChunks):
        pass

    assert FusedWithChunks.replaces is WithChunks
    assert list(inspect.signature(FusedWithChunks.__init__).parameters)[:4] == ["self", "model", "scale", "chunk_bytes"]


#: ``calculate_loss`` alone (no batch) of the GIST drop-ins guided by the student's own embeddings: (what is passed as
#: ``reps_guided``, the error, its message).
CALCULATE_LOSS_ALONE = [
    pytest.param("nothing", TypeError, "takes reps_guided", id="no-reps_guided"),
    pytest.param("one column", ValueError, r"^reps and reps_guided must have the same length, got 2 and 1$",
                 id="reps_guided-one-column"),
    # guide="self" masks the duplicate texts by default, which are found by their token ids, in the batch.
    pytest.param("every column", ValueError, r"^mask_duplicates needs the batch's token ids: call the loss on the "
                 r"batch's features \(calculate_loss alone does not see them\), or pass mask_duplicates=False$",
                 id="mask_duplicates-without-the-batch"),
]


@pytest.mark.parametrize("reps_guided, error, match", CALCULATE_LOSS_ALONE)
@pytest.mark.parametrize("cls", [FusedCachedGISTLoss, FusedGISTEmbedLoss])
def test_gist_calculate_loss_without_what_it_reads_says_so(cls, reps_guided, error, match, student):
    reps = [[torch.randn(4, 8, dtype=torch.float64)] for _ in range(2)]
    given = {"nothing": None, "one column": reps[:1], "every column": reps}[reps_guided]
    with pytest.raises(error, match=match):
        cls(student, "self").calculate_loss(reps, given)
    if reps_guided == "every column":  # what the message advises computes the loss
        assert torch.isfinite(cls(student, "self", mask_duplicates=False).calculate_loss(reps, given))


# Bad assigned values get the constructor's error ---------------------------------------------------------------

BAD = [
    ("gist", "temperature", 0.0), ("gist", "temperature", -0.05), ("gist", "temperature", "0.01"), ("gist", "margin", float("nan")),
    ("gist", "margin_strategy", "percent"), ("gist", "contrast_anchors", None), ("gist", "mini_batch_size", 0),
    ("gist", "mini_batch_num_tokens", -5), ("gist", "gather_across_devices", "yes"), ("gist", "backend", "gpu"),
    ("gist", "block_bytes", 0), ("gist", "mask_self", "yes"), ("gist", "directions", ("doc_to_query",)),
    ("gist", "hardness_strength", -1.0),
    ("cmnrl", "scale", 0.0), ("cmnrl", "scale", float("inf")), ("cmnrl", "directions", ()),
    ("cmnrl", "directions", ("query_to_doc", "sideways")), ("cmnrl", "partition_mode", "split"),
    ("cmnrl", "hardness_mode", "hardest"), ("cmnrl", "hardness_strength", -1.0), ("cmnrl", "mini_batch_size", 1.5),
    ("cmnrl", "backend", "gpu"), ("symmetric", "scale", -1.0), ("symmetric", "block_bytes", -1),
    ("plain-gist", "temperature", 0.0), ("plain-gist", "margin_strategy", "percent"),
    ("plain-gist", "gather_across_devices", "yes"), ("plain-gist", "mask_self", "yes"), ("mnrl", "scale", 0.0),
    ("mnrl", "directions", ()), ("mnrl", "hardness_strength", -1.0), ("mnrl", "backend", "gpu"),
    ("plain-symmetric", "scale", -1.0),
]


@pytest.mark.parametrize("pair, name, value", BAD, ids=[f"{p}-{n}={v!r}" for p, n, v in BAD])
def test_a_bad_assigned_value_gets_the_constructors_error(pair, name, value, student, guide):
    guided = PAIRS[pair][2]
    with pytest.raises((TypeError, ValueError)) as built:
        _build(pair, True, student, guide, **{name: value})
    loss = _build(pair, True, student, guide, backend="torch")
    setattr(loss, name, value)
    features = [student.preprocess(t) for t in short_texts(0)]
    with pytest.raises(built.type) as called:
        loss(features, None)
    assert str(called.value) == str(built.value)
    if not guided:  # calculate_loss alone checks them too
        with pytest.raises(built.type, match="."):
            loss.calculate_loss([[torch.randn(3, 32, dtype=torch.float64)]] * 2)


# What the fused stage does not compute runs sentence-transformers' own code ------------------------------------------

def _negative_euclidean(a, b):
    return -(a - b).norm(dim=-1)


def _capturing_cross_entropy(scores, labels):
    return torch.nn.functional.cross_entropy(scores, labels)


#: (drop-in, attribute, value): each runs unfused, as sentence-transformers computes it.
UNFUSED = [
    ("cmnrl", "similarity_fct", euclidean_sim), ("cmnrl", "similarity_fct", manhattan_sim),
    ("cmnrl", "similarity_fct", lambda a, b: cos_sim(a, b) ** 3),
    ("symmetric", "similarity_fct", euclidean_sim),
    ("gist", "similarity_fct", _negative_euclidean), ("gist", "cross_entropy_loss", _capturing_cross_entropy),
    ("gist", "margin", float("inf")), ("gist", "margin", -float("inf")),
    ("mnrl", "similarity_fct", euclidean_sim), ("plain-symmetric", "similarity_fct", manhattan_sim),
    ("plain-gist", "similarity_fct", _negative_euclidean), ("plain-gist", "cross_entropy_loss", _capturing_cross_entropy),
    ("plain-gist", "margin", float("inf")),
]


@pytest.mark.parametrize("matryoshka", [False, True], ids=["plain", "matryoshka"])
@pytest.mark.parametrize("pair, name, value", UNFUSED,
                         ids=[f"{p}-{n}={getattr(v, '__name__', v)}" for p, n, v in UNFUSED])
def test_what_is_not_fused_runs_sentence_transformers_own_loss(pair, name, value, matryoshka, student, guide, caplog):
    texts = short_texts(1)
    theirs = _build(pair, False, student, guide, matryoshka, mini_batch_size=4)
    ours = _build(pair, True, student, guide, matryoshka, mini_batch_size=4, backend="torch")
    for loss in (_inner(theirs), _inner(ours)):
        if name in loss._modules:  # a module attribute gives way to a function, as in sentence-transformers
            del loss._modules[name]
        setattr(loss, name, value)
    with caplog.at_level(logging.WARNING, logger="cgist"):
        got = _run(ours, student, texts, path=UNFUSED_PATH)
        _run(ours, student, texts, path=UNFUSED_PATH)
    _assert_same(got, _run(theirs, student, texts))
    warnings = [r for r in caplog.records if "sentence-transformers' own loss computation" in r.getMessage()]
    assert len(warnings) == 1 and name in warnings[0].getMessage()
    assert _inner(ours).options is None and _inner(ours).last_stats is None


@pytest.mark.parametrize("similarity_fct", [functools.partial(cos_sim), functools.partial(dot_score)],
                         ids=["partial-cos_sim", "partial-dot_score"])
def test_a_partial_of_cos_sim_or_dot_score_is_fused(similarity_fct, student, caplog):
    texts = short_texts(0)
    ours = FusedCachedMultipleNegativesRankingLoss(student, similarity_fct=similarity_fct, mini_batch_size=4,
                                                   backend="torch")
    theirs = CachedMultipleNegativesRankingLoss(student, similarity_fct=similarity_fct, mini_batch_size=4)
    with caplog.at_level(logging.WARNING, logger="cgist"):
        _assert_same(_run(ours, student, texts), _run(theirs, student, texts))
    assert ours.options is not None and ours.last_stats is not None and not caplog.records


def test_an_unfused_setting_beyond_sentence_transformers_is_an_error(student):
    """Without a guide there is no sentence-transformers loss to run instead: one error names both."""
    loss = FusedCachedGISTLoss(student, None, backend="torch")
    del loss._modules["similarity_fct"]
    loss.similarity_fct = _negative_euclidean
    # mask_self=True is beyond sentence-transformers' loss only where its release leaves the self-pairs to the guide.
    self_pairs = "" if release_rules().self_pairs_excluded else ", mask_self=True"
    with pytest.raises(ValueError, match=r"similarity_fct=.*_negative_euclidean.*CachedGISTEmbedLoss, which would, "
                                         rf"has no guide=None{self_pairs}, mask_duplicates=True$"):
        loss([student.preprocess(t) for t in short_texts(0)], None)


# sentence-transformers' own checks, its types and messages --------------------------------------------------------

ST_CHECKS = [
    ("gist", dict(margin_strategy="percent")), ("gist", dict(mini_batch_num_tokens=0)),
    ("cmnrl", dict(scale=0.0)), ("cmnrl", dict(scale=-2.0)), ("cmnrl", dict(directions=())),
    ("cmnrl", dict(directions=("query_to_doc", "sideways"))), ("cmnrl", dict(directions=("doc_to_query",))),
    ("cmnrl", dict(partition_mode="split")),
    ("cmnrl", dict(directions=("query_to_doc", "query_to_query"), partition_mode="per_direction")),
    ("cmnrl", dict(hardness_mode="hardest")), ("cmnrl", dict(hardness_strength=-1.0)),
    ("cmnrl", dict(mini_batch_num_tokens=-3)), ("symmetric", dict(scale=0.0)),
    ("plain-gist", dict(margin_strategy="percent")), ("mnrl", dict(scale=0.0)), ("mnrl", dict(directions=())),
    ("mnrl", dict(partition_mode="split")), ("mnrl", dict(hardness_mode="hardest")),
    ("plain-symmetric", dict(scale=0.0)),
]


@pytest.mark.parametrize("pair, kw", ST_CHECKS, ids=[f"{p}-{k}" for p, k in ST_CHECKS])
def test_sentence_transformers_checks_keep_their_type_and_message(pair, kw, student, guide):
    with pytest.raises(Exception) as theirs:
        _build(pair, False, student, guide, **kw)
    with pytest.raises(theirs.type) as ours:
        _build(pair, True, student, guide, **kw)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value).startswith(str(theirs.value))


@pytest.mark.parametrize("pair", CACHED)
def test_a_static_embedding_model_gets_sentence_transformers_error(pair, guide):
    """Its inputs cannot be cut into mini-batches: sentence-transformers' constructor check, its message."""
    from helpers_models import guide_tokenizer
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding

    static = SentenceTransformer(modules=[StaticEmbedding(guide_tokenizer().backend_tokenizer, embedding_dim=16)],
                                 device="cpu")
    with pytest.raises(ValueError) as theirs:
        _build(pair, False, static, guide)
    with pytest.raises(ValueError) as ours:
        _build(pair, True, static, guide)
    assert "StaticEmbedding" in str(theirs.value) and str(ours.value) == str(theirs.value)


# Configuration ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", list(PAIRS))
def test_config_is_sentence_transformers_and_only_changed_own_keys(pair, student, guide):
    theirs = _build(pair, False, student, guide).get_config_dict()
    assert _build(pair, True, student, guide).get_config_dict() == theirs
    changed = _build(pair, True, student, guide, backend="torch", block_bytes=1 << 20).get_config_dict()
    assert changed == {**theirs, "backend": "torch", "block_bytes": 1 << 20}


def test_gist_config_names_a_changed_guide_mode_and_masks(student):
    config = FusedCachedGISTLoss(student, "self", mask_duplicates=False, directions=("query_to_doc", "doc_to_query"),
                                 contrast_anchors=False).get_config_dict()
    assert config["guide"] == "self" and config["guide_mode"] == "self" and config["mask_duplicates"] is False
    assert config["directions"] == ("query_to_doc", "doc_to_query") and "mask_self" not in config
    assert "backend" not in config and "hardness_mode" not in config


# A loss built by __new__ with its attributes set by hand -------------------------------------------------------------

def _by_hand(cls, margin: float, mini_batch_size: int):
    loss = cls.__new__(cls)
    torch.nn.Module.__init__(loss)
    loss.temperature, loss.similarity_fct = 0.01, torch.nn.CosineSimilarity(dim=-1)
    loss.mini_batch_size, loss.show_progress_bar = mini_batch_size, False
    loss.margin_strategy, loss.margin = "absolute", margin
    loss.contrast_anchors = loss.contrast_positives = True
    loss.gather_across_devices = False
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
    return loss


@pytest.mark.parametrize("mini_batch_size", [2, 32])
def test_a_loss_built_by_hand_works_as_sentence_transformers(mini_batch_size):
    g = torch.Generator().manual_seed(3)
    anchors, positives = (torch.randn(5, 16, generator=g, dtype=torch.float64) for _ in range(2))

    def run(cls):
        reps = [[anchors.clone().requires_grad_()], [positives.clone().requires_grad_()]]
        loss_obj = _by_hand(cls, 0.1, mini_batch_size)
        with computed_on(loss_obj):
            loss = loss_obj.calculate_loss(reps, [[anchors], [positives]], with_backward=True)
        return loss, [r[0].grad for r in reps]

    (ours, our_grads), (theirs, their_grads) = run(FusedCachedGISTLoss), run(CachedGISTEmbedLoss)
    assert_close("by hand", (theirs, their_grads), (ours, our_grads), MODELS)


# The symmetric drop-in --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("matryoshka", [False, True], ids=["plain", "matryoshka"])
@pytest.mark.parametrize("similarity", ["cos", "dot"])
@pytest.mark.parametrize("columns", [2, 3], ids=["k0", "k1"])
def test_symmetric_equals_sentence_transformers(columns, similarity, matryoshka, student):
    kw = dict(mini_batch_size=4, **(dict(similarity_fct=dot_score, scale=1.0) if similarity == "dot" else {}))
    texts = short_texts(columns - 2, batch=11)
    ours = _build("symmetric", True, student, None, matryoshka, backend="torch", **kw)
    assert type(_inner(ours).calculate_loss).__name__ == ("FusedMatryoshka" if matryoshka else "method")
    _assert_same(_run(ours, student, texts), _run(_build("symmetric", False, student, None, matryoshka, **kw),
                                                  student, texts))
    assert _inner(ours).last_stats is not None


def test_symmetric_has_the_deprecation_of_sentence_transformers(student):
    with pytest.warns(DeprecationWarning, match="directions=\\('query_to_doc', 'doc_to_query'\\)"):
        loss = cgist.FusedCachedMultipleNegativesSymmetricRankingLoss(student)
    assert loss.directions == ("query_to_doc", "doc_to_query") and loss.partition_mode == "per_direction"


def test_a_drop_in_class_is_checked_against_the_protocol_when_it_is_defined():
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cgist.losses.base import FusedDropIn
    from cgist.losses.columns import DenseColumns
    from cgist.losses.ranking import RankingFamily
    from cgist.losses.steps import PlainStep

    class NoTemperature(FusedDropIn):  # a family that forgets a required hook
        family = "ranking"
        columns = DenseColumns()
        _family_options = RankingFamily._family_options

    with pytest.raises(TypeError, match=r"lacks _embeddings_loss \(a hook of PlainStep\), temperature_tensor "
                                        r"\(a hook of FusedDropIn\)$"):
        type("Broken", (NoTemperature, PlainStep, MultipleNegativesRankingLoss), {})
    with pytest.raises(TypeError, match=r"lacks columns \(the family's component of cgist.losses.columns\)"):
        type("NoColumns", (RankingFamily, PlainStep, MultipleNegativesRankingLoss), {"columns": None})
    with pytest.raises(TypeError, match=r"lacks family"):
        type("Nameless", (RankingFamily, PlainStep, MultipleNegativesRankingLoss), {"family": ""})
