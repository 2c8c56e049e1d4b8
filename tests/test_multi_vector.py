"""The multi-vector (late-interaction) loss stage and its drop-ins (docs/design.md#late-interaction).

* ``cgist.maxsim_loss`` against the dense float64 oracle (``maxsim_loss_reference``): gradcheck, ragged masks with
  holes, empty documents, MeanMaxSim, the offset, chunks and tiles small enough that every call crosses several.
* The oracle against sentence-transformers' own MaxSim scorer (``colbert_scores``), so the oracle is the library's
  loss, written out.
* A differential fuzz of both drop-ins against sentence-transformers' two classes, on random token embeddings
  (``calculate_loss``: the cached class's, and the plain drop-in's against the cached class's with the same inputs)
  and on a real model (``forward``, the model's gradients).
* What runs sentence-transformers' code (a custom callable), configuration, and bad inputs (XTR: tests/test_xtr.py).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sentence_transformers.multi_vector_encoder")

from sentence_transformers.multi_vector_encoder.losses import (  # noqa: E402
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores  # noqa: E402

import cgist  # noqa: E402
from cgist.losses.base import FUSED, UNFUSED  # noqa: E402
from cgist.stage.reference import maxsim_loss_reference  # noqa: E402
from helpers import TOL, gradient_addresses  # noqa: E402
from helpers_models import (  # noqa: E402
    DOCUMENTS,
    NEGATIVES,
    QUERIES,
    cached_loss_stage,
    multi_vector_features,
    multi_vector_model,
    multi_vector_step,
)


@functools.cache
def _model():
    return multi_vector_model(0)


def _masks(gen: torch.Generator, rows: int, width: int, holes: float = 0.2) -> torch.Tensor:
    """Ragged masks: a random length per row (at least 1), and holes inside it."""
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = torch.arange(width) < lengths[:, None]
    mask &= torch.rand(rows, width, generator=gen) >= holes
    mask[torch.arange(rows), 0] |= lengths > 0  # one real token at least, unless a test empties the row
    return mask


def _inputs(seed: int, batch: int, columns: int, lq: int, ld: int, dim: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, lq, dim, generator=gen, dtype=dtype)
    documents = [torch.randn(batch, ld, dim, generator=gen, dtype=dtype) for _ in range(columns)]
    return queries, _masks(gen, batch, lq), documents, [_masks(gen, batch, ld) for _ in range(columns)]


def _split(tensor: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(tensor.split(size))


# -- the op against the oracle ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("length_normalize", [False, True])
@pytest.mark.parametrize("offset", [0, 3])
def test_gradcheck_of_the_streaming_stage(length_normalize, offset):
    queries, query_mask, documents, document_masks = _inputs(1, 4, 2, 3, 5, 4)
    documents = [torch.cat([d, d[:offset]]) for d in documents]  # other ranks' rows around this rank's
    document_masks = [torch.cat([m, m[:offset]]) for m in document_masks]
    document_masks[1][2] = False  # a document without a real token

    def loss(q, *docs):
        return cgist.maxsim_loss(_split(q, 3), _split(query_mask, 3), [_split(d, 2) for d in docs],
                                 [_split(m, 2) for m in document_masks], scale=1.7,
                                 length_normalize=length_normalize, offset=offset, block_bytes=64)

    inputs = (queries.requires_grad_(), *(d.requires_grad_() for d in documents))
    assert torch.autograd.gradcheck(loss, inputs, fast_mode=True)


@pytest.mark.parametrize("block_bytes", [1, 500, 60000, None])
def test_the_stage_equals_the_oracle_however_it_is_tiled(block_bytes):
    """1 and 500 bytes: tiles of one query against a few documents, a row block per query; 60000: row blocks of a
    few queries (about 5 kB each, ``kept_bytes``), each over several document tiles; the default: one row block."""
    queries, query_mask, documents, document_masks = _inputs(2, 9, 3, 6, 11, 5)
    document_masks[0][4, :] = False
    leaves = [queries.requires_grad_(), *(d.requires_grad_() for d in documents)]
    expected = maxsim_loss_reference(queries, query_mask, documents, document_masks, scale=2.5)
    got = cgist.maxsim_loss(_split(queries, 4), _split(query_mask, 4), [_split(d, 5) for d in documents],
                            [_split(m, 5) for m in document_masks], scale=2.5, block_bytes=block_bytes)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_second_backward_and_a_scaled_loss_get_their_own_gradients(monkeypatch):
    """The forward makes the gradients of the loss and hands them to the first backward, which passes them on
    without a copy (the leaves' ``.grad`` are those tensors); a scaled loss gets them scaled, and a second backward
    through a retained graph gets them again (made anew)."""
    from cgist.stage.pytorch import maxsim as stage

    queries, query_mask, documents, document_masks = _inputs(8, 5, 2, 4, 7, 6)
    leaves = [queries.requires_grad_(), *(d.requires_grad_() for d in documents)]
    expected = torch.autograd.grad(maxsim_loss_reference(queries, query_mask, documents, document_masks, scale=2.0),
                                   leaves)
    made = gradient_addresses(monkeypatch, stage)
    loss = cgist.maxsim_loss(queries, query_mask, documents, document_masks, scale=2.0, block_bytes=2000)
    loss.backward(retain_graph=True)
    assert [leaf.grad.data_ptr() for leaf in leaves] == made[0]
    loss.backward(retain_graph=True)
    (2.0 * loss).backward()
    for leaf, grad in zip(leaves, expected):
        torch.testing.assert_close(leaf.grad, 4.0 * grad, rtol=1e-12, atol=1e-12)


def test_without_autograd_the_forward_makes_no_gradients(monkeypatch):
    """Under ``torch.no_grad`` (or for inputs that need none) the stage runs its forward alone: no argmax kept."""
    from cgist.stage.pytorch import maxsim as stage

    queries, query_mask, documents, document_masks = _inputs(9, 4, 2, 3, 5, 4)
    calls = []
    original = stage._tile_scores
    monkeypatch.setattr(stage, "_tile_scores", lambda *args: calls.append(args[3]) or original(*args))
    expected = maxsim_loss_reference(queries, query_mask, documents, document_masks)
    with torch.no_grad():
        got = cgist.maxsim_loss([q.requires_grad_() for q in queries.split(2)], query_mask.split(2), documents,
                                document_masks)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert calls and all(where is None for where in calls)
    calls.clear()
    cgist.maxsim_loss(queries.requires_grad_(), query_mask, documents, document_masks)
    assert calls and all(where is not None for where in calls)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_the_oracle_is_sentence_transformers_maxsim(length_normalize):
    queries, query_mask, documents, document_masks = _inputs(3, 5, 2, 4, 7, 6, dtype=torch.float32)
    document_masks[1][1] = False
    scorer = mean_colbert_scores if length_normalize else colbert_scores
    scores = scorer(queries, torch.stack(documents, 1), queries_mask=query_mask,
                    documents_mask=torch.stack(document_masks, 1))
    expected = torch.nn.functional.cross_entropy(scores * 3.0, torch.arange(5) * 2)
    got = maxsim_loss_reference(queries, query_mask, documents, document_masks, scale=3.0,
                                length_normalize=length_normalize)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ld", [9, 300])  # 300: past bf16's exact integers, the argmax is torch.max's
def test_half_and_single_precision_inputs_accumulate_in_float32(dtype, ld):
    queries, query_mask, documents, document_masks = _inputs(4, 6, 2, 5, ld, 8, dtype=dtype)
    leaves = [queries.requires_grad_(), *(d.requires_grad_() for d in documents)]
    got = cgist.maxsim_loss(queries, query_mask, documents, document_masks, block_bytes=300)
    assert got.dtype == torch.float32
    wide = [t.detach().double().requires_grad_() for t in leaves]
    expected = maxsim_loss_reference(wide[0], query_mask, wide[1:], document_masks)
    # Each token product is rounded to the inputs' precision before its maximum, as sentence-transformers does.
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(expected, wide)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("exact", [True, False], ids=["countdown", "torch-max"])
def test_a_tied_maximum_sends_its_gradient_to_the_first_token_as_sentence_transformers_does(monkeypatch, exact):
    """A document token repeated at a later position ties with itself wherever it is a maximum: sentence-transformers'
    ``max`` sends the gradient to the first position alone (the oracle, by ``amax``, would split it)."""
    if not exact:  # the argmax of a dtype that cannot hold the positions (_tile_scores)
        from cgist.stage.pytorch import maxsim as stage

        monkeypatch.setattr(stage, "_exact_integers", lambda dtype: 0)
    queries, _, documents, _ = _inputs(5, 6, 2, 4, 6, 5, dtype=torch.float32)
    query_mask = torch.ones(6, 4, dtype=torch.bool)
    document_masks = [torch.ones(6, 6, dtype=torch.bool) for _ in documents]
    for d in documents:
        d[:, 4] = d[:, 1]
    reps = [_split(queries, 3), *(_split(d, 3) for d in documents)]
    masks = [_split(query_mask, 3), *(_split(m, 3) for m in document_masks)]
    theirs = CachedMultiVectorMultipleNegativesRankingLoss(_model(), similarity_fct=colbert_scores, mini_batch_size=3)
    ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), similarity_fct=colbert_scores,
                                                                   mini_batch_size=3, block_bytes=200)
    expected, expected_grads = cached_loss_stage(theirs, reps, masks)
    got, grads = cached_loss_stage(ours, reps, masks)
    torch.testing.assert_close(got, expected)
    document_grads = torch.cat(grads[2:])
    assert (document_grads[:, 1] != 0).any(), "no query token's maximum is at the repeated token"
    assert (document_grads[:, 4] == 0).all()
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("exact", [True, False], ids=["countdown", "torch-max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_maximum_within_the_rounding_bound_is_a_tie(monkeypatch, exact, dtype):
    """A later token whose product exceeds an earlier one's by less than the bound of two products' rounding
    (``D * eps * |q| * max |d|``) ties with it: the first gets the gradient, on every CPU. Beyond the bound the
    larger one does."""
    if not exact:
        from cgist.stage.pytorch import maxsim as stage

        monkeypatch.setattr(stage, "_exact_integers", lambda dtype: 0)
    gen = torch.Generator().manual_seed(5)
    dim, eps = 8, torch.finfo(dtype).eps
    query = torch.randn(1, 1, dim, generator=gen, dtype=dtype)
    tokens = torch.randn(1, 5, dim, generator=gen, dtype=dtype) * 0.1
    tokens[0, 1] = 2.0 * query[0, 0]  # the maximum
    negative = torch.randn(1, 5, dim, generator=gen, dtype=dtype)  # a second column: the loss has a gradient
    bound = dim * eps * query.norm() * tokens.norm(dim=2).max()
    for excess, winner in ((0.5, 1), (4.0, 4)):  # the product's excess, in units of the bound
        document = tokens.clone()
        document[0, 4] = document[0, 1] * (1 + excess * bound / (document[0, 1] @ query[0, 0]))
        leaves = [query.clone().requires_grad_(), document.requires_grad_()]
        mask = torch.ones(1, 5, dtype=torch.bool)
        loss = cgist.maxsim_loss(leaves[0], torch.ones(1, 1, dtype=torch.bool), [leaves[1], negative], [mask, mask],
                                 backend="torch")
        grad = torch.autograd.grad(loss, leaves[1])[0]
        assert grad[0].norm(dim=1).nonzero().flatten().tolist() == [winner], (excess, grad[0].norm(dim=1))


# -- the drop-ins against sentence-transformers ---------------------------------------------------------------------


def _leaves(tensors: list[torch.Tensor], size: int, dtype=torch.float32) -> list[torch.Tensor]:
    return [t.to(dtype).detach().requires_grad_() for t in tensors[0].split(size)] if len(tensors) == 1 else []


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 7), negatives=st.integers(0, 2), lq=st.integers(1, 5),
       ld=st.integers(1, 8), mini=st.integers(1, 4), mean=st.booleans(), scale=st.sampled_from([1.0, 0.3, 7.0]),
       empty=st.booleans())
def test_fuzz_the_cached_drop_in_against_sentence_transformers(seed, batch, negatives, lq, ld, mini, mean, scale,
                                                                empty):
    queries, query_mask, documents, document_masks = _inputs(seed, batch, 1 + negatives, lq, ld, 6,
                                                             dtype=torch.float32)
    if empty:
        document_masks[-1][batch // 2] = False
    reps = [_split(queries, mini), *(_split(d, mini) for d in documents)]
    masks = [_split(query_mask, mini), *(_split(m, mini) for m in document_masks)]
    scorer = functools.partial(mean_colbert_scores) if mean else colbert_scores
    kwargs = dict(scale=scale, similarity_fct=scorer, mini_batch_size=mini)
    theirs = CachedMultiVectorMultipleNegativesRankingLoss(_model(), **kwargs)
    ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), **kwargs, block_bytes=200)
    expected, expected_grads = cached_loss_stage(theirs, reps, masks)
    got, grads = cached_loss_stage(ours, reps, masks)
    assert ours.last_path == FUSED
    # float32 rounding of logits as large as scale * lq * |token products| (unit normal entries, dim 6).
    atol = 2e-6 * scale * lq
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=atol)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=atol)
    # The plain drop-in's loss stage over the same embeddings: the same loss, by autograd.
    plain = cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), scale=scale, similarity_fct=scorer)
    leaves = [[t.detach().clone().requires_grad_() for t in column] for column in reps]
    value = plain.calculate_loss(leaves, masks)
    value.backward()
    torch.testing.assert_close(value, expected, rtol=2e-5, atol=atol)
    for a, b in zip((t.grad for column in leaves for t in column), expected_grads):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=atol)




_features, _model_step = multi_vector_features, multi_vector_step


CONFIGS = [dict(), dict(scale=4.0), dict(similarity_fct=mean_colbert_scores, scale=9.0),
           dict(similarity_fct=functools.partial(colbert_scores, chunk_elements=500))]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "scale", "meanmaxsim", "partial"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_the_drop_ins_train_a_real_model_as_sentence_transformers_does(config, cached):
    """The loss to float32's rounding; the model's gradients, sums over every token where float32 rounding of the
    token gradients cancels unevenly (a key bias's true gradient is zero), as a whole to a relative norm of 1e-4 and
    each entry to the suite's tolerance of a model's parameter gradients (``helpers.TOL["models"]``: the embeddings'
    rounding through the model's Jacobian, which no rule in u bounds where entries cancel)."""
    columns = [QUERIES, DOCUMENTS, NEGATIVES]
    model = _model()
    if cached:
        kwargs = dict(config, mini_batch_size=2, score_mini_batch_size=3)
        theirs = CachedMultiVectorMultipleNegativesRankingLoss(model, **kwargs)
        ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(model, **kwargs)
    else:
        kwargs = dict(config, mini_batch_size=4, score_mini_batch_size=2)
        theirs = MultiVectorMultipleNegativesRankingLoss(model, **kwargs)
        ours = cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, **kwargs)
    expected, expected_grads = _model_step(theirs, columns)
    got, grads = _model_step(ours, columns)
    assert ours.last_path == FUSED and ours.path_counts == {FUSED: 1, UNFUSED: 0}
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    flat, expected_flat = (torch.cat([g[name].flatten() for name in sorted(g)]) for g in (grads, expected_grads))
    assert (flat - expected_flat).norm() < 1e-4 * expected_flat.norm()
    torch.testing.assert_close(flat, expected_flat, **TOL["models"]["fp32"])
    assert ours.get_config_dict() == theirs.get_config_dict()


def _custom(queries, documents, queries_mask=None, documents_mask=None):
    return colbert_scores(queries, documents, queries_mask=queries_mask, documents_mask=documents_mask) * 0.5


@pytest.mark.parametrize("similarity_fct", [lambda: _custom, lambda: functools.partial(colbert_scores, 1)],
                         ids=["custom", "partial-with-args"])
def test_other_scores_run_sentence_transformers_code_with_one_warning(similarity_fct, caplog):
    columns = [QUERIES[:3], DOCUMENTS[:3]]
    theirs = CachedMultiVectorMultipleNegativesRankingLoss(_model(), similarity_fct=similarity_fct(), mini_batch_size=2)
    with caplog.at_level(logging.WARNING, logger="cgist.losses.base"):
        ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), similarity_fct=similarity_fct(),
                                                                        mini_batch_size=2)
        if similarity_fct().__class__ is functools.partial:
            with pytest.raises(TypeError):  # sentence-transformers' own error for a score it cannot call
                _model_step(theirs, columns)
            return
        expected, _ = _model_step(theirs, columns)
        got, _ = _model_step(ours, columns)
        _model_step(ours, columns)
    assert ours.last_path == UNFUSED
    torch.testing.assert_close(got, expected)
    assert sum("sentence-transformers' own loss computation" in r.getMessage() for r in caplog.records) == 1


