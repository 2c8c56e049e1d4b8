"""The MaxSim kernels (``cgist.kernels.maxsim``, launched by ``cgist.stage.triton.maxsim``) against the streaming
PyTorch stage (``cgist.stage.pytorch.maxsim``: its loss and gradients), a float64 normaliser from
``maxsim_scores_reference``, and the dense float64 oracle (``maxsim_loss_reference``, gradients by autograd).

Without CUDA the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1, and fixes the
interpreter's bf16 ``tl.dot``: ``interpreter_dot``), so the shapes are tiny, with tiles small enough that every loop
runs more than once: 16 document tokens per product against documents of up to 40 (three chunks), 16 query tokens
per product against queries of up to 29 (two token blocks), 16 features per ``tl.dot`` against up to 40 (three
slices, the last one partly masked), 2 to 4 documents per forward program, and slabs of 1 or 2 queries in the
backward (``Case.tiles``); one case takes the launcher's own tiles. The cases cover ragged masks with holes, a
document whose whole first chunk is masked, empty documents (a negative, and a label), MeanMaxSim, a rank offset with
document columns taller than the queries, query and document chunks of different token widths, and documents of a
few tokens that many query tokens of a block pick at once; fp64 and fp32 to their rounding, bf16 and fp16 at one
shape to theirs; and the backward's tie rule (the first of equal maxima takes the gradient), across chunks and within
one, in either token block.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import CUDA, DEVICE, one_thread, xtr_gap  # noqa: F401  (one_thread: autouse)

pytest.importorskip("triton")

from cgist import GistOptions  # noqa: E402
from cgist.stage.pytorch import maxsim as pytorch_maxsim  # noqa: E402
from cgist.stage.pytorch import xtr as pytorch_xtr  # noqa: E402
from cgist.stage.reference import (  # noqa: E402
    maxsim_gist_loss_reference,
    maxsim_loss_reference,
    maxsim_scores_reference,
)
from cgist.stage.spec.maxsim import MaxSimCall  # noqa: E402
from cgist.stage.xtr_thresholds import thresholds  # noqa: E402
from cgist.stage.stats import COUNT_FIELDS  # noqa: E402
from cgist.stage.triton.maxsim import (  # noqa: E402
    maxsim_backward_triton,
    maxsim_forward_triton,
    maxsim_held_triton,
)

#: The incoming gradient of the loss in every backward (not 1, so that its factor is checked).
GRAD_OUTPUT = 0.7
#: Document tokens per product: documents of up to 40 tokens cross three chunks.
BLOCK_TOKENS = 16
#: Query tokens per product (queries of 17 to 32 tokens cross two token blocks) and features per ``tl.dot`` (40
#: features cross three slices, the last one partly masked): the smallest ``tl.dot`` takes.
BLOCK_QUERY_TOKENS = 16
BLOCK_FEATURES = 16


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem. The documents are ``columns`` columns of ``batch + extra_rows`` rows; ``query_chunks`` and
    ``doc_chunks`` split the rows (every column alike), each chunk trimmed to its width (``*_widths``, None: all of
    ``lq`` / ``ld``) with the tokens past it masked in the oracle's dense tensors. ``empty`` lists (column, row) of
    documents without a real token, ``masked_head`` those whose first ``BLOCK_TOKENS`` tokens are all masked."""

    name: str
    batch: int
    columns: int
    lq: int
    ld: int
    dim: int
    dtype: torch.dtype = torch.float64
    extra_rows: int = 0
    offset: int = 0
    length_normalize: bool = False
    scale: float = 1.7
    query_chunks: tuple[int, ...] | None = None
    query_widths: tuple[int, ...] | None = None
    doc_chunks: tuple[int, ...] | None = None
    doc_widths: tuple[int, ...] | None = None
    empty: tuple[tuple[int, int], ...] = ()
    masked_head: tuple[tuple[int, int], ...] = ()
    block_tokens: int | None = BLOCK_TOKENS
    block_docs: int = 2
    block_query_tokens: int | None = BLOCK_QUERY_TOKENS
    block_features: int | None = BLOCK_FEATURES
    block_queries: int | None = 2
    seed: int = 0

    @property
    def tiles(self) -> dict:
        """The tiles both launchers take (the backward's slabs aside)."""
        return dict(block_tokens=self.block_tokens, block_query_tokens=self.block_query_tokens,
                    block_features=self.block_features)


