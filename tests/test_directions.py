"""Every direction: sentence-transformers' ``directions``, ``partition_mode``, hardness and ``dot_score``.

Without a guide the loss is sentence-transformers' ``MultipleNegativesRankingLoss``: the oracle, ``gist_loss`` on
the PyTorch path and under the Triton interpreter, and ``FusedCachedMultipleNegativesRankingLoss`` on a tiny model
must equal it (``compute_loss_from_embeddings`` and ``CachedMultipleNegativesRankingLoss``), loss and gradients, in
float64, for every direction subset that contains query_to_doc under both partitions, every hardness mode at
strengths 0, 5 and 9, cos_sim and dot_score, k = 0, 1, 2: every subset with every hardness, and every pair of values
of any two of these factors (a pairwise design of their product). With a guide, where sentence-transformers has no such loss, the oracle is the reference.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from helpers import assert_close, make_inputs, one_thread, tolerance  # noqa: F401  (one_thread: autouse)
from helpers_models import computed_on
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.util import cos_sim, dot_score

import cgist
from cgist import GistOptions
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.reference import gist_loss_reference

TIGHT = tolerance("embeddings", "fp64")
TRITON = tolerance("triton", "fp64")
MODELS = tolerance("models", "fp64")
SCALE = 20.0

#: Every direction subset with query_to_doc, under each partition that sentence-transformers allows for it.
SUBSETS = [("query_to_doc", *extra) for n in range(4)
           for extra in itertools.combinations(("query_to_query", "doc_to_query", "doc_to_doc"), n)]
PLANS = [(subset, partition) for subset in SUBSETS for partition in ("joint", "per_direction")
         if partition == "joint" or not set(subset) & {"query_to_query", "doc_to_doc"}]
HARDNESS = [(None, 0.0)] + [(mode, s) for mode in ("in_batch_negatives", "hard_negatives", "all_negatives")
                            for s in (0.0, 5.0, 9.0)]


def _plan_id(plan) -> str:
    subset, partition = plan
    short = {"query_to_doc": "q2d", "query_to_query": "q2q", "doc_to_query": "d2q", "doc_to_doc": "d2d"}
    return "+".join(short[d] for d in subset) + f"-{partition}"


def _hardness_id(hardness) -> str:
    mode, strength = hardness
    return "no_hardness" if mode is None else f"{mode}{strength:g}"


@pytest.fixture(autouse=True)
def quiet_hardness_warning(caplog):
    """sentence-transformers warns at every strength-0 hardness mode; the cases make them on purpose."""
    caplog.set_level(logging.ERROR, logger="sentence_transformers")


def _st_mnrl(similarity, **kw) -> MultipleNegativesRankingLoss:
    return MultipleNegativesRankingLoss(torch.nn.Identity(), scale=SCALE,
                                        similarity_fct=cos_sim if similarity == "cos" else dot_score, **kw)


def _options(subset, partition, mode, strength, similarity, **kw) -> GistOptions:
    return GistOptions(temperature=1 / SCALE, contrast_anchors=False, contrast_positives=False, directions=subset,
                       partition_mode=partition, hardness_mode=mode, hardness_strength=strength,
                       similarity=similarity, **kw)


def _grads(loss_fn, columns):
    leaves = [c.detach().clone().requires_grad_() for c in columns]
    loss = loss_fn(leaves)
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _gist_loss_kwargs(subset, partition, mode, strength, similarity="cos") -> dict:
    return dict(temperature=1 / SCALE, contrast_anchors=False, contrast_positives=False, directions=subset,
                partition_mode=partition, hardness_mode=mode, hardness_strength=strength, similarity=similarity,
                mask_self=False)


def _pairwise_grid() -> list:
    """Every (plan, hardness) pair once, with the similarity and the number of negative columns k varied across them
    so that every pair of values of any two of the four factors occurs (a pairwise design of the full product, a sixth
    of its cases: ``test_the_pairwise_grid_covers_every_pair`` checks it)."""
    return [pytest.param(plan, ("cos", "dot")[(p + h // 2) % 2], (p + h) % 3, hardness,
                         id=f"{_plan_id(plan)}-{('cos', 'dot')[(p + h // 2) % 2]}-k{(p + h) % 3}-{_hardness_id(hardness)}")
            for p, plan in enumerate(PLANS) for h, hardness in enumerate(HARDNESS)]


def test_the_pairwise_grid_covers_every_pair():
    cases = [case.values for case in _pairwise_grid()]
    factors = (PLANS, ("cos", "dot"), (0, 1, 2), HARDNESS)
    for a, b in itertools.combinations(range(4), 2):
        assert {(c[a], c[b]) for c in cases} == set(itertools.product(factors[a], factors[b])), (a, b)


@pytest.mark.parametrize("plan,similarity,k,hardness", _pairwise_grid())
def test_without_guide_equals_multiple_negatives_ranking_loss(plan, similarity, k, hardness):
    """The oracle and gist_loss's PyTorch path (the kernels: the next test)."""
    (subset, partition), (mode, strength) = plan, hardness
    student, _ = make_inputs(7, 7, 12, 4, k, seed=k + 3)
    if similarity == "dot":
        student = [s / 3 for s in student]  # dot products of unit scale, so the softmax is not saturated
    st = _st_mnrl(similarity, directions=subset, partition_mode=partition, hardness_mode=mode,
                  hardness_strength=strength)
    want = _grads(lambda e: st.compute_loss_from_embeddings(e, None), student)
    options = _options(subset, partition, mode, strength, similarity)
    assert_close("oracle", want, _grads(lambda e: gist_loss_reference(e, None, options), student), TIGHT)
    kw = _gist_loss_kwargs(subset, partition, mode, strength, similarity)
    assert_close("torch", want, _grads(lambda e: cgist.gist_loss(e, None, backend="torch", **kw), student), TIGHT)