def _half_maxsim(*args, **kwargs):
    """A model's own score that is not MaxSim: half of it."""
    from sentence_transformers.util import similarity as st_similarity

    return st_similarity.maxsim(*args, **kwargs) * 0.5


@pytest.mark.parametrize("score", ["custom", "model-similarity"])
def test_other_scores_over_given_embeddings_are_sentence_transformers_loss(score):
    """``calculate_loss`` of the plain drop-in (given token embeddings, as its loss stage takes them) with a score
    the fused stage does not compute: sentence-transformers' scoring and cross-entropy (its plain class's ``forward``
    after the embedding), in chunks of ``score_mini_batch_size`` queries, the loss and gradients of its cached class's
    ``calculate_loss`` over the same embeddings. ``"model-similarity"``: ``similarity_fct=None`` with a model whose
    own similarity is another score, which sentence-transformers scores with."""
    import copy

    queries, query_mask, documents, document_masks = _inputs(10, 5, 2, 4, 6, 8, dtype=torch.float32)
    reps = [_split(queries, 2), *(_split(d, 2) for d in documents)]
    masks = [_split(query_mask, 2), *(_split(m, 2) for m in document_masks)]
    model = copy.deepcopy(_model())
    chunks = []  # the queries of each call of the custom score

    def custom(queries, *args, **kwargs):
        chunks.append(queries.shape[0])
        return _custom(queries, *args, **kwargs)

    if score == "custom":
        kwargs = dict(similarity_fct=custom)
    else:
        model.similarity_fn_name  # noqa: B018 (sets the model's scorer, which the next line replaces)
        model._similarity, kwargs = _half_maxsim, {}
    theirs = CachedMultiVectorMultipleNegativesRankingLoss(model, scale=3.0, mini_batch_size=2, **kwargs)
    expected, expected_grads = cached_loss_stage(theirs, reps, masks)
    # Without similarity_fct, sentence-transformers 6.3 scores with the model's own similarity (the half score); 6.2
    # binds MaxSim (colbert_scores) when the loss is made, which the drop-in fuses as sentence-transformers scores it.
    fused = score == "model-similarity" and theirs.similarity_fct is not None
    ours = cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, scale=3.0, score_mini_batch_size=2, **kwargs)
    assert (ours.options is not None) == fused
    chunks.clear()
    got, grads = cached_loss_stage(ours, reps, masks)
    assert ours.last_path == (FUSED if fused else UNFUSED)
    assert chunks == ([2, 2, 1] if score == "custom" else [])
    torch.testing.assert_close(got, expected)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # the half score: half the logits of MaxSim, which is fused
        scale = 3.0 if fused else 1.5
        maxsim = cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), scale=scale).calculate_loss(reps, masks)
    torch.testing.assert_close(got, maxsim)


