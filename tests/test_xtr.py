"""XTR scoring through the loss stage (docs/design.md#xtr).

* The float64 oracle (``xtr_scores_reference``, written from XTR's definition) against sentence-transformers'
  ``xtr_scores``, on ragged tie-free batches, ``top_k`` of 1, a few, half the pool and more than the pool.
* ``cgist.maxsim_loss(top_k=...)`` on the PyTorch stage against the oracle, tiled small and large; gradcheck; a
  guide's mask over XTR scores against the guided oracle.
* The four multi-vector drop-ins with ``xtr_scores``, a ``functools.partial`` of it and ``XTRScores``: a differential
  fuzz of the ranking drop-ins against sentence-transformers' two classes (``calculate_loss``), a real model's step,
  and the guided drop-ins without a guide.
* The ties rule: every token tied with the ``top_k``-th is retrieved (sentence-transformers keeps ``top_k`` of them),
  and a maximum within the products' rounding bound below it counts as tied.
* The kernels' first-use check of XTR, and bad arguments.

Every random batch is checked tie-free (``helpers.xtr_gap``): the ``top_k``-th and next similarities of every query
token far apart beside the products' rounding, so that every implementation retrieves the same tokens.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("sentence_transformers.multi_vector_encoder")

from helpers import AllocationProbe, xtr_gap  # noqa: E402
from helpers_models import (  # noqa: E402
    DOCUMENTS,
    NEGATIVES,
    QUERIES,
    cached_loss_stage,
    multi_vector_features,
    multi_vector_step,
)
from helpers_models import multi_vector_model as _new_model  # noqa: E402
from sentence_transformers.multi_vector_encoder.losses import (  # noqa: E402
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import XTRScores, xtr_scores  # noqa: E402

import cgist  # noqa: E402
from cgist import GistOptions  # noqa: E402
from cgist.losses.base import FUSED  # noqa: E402
from cgist.losses.multi_vector import score_fields  # noqa: E402
from cgist.stage.reference import (  # noqa: E402
    maxsim_gist_loss_reference,
    maxsim_loss_reference,
    xtr_scores_reference,
)
from cgist.stage.spec.xtr import xtr_call  # noqa: E402
from cgist.stage.xtr_thresholds import retrieved, thresholds  # noqa: E402

multi_vector_model = functools.cache(_new_model)

#: The least gap between the ``top_k``-th and next similarities of a tie-free batch (float64 products of unit
#: normal entries: rounding is ~1e-15).
GAP = 1e-9


def _masks(gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Ragged masks with holes, a real first token."""
    mask = (torch.arange(width) < torch.randint(1, width + 1, (rows, 1), generator=gen)) \
        & (torch.rand(rows, width, generator=gen) >= 0.2)
    mask[:, 0] = True
    return mask


def _inputs(seed: int, batch: int, columns: int, lq: int, ld: int, dim: int = 6, rows: int | None = None):
    """float64 queries ``(batch, lq, dim)`` and ``columns`` document columns of ``rows`` rows, with their masks."""
    gen = torch.Generator().manual_seed(seed)
    rows = rows or batch
    queries = torch.randn(batch, lq, dim, generator=gen, dtype=torch.float64)
    documents = [torch.randn(rows, ld, dim, generator=gen, dtype=torch.float64) for _ in range(columns)]
    return queries, _masks(gen, batch, lq), documents, [_masks(gen, rows, ld) for _ in range(columns)]


