"""Matryoshka: ``MatryoshkaLoss(FusedCachedGISTLoss)`` and ``gist_loss(matryoshka_dims=...)`` in one pass.

Against sentence-transformers' ``MatryoshkaLoss(CachedGISTEmbedLoss)`` on real models (float64: the
loss and every parameter gradient, dropout on and off, weights, ``n_dims_per_step``, negatives, both
strategies), and the functional form against the oracle applied per dimension.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from helpers import (  # noqa: F401  (one_thread: autouse)
    LossStageCalls, Tol, assert_close, make_inputs, one_thread, precision, tolerance,
)
from helpers_models import computed_on, random_texts, run_loss
from sentence_transformers.sentence_transformer.losses import (
    CachedGISTEmbedLoss,
    CachedMultipleNegativesRankingLoss,
    MatryoshkaLoss,
)

import cgist
from cgist import FusedCachedGISTLoss, FusedCachedMultipleNegativesRankingLoss, GistOptions
from cgist.compat import release_rules
from cgist.losses.matryoshka import FusedMatryoshka
from cgist.stage.reference import gist_loss_reference

MINI_BATCH = 5  # random_texts puts each duplicate at the same place in its mini-batch as the original


def _compare(student, guide, columns, *, dims, weights=None, n_dims_per_step=-1, train=False, **options):
    """ST's MatryoshkaLoss over CachedGISTEmbedLoss and over FusedCachedGISTLoss: same loss, same gradients."""
    results = []
    student.train(train)
    try:
        for cls in (CachedGISTEmbedLoss, FusedCachedGISTLoss):
            inner = cls(student, guide, mini_batch_size=MINI_BATCH, **options)
            loss = MatryoshkaLoss(student, inner, dims, matryoshka_weights=weights, n_dims_per_step=n_dims_per_step)
            results.append((inner, *run_loss(loss, student, columns, seed=99)))
    finally:
        student.eval()
    (_, want, want_grads), (fused, got, grads) = results
    assert isinstance(fused.calculate_loss, FusedMatryoshka), "the Matryoshka decoration was not taken over"
    assert any(g.abs().max() > 0 for g in want_grads.values())
    assert_close("model", (want, want_grads), (got, grads), tolerance("models", "fp64"))
    return got


MODEL_CASES = [
    pytest.param(dict(dims=[32, 16, 8]), id="d32-16-8-eval"),
    pytest.param(dict(dims=[32, 16, 8], train=True), id="d32-16-8-dropout"),
    pytest.param(dict(dims=[8, 32, 20], weights=[0.5, 2.0, 1.0], margin=0.1), id="d8-32-20-weighted-m0.1"),
    pytest.param(dict(dims=[32, 24, 16, 4], n_dims_per_step=2, train=True, margin=0.05), id="d32-24-16-4-n2-dropout"),
    pytest.param(dict(dims=[16, 12], margin=0.2, margin_strategy="relative", contrast_anchors=False), id="d16-12-rel-noAA"),
]


@pytest.mark.parametrize("negatives", [0, 2], ids=["k0", "k2"])
@pytest.mark.parametrize("kwargs", MODEL_CASES)
def test_matryoshka_loss_matches_sentence_transformers(student, guide, kwargs, negatives):
    _compare(student, guide, random_texts(negatives, seed=5), **kwargs)


def test_one_loss_stage_call_per_step(student, guide, monkeypatch):
    """The fused path calls the loss stage once for all dimensions; sentence-transformers' loop once per dimension.
    The takeover reads the decorator's dimensions, weights and sampling, and has no other attribute."""
    counting = LossStageCalls(monkeypatch)
    inner = FusedCachedGISTLoss(student, guide, mini_batch_size=MINI_BATCH)
    loss = MatryoshkaLoss(student, inner, [32, 16, 8, 4])
    run_loss(loss, student, random_texts(1, seed=6), seed=0)
    assert counting.calls == 1
    taken_over = inner.calculate_loss
    assert (taken_over.matryoshka_dims, taken_over.matryoshka_weights, taken_over.n_dims_per_step) == \
        ((32, 16, 8, 4), (1, 1, 1, 1), -1)
    assert taken_over.fn == taken_over.decorator.fn
    with pytest.raises(AttributeError, match=r"^'FusedMatryoshka' object has no attribute 'set_dim'$"):
        taken_over.set_dim  # noqa: B018