@pytest.mark.parametrize("hardness", [(None, 0.0), ("in_batch_negatives", 5.0), ("hard_negatives", 9.0),
                                      ("all_negatives", 5.0)], ids=_hardness_id)
@pytest.mark.parametrize("plan", PLANS, ids=_plan_id)
def test_without_guide_under_the_interpreter(plan, hardness):
    student, _ = make_inputs(7, 7, 12, 4, 2, seed=1)
    st = _st_mnrl("cos", directions=plan[0], partition_mode=plan[1], hardness_mode=hardness[0],
                  hardness_strength=hardness[1])
    want = _grads(lambda e: st.compute_loss_from_embeddings(e, None), student)
    kw = _gist_loss_kwargs(*plan, *hardness)
    assert_close("triton", want, _grads(lambda e: cgist.gist_loss(e, None, backend="triton", **kw), student), TRITON)


# With a guide: the oracle against both backends ---------------------------------------------------------------

GUIDED = {
    "all-joint": dict(directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"), margin=0.05),
    "qwen3": dict(directions=("query_to_doc", "query_to_query", "doc_to_doc"), margin=0.1, mask_self=True),
    "d2q-per-direction": dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
                              margin=0.05, hardness_mode="in_batch_negatives", hardness_strength=5.0),
    "hard-negatives": dict(directions=("query_to_doc", "doc_to_doc"), margin=-0.1, hardness_mode="hard_negatives",
                           hardness_strength=9.0),
    "relative-all-negatives": dict(directions=("query_to_doc", "doc_to_query"), margin=0.2,
                                   margin_strategy="relative", hardness_mode="all_negatives", hardness_strength=5.0),
}


def _guided_inputs(ties: bool, world: int = 1):
    """Rows of one rank (offset = B) among ``world`` ranks, every rank's anchors as the last column; with ``ties``,
    candidates whose guide vectors equal an anchor's positive (bitwise once normalised)."""
    batch = 5
    student, guide = make_inputs(batch * world, batch * world, 12, 8, 2, seed=9)
    anchors_all, guide_all = student[0], guide[0]
    offset = batch if world > 1 else 0
    if ties:
        guide[2][3] = 2.0 * guide[1][offset + 1]  # a negative with the guide vector of anchor 1's positive
        guide_all[offset + 4] = guide[1][offset + 2]  # an anchor of this rank copying anchor 2's positive
    local = [anchors_all[offset : offset + batch], *student[1:]]
    local_guide = [guide_all[offset : offset + batch], *guide[1:]]
    return local + [anchors_all], local_guide + [guide_all], offset


@pytest.mark.parametrize("dims", [None, (12, 6)], ids=["one-dim", "matryoshka"])
@pytest.mark.parametrize("world", [1, 3], ids=["local", "rank1of3"])
@pytest.mark.parametrize("name", list(GUIDED))
def test_with_a_guide_the_backends_equal_the_oracle(name, world, dims):
    student, guide, offset = _guided_inputs(ties=True, world=world)
    everyone = bool({"query_to_query", "doc_to_query"} & set(GUIDED[name]["directions"]))
    if not everyone:  # no direction scores against every rank's anchors: no such column
        student, guide = student[:-1], guide[:-1]
    options = GistOptions(temperature=0.05, contrast_anchors=False, contrast_positives=False, offset=offset,
                          all_anchors=everyone, matryoshka_dims=dims, **GUIDED[name])
    want = _grads(lambda e: gist_loss_reference(e, guide, options), student)
    loss, grads, _ = loss_and_grads("torch", student, guide, options, need_grads=True)
    assert_close("torch", want, (loss, grads), TIGHT)
    # the kernels, under the interpreter
    loss, grads, _ = loss_and_grads("triton", student, guide, options, need_grads=True)
    assert_close("triton", want, (loss, grads), TRITON)


