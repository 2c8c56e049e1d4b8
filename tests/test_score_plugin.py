"""A fourth score, added from outside the package through its public API alone (``cgist.scores``,
docs/design.md#adding-a-score): weighted MaxSim, MaxSim with one learned weight per query token position,

    s(q, d) = sum_t mask_q[t] * w[t] * max_{s real in d} <q_t, d_s>,

with a PyTorch backend and no Triton one. This module is the score's spec module (``door``, ``check_options``), its
backend (``forward``) and its scorer (``scorer``: a ``WeightedMaxSim`` module as a drop-in's ``similarity_fct``), and
the tests: the loss and every gradient (the weight's included) against a float64 reference and ``gradcheck``, the
drop-ins running it fused against sentence-transformers' own loss with the same ``similarity_fct``, the router, the
first-use check and ``cgist doctor``, and the statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sentence_transformers")

from helpers_models import DOCUMENTS, QUERIES, multi_vector_model, multi_vector_step  # noqa: E402
from sentence_transformers.multi_vector_encoder.losses import (  # noqa: E402
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)

import cgist  # noqa: E402
from cgist.scores import (  # noqa: E402
    SCORES, TEMPERATURE, GistOptions, Grads, MaxSimCall, Score, maxsim_call, register_score, run,
)

NAME = "weighted_maxsim"
#: The query token positions the weight covers.
POSITIONS = 64


def weighted_maxsim(queries, documents, queries_mask, documents_mask, weight):
    """``(Q, M)`` scores of padded ``(Q, Lq, D)`` queries against ``(M, Ld, D)`` documents (a document with no real
    token scores its queries' weighted count times -1e9, as sentence-transformers' MaxSim does)."""
    products = torch.einsum("qtd,msd->qmts", queries, documents)
    products = products.masked_fill(~documents_mask.bool()[None, :, None, :], -1e9)
    per_token = products.amax(-1) * (queries_mask.to(products.dtype) * weight[: queries.shape[1]])[:, None, :]
    return per_token.sum(-1)


class WeightedMaxSim(torch.nn.Module):
    """A multi-vector loss's ``similarity_fct`` with a learned weight per query token position. sentence-transformers
    calls it as its scorers: ``(Q, Lq, D)`` queries against ``(Q_doc, N, Ld, D)`` document groups, scores
    ``(Q, Q_doc * N)``, query-major."""

    def __init__(self, positions: int = POSITIONS) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(positions))

    def forward(self, queries, documents, queries_mask=None, documents_mask=None):
        documents = documents.flatten(0, 1)
        queries_mask = torch.ones(queries.shape[:2], dtype=torch.bool) if queries_mask is None else queries_mask
        documents_mask = torch.ones(documents.shape[:2], dtype=torch.bool) if documents_mask is None \
            else documents_mask.flatten(0, 1)
        return weighted_maxsim(queries, documents, queries_mask, documents_mask, self.weight.to(queries.dtype))


# The score's modules: this one -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightedCall(MaxSimCall):
    """A weighted MaxSim call: MaxSim's, with the learned weight among its parameters."""

    @property
    def weight(self) -> torch.Tensor:
        return self.parameters["weight"]


def door(queries, query_mask, documents, document_masks, options, *, weight, guide=None, guide_masks=None,
         text_ids=None, temperature=None):
    """The score's door: MaxSim's checks, the weight's, and no guide (this score masks nothing)."""
    if guide is not None or guide_masks is not None or options.mask_duplicates:
        raise ValueError(f"the {NAME} score takes no guide")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise TypeError(f"weight must be a 1-dim tensor, one weight per query token position, got {weight!r}")
    call = maxsim_call(queries, query_mask, documents, document_masks, options, text_ids=text_ids,
                       temperature=temperature, call_class=WeightedCall, parameters={"weight": weight})
    widths = {t.shape[1] for t in call.columns[0]}
    if max(widths) > weight.shape[0]:
        raise ValueError(f"weight covers {weight.shape[0]} query token positions, the queries have {max(widths)}")
    return call