@pytest.mark.parametrize("unrecognised", ["decoration", "release"])
def test_unrecognised_decoration_falls_back_to_one_call_per_dimension(unrecognised, student, guide, monkeypatch):
    """If the decoration is not the one the takeover knows, the per-dimension loop runs, with the same results:
    another decoration, or a sentence-transformers release without the module of the decorator the takeover knows
    (``sentence_transformers.sentence_transformer.losses.matryoshka``: sentence-transformers has moved its losses
    before)."""
    if unrecognised == "decoration":
        monkeypatch.setattr(FusedMatryoshka, "take_over", staticmethod(lambda loss, value: value))
    else:  # the import fails as for a module that is not there; MatryoshkaLoss, imported, still decorates
        monkeypatch.setitem(sys.modules, "sentence_transformers.sentence_transformer.losses.matryoshka", None)
    columns, dims = random_texts(1, seed=7), [32, 16, 8]
    want = []
    for cls in (CachedGISTEmbedLoss, FusedCachedGISTLoss):
        inner = cls(student, guide, mini_batch_size=MINI_BATCH, margin=0.1)
        want.append(run_loss(MatryoshkaLoss(student, inner, dims), student, columns, seed=3))
        if cls is FusedCachedGISTLoss:
            assert not isinstance(inner.calculate_loss, FusedMatryoshka)
    counting = LossStageCalls(monkeypatch)
    run_loss(MatryoshkaLoss(student, FusedCachedGISTLoss(student, guide, mini_batch_size=MINI_BATCH, margin=0.1), dims),
         student, columns, seed=3)
    assert counting.calls == len(dims)
    assert_close("model", want[0], want[1], tolerance("models", "fp64"))


def test_sampled_dimensions_follow_the_same_random_calls(student, guide, monkeypatch):
    """Seeded alike, n_dims_per_step picks the same dimensions as sentence-transformers, step after step."""
    picked = []
    real = cgist.losses.gist.FusedCachedGISTLoss.loss_stage

    def spy(self, reps, reps_guided, *, with_backward, dims=None):
        picked.append(tuple(d for d, _ in dims))
        return real(self, reps, reps_guided, with_backward=with_backward, dims=dims)

    monkeypatch.setattr(cgist.losses.gist.FusedCachedGISTLoss, "loss_stage", spy)
    dims = [32, 24, 16, 8, 4]
    inner = FusedCachedGISTLoss(student, guide, mini_batch_size=MINI_BATCH)
    loss = MatryoshkaLoss(student, inner, dims, n_dims_per_step=2)
    random.seed(11)
    expected = [tuple(sorted(dims, reverse=True)[i] for i in random.sample(range(5), 2)) for _ in range(3)]
    random.seed(11)
    features = [student.preprocess(t) for t in random_texts(0, seed=8)]
    for _ in range(3):
        loss(features, None)
    assert picked == expected and len(set(picked)) > 1


# The functional form -----------------------------------------------------------------------------------------

FUNCTIONAL = [  # B, N, D, Dg, k, dims, weights, options
    pytest.param(13, 26, 40, 24, 1, (40, 20, 8), (1.0, 0.5, 2.0), dict(offset=13, margin=0.1), id="B13-N26-D40-k1-d40-20-8"),
    pytest.param(7, 21, 33, 65, 2, (5, 33), None, dict(offset=7, margin=-0.2, margin_strategy="relative"), id="B7-N21-D33-k2-d5-33"),
    pytest.param(11, 11, 24, 16, 0, (3, 17, 9), (0.3, 1.0, 1.0), dict(temperature=0.5), id="B11-N11-D24-k0-d3-17-9"),
    pytest.param(9, 9, 16, 8, 1, (12,), None, dict(margin=0.05), id="B9-N9-D16-k1-d12"),
]