def test_directions_with_gist_blocks_and_two_passes():
    """GIST's contrast blocks beside the directions that do not hold them, on a budget of two passes."""
    student, guide, offset = _guided_inputs(ties=False, world=2)
    options = GistOptions(temperature=0.05, margin=0.05, offset=offset, all_anchors=True,
                          directions=("query_to_doc", "doc_to_query"), block_bytes=1)
    want = _grads(lambda e: gist_loss_reference(e, guide, options), student)
    loss, grads, _ = loss_and_grads("torch", student, guide, options, need_grads=True)
    assert_close("torch", want, (loss, grads), TIGHT)


# Bad combinations: one clear error each ----------------------------------------------------------------------

BAD = [
    pytest.param(dict(directions=("query_to_query",)), ValueError, r"directions must include 'query_to_doc'",
                 id="no-q2d"),
    pytest.param(dict(directions=("query_to_doc", "sideways")), ValueError, r"directions must be among .*'sideways'",
                 id="unknown"),
    pytest.param(dict(directions=("query_to_doc", "query_to_doc")), ValueError, r"directions must be distinct",
                 id="repeated"),
    pytest.param(dict(directions="query_to_doc"), TypeError, r"directions must be a non-empty sequence", id="str"),
    pytest.param(dict(directions=("query_to_doc", "query_to_query"), contrast_positives=False), ValueError,
                 r"contrast_anchors=True adds the anchor-anchor block, which the direction 'query_to_query' contains",
                 id="aa-and-q2q"),
    pytest.param(dict(directions=("query_to_doc", "doc_to_doc"), contrast_anchors=False), ValueError,
                 r"contrast_positives=True adds the positive-positive block, which the direction 'doc_to_doc'",
                 id="pp-and-d2d"),
    pytest.param(dict(partition_mode="per_direction"), ValueError,
                 r"partition_mode='per_direction' requires .*contrast_anchors, contrast_positives", id="per-direction-gist"),
    pytest.param(dict(directions=("query_to_doc", "query_to_query"), partition_mode="per_direction",
                      contrast_anchors=False, contrast_positives=False), ValueError,
                 r"partition_mode='per_direction' requires .*query_to_query", id="per-direction-q2q"),
    pytest.param(dict(partition_mode="both"), ValueError, r"partition_mode must be one of", id="partition"),
    pytest.param(dict(hardness_mode="hardest"), ValueError, r"hardness_mode must be one of", id="hardness-mode"),
    pytest.param(dict(hardness_mode="hard_negatives", hardness_strength=-1.0), ValueError,
                 r"hardness_strength must be a finite number >= 0, got -1", id="negative-strength"),
    pytest.param(dict(similarity="euclid"), ValueError,
                 r"similarity must be one of \('cos', 'dot', 'maxsim', 'mean_maxsim', 'xtr'\)", id="similarity"),
]


@pytest.mark.parametrize(("overrides", "error", "match"), BAD)
def test_bad_combinations(overrides, error, match):
    with pytest.raises(error, match=match):
        GistOptions(**overrides)


def test_all_anchors_arguments_are_checked():
    student, guide, offset = _guided_inputs(ties=False, world=2)
    with pytest.raises(ValueError, match="all_anchors is only read by the directions"):
        cgist.gist_loss(student[:-1], guide[:-1], offset=offset, all_anchors=student[-1], all_anchors_guide=guide[-1])
    with pytest.raises(ValueError, match="all_anchors needs all_anchors_guide"):
        cgist.gist_loss(student[:-1], guide[:-1], offset=offset, contrast_anchors=False,
                        directions=("query_to_doc", "query_to_query"), all_anchors=student[-1])
    with pytest.raises(ValueError, match=r"all_anchors has 7 rows, but the positives have 10"):
        cgist.gist_loss(student[:-1], guide[:-1], offset=offset, contrast_anchors=False,
                        directions=("query_to_doc", "query_to_query"), all_anchors=student[-1][:7],
                        all_anchors_guide=guide[-1][:7])


# The drop-in for CachedMultipleNegativesRankingLoss, on a tiny model -------------------------------------------