def test_assigned_attributes_take_effect_at_the_next_call():
    columns = [QUERIES[:4], DOCUMENTS[:4]]
    ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), mini_batch_size=2)
    ours.scale, ours.similarity_fct = 6.0, mean_colbert_scores
    theirs = CachedMultiVectorMultipleNegativesRankingLoss(_model(), mini_batch_size=2, scale=6.0,
                                                           similarity_fct=mean_colbert_scores)
    torch.testing.assert_close(_model_step(ours, columns)[0], _model_step(theirs, columns)[0], rtol=1e-5, atol=1e-6)
    ours.scale = -1.0
    with pytest.raises(ValueError, match="Scale must be a positive value"):
        _model_step(ours, columns)


# -- bad input ------------------------------------------------------------------------------------------------------


def test_bad_constructor_arguments_are_named():
    with pytest.raises(ValueError, match="Scale must be a positive value"):
        cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), scale=0.0)
    with pytest.raises(ValueError, match="scale must be finite"):
        cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), scale=float("inf"))
    with pytest.raises(TypeError, match="model must be a Module"):  # any module, as sentence-transformers takes
        cgist.FusedMultiVectorMultipleNegativesRankingLoss("model")
    with pytest.raises(ValueError, match="score_mini_batch_size must be at least 1"):
        cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), score_mini_batch_size=0)
    with pytest.raises(ValueError, match="backend"):
        cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), backend="cuda")
    with pytest.raises(TypeError, match="FusedMultiVectorMultipleNegativesRankingLoss"):
        cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), 2.0)  # keyword-only, as sentence-transformers'