def check_options(options):
    """No option of its own: the contrast blocks are MaxSim's, not this score's."""
    if options.contrast_anchors or options.contrast_positives:
        raise ValueError(f"the {NAME} score has no contrast blocks: contrast_anchors and contrast_positives must be "
                         "False")
    return {}


def _padded(chunks, masks):
    width = max(t.shape[1] for t in chunks)
    pad = [F.pad(t, (0, 0, 0, width - t.shape[1])) for t in chunks]
    return torch.cat(pad), torch.cat([F.pad(m, (0, width - m.shape[1])) for m in masks])


def forward(call: WeightedCall, with_grad: bool, need_stats: bool = False):
    """The score's PyTorch backend: the scores of every query against every document of every column, the
    cross-entropy over them (query ``i``'s label: the first column's row ``offset + i``), and by autograd the
    gradients of every input chunk and every learned parameter."""
    n_queries = len(call.columns[0])
    leaves = [t.detach().requires_grad_(with_grad) for t in call.tensors]
    params = {name: p.detach().requires_grad_(with_grad) for name, p in call.parameters.items()}
    temperature = params.get(TEMPERATURE, call.options.temperature)
    with torch.enable_grad():
        queries, query_mask = _padded(leaves[:n_queries], call.masks[0])
        columns, start = [], n_queries
        for chunks, masks in zip(call.columns[1:], call.masks[1:]):
            columns.append(_padded(leaves[start : start + len(chunks)], masks))
            start += len(chunks)
        width = max(d.shape[1] for d, _ in columns)
        documents = torch.cat([F.pad(d, (0, 0, 0, width - d.shape[1])) for d, _ in columns])
        document_mask = torch.cat([F.pad(m, (0, width - m.shape[1])) for _, m in columns])
        scores = weighted_maxsim(queries, documents, query_mask, document_mask, params["weight"].to(queries.dtype))
        labels = torch.arange(queries.shape[0]) + call.options.offset
        loss = F.cross_entropy(scores / temperature, labels)
        if not with_grad:
            return loss.detach(), None, None
        grads = torch.autograd.grad(loss, [*leaves, *params.values()])
    return loss.detach(), Grads(list(grads[: len(leaves)]), dict(zip(params, grads[len(leaves) :]))), None


def scorer(similarity_fct, model):
    """The score's scorer: a ``WeightedMaxSim`` is this score, and its weight the call's learned parameter."""
    if isinstance(similarity_fct, WeightedMaxSim):
        return {"similarity": NAME}, {"weight": similarity_fct.weight}
    return None


SCORE = Score(NAME, (NAME,), tokens=True, options=(), spec=__name__, backends={"torch": __name__},
              scorer=f"{__name__}:scorer")


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The score, registered for this module's tests (and taken out of the registry after them)."""
    register_score(SCORE)
    yield SCORE
    SCORES.remove(SCORE)


# The tests ----------------------------------------------------------------------------------------------------------


def _inputs(seed=0, batch=4, columns=2, lq=5, ld=7, dim=6, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, lq, dim, generator=gen, dtype=dtype)
    query_mask = torch.arange(lq) < torch.randint(1, lq + 1, (batch, 1), generator=gen)
    documents = [torch.randn(batch, ld, dim, generator=gen, dtype=dtype) for _ in range(columns)]
    masks = [torch.arange(ld) < torch.randint(1, ld + 1, (batch, 1), generator=gen) for _ in range(columns)]
    weight = (torch.rand(POSITIONS, generator=gen, dtype=dtype) + 0.5).requires_grad_()
    return queries, query_mask, documents, masks, weight


def _reference(queries, query_mask, documents, masks, weight, scale):
    """The loss in float64, written apart from the backend: each query token's maximum over each document's real
    tokens, weighted and summed, then the cross-entropy with label ``i``."""
    q = queries.double()
    rows = []
    for i in range(q.shape[0]):
        row = []
        for column, mask in zip(documents, masks):
            for j in range(column.shape[0]):
                real = column[j][mask[j]].double()
                maxima = (q[i][query_mask[i]] @ real.T).amax(1)
                row.append((weight[: q.shape[1]].double()[query_mask[i]] * maxima).sum())
        rows.append(torch.stack(row))
    logits = torch.stack(rows) * scale
    return torch.logsumexp(logits, 1).sub(logits.diagonal()).mean()


