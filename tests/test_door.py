"""One door for bad input (docs/design.md#adding-a-score): the inputs a user of the multi-vector and dense drop-ins can
hit, on both backends (the kernels under the Triton interpreter), each answered with sentence-transformers' own
result or a clear error naming the problem.

* Masks in any layout (a column-major mask, built as ``(L, B)`` and transposed), and float 0/1 masks (which
  sentence-transformers' scorers document and take): its loss and gradients. A mask holding another value is refused
  (sentence-transformers would weigh the token by it).
* A token axis of width 0 (queries: every score 0; documents: every document empty, -1e9) and every document masked:
  its loss (``log`` of the candidates, in float32 too) and gradients.
* A batch of zero rows: an error naming it.
* A learned ``scale`` (``nn.Parameter``, or a tensor): sentence-transformers' gradient, for ``maxsim_loss``, the
  multi-vector drop-ins and the dense ranking drop-ins; a learned GIST ``temperature``: the loss's derivative (where
  sentence-transformers' own is NaN: its masked similarities are -inf before the division).
"""

from __future__ import annotations

import pytest
import torch
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

import cgist

BACKENDS = ["torch", "triton"]


def _problem(dtype=torch.float64, batch=4, columns=2, lq=5, ld=7, dim=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, lq, dim, generator=gen, dtype=dtype)
    documents = [torch.randn(batch, ld, dim, generator=gen, dtype=dtype) for _ in range(columns)]
    query_mask = torch.rand(batch, lq, generator=gen) > 0.3
    query_mask[:, 0] = True
    masks = [torch.rand(batch, ld, generator=gen) > 0.3 for _ in range(columns)]
    for m in masks:
        m[:, 0] = True
    return queries, query_mask, documents, masks


def _theirs(queries, query_mask, documents, masks, scale=1.0):
    """sentence-transformers' loss: its scorer over the query-major documents, then the cross-entropy."""
    scores = colbert_scores(queries, torch.stack(documents, 1), queries_mask=query_mask,
                            documents_mask=torch.stack(masks, 1))
    return torch.nn.functional.cross_entropy(scores * scale, torch.arange(queries.shape[0]) * len(documents))


def _both(inputs, backend, masks_as=None, **kwargs):
    """(ours, theirs): each the loss and the gradients of the queries and documents, on the same leaves' values;
    ``masks_as`` gives the masks the fused stage takes (sentence-transformers' take the bool ones)."""
    queries, query_mask, documents, masks = inputs
    results = []
    for fused in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (queries, *documents)]
        if fused:
            q_mask, d_masks = masks_as(query_mask, masks) if masks_as else (query_mask, masks)
            loss = cgist.maxsim_loss(leaves[0], q_mask, leaves[1:], d_masks, backend=backend, **kwargs)
        else:
            loss = _theirs(leaves[0], query_mask, leaves[1:], masks, **kwargs)
        # every document masked: sentence-transformers' scores are constants, its loss has no graph
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
        results.append((loss.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]))
    return results


def _assert_same(ours, theirs, tol=1e-6):
    """The same loss and gradients, to float32's rounding: sentence-transformers' scorer sums its maxima in float32."""
    (loss, grads), (want, want_grads) = ours, theirs
    torch.testing.assert_close(loss.double(), want.double(), rtol=tol, atol=0)
    for got, expected in zip(grads, want_grads):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got.double(), expected.double(), rtol=tol, atol=tol)


def _column_major(mask: torch.Tensor) -> torch.Tensor:
    """The same mask, laid out column-major: built as ``(L, B)`` and transposed."""
    out = mask.T.contiguous().T
    assert not out.is_contiguous()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["column-major", "float", "int"])
def test_masks_in_any_layout_and_dtype_give_sentence_transformers_result(backend, layout):
    convert = {"column-major": _column_major, "float": lambda m: m.double(), "int": lambda m: m.to(torch.int8)}[layout]
    ours, theirs = _both(_problem(seed=1), backend, masks_as=lambda q, d: (convert(q), [convert(m) for m in d]),
                         scale=2.0)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("axis", ["queries", "documents"])