#: ``calculate_loss`` (and ``loss_stage``) of a multi-vector drop-in called without what it takes: (the call, error,
#: message).
BAD_CALLS = [
    pytest.param("no masks", TypeError, r"^calculate_loss of a multi-vector drop-in takes the token embeddings' masks "
                 r"beside them, one list of mini-batch masks per column \(masks_chunks\)$", id="no-masks"),
    pytest.param("masks of one column", TypeError, r"takes the token embeddings' masks beside them",
                 id="masks-of-one-column"),
    # MatryoshkaLoss's dimensions are sentence-transformers' loop, a loss stage per dimension (fuses_matryoshka).
    pytest.param("dimensions", NotImplementedError,
                 r"^the multi-vector loss stage computes one Matryoshka dimension per call$", id="matryoshka-dims"),
]


@pytest.mark.parametrize("call, error, match", BAD_CALLS)
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_a_call_without_what_the_loss_stage_takes_is_named(cached, call, error, match):
    queries, query_mask, documents, document_masks = _inputs(11, 4, 1, 3, 5, 6, dtype=torch.float32)
    reps, masks = [[queries], [documents[0]]], [[query_mask], [document_masks[0]]]
    cls = (cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss if cached
           else cgist.FusedMultiVectorMultipleNegativesRankingLoss)
    loss = cls(_model())
    with pytest.raises(error, match=match):
        if call == "dimensions":
            loss.loss_stage(reps, masks, with_backward=False, dims=((64, 1.0), (32, 0.5)))
        else:
            loss.calculate_loss(reps, None if call == "no masks" else masks[:1])
    assert torch.isfinite(loss.calculate_loss(reps, masks))