@pytest.mark.parametrize("block_bytes", [None, 1], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("name", ["fp64", "fp32"])
@pytest.mark.parametrize("B, N, D, Dg, k, dims, weights, options", FUNCTIONAL)
def test_gist_loss_matches_the_oracle_per_dimension(B, N, D, Dg, k, dims, weights, options, name, block_bytes):
    dtype = {"fp64": torch.float64, "fp32": torch.float32}[name]
    student, guide = make_inputs(B, N, D, Dg, k, dtype, seed=B + k)
    base = GistOptions(**options)
    leaves = [s.double().requires_grad_() for s in student]
    expected = sum(w * gist_loss_reference([x[:, :d] for x in leaves], [g.double() for g in guide], base)
                   for d, w in zip(dims, weights or [1.0] * len(dims)))
    expected_grads = torch.autograd.grad(expected, leaves)

    inputs = [s.detach().requires_grad_() for s in student]
    loss = cgist.gist_loss(inputs, guide, matryoshka_dims=dims, matryoshka_weights=weights, block_bytes=block_bytes,
                           backend="torch", **options)
    loss.backward()
    assert_close("torch", (expected, expected_grads), (loss, [x.grad for x in inputs]), tolerance("streaming", name))


@pytest.mark.parametrize("dims, error, match", [
    pytest.param((41,), ValueError, r"matryoshka_dims \[41\] exceed the student embedding dimension D=40", id="d>D"),
    pytest.param((0, 8), ValueError, r"matryoshka_dims must be positive, got 0", id="d=0"),
    pytest.param((-3,), ValueError, r"matryoshka_dims must be positive, got -3", id="d<0"),
    pytest.param((16, 8, 16), ValueError, r"matryoshka_dims must be distinct, got \[16, 8, 16\] \(repeated: \[16\]\)",
                 id="duplicate"),
    pytest.param((), TypeError, r"matryoshka_dims must be a non-empty sequence of ints", id="empty"),
    pytest.param((8.0,), TypeError, r"matryoshka_dims must hold ints, got float 8.0", id="float"),
])
def test_bad_dimensions_are_rejected(dims, error, match):
    student, guide = make_inputs(5, 5, 40, 8, 0, seed=1)
    with pytest.raises(error, match=match):
        cgist.gist_loss(student, guide, matryoshka_dims=dims)


@pytest.mark.parametrize("weights, error, match", [
    pytest.param((1.0,), ValueError, r"matryoshka_weights must have one weight per dimension \(2\)", id="short"),
    pytest.param((1.0, float("nan")), ValueError, r"matryoshka_weights must be finite, got nan", id="nan"),
    pytest.param((1.0, "2"), TypeError, r"matryoshka_weights must be a real number, got str", id="str"),
])
def test_bad_weights_are_rejected(weights, error, match):
    with pytest.raises(error, match=match):
        GistOptions(matryoshka_dims=(16, 8), matryoshka_weights=weights)


def test_weights_need_dimensions():
    with pytest.raises(ValueError, match="matryoshka_weights needs matryoshka_dims"):
        GistOptions(matryoshka_weights=(1.0,))


@pytest.mark.parametrize("block_bytes", [None, 1], ids=["one-pass", "two-pass"])
def test_small_dimension_with_candidates_far_above_the_positive(block_bytes):
    """fp32, dims (24, 5), tau 0.01: in the 5-dim scores every negative sits ~122 base-2 units above the
    positive (cosine 0.95 against 0.1). Relative to the positive's, the softmax terms (~2^122) are finite but
    their products in the gradient would overflow, so the row blocks are shifted by their maximum instead:
    the gradients are finite and equal the oracle's, dimension by dimension."""
    student, guide = make_inputs(12, 12, 24, 8, 1, torch.float32, seed=21)
    for column, cosine in ((0, 1.0), (1, 0.1), (2, 0.95)):  # the first 5 components, set exactly
        student[column][:, :5] = torch.tensor([cosine, (1 - cosine**2) ** 0.5, 0.0, 0.0, 0.0])
    guide[2] = -guide[0]  # the guide keeps the negatives
    options = GistOptions(margin=0.05, contrast_anchors=False, contrast_positives=False)
    leaves = [s.double().requires_grad_() for s in student]
    expected = sum(gist_loss_reference([x[:, :d] for x in leaves], [g.double() for g in guide], options) for d in (24, 5))
    expected.backward()

    inputs = [s.detach().requires_grad_() for s in student]
    loss = cgist.gist_loss(inputs, guide, matryoshka_dims=(24, 5), block_bytes=block_bytes, backend="torch",
                           margin=0.05, contrast_anchors=False, contrast_positives=False)
    loss.backward()
    assert all(bool(torch.isfinite(x.grad).all()) for x in inputs)
    assert_close("torch", (expected, [leaf.grad for leaf in leaves]), (loss, [x.grad for x in inputs]),
                 tolerance("streaming", "fp32"))


def test_the_oracle_sums_the_truncated_losses():
    student, guide = make_inputs(6, 12, 10, 8, 1, seed=4)
    options = GistOptions(offset=6, margin=0.1, matryoshka_dims=(4, 10), matryoshka_weights=(2.0, 0.5))
    flat = GistOptions(offset=6, margin=0.1)
    expected = 2.0 * gist_loss_reference([s[:, :4] for s in student], guide, flat) + 0.5 * gist_loss_reference(
        student, guide, flat)
    torch.testing.assert_close(gist_loss_reference(student, guide, options), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="gist_scores scores one dimension"):
        cgist.stage.reference.gist_scores(student, guide, options)


# sentence-transformers 6.3's MatryoshkaLoss ----------------------------------------------------------------------


class _Wrapper(torch.nn.Module):
    """A loss that hands its batches to a gradient-cache loss it holds as ``.loss`` and has no ``calculate_loss`` of
    its own: ``MatryoshkaLoss`` of 6.3 decorates the inner loss's (``resolve_gradient_cache_loss``)."""

    uses_gradient_cache = True

    def __init__(self, loss: torch.nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, features, labels):
        return self.loss(features, labels)


@pytest.mark.skipif(not release_rules().matryoshka_follows_wrappers,
                    reason="this sentence-transformers' MatryoshkaLoss decorates only the loss it is given")
@pytest.mark.parametrize("cls", [FusedCachedGISTLoss, FusedCachedMultipleNegativesRankingLoss], ids=["gist", "cmnrl"])
def test_a_drop_in_inside_a_wrapper_is_taken_over(cls, student, guide):
    """The decoration lands on the drop-in inside the wrapper, which takes it over: one pass, sentence-transformers'
    loss and gradients."""
    columns = random_texts(1, seed=6)
    results = []
    for fused in (False, True):
        if cls is FusedCachedGISTLoss:
            inner = (cls if fused else CachedGISTEmbedLoss)(student, guide, mini_batch_size=MINI_BATCH, margin=0.05)
        else:
            inner = (cls if fused else CachedMultipleNegativesRankingLoss)(student, mini_batch_size=MINI_BATCH)
        loss = MatryoshkaLoss(student, _Wrapper(inner), [32, 16, 8], n_dims_per_step=2)
        results.append((inner, *run_loss(loss, student, columns, seed=7)))
    (_, want, want_grads), (fused, got, grads) = results
    assert isinstance(fused.calculate_loss, FusedMatryoshka)
    assert_close("model", (want, want_grads), (got, grads), tolerance("models", "fp64"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=precision)
@pytest.mark.parametrize("temperature", [0.01, 0.05])
def test_half_embeddings_under_matryoshka(dtype, temperature, student, guide):
    """bf16 and fp16 embeddings: the fused Matryoshka (prefix norms and products in float32) equals the float64 loss
    of the same rounded embeddings within the half dtype's tolerance of the PyTorch path, and sentence-transformers'
    own half-precision loss within two units of the half dtype's epsilon. (Its loss stage runs in the half dtype:
    measured here, its loss is up to 2.5e-3 (bf16) and its gradients up to 9% of their largest entry off the float64
    ones, where cgist's are 1.3e-7 and 0.3%.)"""
    gen = torch.Generator().manual_seed(11)
    batch, width = 24, student.get_embedding_dimension()
    columns = [torch.randn(batch, width, dtype=torch.float64, generator=gen).to(dtype) for _ in range(3)]
    guides = [torch.randn(batch, 384, dtype=torch.float64, generator=gen).to(dtype) for _ in range(3)]
    results = {}
    for name, cls, run_dtype in (("st", CachedGISTEmbedLoss, dtype), ("st-fp64", CachedGISTEmbedLoss, torch.float64),
                                 ("cgist", FusedCachedGISTLoss, dtype)):
        inner = cls(student, guide, temperature=temperature, mini_batch_size=MINI_BATCH, margin=0.05)
        MatryoshkaLoss(student, inner, [32, 16, 8], matryoshka_weights=[1.0, 0.5, 2.0])
        reps = [[c.to(run_dtype)[i:i + MINI_BATCH].clone().requires_grad_() for i in range(0, batch, MINI_BATCH)]
                for c in columns]
        guided = [[g.to(run_dtype)[i:i + MINI_BATCH] for i in range(0, batch, MINI_BATCH)] for g in guides]
        with computed_on(inner):
            loss = inner.calculate_loss(reps, guided, with_backward=True)
        results[name] = loss.double(), torch.cat([torch.cat([r.grad for r in column]) for column in reps]).double()
    assert results["cgist"][1].dtype == torch.float64 and torch.isfinite(results["cgist"][1]).all()
    assert_close("fused vs float64", results["st-fp64"], results["cgist"], tolerance("streaming", dtype))
    assert_close("fused vs sentence-transformers' half loss", results["st"][0], results["cgist"][0],
                 Tol(rtol=2 * torch.finfo(dtype).eps))