def _masks(gen: torch.Generator, rows: int, width: int, holes: float = 0.25) -> torch.Tensor:
    """Ragged masks: a random length per row (at least 1) with holes inside it, the first token always real."""
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]) & (torch.rand(rows, width, generator=gen) >= holes)
    mask[:, 0] = True
    return mask


def _chunked(dense: torch.Tensor, mask: torch.Tensor, rows: tuple[int, ...] | None,
             widths: tuple[int, ...] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``dense`` and ``mask`` split into row chunks, each trimmed to its width; ``mask`` is cleared past the widths
    in place, so the dense tensors describe the same problem."""
    rows = rows or (dense.shape[0],)
    widths = widths or (dense.shape[1],) * len(rows)
    assert sum(rows) == dense.shape[0] and len(widths) == len(rows)
    chunks, masks, start = [], [], 0
    for count, width in zip(rows, widths):
        mask[start : start + count, width:] = False
        chunks.append(dense[start : start + count, :width])
        masks.append(mask[start : start + count, :width])
        start += count
    return chunks, masks


def _problem(case: Case):
    """The call, and the dense queries, query mask, documents and document masks (the oracle's)."""
    gen = torch.Generator().manual_seed(case.seed)
    rows = case.batch + case.extra_rows
    queries = torch.randn(case.batch, case.lq, case.dim, generator=gen, dtype=torch.float64).to(case.dtype)
    query_mask = _masks(gen, case.batch, case.lq)
    documents = [torch.randn(rows, case.ld, case.dim, generator=gen, dtype=torch.float64).to(case.dtype)
                 for _ in range(case.columns)]
    document_masks = [_masks(gen, rows, case.ld) for _ in range(case.columns)]
    for column, row in case.masked_head:
        assert case.ld > BLOCK_TOKENS
        document_masks[column][row, :BLOCK_TOKENS] = False
        document_masks[column][row, BLOCK_TOKENS + 1] = True
    for column, row in case.empty:
        document_masks[column][row] = False
    q_chunks, q_masks = _chunked(queries, query_mask, case.query_chunks, case.query_widths)
    d_chunks, d_masks = zip(*(_chunked(d, m, case.doc_chunks, case.doc_widths)
                              for d, m in zip(documents, document_masks)))
    for column, row in case.masked_head:  # still a real token after the masked chunk, within the chunk's width
        assert bool(document_masks[column][row, BLOCK_TOKENS:].any())
    return _call(case, q_chunks, q_masks, d_chunks, d_masks), (queries, query_mask, documents, document_masks)


def _call(case: Case, q_chunks, q_masks, d_chunks, d_masks, top_k: int | None = None, **guide) -> MaxSimCall:
    """The call of these chunks on the test device (their score's door, which every caller goes through): MaxSim's,
    or XTR's with ``top_k``."""
    similarity = "xtr" if top_k else "mean_maxsim" if case.length_normalize else "maxsim"
    options = GistOptions(similarity=similarity, score_options={"top_k": top_k} if top_k else {},
                          temperature=1 / case.scale, offset=case.offset,
                          block_bytes=2**20, contrast_anchors=False, contrast_positives=False,
                          margin=guide.pop("margin", 0.0))
    return options.score.door()([t.to(DEVICE) for t in q_chunks], [t.to(DEVICE) for t in q_masks],
                                [[t.to(DEVICE) for t in c] for c in d_chunks],
                                [[t.to(DEVICE) for t in c] for c in d_masks], options, **guide)


def _oracle(case: Case, dense) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The oracle's loss and gradients (times ``GRAD_OUTPUT``), in float64 on the inputs' values."""
    queries, query_mask, documents, document_masks = dense
    leaves = [t.double().requires_grad_() for t in (queries, *documents)]
    loss = maxsim_loss_reference(leaves[0], query_mask, leaves[1:], document_masks, scale=case.scale,
                                 length_normalize=case.length_normalize, offset=case.offset)
    grads = torch.autograd.grad(loss * GRAD_OUTPUT, leaves)
    return loss.detach(), grads[0], list(grads[1:])


def _columns(call: MaxSimCall, flat: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Gradients given one per chunk (the backend contract's), as the call's columns."""
    out, start = [], 0
    for column in call.columns:
        out.append(list(flat[start:start + len(column)]))
        start += len(column)
    return out


def _flat(call: MaxSimCall, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The gradients of every chunk (the call's columns' layout), padded back to the dense widths and concatenated
    per column, on the CPU: ``[queries, column 0, column 1, ...]``."""
    def pad(chunks, width):
        return torch.cat([torch.nn.functional.pad(g.cpu(), (0, 0, 0, width - g.shape[1])) for g in chunks])

    return [pad(column, max(t.shape[1] for t in chunks)) for column, chunks in zip(grads, call.columns)]


def _stage(call: MaxSimCall, need_stats: bool = False):
    """The PyTorch stage's loss, gradients (times ``GRAD_OUTPUT``, the call's columns' layout) and counters."""
    loss, state, counters = pytorch_maxsim.forward(call, True, need_stats)
    grads = state.scaled(torch.tensor(GRAD_OUTPUT, dtype=torch.float64)).inputs
    return loss, _columns(call, grads), counters


def _normaliser(case: Case, dense) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's softmax normaliser, ``(peak, total)``, in float64 from the oracle's scores."""
    queries, query_mask, documents, document_masks = dense
    scores = maxsim_scores_reference(queries.double(), query_mask, torch.cat(documents).double(),
                                     torch.cat(document_masks), length_normalize=case.length_normalize)
    logits = case.scale * scores
    peak = logits.amax(1)
    return peak, torch.exp(logits - peak[:, None]).sum(1)


def _run(case: Case):
    """The Triton stage's loss, normaliser and gradients (checked for their dtypes and shapes), the PyTorch stage's
    loss and gradients with the float64 normaliser, and the oracle's loss and gradients."""
    call, dense = _problem(case)
    kw = case.tiles
    loss, peak, total = maxsim_forward_triton(call, block_docs=case.block_docs, **kw)
    grads = maxsim_backward_triton(call, peak, total, GRAD_OUTPUT, block_queries=case.block_queries, **kw)
    acc = torch.promote_types(case.dtype, torch.float32)
    assert loss.dtype == peak.dtype == total.dtype == acc and loss.dim() == 0
    assert peak.shape == total.shape == (case.batch,)
    assert [[(g.shape, g.dtype) for g in column] for column in grads] == \
        [[(t.shape, acc) for t in column] for column in call.columns]
    if CUDA:  # no atomics: a second run is bitwise the same
        again = maxsim_forward_triton(call, block_docs=case.block_docs, **kw)
        assert all(torch.equal(a, b) for a, b in zip((loss, peak, total), again))
        grads2 = maxsim_backward_triton(call, peak, total, GRAD_OUTPUT, block_queries=case.block_queries, **kw)
        assert all(torch.equal(a, b) for a, b in zip(_flat(call, grads), _flat(call, grads2)))

    stage_loss, stage_grads, _ = _stage(call)
    triton_run = (loss.cpu(), peak.cpu(), total.cpu(), _flat(call, grads))
    stage_run = (stage_loss.cpu(), *_normaliser(case, dense), _flat(call, stage_grads))
    oracle_loss, *oracle_grads = _oracle(case, dense)
    return triton_run, stage_run, (oracle_loss, [oracle_grads[0], *oracle_grads[1]])


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """``got`` within ``rel`` of ``want``, entry by entry, relative to ``want``'s largest entry (at least 1)."""
    scale = max(1.0, float(want.double().abs().max()))
    error = float((got.double() - want.double()).abs().max())
    assert error <= rel * scale, f"{name}: error {error:.3g} > {rel:.3g} x {scale:.3g}"


#: Relative tolerances: fp64's and fp32's rounding (a few hundred units of the accumulation's, for sums of
#: ``Lq * D`` products and logits up to ``scale * Lq * max |product|``).
REL = {torch.float64: 1e-10, torch.float32: 1e-5}

#: The cases XTR runs on (MaxSim's, as XTR's scores are not length-normalised: ragged chunks, an empty label, token
#: blocks, shared picks, fp32), each with the ``top_k`` it takes: 1, a few (5) and half the pool ("half") on the two
#: small ones, and one or two of them by turns on the larger ones (a launch of theirs takes seconds here).
XTR_CASES = {"maxsim": (1, 5, "half"), "empty-label": (1, 5, "half"), "token-blocks": (1, "half"),
             "shared-picks": (5,), "fp32": ("half",)}

CASES = [
    Case("maxsim", 3, 2, 4, 37, 8, doc_chunks=(2, 1), doc_widths=(37, 30), masked_head=((0, 1),)),
    Case("meanmaxsim-empty", 4, 2, 5, 23, 6, length_normalize=True, query_chunks=(2, 2), query_widths=(5, 3),
         empty=((1, 2),), block_docs=3, seed=1),
    Case("offset", 3, 3, 3, 40, 16, extra_rows=4, offset=3, length_normalize=True, query_chunks=(1, 2),
         query_widths=(3, 2), doc_chunks=(3, 2, 2), doc_widths=(40, 17, 5), masked_head=((0, 0), (2, 4)),
         empty=((1, 5),), block_docs=4, scale=0.6, seed=2),
    Case("one-token", 1, 2, 1, 1, 4, block_tokens=None, seed=3),
    Case("empty-label", 2, 2, 2, 5, 4, empty=((0, 1), (1, 0)), seed=4),
    # query 0's label is empty, and it has 3 real tokens: the label's logit is the fill divided by 3
    Case("empty-label-meanmaxsim", 2, 1, 3, 5, 4, extra_rows=1, offset=1, length_normalize=True, empty=((0, 1),),
         seed=5),
    # two token blocks of 16 (the second one partly padded), three feature slices (the last one partly masked), three
    # chunks of document tokens, and two slabs of queries in the backward
    Case("token-blocks", 5, 2, 20, 37, 40, extra_rows=1, offset=1, query_chunks=(3, 2), query_widths=(20, 14),
         doc_chunks=(4, 2), doc_widths=(37, 21), masked_head=((1, 0),), empty=((0, 5),), block_docs=3, seed=10),
    Case("token-blocks-meanmaxsim", 3, 1, 29, 19, 24, length_normalize=True, block_queries=1, block_docs=4, seed=11),
    # documents of a few tokens against queries of 20: many query tokens of a block pick the same document token
    Case("shared-picks", 4, 2, 20, 3, 20, doc_chunks=(3, 1), doc_widths=(3, 2), empty=((1, 3),), seed=12),
    # the launcher's own tiles: two token blocks of 32, two chunks of 64 document tokens, two feature slices, one
    # document block and one slab
    Case("default-tiles", 3, 2, 40, 70, 40, block_tokens=None, block_query_tokens=None, block_features=None,
         block_queries=None, block_docs=32, seed=13),
    Case("fp32", 5, 2, 5, 40, 16, dtype=torch.float32, doc_chunks=(3, 2), doc_widths=(40, 33), masked_head=((1, 3),),
         scale=3.0, seed=5),
    Case("fp32-meanmaxsim-offset", 2, 2, 4, 29, 12, dtype=torch.float32, extra_rows=3, offset=1,
         length_normalize=True, query_chunks=(1, 1), query_widths=(4, 2), doc_chunks=(1, 4), doc_widths=(20, 29),
         empty=((1, 4),), block_docs=3, seed=6),
    Case("fp32-token-blocks", 3, 2, 18, 33, 36, dtype=torch.float32, doc_chunks=(2, 1), doc_widths=(33, 17),
         masked_head=((0, 1),), scale=2.0, seed=14),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_matches_the_pytorch_stage_and_the_oracle(case):
    (loss, peak, total, grads), (s_loss, s_peak, s_total, s_grads), (o_loss, o_grads) = _run(case)
    rel = REL[case.dtype]
    _close("loss vs stage", loss, s_loss, rel)
    _close("loss vs oracle", loss, o_loss, rel)
    # The normaliser against float64's: the largest logit, and the log-sum-exp it makes with the total.
    _close("peak", peak, s_peak, rel)
    _close("log-sum-exp", peak.double() + torch.log(total.double()), s_peak + torch.log(s_total), rel)
    names = ["queries", *(f"column {n}" for n in range(case.columns))]
    for name, got, stage, oracle in zip(names, grads, s_grads, o_grads):
        # a gradient's entries relative to its largest (the softmax's weights times token vectors)
        scale = float(oracle.abs().max())
        assert scale > 0, f"{name}: no gradient, nothing checked"
        _close(f"{name} gradient vs stage", got / scale, stage / scale, rel)
        _close(f"{name} gradient vs oracle", got / scale, oracle / scale, rel)
    if case.empty:  # an empty document gets no gradient, and none of its tokens is ever picked
        for column, row in case.empty:
            assert not bool(grads[1 + column][row].any())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_the_guided_kernels_match_the_pytorch_stage_and_the_oracle(case):
    """GIST's mask from the student's own scores (margin 0.1): the guided launcher (``maxsim_scores_kernel`` per slab,
    the mask and softmax on the host, the gradient kernels) against the PyTorch stage, its mask's counts exactly, and
    the oracle with the same guide."""
    _, dense = _problem(case)
    acc = torch.promote_types(case.dtype, torch.float32)
    queries, query_mask, documents, document_masks = dense
    q_chunks, q_masks = _chunked(queries, query_mask, case.query_chunks, case.query_widths)
    d_chunks, d_masks = zip(*(_chunked(d, m, case.doc_chunks, case.doc_widths)
                              for d, m in zip(documents, document_masks)))
    call = _call(case, q_chunks, q_masks, d_chunks, d_masks, guide="self", margin=0.1)
    loss, grads, masks = maxsim_held_triton(call, True, block_docs=case.block_docs, block_queries=case.block_queries,
                                            **case.tiles)
    grads = _flat(call, [[g * GRAD_OUTPUT for g in column] for column in grads])
    s_loss, s_grads, s_counters = _stage(call, need_stats=True)
    s_grads = _flat(call, s_grads)
    assert loss.dtype == acc and all(g.dtype == acc for g in grads)
    assert torch.equal(masks.counts, s_counters[0])
    leaves = [t.double().requires_grad_() for t in (queries, *documents)]
    o_loss, o_mask = maxsim_gist_loss_reference(leaves[0], query_mask, leaves[1:], document_masks, "self",
                                                scale=case.scale, length_normalize=case.length_normalize,
                                                offset=case.offset, margin=0.1)
    o_grads = torch.autograd.grad(o_loss * GRAD_OUTPUT, leaves)
    # The oracle's mask is float64's: in fp32 a score within rounding of its threshold may fall the other way.
    exact = case.dtype == torch.float64
    if exact:
        ap, an = COUNT_FIELDS.index("masked_ap"), COUNT_FIELDS.index("masked_an")
        assert int(masks.counts[ap] + masks.counts[an]) == int(o_mask.sum())
    rel = REL[case.dtype]
    _close("loss vs stage", loss.cpu(), s_loss.cpu(), rel)
    if exact:
        _close("loss vs oracle", loss.cpu(), o_loss.detach(), rel)
    for name, got, stage, oracle in zip(["queries", *(f"column {n}" for n in range(case.columns))], grads, s_grads,
                                        o_grads):
        scale = float(stage.abs().max()) or 1.0  # 0 where the guide leaves every query its label alone
        _close(f"{name} gradient vs stage", got / scale, stage / scale, rel)
        if exact:
            _close(f"{name} gradient vs oracle", got / scale, oracle / scale, rel)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES if c.name in XTR_CASES])
def test_the_xtr_kernels_match_the_pytorch_stage_and_the_oracle(case):
    """XTR on the held launcher (``maxsim_scores_kernel``, ``maxsim_dq_kernel`` and ``maxsim_dd_kernel`` with their
    ``XTR`` constexpr, the thresholds of ``cgist.stage.xtr_thresholds.thresholds``) against the PyTorch stage and the XTR
    oracle, at ``top_k`` 1, a few and half the pool (by case: ``XTR_CASES``), on tie-free batches."""
    _, dense = _problem(case)
    queries, query_mask, documents, document_masks = dense
    q_chunks, q_masks = _chunked(queries, query_mask, case.query_chunks, case.query_widths)
    d_chunks, d_masks = zip(*(_chunked(d, m, case.doc_chunks, case.doc_widths)
                              for d, m in zip(documents, document_masks)))
    pool = int(sum(m.sum() for m in document_masks))
    for top_k in (pool // 2 if k == "half" else k for k in XTR_CASES[case.name]):
        assert xtr_gap(queries, query_mask, documents, document_masks, top_k) > 1e-4
        call = _call(case, q_chunks, q_masks, d_chunks, d_masks, top_k=top_k)
        loss, grads, _ = maxsim_held_triton(call, True, tau=thresholds(call), block_docs=case.block_docs,
                                            block_queries=case.block_queries, **case.tiles)
        grads = _flat(call, [[g * GRAD_OUTPUT for g in column] for column in grads])
        s_loss, state, _ = pytorch_xtr.forward(call, True)
        s_grads = _flat(call, _columns(call, state.scaled(torch.tensor(GRAD_OUTPUT, dtype=torch.float64)).inputs))
        leaves = [t.double().clone().requires_grad_() for t in (queries, *documents)]
        o_loss = maxsim_loss_reference(leaves[0], query_mask, leaves[1:], document_masks, scale=case.scale,
                                       offset=case.offset, top_k=top_k)
        o_grads = torch.autograd.grad(o_loss * GRAD_OUTPUT, leaves)
        rel = REL[case.dtype]
        _close(f"top_k {top_k}: loss vs stage", loss.cpu(), s_loss.cpu(), rel)
        _close(f"top_k {top_k}: loss vs oracle", loss.cpu(), o_loss.detach(), rel)
        for name, got, stage, oracle in zip(["queries", *(f"column {n}" for n in range(case.columns))], grads,
                                            s_grads, o_grads):
            scale = float(oracle.abs().max())
            assert scale > 0, f"{name}: no gradient, nothing checked"
            _close(f"top_k {top_k}: {name} gradient vs stage", got / scale, stage / scale, rel)
            _close(f"top_k {top_k}: {name} gradient vs oracle", got / scale, oracle / scale, rel)


@pytest.mark.parametrize(("token", "first", "second"), [(0, 3, 35), (17, 3, 35), (0, 3, 10), (17, 20, 29)],
                         ids=["across-chunks", "across-chunks-second-block", "within-a-chunk",
                              "within-a-chunk-second-block"])
def test_a_tie_sends_the_gradient_to_the_first_token(token, first, second):
    """A document holds one token twice (in different chunks of 16, or in one), as the largest product of a query
    token (in the query's first token block of 16, or its second): the kernels' gradient goes to the first copy and
    none to the second. The oracle's (``amax``'s) splits it evenly between them where its products of the two tie
    bitwise (a CPU GEMM may round them apart), so their sum is the oracle's sum, and the query's gradient is the
    oracle's."""
    case = Case("tie", 2, 1, 20, 40, 8, seed=7)
    call, dense = _problem(case)
    queries, query_mask, documents, document_masks = dense
    # document m's copies are twice token ``token`` of the other query, its largest product there: that query's
    # softmax favours document m over its label, so both get a large gradient
    query_mask[:, token] = True
    for m, i in enumerate([1, 0]):
        documents[0][m, first] = documents[0][m, second] = 2.0 * queries[i, token]
        document_masks[0][m, [first, second]] = True
    call = _call(case, [queries], [query_mask], [[documents[0]]], [[document_masks[0]]])
    loss, peak, total = maxsim_forward_triton(call, block_docs=1, **case.tiles)
    (q_grad,), (d_grad,) = maxsim_backward_triton(call, peak, total, GRAD_OUTPUT, block_queries=1, **case.tiles)
    oracle_loss, oracle_q, (oracle_d,) = _oracle(case, dense)
    got_d = d_grad.cpu()
    rel = REL[torch.float64]
    _close("loss", loss.cpu(), oracle_loss, rel)
    _close("query gradient", q_grad.cpu(), oracle_q, rel)
    for m in range(2):
        # the oracle's two copies share the gradient (evenly, where its products tie bitwise)
        assert bool((oracle_d[m, first] + oracle_d[m, second] != 0).all())
        assert not bool(got_d[m, second].any()), "the second copy of a tied maximum got a gradient"
        _close(f"document {m}'s first copy", got_d[m, first], oracle_d[m, first] + oracle_d[m, second], rel)
    mask = torch.ones(40, dtype=torch.bool)
    mask[[first, second]] = False
    _close("the other tokens", got_d[:, mask], oracle_d[:, mask], rel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs_to_their_rounding(dtype):
    """bf16 and fp16 inputs, fp32 accumulation: each token product is rounded to the inputs' dtype before its
    maximum (as the PyTorch stage's and sentence-transformers' are), so a maximum is off by up to ``eps`` of itself
    (the dtype's, which also covers the interpreter's bf16 rounding by truncation) and a logit by
    ``eps * scale * sum_t w_t |max_t|``: the loss by twice the largest, a gradient entry by a few times it relative to
    the largest. Against the oracle on the same rounded values, whose maxima are at the same tokens: every largest
    product leads the next by more than two of its ``eps``, so no rounding reorders them."""
    case = Case("half", 3, 2, 20, 20, 24, dtype=dtype, doc_chunks=(2, 1), doc_widths=(20, 13), masked_head=((1, 0),),
                scale=2.0, seed=44)
    call, dense = _problem(case)
    queries, query_mask, documents, document_masks = dense
    products = torch.einsum("qtd,msd->qmts", queries.double(), torch.cat(documents).double())
    products = products.masked_fill(~torch.cat(document_masks)[None, :, None, :], float("-inf"))
    top2 = products.topk(2, dim=-1).values
    eps = torch.finfo(dtype).eps
    clear = (top2[..., 0] - top2[..., 1]) > 2 * eps * top2[..., 0].abs()
    assert bool((clear | ~query_mask[:, None, :]).all()), "a near-tie: change the seed"
    bound = eps * case.scale * float((top2[..., 0].abs() * query_mask[:, None, :]).sum(-1).max())

    (loss, peak, total, grads), (s_loss, *_, s_grads), (o_loss, o_grads) = _run(case)
    assert loss.dtype == torch.float32
    for want in (s_loss, o_loss):
        assert abs(float(loss) - float(want)) <= 2 * bound
    for got, stage, oracle in zip(grads, s_grads, o_grads):
        scale = float(oracle.abs().max())
        for want in (stage, oracle):
            error = float((got.double() - want.double()).abs().max())
            assert error <= 4 * bound * scale, f"gradient error {error:.3g} > {4 * bound * scale:.3g}"


# -- dispatch: backend="triton", and "auto"'s first-use check -------------------------------------------------------


def _small_problem(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    queries = torch.randn(4, 3, 8, generator=gen, dtype=dtype)
    documents = [torch.randn(4, 20, 8, generator=gen, dtype=dtype) for _ in range(2)]
    masks = [torch.arange(20) < torch.randint(1, 21, (4, 1), generator=gen) for _ in range(2)]
    return [t.to(DEVICE) for t in (queries, torch.ones(4, 3, dtype=torch.bool))] + [
        [t.to(DEVICE) for t in documents], [m.to(DEVICE) for m in masks]]


def _loss_and_grads(backend, problem, **guide):
    import cgist

    queries, query_mask, documents, masks = problem
    leaves = [t.clone().requires_grad_() for t in (queries, *documents)]
    loss = cgist.maxsim_loss(leaves[0], query_mask, leaves[1:], masks, scale=2.0, backend=backend, **guide)
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


def test_backend_triton_runs_the_kernels_through_maxsim_loss():
    problem = _small_problem()
    for got, expected in zip(_loss_and_grads("triton", problem), _loss_and_grads("torch", problem)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture
def kernels_routed(simulate, monkeypatch):
    """``"auto"`` routed to the kernels: on a GPU they serve, or on the CPU simulating sm_90 (the interpreter); the
    verdicts forgotten before and after, the first-use check on; returns the first-use checks run."""
    from cgist.stage.dispatch import selfcheck

    if DEVICE == "cpu":
        simulate("sm_90")
    monkeypatch.delenv(selfcheck.ENV, raising=False)
    checks = []
    check_call = selfcheck.check_call
    monkeypatch.setattr(selfcheck, "check_call", lambda *a: checks.append(check_call(*a)) or checks[-1])
    return checks


def test_auto_takes_the_kernels_once_their_first_use_check_passes(kernels_routed, monkeypatch):
    """One check per variant (the unguided kernels, the held ones), then the kernels run: the PyTorch stage's
    results, to rounding."""
    from cgist.stage.triton import maxsim as launcher

    launched = []
    for name in ("maxsim_forward_triton", "maxsim_held_triton"):
        real = getattr(launcher, name)
        monkeypatch.setattr(launcher, name,
                            lambda *a, real=real, name=name, **k: launched.append(name) or real(*a, **k))
    problem = _small_problem()
    for guide in ({}, {}, {"guide": "self"}, {"guide": "self"}):
        got, expected = (_loss_and_grads(backend, problem, **guide) for backend in ("auto", "torch"))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [c.variant.held for c in kernels_routed] == [False, True] and all(c.ok for c in kernels_routed)
    # the checks' own runs, then each call's
    assert launched.count("maxsim_held_triton") >= 2 and launched.count("maxsim_forward_triton") >= 2


@pytest.mark.parametrize("failure", ["raises", "disagrees"])
def test_a_failing_first_use_check_keeps_the_pytorch_stage_with_one_warning(kernels_routed, monkeypatch, caplog,
                                                                             failure):
    from cgist.stage.triton import maxsim as launcher

    real = launcher.maxsim_forward_triton

    def kernels(*args, **kwargs):
        if failure == "raises":
            raise RuntimeError("no kernel here")
        loss, peak, total = real(*args, **kwargs)
        return loss * 1.01, peak, total

    monkeypatch.setattr(launcher, "maxsim_forward_triton", kernels)
    problem = _small_problem()
    with caplog.at_level("WARNING", logger="cgist.stage.dispatch.route"):
        results = [_loss_and_grads("auto", problem) for _ in range(2)]
    for got in results:
        for a, b in zip(got, _loss_and_grads("torch", problem)):
            assert torch.equal(a, b)  # the PyTorch stage's, exactly
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(warnings) == 1, warnings
    assert ("no kernel here" if failure == "raises" else "disagree") in warnings[0] and len(kernels_routed) <= 1


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_kernel_failing_after_its_check_falls_back_with_one_warning(kernels_routed, monkeypatch, caplog, where):
    """A MaxSim kernel that fails after its first-use check passed (in the forward, or in the backward of an unguided
    call, which recomputes): that call, and every later one with these dtypes on this device, runs on the PyTorch
    stage, with one warning naming the score and the error; ``backend="triton"`` raises instead."""
    from cgist.stage.devices import device_key
    from cgist.stage.dispatch import route, selfcheck
    from cgist.stage.triton import maxsim as launcher

    problem = _small_problem()
    expected = _loss_and_grads("torch", problem)
    _loss_and_grads("auto", problem)  # the first-use check passes, and the kernels run
    assert len(kernels_routed) == 1 and kernels_routed[0].ok

    def fail(*args, **kwargs):
        raise RuntimeError("an illegal memory access was encountered")

    name = "maxsim_forward_triton" if where == "forward" else "maxsim_backward_triton"
    monkeypatch.setattr(launcher, name, fail)
    with caplog.at_level("WARNING", logger="cgist.stage.dispatch.route"):
        for call in range(2):
            loss, *grads = _loss_and_grads("auto", problem)
            # The first call's backward falls back after the kernels' forward: its loss is theirs (within the
            # first-use check's bound of the two paths' rounding), its gradients the PyTorch stage's; every later
            # call is the PyTorch stage's alone.
            if where == "backward" and call == 0:
                torch.testing.assert_close(loss, expected[0], rtol=selfcheck.TOLERANCE["fp32"], atol=0)
            else:
                assert torch.equal(loss, expected[0])
            assert all(torch.equal(a, b) for a, b in zip(grads, expected[1:]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(warnings) == 1, warnings
    assert "maxsim score" in warnings[0] and "an illegal memory access" in warnings[0]
    assert list(route.kernel_failures()) == [("maxsim", device_key(torch.device(DEVICE)), torch.float32, None)]
    with pytest.raises(RuntimeError, match="an illegal memory access"):
        _loss_and_grads("triton", problem)