def test_bad_inputs_get_a_clear_error():
    queries, query_mask, documents, document_masks = _inputs(5, 3, 1, 2, 4, 5, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"documents\[0\] has token embeddings of dim 4, but the queries' have dim 5"):
        cgist.maxsim_loss(queries, query_mask, [documents[0][..., :4]], document_masks)
    with pytest.raises(ValueError, match=r"document_masks\[0\] must have shape \(3, 4\)"):
        cgist.maxsim_loss(queries, query_mask, documents, [document_masks[0][:, :3]])
    with pytest.raises(ValueError, match="query_mask must have shape"):
        cgist.maxsim_loss(queries, query_mask[:2], documents, document_masks)
    bad = queries.clone()
    bad[1, 0, 2] = float("nan")
    with pytest.raises(ValueError, match="queries contains NaN"):
        cgist.maxsim_loss(bad, query_mask, documents, document_masks)
    with pytest.raises(ValueError, match="every document column must have the same number of rows"):
        cgist.maxsim_loss(queries, query_mask, [documents[0], documents[0][:2]],
                          [document_masks[0], document_masks[0][:2]])
    with pytest.raises(ValueError, match="offset must be an int in"):
        cgist.maxsim_loss(queries, query_mask, documents, document_masks, offset=1)
    with pytest.raises(ValueError, match=r"query_mask must hold 0 and 1 only \(True at a real token\), got \[2.0\]"):
        # sentence-transformers would weigh a token twice
        cgist.maxsim_loss(queries, query_mask.float() + query_mask[:, :1].float(), documents, document_masks)