def _call(queries, query_mask, documents, masks, weight, scale=2.0, temperature=None):
    options = GistOptions(similarity=NAME, temperature=1.0 / scale, contrast_anchors=False, contrast_positives=False)
    return SCORE.door()(queries, query_mask, documents, masks, options, weight=weight, temperature=temperature)


def test_its_loss_and_gradients_equal_a_float64_reference_and_pass_gradcheck():
    queries, query_mask, documents, masks, weight = _inputs()
    leaves = [queries.requires_grad_(), *(d.requires_grad_() for d in documents), weight]
    got = run(_call(queries, query_mask, documents, masks, weight), backend="torch")
    expected = _reference(queries, query_mask, documents, masks, weight, 2.0)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    def loss(q, d0, d1, w):
        return run(_call([q[:2], q[2:]], [query_mask[:2], query_mask[2:]], [d0, d1], masks, w), backend="torch")

    assert torch.autograd.gradcheck(loss, (queries, *documents, weight), fast_mode=True)


def test_a_learned_temperature_is_one_more_parameter():
    queries, query_mask, documents, masks, weight = _inputs(1)
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    got = cgist.scores.run(_call(queries, query_mask, documents, masks, weight, scale=3.0, temperature=1 / scale))
    expected = _reference(queries, query_mask, documents, masks, weight, scale)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, [scale, weight]), torch.autograd.grad(expected, [scale, weight])):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_its_checks_name_what_is_wrong():
    queries, query_mask, documents, masks, weight = _inputs(2)
    with pytest.raises(ValueError, match=r"^weight covers 3 query token positions, the queries have 5$"):
        _call(queries, query_mask, documents, masks, weight[:3])
    with pytest.raises(ValueError, match=rf"^the {NAME} score has no contrast blocks"):
        GistOptions(similarity=NAME)
    with pytest.raises(ValueError, match=r"^top_k=3 is an option of the xtr score"):
        GistOptions(similarity=NAME, score_options={"top_k": 3}, contrast_anchors=False, contrast_positives=False)
    with pytest.raises(ValueError, match=rf"^a score named '{NAME}' is registered already$"):
        register_score(dataclasses.replace(SCORE, similarities=("other",)))
    with pytest.raises(ValueError, match=r"^similarity 'maxsim' is the maxsim score's$"):
        register_score(dataclasses.replace(SCORE, name="other", similarities=("maxsim",)))
    with pytest.raises(ValueError, match=r"^backends must name a module for 'torch' \(and may for 'triton'\), got "
                       r"\{'triton': 'x'\}$"):
        register_score(dataclasses.replace(SCORE, name="other", similarities=("other",), backends={"triton": "x"}))
    with pytest.raises(ValueError, match=r"^similarities must name at least one value of GistOptions.similarity$"):
        register_score(dataclasses.replace(SCORE, name="other", similarities=()))
    with pytest.raises(TypeError, match=r"^score must be a cgist Score, got dict$"):
        register_score({"name": "other"})
    assert register_score(SCORE) is SCORE  # registering the same entry again does nothing
    assert [score.name for score in SCORES].count(NAME) == 1


def test_a_backend_must_return_every_parameters_gradient(monkeypatch):
    """The node takes one gradient per learned parameter of the call, by name: a backend that leaves one out is
    named."""
    queries, query_mask, documents, masks, weight = _inputs(5)
    call = _call(queries.requires_grad_(), query_mask, documents, masks, weight)

    original = forward

    def forward_without_the_weight(call, with_grad, need_stats=False):
        loss, grads, counters = original(call, with_grad, need_stats)
        return loss, Grads(grads.inputs), counters

    monkeypatch.setattr(sys.modules[__name__], "forward", forward_without_the_weight)
    loss = run(call)
    with pytest.raises(RuntimeError, match=rf"^the {NAME} score's backend returned gradients of the parameters \[\], "
                       r"not of the call's \['weight'\]$"):
        loss.backward()