def _depths(document_masks: list[torch.Tensor]) -> list[int]:
    """``top_k`` of 1, a few, half the pool and more than the pool."""
    pool = int(sum(m.sum() for m in document_masks))
    return [1, 3, max(1, pool // 2), pool + 5]


# -- the oracle is sentence-transformers' XTR ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_the_oracle_is_sentence_transformers_xtr(seed):
    queries, query_mask, documents, document_masks = _inputs(seed, 4, 2, 5, 7)
    document_masks[1][2] = False  # a document without a real token: -1e9
    stacked, stacked_mask = torch.stack(documents, 1), torch.stack(document_masks, 1)
    for top_k in _depths(document_masks):
        assert xtr_gap(queries, query_mask, documents, document_masks, top_k) > GAP
        theirs = xtr_scores(queries, stacked, queries_mask=query_mask, documents_mask=stacked_mask, top_k=top_k)
        ours = xtr_scores_reference(queries, query_mask, stacked.flatten(0, 1), stacked_mask.flatten(0, 1),
                                    top_k=top_k)
        torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=1e-6)
        assert bool((ours[:, 2 * 2 + 1] == -1e9).all())


# -- the stage against the oracle ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_bytes", [None, 3000], ids=["default", "tiny-tiles"])
def test_the_stage_equals_the_oracle_however_it_is_tiled(block_bytes):
    """Chunked queries and documents (two mini-batches), a rank offset, an empty document; every depth."""
    queries, query_mask, documents, document_masks = _inputs(3, 4, 2, 5, 9, rows=7)
    document_masks[0][5] = False
    for top_k in _depths(document_masks):
        assert xtr_gap(queries, query_mask, documents, document_masks, top_k) > GAP
        leaves = [t.clone().requires_grad_() for t in (queries, *documents)]
        chunked = [list(t.split(3)) for t in leaves]
        loss = cgist.maxsim_loss(chunked[0], list(query_mask.split(3)), chunked[1:],
                                 [list(m.split(3)) for m in document_masks], scale=3.0, offset=2, top_k=top_k,
                                 block_bytes=block_bytes, backend="torch")
        grads = torch.autograd.grad(loss, leaves)
        oracle = [t.clone().requires_grad_() for t in (queries, *documents)]
        expected = maxsim_loss_reference(oracle[0], query_mask, oracle[1:], document_masks, scale=3.0, offset=2,
                                         top_k=top_k)
        expected_grads = torch.autograd.grad(expected, oracle)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, expected_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_of_the_stage():
    queries, query_mask, documents, document_masks = _inputs(5, 3, 2, 3, 4)
    assert xtr_gap(queries, query_mask, documents, document_masks, 4) > 1e-3  # beyond gradcheck's steps

    def loss(q, *docs):
        return cgist.maxsim_loss(q, query_mask, list(docs), document_masks, scale=2.0, top_k=4, backend="torch")

    assert torch.autograd.gradcheck(loss, [t.requires_grad_() for t in (queries, *documents)], fast_mode=True)


def test_no_allocation_holds_the_token_grid():
    """The PyTorch stage's every allocation fits the budget or the inputs' size (a gradient; the thresholds, one a
    query token): the token similarities of every query token against every document token are 15 times the inputs
    and 60 times the budget."""
    from cgist.stage.pytorch import workspace

    batch, lq, ld, dim, budget = 24, 6, 20, 8, 16384
    queries, query_mask, documents, document_masks = _inputs(9, batch, 2, lq, ld, dim)
    grid = batch * lq * 2 * batch * ld
    inputs = 2 * batch * ld * dim
    assert grid > 15 * inputs and grid * 8 > 60 * budget

    def run():
        leaves = [t.clone().requires_grad_() for t in (queries, *documents)]
        loss = cgist.maxsim_loss(leaves[0], query_mask, leaves[1:], document_masks, top_k=10, block_bytes=budget,
                                 backend="torch")
        return torch.autograd.grad(loss, leaves)

    workspace.release_workspace()
    run()
    with AllocationProbe() as probe:
        run()
    offenders = [a for a in probe.allocations if a[0] > budget and a[1] > inputs]
    assert probe.allocations and not offenders, offenders[:5]


@pytest.mark.parametrize("guide", ["self", "vectors"])
def test_a_guide_masks_xtr_scores_as_the_guided_oracle(guide):
    queries, query_mask, documents, document_masks = _inputs(6, 5, 2, 4, 6)
    gen = torch.Generator().manual_seed(7)
    columns = "self" if guide == "self" else [torch.randn(5, 8, generator=gen, dtype=torch.float64)
                                               for _ in range(3)]
    assert xtr_gap(queries, query_mask, documents, document_masks, 6) > GAP
    leaves = [t.clone().requires_grad_() for t in (queries, *documents)]
    loss, stats = cgist.maxsim_loss(leaves[0], query_mask, leaves[1:], document_masks, scale=2.0, top_k=6,
                                    guide=columns, margin=0.05, backend="torch", return_stats=True)
    grads = torch.autograd.grad(loss, leaves)
    oracle = [t.clone().requires_grad_() for t in (queries, *documents)]
    expected, mask = maxsim_gist_loss_reference(oracle[0], query_mask, oracle[1:], document_masks, columns,
                                                scale=2.0, margin=0.05, top_k=6)
    expected_grads = torch.autograd.grad(expected, oracle)
    assert 0 < int(mask.sum()) == sum(stats.masked.values())
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# -- the drop-ins against sentence-transformers ----------------------------------------------------------------------


def _scorer(form: str, top_k: int):
    if form == "function":  # its default top_k, 256: more than these pools
        return xtr_scores
    if form == "partial":
        return functools.partial(xtr_scores, top_k=top_k, chunk_elements=50)
    return XTRScores(top_k)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 6), negatives=st.integers(0, 2), lq=st.integers(1, 5),
       ld=st.integers(1, 7), mini=st.integers(1, 4), form=st.sampled_from(["function", "partial", "class"]),
       depth=st.sampled_from([1, 3, "half", "more"]), scale=st.sampled_from([1.0, 7.0]), empty=st.booleans())