def _cached_against_sentence_transformers(reps, masks, ours_reps=None, ours_masks=None, **kwargs):
    """``cached_loss_stage`` of sentence-transformers' cached class over ``reps`` and ``masks``, and of the drop-in over
    ``ours_reps`` and ``ours_masks`` (default: the same)."""
    theirs = cached_loss_stage(CachedMultiVectorMultipleNegativesRankingLoss(_model(), mini_batch_size=2, **kwargs),
                               reps, masks)
    ours = cached_loss_stage(cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(
        _model(), mini_batch_size=2, **kwargs), reps if ours_reps is None else ours_reps,
        masks if ours_masks is None else ours_masks)
    return theirs, ours


def test_a_nan_at_a_padding_token_is_masked_as_sentence_transformers_masks_it():
    """A padding token is never scored: sentence-transformers' loss is the same with NaN there, and so is the
    drop-in's, whose gradients are those of the padding zeroed (sentence-transformers' queries get NaN, 0 x NaN in
    its backward's product); a NaN at a real token is refused."""
    queries, query_mask, documents, document_masks = _inputs(8, 4, 1, 3, 5, 6, dtype=torch.float32)
    padding = (~document_masks[0]).nonzero()[0].tolist()
    nan = documents[0].clone()
    nan[tuple(padding)] = float("nan")
    masks = [[query_mask], [document_masks[0]]]
    (expected, expected_grads), (got, grads) = _cached_against_sentence_transformers([[queries], [nan]], masks)
    (zeroed, zeroed_grads), _ = _cached_against_sentence_transformers(
        [[queries], [torch.where(document_masks[0].unsqueeze(-1), documents[0], 0.0)]], masks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not expected_grads[0].isfinite().all()
    for a, b in zip(grads, zeroed_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    real = documents[0].clone()
    real[tuple(document_masks[0].nonzero()[0].tolist())] = float("nan")
    with pytest.raises(ValueError, match=r"^documents\[0\] contains NaN or infinite values at a real token$"):
        cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model()).calculate_loss([[queries], [real]], masks)


def test_one_mask_over_a_columns_chunks_is_split_as_sentence_transformers_concatenates_them():
    queries, query_mask, documents, document_masks = _inputs(9, 4, 1, 3, 5, 6, dtype=torch.float32)
    reps = [_split(queries, 2), _split(documents[0], 3)]
    (expected, expected_grads), (got, grads) = _cached_against_sentence_transformers(
        reps, [_split(query_mask, 2), _split(document_masks[0], 3)], reps, [[query_mask], [document_masks[0]]])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ragged = [_split(queries, 2), [documents[0][:3], documents[0][3:, :4]]]
    with pytest.raises(ValueError, match=r"^document_masks\[0\] must have one mask per chunk of documents\[0\], or "
                       r"one \(rows, tokens\) mask over chunks of one token width: got 1 masks for 2 chunks$"):
        cgist.maxsim_loss(ragged[0], [query_mask], ragged[1:], [[document_masks[0]]])


def test_a_scale_whose_logits_overflow_is_named():
    """sentence-transformers' loss is NaN at scale 1e38 (MaxSim sums up to a score per query token); the drop-in's
    error names the scale."""
    queries, query_mask, documents, document_masks = _inputs(10, 4, 1, 3, 5, 6, dtype=torch.float32)
    reps, masks = [[queries], [documents[0]]], [[query_mask], [document_masks[0]]]
    assert cached_loss_stage(CachedMultiVectorMultipleNegativesRankingLoss(_model(), scale=1e38), reps, masks)[0].isnan()
    with pytest.raises(ValueError, match=r"^the loss is nan: scale \(1 / temperature\) = 1e\+38 times the scores "
                       r"overflows torch.float32; lower the scale \(or the embeddings' magnitude\)$"):
        cached_loss_stage(cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), scale=1e38), reps, masks)