def test_the_router_takes_its_pytorch_backend_where_auto_takes_the_kernels(simulate, monkeypatch):
    """On a simulated H100, "auto" takes the kernels for MaxSim and this score's PyTorch backend for it, with no
    first-use check (it has no kernels to check); "triton" names why it cannot run."""
    from cgist.stage.dispatch import route, selfcheck
    from cgist.stage.spec.scores import MAXSIM

    simulate("sm_90")
    monkeypatch.setenv(selfcheck.ENV, "1")
    queries, query_mask, documents, masks, weight = _inputs(3, dtype=torch.float32)
    call = _call(queries, query_mask, documents, masks, weight)
    assert route.auto_route(call.device, call.dtype, None, MAXSIM)[0] == "triton"
    assert route.auto_route(call.device, call.dtype, None, SCORE) == ("torch", f"the {NAME} score has no Triton kernels")
    assert route.select_stage(call) is sys.modules[__name__]
    loss = run(call)
    assert route.first_use_checks() == {} and route.kernel_failures() == {}
    torch.testing.assert_close(loss, run(call, backend="torch"), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=rf"^backend='triton' is unavailable: the {NAME} score has no Triton kernels"):
        run(call, backend="triton")


def test_cgist_doctor_lists_it(monkeypatch, capsys):
    """``cgist doctor``'s first-use checks go over the registry: this score, without kernels, is listed as such."""
    from cgist.cli import doctor
    from cgist.stage.spec import scores

    monkeypatch.setattr(scores, "SCORES", [SCORE])
    assert doctor._checks(torch.device("cpu"), interpreted=True) == []
    assert f"  {NAME:<24} no Triton kernels: the PyTorch path\n" in capsys.readouterr().out


def test_its_statistics_count_every_candidate_and_mask_none():
    """Without a guide nothing is masked; AP's candidates leave out each query's label (``GistStats``)."""
    batch = 4
    queries, query_mask, documents, masks, weight = _inputs(4, batch=batch)
    loss, stats = run(_call(queries, query_mask, documents, masks, weight), return_stats=True)
    assert stats.anchors == batch and stats.positive_only == 0 and stats.theta_mean is None
    assert stats.masked == {"ap": 0, "an": 0}
    assert stats.candidates == {"ap": batch * (batch - 1), "an": batch * batch}


@functools.cache
def _model():
    return multi_vector_model(0)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_the_drop_ins_run_it_fused_with_sentence_transformers_loss(cached, monkeypatch):
    """sentence-transformers' class with a ``WeightedMaxSim`` computes its scores by calling it; the drop-in with the
    same ``similarity_fct`` runs the score's backend in the loss stage instead: the same loss, the same gradients of
    the model's parameters and of the weight."""
    calls = []
    monkeypatch.setattr(sys.modules[__name__], "forward", _counting(forward, calls))
    results = []
    for cls in ((CachedMultiVectorMultipleNegativesRankingLoss, cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss)
                if cached else (MultiVectorMultipleNegativesRankingLoss, cgist.FusedMultiVectorMultipleNegativesRankingLoss)):
        fct = WeightedMaxSim()
        with torch.no_grad():
            fct.weight.copy_(torch.linspace(0.5, 1.5, POSITIONS))
        loss = cls(_model(), similarity_fct=fct, **({"mini_batch_size": 2} if cached else {}))
        value, grads = multi_vector_step(loss, [QUERIES[:4], DOCUMENTS[:4]])
        results.append((value, grads, fct.weight.grad.clone()))
    (expected, expected_grads, expected_weight), (got, grads, weight) = results
    assert calls, "the drop-in did not run the score's backend"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight, expected_weight, rtol=1e-4, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _counting(function, calls):
    def counted(*args, **kwargs):
        calls.append(args[0])
        return function(*args, **kwargs)

    return counted
