"""Every check of the loss stage's doors, each with the error it raises and the words that name the argument: one
bad argument at a time into ``cgist.maxsim_loss`` (MaxSim and XTR), ``cgist.gist_loss`` and the options, beside the
other test modules' tables of the common cases."""

from __future__ import annotations

import pytest
import torch

import cgist
from cgist import GistOptions
from cgist.stage.spec import dense, guide, maxsim, xtr


def _tokens(rows=3, tokens=4, dim=5, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, tokens, dim, generator=gen, dtype=dtype)


def _mask(rows=3, tokens=4):
    return torch.ones(rows, tokens, dtype=torch.bool)


def _maxsim(**changes):
    """``cgist.maxsim_loss`` of three queries against one document column, with ``changes`` to its arguments."""
    args = dict(queries=_tokens(), query_mask=_mask(), documents=[_tokens(seed=1)], document_masks=[_mask()])
    args.update(changes)
    return cgist.maxsim_loss(args.pop("queries"), args.pop("query_mask"), args.pop("documents"),
                             args.pop("document_masks"), **args)


def _vectors(rows=3, dim=6, seed=2):
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))


MAXSIM_CASES = {
    "scale-zero": (dict(scale=0.0), ValueError, "scale must be a positive finite number, got 0.0"),
    "masks-per-chunk": (dict(queries=[_tokens()[:2], _tokens()[2:]], query_mask=[_mask(rows=2)]), ValueError,
                        r"query_mask must have one mask per chunk of queries, or one \(rows, tokens\) mask over "
                        r"chunks of one token width: got 1 masks for 2 chunks"),
    "not-tokens": (dict(queries=_tokens()[:, 0]), ValueError,
                   r"queries must be a floating \(rows, tokens, dim\) tensor of token embeddings"),
    "dim-zero": (dict(queries=_tokens(dim=0), documents=[_tokens(dim=0)]), ValueError,
                 "queries has token embeddings of dim 0"),
    "dtypes": (dict(documents=[_tokens(dtype=torch.float64)]), ValueError,
               r"documents\[0\] is torch.float64, but the queries are torch.float32: pass one dtype"),
    "complex-mask": (dict(query_mask=_mask().to(torch.complex64)), TypeError,
                     "query_mask must be a bool \\(or 0/1\\) tensor, got torch.complex64"),
    "documents-a-tensor": (dict(documents=_tokens()), TypeError,
                           "documents must be a non-empty list of columns, each a tensor or a list of row chunks"),
    "masks-per-column": (dict(document_masks=_mask()), ValueError,
                         r"document_masks must be a list of one mask per column of documents \(1\)"),
    "chunks": (dict(queries="queries"), TypeError,
               "queries must be a torch.Tensor or a non-empty list of them \\(row chunks\\), got str"),
    "guide-word": (dict(guide="labels"), ValueError, "guide must be 'self', the guide's columns or None, got 'labels'"),
    "guide-masks-without-columns": (dict(guide="self", guide_masks=[_mask()]), ValueError,
                                    "guide_masks are for a multi-vector guide's"),
    "guide-columns": (dict(guide=[_vectors()]), ValueError,
                      "guide must be 'self', None, or a list of the guide's columns: the queries', then the 1 "
                      "document columns'"),
    "vector-guide-masks": (dict(guide=[_vectors(), _vectors()], guide_masks=[_mask(), _mask()]), ValueError,
                           r"this guide's columns are \(rows, dim\) embeddings"),
    "vector-guide-shape": (dict(guide=[_vectors(), _tokens()]), ValueError,
                           r"guide\[1\] must be floating \(rows, dim\) embeddings like guide\[0\]"),
    "token-guide-masks": (dict(guide=[_tokens(), _tokens()]), ValueError,
                          "a multi-vector guide needs guide_masks: one mask per guide column"),
    "token-guide-rows": (dict(guide=[_tokens(), _tokens(rows=2)], guide_masks=[_mask(), _mask(rows=2)]), ValueError,
                         r"guide\[1\] has 2 rows, but documents\[0\] has 3"),
    "xtr-length-normalize": (dict(top_k=2, length_normalize=True), ValueError,
                             "length_normalize divides MaxSim's scores by the query's token count"),
    "xtr-contrast": (dict(top_k=2, contrast_anchors=True), ValueError,
                     "contrast_anchors and contrast_positives are not defined for XTR scoring"),
}


@pytest.mark.parametrize("case", list(MAXSIM_CASES))
def test_maxsim_loss_names_a_bad_argument(case):
    changes, error, match = MAXSIM_CASES[case]
    with pytest.raises(error, match=match):
        _maxsim(**changes)


def test_a_guide_on_another_device_than_the_queries_is_named(monkeypatch):
    """A multi-vector guide's device against the queries' (the meta device stands in for another)."""
    meta = [t.to("meta") for t in (_tokens(), _tokens())]
    with pytest.raises(ValueError, match=r"guide\[0\] is on meta, but the queries are on cpu"):
        _maxsim(guide=meta, guide_masks=[_mask().to("meta"), _mask().to("meta")])
    with pytest.raises(ValueError, match=r"documents\[0\] is on meta, but the queries are on cpu"):
        _maxsim(documents=[_tokens().to("meta")], document_masks=[_mask()])