def test_the_plain_class_ignores_a_score_mini_batch_size_of_0_as_sentence_transformers_does():
    """Its plain class scores ``score_mini_batch_size or batch_size`` queries at a time; the cached class steps by it,
    and 0 is refused there (``test_bad_constructor_arguments_are_named``)."""
    columns = [QUERIES[:4], DOCUMENTS[:4]]
    theirs = MultiVectorMultipleNegativesRankingLoss(_model(), score_mini_batch_size=0)
    ours = cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), score_mini_batch_size=0)
    assert ours.score_mini_batch_size == 0
    torch.testing.assert_close(_model_step(ours, columns)[0], _model_step(theirs, columns)[0], rtol=1e-5, atol=1e-6)
    assert ours.last_path == FUSED


def test_a_confident_query_keeps_its_small_gradient_in_float32():
    """Queries that rank their positives far above the rest (a loss of 8e-5) have a gradient of ``p - 1`` near zero
    at the positive. The stage keeps each softmax's normaliser as (largest logit, sum) and sums the other terms
    apart from the label's, so that ``1 - p_label`` keeps float32's relative precision, where ``p_label - 1`` cancels
    to an ulp of 1 (sentence-transformers' softmax: a relative error of about ``u / loss``, 3e-4 here). The bound is
    the error analysis's: each probability moves by the rounding of its logit's difference to the largest,
    ``2 * scale * Lq * gamma_D`` for unit tokens (each maximum a product of ``D`` terms within
    ``gamma_D = D u / (1 - D u)`` of exact), plus a few roundings of its exponential and sum."""
    queries, query_mask, documents, document_masks = _inputs(6, 6, 2, 8, 10, 16, dtype=torch.float32)
    queries = torch.nn.functional.normalize(queries, dim=-1)
    documents = [torch.nn.functional.normalize(d, dim=-1) for d in documents]
    documents[0][:, :8] = queries  # every query's real tokens are in its positive: MaxSim of its length, ~3x others
    document_masks[0][:, :8] = query_mask
    exact = [t.double().requires_grad_() for t in (queries, *documents)]
    loss = maxsim_loss_reference(exact[0], query_mask, exact[1:], document_masks, scale=8.0)
    assert loss < 1e-4  # confident
    reference = torch.autograd.grad(loss, exact)
    leaves = [t.clone().requires_grad_() for t in (queries, *documents)]
    ours = torch.autograd.grad(cgist.maxsim_loss(leaves[0], query_mask, leaves[1:], document_masks, scale=8.0), leaves)
    unit = 2.0**-24
    gamma = 16 * unit / (1 - 16 * unit)  # D = 16
    bound = 2 * 8.0 * 8 * gamma + 8 * unit  # scale 8, Lq 8
    for got, exact_grad in zip(ours, reference):
        error = (got.double() - exact_grad).norm() / exact_grad.norm()
        assert error <= bound, (float(error), bound)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_the_drop_ins_on_the_triton_backend_equal_sentence_transformers(cached):
    """The kernels (under the Triton interpreter without CUDA) behind both drop-ins, on ragged random embeddings."""
    pytest.importorskip("triton")
    queries, query_mask, documents, document_masks = _inputs(7, 5, 2, 4, 9, 8, dtype=torch.float32)
    document_masks[1][2] = False
    reps = [_split(queries, 2), *(_split(d, 2) for d in documents)]
    masks = [_split(query_mask, 2), *(_split(m, 2) for m in document_masks)]
    expected, expected_grads = cached_loss_stage(
        CachedMultiVectorMultipleNegativesRankingLoss(_model(), scale=3.0, mini_batch_size=2), reps, masks)
    if cached:
        ours = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(_model(), scale=3.0, mini_batch_size=2,
                                                                        backend="triton")
        got, grads = cached_loss_stage(ours, reps, masks)
    else:
        ours = cgist.FusedMultiVectorMultipleNegativesRankingLoss(_model(), scale=3.0, backend="triton")
        leaves = [[t.detach().clone().requires_grad_() for t in column] for column in reps]
        got = ours.calculate_loss(leaves, masks)
        grads = torch.autograd.grad(got, [t for column in leaves for t in column])
    assert ours.last_path == FUSED
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _wrapped_step(wrap, cached: bool, columns):
    """``wrap(model, inner)``'s training step around sentence-transformers' class and around the drop-in."""
    if cached:
        pair = (CachedMultiVectorMultipleNegativesRankingLoss, cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss)
        kwargs = dict(mini_batch_size=2, scale=3.0)
    else:
        pair = (MultiVectorMultipleNegativesRankingLoss, cgist.FusedMultiVectorMultipleNegativesRankingLoss)
        kwargs = dict(scale=3.0)
    results = []
    for cls in pair:
        inner = cls(_model(), **kwargs)
        results.append((*_model_step_of(wrap(_model(), inner), columns), inner))
    return results


