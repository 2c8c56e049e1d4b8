"""The Triton backend: where the guide comes from, and the explicit masks, against the dense float64 oracle.

No guide (nothing is guide-masked), the student as its own guide, and a guide's embeddings, each with and
without ``mask_self`` (AA[i, i], PP[i, o + i]) and ``mask_duplicates`` (candidates with anchor i's or its
positive's text), through the backward and with the mask counters. Under the interpreter on CPU, in float64
and float32 (see test_kernels).
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, assert_close, make_inputs, tolerance

from cgist import GistOptions
from cgist.stage import ties
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.reference import gist_loss_reference, gist_scores
from cgist.stage.triton.dense import gist_backward, gist_forward

B, N, D, DG, K = 13, 26, 40, 24, 1


def _texts(seed: int) -> list[torch.Tensor]:
    """Text ids with duplicates: anchor 2's text is also a negative's and another anchor's, positive 7's a
    positive's and a negative's, and a few texts repeat at random."""
    gen = torch.Generator().manual_seed(seed)
    texts = [torch.randperm(1000, generator=gen)[:B], torch.randperm(1000, generator=gen)[:N] + 1000]
    texts += [torch.randperm(1000, generator=gen)[:N] + 2000 + 1000 * k for k in range(K)]
    texts[2][5] = texts[0][2]
    texts[0][9] = texts[0][2]
    texts[1][2] = texts[1][B + 7]  # positive row 2 has the text of anchor 7's positive (row B + 7)
    texts[2][11] = texts[1][B + 7]
    texts[1][3] = texts[0][4]  # a positive with the text of anchor 4
    return texts


def _check(source: str, precision: str, **options) -> None:
    dtype = torch.float64 if precision == "fp64" else torch.float32
    student, guide = make_inputs(B, N, D, DG, K, dtype, seed=5)
    if source == "self":
        guide = [s.clone() for s in student]
    elif source == "none":
        guide = None
    texts = _texts(3)
    options = GistOptions(temperature=0.05, offset=B, **options)
    ids = ties.rank_ids(texts)

    leaves = [s.double().requires_grad_() for s in student]
    guide64 = None if guide is None else [g.double() for g in guide]
    want = gist_loss_reference(leaves, guide64, options, texts)
    want.backward()
    if options.mask_duplicates:  # the duplicates are excluded in the oracle, so the test exercises them
        scores = gist_scores([s.detach() for s in leaves], guide64, options, texts)
        assert torch.isinf(scores[2, N + B + N + 5]) and torch.isinf(scores[7, N + B + N + 11])

    loss, state = gist_forward([s.to(DEVICE) for s in student], None if guide is None else [g.to(DEVICE) for g in guide],
                               options, need_stats=True, text_ids=[i.to(DEVICE) for i in ids])
    grads = gist_backward(state)
    assert_close("triton", (want, [leaf.grad for leaf in leaves]), (loss, grads), tolerance("triton", precision))
    # the counters count every exclusion in its block, as the streaming path does
    counts, _ = state.counters()
    _, _, (streamed, _) = loss_and_grads("torch", student, guide, options, need_grads=False, need_stats=True,
                                         text_ids=ids)
    assert torch.equal(counts.cpu(), streamed)


CASES = [
    ("none", dict()),
    ("none", dict(mask_self=True)),
    ("none", dict(mask_self=True, mask_duplicates=True)),
    ("self", dict(margin=-0.1, mask_self=True, mask_duplicates=True)),
    ("self", dict(margin=0.0)),
    ("self", dict(margin=0.1, mask_self=True)),
    ("guide", dict(margin=0.05, mask_duplicates=True)),
    ("guide", dict(margin=-0.3, mask_self=True, margin_strategy="relative")),
]


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize(("source", "options"), CASES,
                         ids=[f"{s}-" + "-".join(f"{k}{v}" for k, v in o.items()) for s, o in CASES])
def test_guide_sources_and_masks(source, options, precision):
    _check(source, precision, **options)