def test_the_doors_name_a_call_of_another_score():
    tokens = (_tokens(), _mask(), [_tokens()], [_mask()])
    with pytest.raises(ValueError, match="similarity='xtr' is not a MaxSim score; maxsim_call takes"):
        maxsim.maxsim_call(*tokens, GistOptions(similarity="xtr", score_options={"top_k": 2}, contrast_anchors=False,
                                                contrast_positives=False))
    with pytest.raises(ValueError, match="similarity='maxsim' is not XTR"):
        xtr.xtr_call(*tokens, GistOptions(similarity="maxsim"))
    with pytest.raises(ValueError, match="similarity='maxsim' scores token embeddings: cgist.maxsim_loss takes them"):
        dense.dense_call([_vectors()] * 2, None, GistOptions(similarity="maxsim"))
    with pytest.raises(ValueError, match="mask_duplicates=True needs text_ids"):
        dense.dense_call([_vectors()] * 2, None, GistOptions(mask_duplicates=True))
    with pytest.raises(ValueError, match="--guide-mode must be one of"):
        guide.by_cli("nope")


TEXT_ID_CASES = {
    "columns": ([torch.arange(3)], ValueError, "text_ids has 1 columns but there are 2 columns"),
    "floating": ([torch.arange(3.0), torch.arange(3)], TypeError, r"text_ids\[0\] \(anchor\) must be an integer "
                                                                  "tensor, got torch.float32"),
    "rows": ([torch.arange(2), torch.arange(3)], ValueError, r"must hold one id per row, shape \(3,\), got \(2,\)"),
    "device": ([torch.arange(3).to("meta"), torch.arange(3)], ValueError, "is on meta, but the embeddings are on cpu"),
}


@pytest.mark.parametrize("case", list(TEXT_ID_CASES))
def test_gist_loss_names_bad_text_ids(case):
    ids, error, match = TEXT_ID_CASES[case]
    with pytest.raises(error, match=match):
        cgist.gist_loss([_vectors(), _vectors(seed=3)], None, text_ids=ids)


def test_all_anchors_with_text_ids_needs_theirs():
    with pytest.raises(ValueError, match="all_anchors with text_ids needs all_anchors_text_ids"):
        cgist.gist_loss([_vectors(), _vectors(seed=3)], None, text_ids=[torch.arange(3)] * 2,
                        directions=("query_to_doc", "query_to_query"), all_anchors=_vectors(seed=4))


OPTION_CASES = {
    "block-bytes": (dict(block_bytes=1.5), TypeError, "block_bytes must be an int or None, got float"),
    "guide-similarity": (dict(guide_similarity="dot"), ValueError, "guide_similarity must be one of"),
    "xtr-without-top-k": (dict(similarity="xtr", contrast_anchors=False, contrast_positives=False), ValueError,
                          "similarity='xtr' needs top_k"),
    "top-k-of-another-score": (dict(score_options={"top_k": 3}), ValueError,
                               "top_k=3 is an option of the xtr score; similarity='cos' .* takes no option of its own"),
    "unknown-score-option": (dict(similarity="xtr", score_options={"top_k": 3, "depth": 2}, contrast_anchors=False,
                                  contrast_positives=False), ValueError,
                             r"depth=2 is no registered score's option; similarity='xtr' \(the xtr score\) takes "
                             r"\['top_k'\]"),
    "dense-option-under-maxsim": (dict(similarity="maxsim", hardness_mode="hard_negatives"), ValueError,
                                  r"^hardness_mode='hard_negatives' is an option of the dense score; "
                                  r"similarity='maxsim' \(the maxsim score\) takes it only at its default$"),
    "score-options-not-a-mapping": (dict(score_options=[("top_k", 3)]), TypeError,
                                    "score_options must be a mapping of option names to values, got list"),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options_name_a_bad_value(case):
    changes, error, match = OPTION_CASES[case]
    with pytest.raises(error, match=match):
        GistOptions(**changes)


def test_the_oracles_name_what_they_do_not_define():
    """The float64 oracles (``cgist.stage.reference``) refuse what their definitions leave out, by name."""
    from cgist.stage import reference

    tokens, mask = _tokens(dtype=torch.float64), _mask()
    with pytest.raises(ValueError, match="mask_duplicates needs text_ids"):
        reference.score_groups([_vectors(), _vectors(seed=3)], None, GistOptions(mask_duplicates=True))
    with pytest.raises(ValueError, match="XTR scores are not length-normalised"):
        reference.token_scores_reference(tokens, mask, tokens, mask, length_normalize=True, top_k=2)
    with pytest.raises(ValueError, match="XTR has no contrast blocks"):
        reference.maxsim_gist_loss_reference(tokens, mask, [tokens], [mask], "self", top_k=2, contrast_anchors=True)


def test_xtr_without_a_real_document_token_retrieves_nothing():
    """Every document masked: the pool is empty, no query token retrieves anything, and every score is
    sentence-transformers' empty-document score, in the oracle and in the stage."""
    from cgist.stage import reference
    from cgist.stage.spec.maxsim import EMPTY_DOCUMENT_SCORE

    tokens = _tokens(dtype=torch.float64)
    nothing = torch.zeros(3, 4, dtype=torch.bool)
    scores = reference.xtr_scores_reference(tokens, _mask(), tokens, nothing, top_k=2)
    assert torch.equal(scores, torch.full((3, 3), EMPTY_DOCUMENT_SCORE, dtype=torch.float64))


def test_finiteness_of_nothing_is_no_error():
    from cgist.stage.spec.checks import check_finite

    check_finite([("empty", torch.empty(0, 5))])  # no element, nothing to check: no error