def _model_step_of(loss, columns):
    model = _model()
    model.zero_grad()
    value = loss(_features(model, columns), None)
    value.backward()
    grads = torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])
    return value.detach(), grads


def _wrappers():
    losses = pytest.importorskip("sentence_transformers.multi_vector_encoder.losses")
    if not hasattr(losses, "MultiVectorMatryoshkaLoss"):
        pytest.skip("sentence-transformers before 6.3 has no multi-vector Matryoshka or token-pooling loss")
    from sentence_transformers.multi_vector_encoder.modules import HierarchicalTokenPooling

    return {
        "matryoshka": lambda model, inner: losses.MultiVectorMatryoshkaLoss(model, inner, [128, 64, 32],
                                                                           matryoshka_weights=[1.0, 0.5, 0.25]),
        "token-pooling": lambda model, inner: losses.MultiVectorTokenPoolingLoss(
            model, inner, token_poolings=[None, HierarchicalTokenPooling(pool_factor=2)]),
    }


@pytest.mark.parametrize("wrapper", ["matryoshka", "token-pooling"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_sentence_transformers_wrappers_run_the_fused_stage(wrapper, cached):
    """``MultiVectorMatryoshkaLoss`` and ``MultiVectorTokenPoolingLoss`` (6.3) around each drop-in: the loss and the
    model's gradients of the same wrapper around sentence-transformers' class, each variant a fused loss stage."""
    wrap = _wrappers()[wrapper]
    (expected, expected_grads, _), (got, grads, ours) = _wrapped_step(wrap, cached, [QUERIES, DOCUMENTS, NEGATIVES])
    assert ours.path_counts[UNFUSED] == 0 and ours.path_counts[FUSED] >= 2  # a fused stage per variant
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (grads - expected_grads).norm() < 1e-4 * expected_grads.norm()


def test_which_scores_are_fused():
    """``maxsim_normalization``: MaxSim (False), MeanMaxSim (True) or not fused (None), for every form of the score."""
    import copy

    from cgist.losses.scorers import maxsim_normalization

    model = copy.deepcopy(_model())
    assert maxsim_normalization(colbert_scores, model) is False
    assert maxsim_normalization(mean_colbert_scores, model) is True
    assert maxsim_normalization(functools.partial(mean_colbert_scores, length_normalize=False), model) is False
    assert maxsim_normalization(functools.partial(colbert_scores, chunk_elements=10), model) is False
    assert maxsim_normalization(functools.partial(colbert_scores, device="cpu"), model) is None
    assert maxsim_normalization(_custom, model) is None
    assert maxsim_normalization(None, object()) is None  # no model similarity to read
    if not hasattr(model, "_similarity"):
        return  # sentence-transformers 6.2 sets colbert_scores itself: None is never its default
    assert maxsim_normalization(None, model) is False
    model.similarity_fn_name = "meanmaxsim"
    assert maxsim_normalization(None, model) is True
    from sentence_transformers.multi_vector_encoder.scoring import colbert

    if hasattr(colbert, "_MaxSimScorer"):  # 6.3: the model's kernels (use_kernels=True)
        model._similarity = colbert._MaxSimScorer(length_normalize=True)
        assert maxsim_normalization(None, model) is True
    model._similarity = lambda *args, **kwargs: None
    assert maxsim_normalization(None, model) is None