TEXTS = [
    ["a cat sat on the mat", "dogs bark at night", "two birds on a wire", "the sun is up", "rain falls", "snow"],
    ["cats like mats", "a dog barks", "birds fly south", "sunlight at noon", "wet rain", "cold snow"],
    ["tax forms", "a red car", "the stock market", "old maps", "piano keys", "a green door"],
]


def _train_step(loss, model, columns):
    model.zero_grad()
    with computed_on(loss):
        value = loss([model.preprocess(texts) for texts in columns], None)
    value.backward()
    return value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("columns, hardness", [(2, (None, 0.0)), (3, ("all_negatives", 5.0)),
                                               (3, ("hard_negatives", 9.0))],
                         ids=["k0-no_hardness", "k1-all_negatives5", "k1-hard_negatives9"])
@pytest.mark.parametrize("plan", PLANS, ids=_plan_id)
def test_fused_cached_mnrl_equals_sentence_transformers(student, plan, columns, hardness):
    kw = dict(mini_batch_size=4, directions=plan[0], partition_mode=plan[1], hardness_mode=hardness[0],
              hardness_strength=hardness[1])
    want = _train_step(CachedMultipleNegativesRankingLoss(student, **kw), student, TEXTS[:columns])
    got = _train_step(cgist.FusedCachedMultipleNegativesRankingLoss(student, backend="torch", **kw), student,
                      TEXTS[:columns])
    assert_close("model", want, got, MODELS)


def test_fused_cached_mnrl_dot_score_and_matryoshka(student):
    kw = dict(similarity_fct=dot_score, scale=1.0, mini_batch_size=4, directions=("query_to_doc", "doc_to_query"))
    assert_close("dot_score", _train_step(CachedMultipleNegativesRankingLoss(student, **kw), student, TEXTS),
                 _train_step(cgist.FusedCachedMultipleNegativesRankingLoss(student, backend="torch", **kw), student,
                             TEXTS), MODELS)
    dims = dict(matryoshka_dims=[32, 16, 8], matryoshka_weights=[1.0, 0.5, 0.25])
    kw = dict(mini_batch_size=4, directions=("query_to_doc", "query_to_query", "doc_to_doc"),
              hardness_mode="in_batch_negatives", hardness_strength=5.0)
    fused = MatryoshkaLoss(student, cgist.FusedCachedMultipleNegativesRankingLoss(student, backend="torch", **kw), **dims)
    assert type(fused.loss.calculate_loss).__name__ == "FusedMatryoshka"
    assert_close("matryoshka", _train_step(MatryoshkaLoss(student, CachedMultipleNegativesRankingLoss(student, **kw),
                                                          **dims), student, TEXTS),
                 _train_step(fused, student, TEXTS), MODELS)


def test_fused_cached_mnrl_arguments(student):
    """sentence-transformers' parameters and defaults, in its order, then the backend and the budget (the rest of the
    drop-in contract, for every drop-in: tests/test_dropin.py)."""
    import inspect

    theirs = [(n, p.default) for n, p in inspect.signature(CachedMultipleNegativesRankingLoss.__init__).parameters.items()]
    ours = [(n, p.default) for n, p in inspect.signature(cgist.FusedCachedMultipleNegativesRankingLoss.__init__)
            .parameters.items()]
    assert ours == theirs + [("backend", "auto"), ("block_bytes", None)]


# FusedCachedGISTLoss with directions, on real models: against the oracle -------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "d2q-per-direction", "hard-negatives"])
def test_fused_gist_with_directions_equals_the_oracle_on_models(student, guide, name):
    """Every parameter gradient of the student, against the oracle's loss over the models' embeddings."""
    settings = dict(GUIDED[name])
    options = GistOptions(temperature=0.05, contrast_anchors=False, contrast_positives=False, **settings)
    features = [student.preprocess(texts) for texts in TEXTS]
    student.zero_grad()
    embeddings = [student(dict(f))["sentence_embedding"] for f in features]
    with torch.no_grad():
        guide_embeddings = [guide(dict(f))["sentence_embedding"] for f in features]
    want_loss = gist_loss_reference(embeddings, guide_embeddings, options)
    want_loss.backward()
    want = (want_loss.detach(), [p.grad.clone() for p in student.parameters() if p.grad is not None])
    loss = cgist.FusedCachedGISTLoss(student, guide, temperature=0.05, mini_batch_size=4, contrast_anchors=False,
                                     contrast_positives=False, backend="torch", **settings)
    assert_close("model", want, _train_step(loss, student, TEXTS), MODELS)
