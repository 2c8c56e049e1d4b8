"""The Triton backend (``cgist.stage.triton`` over ``cgist.kernels``) in every dtype pair the launcher picks, against
the float64 oracle on the same rounded inputs.

The pairs: bf16, fp16, a half student with an fp32 guide, fp32 at torch's default matmul precision ("highest",
tf32x3 products), and fp32 with a bf16 guide. Each runs odd shapes, rank offsets, ties at zero margin, Matryoshka
dimensions, the directions (joint and per direction), the student as its own guide and no guide, a chunked
backward, and checks the mask counters exactly.

Without CUDA this runs under the Triton interpreter, whose ``tl.dot`` multiplies bf16 operands by value only with the
test-only fix of ``interpreter_dot`` (installed by conftest; ``test_interpreter_dot_*`` below show that it is needed
and that it is right). The interpreter has no tf32: the kernels' fp32 dots run in plain fp32 there, and the backward
tf32x3 GEMMs of an fp32 student run on emulated tf32 tensor cores (``interpreter_dot.emulated_tf32_dot``, which rounds
as ``helpers.tf32_addmm``), as they run on a GPU.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import pytest
import torch
import triton
import triton.language as tl
from helpers import (  # noqa: F401  (one_thread: autouse)
    CUDA,
    DEVICE,
    TOL,
    assert_close,
    make_inputs,
    one_thread,
    oracle_counters,
    shape_id,
    tf32_addmm,
)
from interpreter_dot import emulated_tf32_dot, unpatched_dot

from cgist import GistOptions
from cgist.stage.numerics import normalize, threshold
from cgist.stage.reference import gist_loss_reference
from cgist.stage.stats import COUNT_FIELDS
from cgist.stage.ties import rank_ids, tie_ids
from cgist.stage.triton.dense import gist_backward, gist_forward

#: Student and guide dtype of each pair, by its id.
PAIRS = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "bf16-fp32guide": (torch.bfloat16, torch.float32),
    "fp16-fp32guide": (torch.float16, torch.float32),
    "tf32x3": (torch.float32, torch.float32),
    "tf32x3-bf16guide": (torch.float32, torch.bfloat16),
}
#: The temperature of a case that names none.
TEMPERATURE = 0.05


# -- the fix itself ---------------------------------------------------------------------------------------------------

@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    offs_m, offs_n, offs_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :])
    b = tl.load(b_ptr + offs_k[:, None] * N + offs_n[None, :])
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], tl.dot(a, b, out_dtype=tl.float32))


def _dot_operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16 x 32 and 32 x 16 random ``dtype`` operands of ``_small_dot``."""
    gen = torch.Generator().manual_seed(11)
    return torch.randn(16, 32, generator=gen).to(dtype), torch.randn(32, 16, generator=gen).to(dtype)