def test_a_token_axis_of_width_zero_scores_as_sentence_transformers(backend, axis):
    """Queries without tokens score 0 against every document, documents without tokens -1e9: the loss is ``log`` of
    the candidates, every gradient 0 (and shaped as its zero-width input)."""
    queries, query_mask, documents, masks = _problem(seed=2, dtype=torch.float32)
    if axis == "queries":
        queries, query_mask = queries[:, :0], query_mask[:, :0]
    else:
        documents, masks = [d[:, :0] for d in documents], [m[:, :0] for m in masks]
    ours, theirs = _both((queries, query_mask, documents, masks), backend)
    _assert_same(ours, theirs)
    assert abs(float(ours[0]) - float(torch.log(torch.tensor(8.0)))) < 1e-6  # 4 queries x 2 columns


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_document_masked_gives_log_of_the_candidates(backend, dtype):
    """Every document without a real token: every score is -1e9, the softmax uniform, the loss ``log(B * N)`` in
    float32 as in float64 (the -1e9 does not round the loss away), and no gradient."""
    queries, query_mask, documents, masks = _problem(seed=3, dtype=dtype)
    masks = [torch.zeros_like(m) for m in masks]
    ours, theirs = _both((queries, query_mask, documents, masks), backend, scale=3.0)
    _assert_same(ours, theirs)
    assert abs(float(ours[0]) - float(torch.log(torch.tensor(8.0)))) < 1e-6
    assert all(not g.any() for g in ours[1])


def test_a_batch_of_zero_rows_is_named():
    queries, query_mask, documents, masks = _problem()
    with pytest.raises(ValueError, match="queries must hold at least one query, got 0 rows"):
        cgist.maxsim_loss(queries[:0], query_mask[:0], documents, masks)
    with pytest.raises(ValueError, match=r"embeddings\[0\] \(student anchor\) must be non-empty"):
        cgist.gist_loss([torch.zeros(0, 4), torch.randn(3, 4)], None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("guided", [False, True], ids=["plain", "guided"])
def test_a_learned_scale_gets_sentence_transformers_gradient(backend, guided):
    """``maxsim_loss`` with a ``scale`` that requires a gradient: the loss's derivative with respect to it, as autograd
    gives it through sentence-transformers' ``scores * scale``; with a guide, the oracle's derivative by central
    differences (autograd's is NaN through its masked scores, ``-inf * scale``)."""
    from cgist.stage.reference import maxsim_gist_loss_reference

    queries, query_mask, documents, masks = _problem(seed=4)
    scale = torch.nn.Parameter(torch.tensor(2.5, dtype=torch.float64))
    guide = dict(guide="self", margin=0.2) if guided else {}
    loss = cgist.maxsim_loss(queries, query_mask, documents, masks, scale=scale, backend=backend, **guide)
    loss.backward()
    if guided:
        def oracle(value: float) -> float:
            return float(maxsim_gist_loss_reference(queries, query_mask, documents, masks, "self", scale=value,
                                                    margin=0.2)[0])

        want, eps = oracle(2.5), 1e-6
        want_grad = torch.tensor((oracle(2.5 + eps) - oracle(2.5 - eps)) / (2 * eps), dtype=torch.float64)
        tol = 1e-6
    else:
        theirs = torch.nn.Parameter(torch.tensor(2.5, dtype=torch.float64))
        value = _theirs(queries, query_mask, documents, masks, scale=theirs)
        value.backward()
        want, want_grad, tol = float(value.detach()), theirs.grad, 1e-6
    assert abs(float(loss.detach()) - want) <= tol * abs(want) and want_grad != 0
    torch.testing.assert_close(scale.grad, want_grad, rtol=tol, atol=tol)


# The drop-ins: any model sentence-transformers' classes take, and a learned scale or temperature ------------------


class TokenTable(torch.nn.Module):
    """A pass-through model, as sentence-transformers' own multi-vector loss tests use: no ``MultiVectorEncoder``,
    just token embeddings (a table looked up by the features' token ids, so the gradients reach a parameter) and the
    attention mask, whatever the task."""

    def __init__(self, vocabulary: int = 40, dim: int = 8) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocabulary, dim, dtype=torch.float64)
        with torch.no_grad():
            self.table.weight.normal_(generator=torch.Generator().manual_seed(7))

    def forward(self, features: dict, task: str | None = None) -> dict:
        return {**features, "token_embeddings": self.table(features["input_ids"]),
                "attention_mask": features["attention_mask"]}


