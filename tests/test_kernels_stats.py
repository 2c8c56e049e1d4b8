"""The Triton backend: the guide-mask counters (``need_stats``) against the oracle's masks and the streaming path.

The counts of each block, and the rows where only the label survives, are the test oracle's
(``helpers.oracle_counters``, counted on the masks of the dense oracle ``cgist.stage.reference.score_groups``: the
rules of docs/design.md#column-groups). The kernels count in per-row int32 counters during the forward; theta and
the thresholds are summed from the values the AP launch stored. Runs under the Triton interpreter without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (  # noqa: F401  (one_thread: autouse)
    DEVICE,
    DTYPES,
    Tol,
    assert_close,
    make_inputs,
    one_thread,
    oracle_counters,
    oracle_stats,
    shape_id,
)

from cgist import GistOptions
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.numerics import compute_dtype
from cgist.stage.stats import COUNT_FIELDS, SUM_FIELDS


def _tie(guide, column, row, anchor, offset):
    guide[column][row] = guide[1][offset + anchor]


CASES = [
    # (batch, n_cand, dim, dim_g, k, precision, options, ties)
    (13, 26, 40, 24, 1, "fp64", dict(offset=13, margin=0.1), ()),
    (13, 37, 40, 24, 2, "fp64", dict(offset=9, margin=0.0), ((1, 2, 3), (2, 19, 3), (3, 0, 7), (0, 4, 9))),
    (13, 37, 40, 24, 2, "fp32", dict(offset=9, margin=0.0), ((1, 25, 3), (2, 4, 6), (0, 10, 3))),
    (21, 42, 40, 24, 1, "fp64", dict(offset=17, margin=0.3, margin_strategy="relative", contrast_anchors=False), ()),
    (21, 42, 40, 24, 2, "fp64", dict(offset=17, margin=3.0), ()),  # only the label survives: every row
    (13, 26, 40, 24, 1, "fp64", dict(offset=11, margin=-2.5, contrast_positives=False), ()),  # nothing masked
    (5, 41, 17, 50, 0, "fp32", dict(offset=36, margin=0.05, temperature=0.02), ()),
]


def _case_id(case) -> str:
    batch, n_cand, dim, dim_g, k, precision, options, ties = case
    extra = "".join(f"-{key}{value}" for key, value in options.items())
    return f"{shape_id(batch, n_cand, dim, dim_g, k)}-{precision}{extra}{'-ties' if ties else ''}"


def _values(counters) -> dict[str, float]:
    """A backend's ``(counts, sums)`` by field name."""
    counts, sums = (t.cpu().tolist() for t in counters)
    return {**dict(zip(COUNT_FIELDS, counts)), **dict(zip(SUM_FIELDS, sums))}


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_counters_match_oracle_and_streaming(case):
    batch, n_cand, dim, dim_g, k, precision, kw, ties = case
    options = GistOptions(temperature=kw.pop("temperature", 0.05), **kw)
    student, guide = make_inputs(batch, n_cand, dim, dim_g, k, DTYPES[precision], seed=4)
    for tie in ties:
        _tie(guide, *tie, options.offset)

    _, _, counters = loss_and_grads("triton", [s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide],
                                    options, need_grads=False, need_stats=True)
    _, _, torch_counters = loss_and_grads("torch", student, guide, options, need_grads=False, need_stats=True)
    for pair in (counters, torch_counters):
        assert pair[0].dtype == torch.int64 and pair[0].shape == (len(COUNT_FIELDS),)
        assert pair[1].dtype == compute_dtype(student[0].dtype) and pair[1].shape == (len(SUM_FIELDS),)
    got = _values(counters)
    want = oracle_counters(student, guide, options)
    streamed = _values(torch_counters)
    assert_close("kernels' counters", want, {f: got[f] for f in COUNT_FIELDS})
    assert_close("streaming counters", want, {f: streamed[f] for f in COUNT_FIELDS})
    if kw.get("margin", 0.0) >= 3.0:
        assert got["positive_only"] == batch
    assert any(got[f] for f in COUNT_FIELDS[:4]) or kw["margin"] < 0, "nothing masked: the case is vacuous"
    rtol = 1e-12 if precision == "fp64" else 1e-5
    stats = oracle_stats(student, guide, options)
    sums = {"theta_sum": stats.theta_mean * batch, "threshold_sum": stats.threshold_mean * batch}
    assert_close("sums", sums, {f: got[f] for f in SUM_FIELDS}, Tol(0.0, rtol * batch))


def test_counting_changes_nothing_else():
    """need_stats adds counters; the loss and the gradients stay bitwise the same."""
    student, guide = make_inputs(13, 26, 40, 24, 1, torch.float64, seed=5)
    options = GistOptions(temperature=0.05, margin=0.1, offset=7)
    loss, grads, none = loss_and_grads("triton", student, guide, options, need_grads=True)
    loss2, grads2, counters = loss_and_grads("triton", student, guide, options, need_grads=True, need_stats=True)
    assert none is None and counters is not None
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