def _small_dot(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 16 x 32 by 32 x 16 ``tl.dot`` of random ``dtype`` values (at Triton's default input precision, tf32 for fp32),
    torch's float64 product of the same values, and the sums of the absolute products ``|a| @ |b|`` (the scale of a
    float32 summation's error)."""
    a, b = _dot_operands(dtype)
    c = torch.full((16, 16), float("nan"), device=DEVICE)
    _dot_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c, 16, 16, 32)
    a, b = a.double(), b.double()
    return c.cpu().double(), a @ b, a.abs() @ b.abs()


#: A float32 sum of 32 exact products is within 32 float32 roundings of the sum of their absolute values.
SUM_BOUND = 32 * 2.0**-24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_interpreter_dot_multiplies_half_operands_by_value(dtype):
    """Exact products, float32 sums (under the interpreter with the fix, as on the tensor cores)."""
    got, want, scale = _small_dot(dtype)
    assert bool(((got - want).abs() <= SUM_BOUND * scale).all())


@pytest.mark.skipif(CUDA, reason="the fix is for the interpreter only")
def test_interpreter_dot_needs_the_fix_for_bf16():
    """The interpreter's own dot multiplies bf16 bit patterns (so the fix is needed); fp16 it gets right."""
    with unpatched_dot():
        bf16, want_bf16, _ = _small_dot(torch.bfloat16)
        fp16, want_fp16, scale_fp16 = _small_dot(torch.float16)
    assert (bf16 - want_bf16).abs().max() > 1e6 * want_bf16.abs().max()
    assert bool(((fp16 - want_fp16).abs() <= SUM_BOUND * scale_fp16).all())


@pytest.mark.skipif(CUDA, reason="an emulation for the interpreter only")
@pytest.mark.parametrize("mode", ["rz", "rn"])
def test_the_emulated_tf32_dot_rounds_as_tensor_cores(mode):
    """Under ``emulated_tf32_dot`` a tf32 ``tl.dot`` of fp32 operands is ``helpers.tf32_addmm``'s product, rounded once
    to float32; the interpreter's own multiplies the fp32 values as they are, which a tf32 product does not."""
    with emulated_tf32_dot(mode):
        emulated, want, scale = _small_dot(torch.float32)
    plain, _, _ = _small_dot(torch.float32)
    tensor_cores = torch.zeros(16, 16, dtype=torch.float64)
    tf32_addmm(mode)(tensor_cores, *_dot_operands(torch.float32))
    assert bool(((emulated - tensor_cores).abs() <= 2.0**-24 * tensor_cores.abs()).all())
    assert bool(((plain - want).abs() <= SUM_BOUND * scale).all())
    assert bool(((emulated - want).abs() > SUM_BOUND * scale).any())


# -- the kernels in every pair ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: the shape, the options, where the guide comes from and guide ties."""

    name: str
    shape: tuple[int, int, int, int, int]  # batch, candidates, dim, guide dim, negative sets
    options: dict
    source: str = "guide"  # "guide" (a guide of the pair's guide dtype), "self" (the student's values) or "none"
    ties: tuple[tuple[int, int, int], ...] = ()  # (column, row, anchor): that guide row copies anchor's positive
    texts: bool = False  # text ids with duplicates (for mask_duplicates; not with everyone)
    everyone: bool = False  # a last column of every rank's anchors, this rank's at the offset (directions)


# Copies of the positives of anchors 3 and 7 among the positives and negatives, in other tiles and at other positions
# than the labels, and anchors copying other anchors' positives (AA ties, and PP through the transposed theta).
TIES = ((1, 2, 3), (1, 25, 3), (2, 19, 3), (3, 0, 7), (1, 30, 7),
        (0, 1, 6), (0, 4, 9), (0, 7, 0), (0, 10, 3), (0, 12, 5), (0, 2, 11), (0, 8, 4))
FOUR = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")

CASES = [
    Case("offset", (13, 39, 40, 24, 2), dict(offset=20, margin=0.1)),
    # 3 row and column tiles, 5 K tiles; a budget below one 16 x 37 chunk, so the GEMM backward runs 3 x 3 chunks of
    # one 16 x 16 tile in every pair
    Case("chunked", (37, 37, 70, 33, 1), dict(margin=0.1, block_bytes=1000)),
    Case("relative", (5, 41, 17, 50, 2), dict(offset=36, margin=0.2, margin_strategy="relative", temperature=0.02,
                                               contrast_anchors=False)),
    Case("ties", (13, 37, 40, 24, 2), dict(offset=9, margin=0.0), ties=TIES),
    Case("matryoshka", (13, 26, 40, 24, 1), dict(offset=13, margin=0.1, matryoshka_dims=(40, 24, 9),
                                                 matryoshka_weights=(1.0, 0.5, 2.0), block_bytes=3000)),
    Case("directions", (7, 14, 20, 12, 1), dict(offset=7, margin=0.05, directions=FOUR, contrast_anchors=False,
                                                contrast_positives=False, mask_self=True), everyone=True),
    Case("per-direction", (7, 14, 20, 12, 1), dict(offset=7, margin=0.05, directions=FOUR[::2],
                                                   partition_mode="per_direction", hardness_mode="in_batch_negatives",
                                                   hardness_strength=5.0, contrast_anchors=False,
                                                   contrast_positives=False, matryoshka_dims=(20, 8)), everyone=True),
    Case("self", (13, 26, 40, 24, 1), dict(offset=13, margin=-0.1, mask_self=True, mask_duplicates=True),
         source="self", texts=True),
    Case("none", (13, 26, 40, 24, 1), dict(offset=13, mask_self=True), source="none"),
]


def _texts(shape, offset, seed=3) -> list[torch.Tensor]:
    """Random text ids with duplicates across the columns: anchor 2's text is another anchor's and a negative's,
    anchor 7's positive's another positive's and a negative's."""
    batch, n_cand, _, _, k = shape
    gen = torch.Generator().manual_seed(seed)
    texts = [torch.randperm(1000, generator=gen)[:batch]]
    texts += [torch.randperm(1000, generator=gen)[:n_cand] + 1000 * (1 + c) for c in range(1 + k)]
    texts[0][9] = texts[2][5] = texts[0][2]
    texts[1][3] = texts[2][11] = texts[1][offset + 7]
    return texts


def _inputs(case: Case, student_dtype, guide_dtype, seed=5):
    """Student and guide columns (with ``everyone``, this rank's anchors are rows offset.. of the last column)."""
    batch, n_cand, dim, dim_g, k = case.shape
    offset = case.options.get("offset", 0)
    if case.everyone:  # draw every rank's anchors, then take this rank's
        student, guide = make_inputs(n_cand, n_cand, dim, dim_g, k, torch.float64, seed)
        student = [student[0][offset : offset + batch], *student[1:], student[0]]
        guide = [guide[0][offset : offset + batch], *guide[1:], guide[0]]
    else:
        student, guide = make_inputs(batch, n_cand, dim, dim_g, k, torch.float64, seed)
    for column, row, anchor in case.ties:
        guide[column][row] = guide[1][offset + anchor]
    student = [s.to(student_dtype) for s in student]
    if case.source == "self":
        guide = [s.to(guide_dtype) for s in student]
    elif case.source == "none":
        guide = None
    else:
        guide = [g.to(guide_dtype) for g in guide]
    return student, guide


def _errors(case: Case, pair: str) -> tuple[float, float, dict, dict, tuple, tuple]:
    """Run ``case`` in ``pair``: the loss's error (relative above 1), the gradients' largest error relative to their
    largest entry, the kernels' counters and the oracle's, and the kernels' and oracle's sums of theta and T_i (None
    without a guide)."""
    student_dtype, guide_dtype = PAIRS[pair]
    student, guide = _inputs(case, student_dtype, guide_dtype)
    options = GistOptions(all_anchors=case.everyone, **{"temperature": TEMPERATURE, **case.options})
    texts = _texts(case.shape, options.offset) if case.texts else None

    leaves = [s.double().requires_grad_() for s in student]
    guide64 = None if guide is None else [g.double() for g in guide]
    want = gist_loss_reference(leaves, guide64, options, texts)
    want.backward()
    if case.ties:  # each copy ties with theta for the oracle and for the kernels, so the case exercises ties
        for ids in (tie_ids(guide, guide[0].dtype), tie_ids(guide64, torch.float64)):
            assert all(ids[column][row] == ids[1][options.offset + anchor] for column, row, anchor in case.ties)

    with ExitStack() as stack:
        if student_dtype == torch.float32 and not CUDA:
            stack.enter_context(emulated_tf32_dot("rn"))
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            loss, state = gist_forward(
                [s.to(DEVICE) for s in student], None if guide is None else [g.to(DEVICE) for g in guide], options,
                need_stats=True, text_ids=None if texts is None else [i.to(DEVICE) for i in rank_ids(texts)])
            grads = gist_backward(state)
        finally:
            torch.set_float32_matmul_precision(previous)
    assert loss.dtype == torch.float32 and all(g.dtype == student_dtype for g in grads)
    loss_error = abs(float(loss) - float(want.detach())) / max(1.0, abs(float(want.detach())))
    grad_error = max(float((g.cpu().double() - leaf.grad).abs().max() / leaf.grad.abs().max())
                     for g, leaf in zip(grads, leaves))

    counts, sums = (t.cpu() for t in state.counters())
    got_counts = dict(zip(COUNT_FIELDS, counts.tolist()))
    want_counts = oracle_counters(student, guide, options, texts)
    if guide is None:
        return loss_error, grad_error, got_counts, want_counts, None, None
    ga, gp = (normalize(g.double())[0] for g in guide64[:2])
    theta = (ga * gp[options.offset : options.offset + ga.shape[0]]).sum(dim=1)
    want_sums = (float(theta.sum()), float(threshold(theta, options.margin, options.relative).sum()))
    return loss_error, grad_error, got_counts, want_counts, tuple(sums.tolist()), want_sums


#: The pairs by student dtype: the guide's own dtype first, then the mixed pair (a guide in another dtype).
STUDENT_PAIRS = (("bf16", "bf16-fp32guide"), ("fp16", "fp16-fp32guide"), ("tf32x3", "tf32x3-bf16guide"))


def _params():
    """Each case in each student dtype once, its guide by turns its own dtype or the mixed pair's (every mixed pair
    meets about half the cases; without a guide, the mixed pair is its student's pair)."""
    out = []
    for n, case in enumerate(CASES):
        for m, (same, mixed) in enumerate(STUDENT_PAIRS):
            pair = mixed if (n + m) % 2 and case.source != "none" else same
            out.append(pytest.param(case, pair, id=f"{shape_id(*case.shape)}-{pair}-{case.name}"))
    return out


def test_the_design_runs_every_case_in_every_student_dtype_and_every_pair():
    """``_params``: every case in each student dtype, and every pair (the mixed ones included) in several cases."""
    runs = [param.values for param in _params()]
    assert {(case.name, PAIRS[pair][0]) for case, pair in runs} == \
        {(case.name, PAIRS[same][0]) for case in CASES for same, _ in STUDENT_PAIRS}
    assert {pair for _, pair in runs} == set(PAIRS) and set(PAIRS) == {p for pairs in STUDENT_PAIRS for p in pairs}
    assert min(sum(pair == p for _, pair in runs) for p in PAIRS) >= 3


@pytest.mark.parametrize(("case", "pair"), _params())
def test_pair_matches_oracle(case, pair):
    loss_error, grad_error, got_counts, want_counts, sums, want_sums = _errors(case, pair)
    loss_unit, grad_tol = TOL["pairs"][pair]
    loss_tol = loss_unit * (1.0 + 1.0 / case.options.get("temperature", TEMPERATURE))
    assert loss_error <= loss_tol, f"loss: error {loss_error:.3g} > {loss_tol:.3g}"
    assert grad_error <= grad_tol, f"gradients: error {grad_error:.3g} x the largest > {grad_tol:.3g}"
    assert_close("counters", want_counts, got_counts)
    masked = sum(v for f, v in want_counts.items() if f.startswith("masked"))
    assert 0 < masked, "nothing masked: the counters are not exercised"
    if sums is not None:
        assert sums == pytest.approx(want_sums, rel=1e-5, abs=1e-5 * case.shape[0])