def _token_features(columns: int = 3, batch: int = 4, seed: int = 8) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    features = []
    for _ in range(columns):
        lengths = torch.randint(2, 7, (batch,), generator=gen)
        ids = torch.randint(1, 40, (batch, 6), generator=gen)
        mask = (torch.arange(6) < lengths[:, None]).long()
        features.append({"input_ids": ids * mask, "attention_mask": mask})
    return features


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_the_multi_vector_drop_ins_take_a_pass_through_model_and_a_learned_scale(cached):
    """A model that is no ``MultiVectorEncoder`` (its output holds ``token_embeddings``), and a ``scale`` that is an
    ``nn.Parameter``: the fused stage runs, with sentence-transformers' loss, the model's gradients and the scale's."""
    from sentence_transformers.multi_vector_encoder.losses import (
        CachedMultiVectorMultipleNegativesRankingLoss,
        MultiVectorMultipleNegativesRankingLoss,
    )

    from cgist.losses.base import FUSED

    results = []
    for fused in (True, False):
        model = TokenTable()
        cls = {(True, True): cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss,
               (True, False): cgist.FusedMultiVectorMultipleNegativesRankingLoss,
               (False, True): CachedMultiVectorMultipleNegativesRankingLoss,
               (False, False): MultiVectorMultipleNegativesRankingLoss}[fused, cached]
        loss = cls(model, scale=torch.nn.Parameter(torch.tensor(3.0, dtype=torch.float64)),
                   similarity_fct=colbert_scores, **(dict(mini_batch_size=2) if cached else {}))
        value = loss(_token_features(), None)
        value.backward()
        if fused:
            assert loss.last_path == FUSED
        results.append((value.detach(), model.table.weight.grad, loss.scale.grad))
    # sentence-transformers' scorer sums its maxima in float32: its rounding
    (loss, table, scale), (want, want_table, want_scale) = results
    torch.testing.assert_close(loss, want.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(table, want_table, rtol=1e-5, atol=1e-7)
    assert want_scale != 0
    torch.testing.assert_close(scale, want_scale, rtol=1e-5, atol=1e-8)


def test_a_learned_scale_of_the_ranking_drop_ins_gets_sentence_transformers_gradient(student):
    from helpers_models import random_texts, run_loss
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from cgist.losses.base import FUSED, UNFUSED

    texts = random_texts(1, seed=3, batch=6, duplicates=False)
    grads = []
    for cls, path in ((cgist.FusedMultipleNegativesRankingLoss, FUSED), (MultipleNegativesRankingLoss, UNFUSED)):
        loss = cls(student, scale=torch.nn.Parameter(torch.tensor(20.0, dtype=torch.float64)))
        value, model_grads = run_loss(loss, student, texts, seed=0, path=path)
        grads.append((value, model_grads, loss.scale.grad))
    (value, model_grads, scale), (want, want_grads, want_scale) = grads
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(scale, want_scale, rtol=1e-8, atol=1e-10)
    for name, grad in want_grads.items():
        torch.testing.assert_close(model_grads[name], grad, rtol=1e-7, atol=1e-10)


def test_a_learned_gist_temperature_gets_the_losss_derivative(student, tiny_guide):
    """sentence-transformers' own temperature gradient is NaN (its masked similarities are -inf before the division);
    the fused stage's is the loss's derivative, here by central differences of the loss itself."""
    from helpers_models import random_texts

    texts = random_texts(1, seed=4, batch=6, duplicates=False)
    features = [student.preprocess(t) for t in texts]
    temperature = torch.nn.Parameter(torch.tensor(0.05, dtype=torch.float64))
    loss = cgist.FusedCachedGISTLoss(student, tiny_guide, temperature=temperature, margin=0.1, mini_batch_size=3)
    loss(features, None).backward()
    assert temperature.grad is not None and torch.isfinite(temperature.grad)

    def at(value: float) -> float:
        with torch.no_grad():
            temperature.fill_(value)  # the same parameter, another value: read at the call
            return float(loss(features, None))

    eps = 1e-7
    difference = (at(0.05 + eps) - at(0.05 - eps)) / (2 * eps)
    assert abs(float(temperature.grad) - difference) <= 1e-5 * abs(difference)


def test_a_learned_temperature_gets_the_same_gradient_from_the_dense_kernels():
    """``gist_loss`` with a learned temperature (a tensor that requires a gradient) on the kernels (under the
    interpreter without CUDA) and on the PyTorch path: the same loss and gradients, the temperature's included."""
    from helpers import make_inputs

    grads = {}
    for backend in BACKENDS:
        student, guide = make_inputs(6, 9, 8, 5, 1, torch.float64, seed=8, requires_grad=True)
        temperature = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
        loss = cgist.gist_loss(student, guide, temperature=temperature, margin=0.05, backend=backend)
        grads[backend] = (loss, *torch.autograd.grad(loss, [*student, temperature]))
    for got, want in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