def test_fuzz_the_ranking_drop_ins_against_sentence_transformers(seed, batch, negatives, lq, ld, mini, form, depth,
                                                                  scale, empty):
    queries, query_mask, documents, document_masks = _inputs(seed, batch, 1 + negatives, lq, ld)
    if empty:
        document_masks[-1][batch // 2] = False
    pool = int(sum(m.sum() for m in document_masks))
    top_k = {"half": max(1, pool // 2), "more": pool + 1}.get(depth, depth)
    assume(xtr_gap(queries, query_mask, documents, document_masks, 256 if form == "function" else top_k) > GAP)
    reps = [list(queries.split(mini)), *(list(d.split(mini)) for d in documents)]
    masks = [list(query_mask.split(mini)), *(list(m.split(mini)) for m in document_masks)]
    kwargs = dict(scale=scale, similarity_fct=_scorer(form, top_k), mini_batch_size=mini)
    expected, expected_grads = cached_loss_stage(CachedMultiVectorMultipleNegativesRankingLoss(multi_vector_model(), **kwargs),
                                           reps, masks)
    ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(multi_vector_model(), **kwargs, block_bytes=400)
    got, grads = cached_loss_stage(ours, reps, masks)
    assert ours.last_path == FUSED
    # sentence-transformers' scores are float32 (its XTR casts the maxima): logits of up to scale * |product|
    tol = dict(rtol=1e-5, atol=2e-6 * scale)
    torch.testing.assert_close(got.double(), expected.double(), **tol)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, **tol)
    plain = cgist.FusedMultiVectorMultipleNegativesRankingLoss(multi_vector_model(), scale=scale,
                                                              similarity_fct=_scorer(form, top_k))
    leaves = [[t.detach().clone().requires_grad_() for t in column] for column in reps]
    value = plain.calculate_loss(leaves, masks)
    value.backward()
    assert plain.last_path == FUSED
    torch.testing.assert_close(value.double(), expected.double(), **tol)
    for a, b in zip((t.grad for column in leaves for t in column), expected_grads):
        torch.testing.assert_close(a, b, **tol)


def _model_step(loss, columns):
    """The loss and the model's gradients, flat."""
    value, grads = multi_vector_step(loss, columns)
    return value, torch.cat([grads[name].flatten() for name in sorted(grads)])


def _token_gap(model, columns, top_k: int) -> float:
    """``xtr_gap`` of the model's token embeddings of these columns (as the loss embeds them)."""
    with torch.no_grad():
        outputs = [model(feature, task=feature.get("task")) for feature in multi_vector_features(model, columns)]
    (q, qm), *docs = ((o["token_embeddings"], o["attention_mask"].bool()) for o in outputs)
    return xtr_gap(q, qm, [d for d, _ in docs], [m for _, m in docs], top_k)


@pytest.mark.parametrize("guided", [False, True], ids=["ranking", "gist-without-guide"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_the_drop_ins_train_a_real_model_as_sentence_transformers_does(cached, guided):
    """A step of the real model with ``XTRScores(5)``: the loss, and the model's gradients to float32's rounding of
    sums over every token; the guided drop-ins with ``guide=None`` are the ranking losses."""
    columns = [QUERIES, DOCUMENTS, NEGATIVES]
    model = multi_vector_model()
    assert _token_gap(model, columns, 5) > 1e-4  # float32 products: tie-free beside their rounding
    kwargs = dict(scale=5.0, similarity_fct=XTRScores(5), mini_batch_size=2)
    theirs = (CachedMultiVectorMultipleNegativesRankingLoss if cached else MultiVectorMultipleNegativesRankingLoss)(
        model, **kwargs)
    if guided:
        ours = (cgist.FusedCachedMultiVectorGISTLoss if cached else cgist.FusedMultiVectorGISTLoss)(model, None,
                                                                                                     **kwargs)
    else:
        ours = (cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss if cached
                else cgist.FusedMultiVectorMultipleNegativesRankingLoss)(model, **kwargs)
    expected, expected_grads = _model_step(theirs, columns)
    got, grads = _model_step(ours, columns)
    assert ours.last_path == FUSED
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (grads - expected_grads).norm() < 1e-4 * expected_grads.norm()
    if not guided:
        assert ours.get_config_dict() == theirs.get_config_dict()


def test_which_xtr_forms_are_fused_and_their_depth():
    model = multi_vector_model()

    def xtr(top_k):
        return {"similarity": "xtr", "score_options": {"top_k": top_k}}

    assert score_fields(xtr_scores, model) == xtr(256)
    assert score_fields(XTRScores(7, chunk_elements=10), model) == xtr(7)
    assert score_fields(functools.partial(xtr_scores, top_k=3), model) == xtr(3)
    assert score_fields(functools.partial(xtr_scores, chunk_elements=9), model) == xtr(256)
    assert score_fields(functools.partial(xtr_scores, 3), model) is None  # a positional argument
    assert score_fields(functools.partial(xtr_scores, queries_mask=None), model) is None


def test_a_changed_depth_on_the_scorer_rebuilds_the_options():
    """The drop-in's options follow the scorer's settings as they are at each step (an ``XTRScores``' ``top_k``)."""
    scorer = XTRScores(3)
    loss = cgist.FusedMultiVectorMultipleNegativesRankingLoss(multi_vector_model(), similarity_fct=scorer)
    assert loss.options.score_options == {"top_k": 3}
    scorer.top_k = 5
    assert loss.options.score_options == {"top_k": 5}


def test_maxsim_loss_names_its_score_or_takes_the_one_its_options_ask_for():
    args = _inputs(1, 3, 2, 3, 4)
    by_top_k = cgist.maxsim_loss(*args, top_k=2)
    assert torch.equal(cgist.maxsim_loss(*args, top_k=2, similarity="xtr"), by_top_k)
    assert not torch.equal(cgist.maxsim_loss(*args), by_top_k)
    assert torch.equal(cgist.maxsim_loss(*args, similarity="mean_maxsim"), cgist.maxsim_loss(*args, length_normalize=True))


def test_the_score_is_found_by_the_options_it_takes():
    from cgist.stage.spec.scores import MAXSIM, XTR, token_score_taking

    assert token_score_taking(()) is MAXSIM and token_score_taking(("top_k",)) is XTR
    with pytest.raises(ValueError, match=r"no registered token score takes \['directions', 'top_k'\] together"):
        token_score_taking(("top_k", "directions"))


def test_bad_xtr_arguments_are_named():
    queries, query_mask, documents, document_masks = _inputs(0, 2, 1, 2, 3)
    args = (queries, query_mask, documents, document_masks)
    for top_k, error in ((0, ValueError), (-2, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="top_k"):
            cgist.maxsim_loss(*args, top_k=top_k)
    with pytest.raises(ValueError, match="length_normalize"):
        cgist.maxsim_loss(*args, top_k=2, length_normalize=True)
    with pytest.raises(ValueError, match="length_normalize picks MeanMaxSim, but similarity='xtr'"):
        cgist.maxsim_loss(*args, top_k=2, similarity="xtr", length_normalize=True)
    with pytest.raises(ValueError, match="similarity must be a token score's .* got 'cos'"):
        cgist.maxsim_loss(*args, similarity="cos")
    with pytest.raises(ValueError, match="contrast_anchors and contrast_positives are not defined for XTR"):
        cgist.maxsim_loss(*args, top_k=2, guide="self", contrast_anchors=True)
    with pytest.raises(ValueError, match="chunk_elements must be at least 1"):
        score_fields(functools.partial(xtr_scores, chunk_elements=0), None)
    with pytest.raises(TypeError, match="chunk_elements must be an int"):
        score_fields(XTRScores(3, chunk_elements=2.0), None)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):  # at once, not at the first step
        cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(multi_vector_model(), similarity_fct=XTRScores(0))


# -- ties ------------------------------------------------------------------------------------------------------------


def test_every_token_tied_with_the_kth_is_retrieved_where_sentence_transformers_keeps_k():
    """One query token against four one-token documents with similarities 3, 2, 2 and 1, ``top_k`` 2: both documents
    at 2 are retrieved (score 2 each); sentence-transformers' ``topk`` keeps one of them (the other scores 0)."""
    queries = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    documents = torch.tensor([[[3.0, 0.0]], [[2.0, 1.0]], [[2.0, -1.0]], [[1.0, 0.0]]], dtype=torch.float64)
    query_mask, document_mask = torch.ones(1, 1, dtype=torch.bool), torch.ones(4, 1, dtype=torch.bool)
    expected = torch.tensor([[3.0, 2.0, 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(xtr_scores_reference(queries, query_mask, documents, document_mask, top_k=2), expected)
    for backend in ("torch", "triton"):
        loss = cgist.maxsim_loss(queries, query_mask, [documents], [document_mask], top_k=2, backend=backend)
        torch.testing.assert_close(loss, torch.logsumexp(expected[0], 0) - expected[0, 0])
    theirs = xtr_scores(queries, documents.unsqueeze(0), queries_mask=query_mask,
                        documents_mask=document_mask.unsqueeze(0), top_k=2)[0]
    assert theirs[0] == 3.0 and sorted(theirs[1:3].tolist()) == [0.0, 2.0]


def test_a_maximum_within_the_products_rounding_below_the_threshold_is_tied():
    """float32, one feature: the threshold is 0.5 (the first document's token, ``top_k`` 1); a maximum one float32
    step below it counts as tied (the rounding bound of a product of 1 term of 0.5 is 6e-8), four steps below do
    not."""
    below = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0))
    far = torch.tensor(0.5) - 4 * (torch.tensor(0.5) - below)
    documents = torch.stack([torch.tensor(0.5), below, far]).view(3, 1, 1)
    call = xtr_call(torch.ones(1, 1, 1), torch.ones(1, 1, dtype=torch.bool), [documents],
                    [torch.ones(3, 1, dtype=torch.bool)], GistOptions(similarity="xtr", score_options={"top_k": 1},
                                                                      contrast_anchors=False,
                                                                      contrast_positives=False))
    tau = thresholds(call)
    assert retrieved(documents.view(1, 3), tau, torch.ones(1, 1)).tolist() == [[1.0, 1.0, 0.0]]


# -- the kernels' first-use check ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_use_check_covers_xtr(dtype):
    """XTR's check problem through the kernels (the interpreter without CUDA) and the PyTorch stage agrees, in its
    own variant (not MaxSim's)."""
    pytest.importorskip("triton")
    from cgist.stage.dispatch import route

    queries, query_mask, documents, document_masks = _inputs(0, 2, 1, 2, 3)
    options = GistOptions(similarity="xtr", score_options={"top_k": 2}, contrast_anchors=False, contrast_positives=False)
    call = xtr_call(queries.to(dtype), query_mask, [documents[0].to(dtype)], document_masks[:1], options)
    route.reset()
    try:
        assert route._first_use_check(call)
        (variant,) = route.first_use_checks()
        assert "XTR" in variant.describe()
    finally:
        route.reset()
