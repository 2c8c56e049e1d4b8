"""cgist.function: ``gist_loss``'s input validation, backend selection and autograd Function (gradcheck, no_grad...).

The validation catalogue builds valid random inputs, breaks exactly one thing, and expects a ValueError or
TypeError whose message names the argument (and, for tensors, the column and side) and says what was expected.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from helpers import BAD_OPTIONS, TOL, Tol, assert_close, gradient_addresses, make_inputs
from torch.overrides import TorchFunctionMode

import cgist
from cgist import GistOptions, function
from cgist.stage.devices import arch_for
from cgist.stage.dispatch import route
from cgist.stage.pytorch import dense as pytorch_dense
from cgist.stage.reference import gist_loss_reference
from cgist.stage.spec.dense import check_embeddings

TIGHT = Tol(**TOL["embeddings"]["fp64"])

# The autograd Function ----------------------------------------------------------------------------------------


def test_the_backward_hands_over_the_forwards_gradients_without_a_copy(monkeypatch):
    """The forward makes the gradients; at an incoming gradient of 1 the backward passes them on as they are (the
    leaves' ``.grad`` are those tensors), and a scaled loss gets them scaled."""
    student, guide = make_inputs(4, 8, 5, 3, 1, seed=3, requires_grad=True)
    made = gradient_addresses(monkeypatch, pytorch_dense)
    loss = cgist.gist_loss(student, guide, temperature=0.5, backend="torch")
    loss.backward(retain_graph=True)
    assert [s.grad.data_ptr() for s in student] == made[0]
    expected = [s.grad.clone() for s in student]
    for s in student:
        s.grad = None
    (3.0 * loss).backward()
    for s, grad in zip(student, expected):
        torch.testing.assert_close(s.grad, 3.0 * grad, rtol=1e-12, atol=1e-12)


def _gradcheck(B, W, D, Dg, k, **options):
    """gradcheck of gist_loss in float64 on every student column, for each rank's offset."""
    student, guide = make_inputs(B, B * W, D, Dg, k, seed=B + D + k, requires_grad=True)
    for rank in range(W):
        opts = {"temperature": 0.5, **options, "offset": rank * B, "backend": "torch"}
        assert torch.autograd.gradcheck(lambda *s: cgist.gist_loss(list(s), guide, **opts), tuple(student),
                                         fast_mode=True)


@pytest.mark.parametrize(
    "B,W,D,Dg,k,options",
    [
        (3, 1, 5, 4, 0, {}),
        (3, 2, 5, 7, 1, {"margin": 0.1}),
        (4, 2, 3, 3, 2, {"margin": 0.2, "margin_strategy": "relative", "contrast_anchors": False}),
        (2, 3, 6, 5, 1, {"margin": -0.3, "contrast_positives": False}),
    ],
    ids=["B3-N3-D5-k0", "B3-N6-D5-k1-m0.1", "B4-N8-D3-k2-rel-noAA", "B2-N6-D6-k1-mneg-noPP"],
)
def test_gradcheck(B, W, D, Dg, k, options):
    _gradcheck(B, W, D, Dg, k, **options)


def test_backward_scales_by_grad_output():
    student, guide = make_inputs(7, 14, 9, 6, 1, seed=1, requires_grad=True)
    loss = cgist.gist_loss(student, guide, offset=7, margin=0.05)
    upstream = torch.tensor(-2.75, dtype=torch.float64)
    grads = torch.autograd.grad(loss, student, grad_outputs=upstream)
    reference = gist_loss_reference(student, guide, GistOptions(offset=7, margin=0.05))
    assert_close("gradients", torch.autograd.grad(reference * upstream, student), grads, TIGHT)


def test_loss_in_a_larger_graph():
    """The loss composes with other autograd ops in one backward."""
    student, guide = make_inputs(5, 5, 8, 8, 1, seed=2, requires_grad=True)
    total = 3.0 * cgist.gist_loss(student, guide) + (student[0] ** 2).sum()
    total.backward()
    leaves = [s.detach().clone().requires_grad_() for s in student]
    (3.0 * gist_loss_reference(leaves, guide) + (leaves[0] ** 2).sum()).backward()
    assert_close("gradients", [leaf.grad for leaf in leaves], [s.grad for s in student], TIGHT)


def test_no_grad_computes_only_the_loss(monkeypatch):
    student, guide = make_inputs(6, 6, 8, 5, 0, seed=3, requires_grad=True)
    calls = []
    real = pytorch_dense.forward

    def spy(call, with_grad, need_stats):
        calls.append(with_grad)
        return real(call, with_grad, need_stats)

    monkeypatch.setattr(pytorch_dense, "forward", spy)
    with torch.no_grad():
        loss = cgist.gist_loss(student, guide)
    assert calls == [False] and not loss.requires_grad
    assert_close("loss", gist_loss_reference(student, guide), loss, TIGHT)
    loss = cgist.gist_loss([s.detach() for s in student], guide)  # nothing requires grad
    assert calls == [False, False] and not loss.requires_grad


def test_partial_requires_grad():
    """Only the columns that require grad receive one."""
    student, guide = make_inputs(4, 4, 6, 6, 1, seed=5)
    student[1].requires_grad_()
    cgist.gist_loss(student, guide).backward()
    assert student[0].grad is None and student[2].grad is None
    leaves = [s.detach().clone().requires_grad_() for s in student]
    gist_loss_reference(leaves, guide).backward()
    assert_close("gradient", leaves[1].grad, student[1].grad, TIGHT)


def test_with_options_equals_keywords():
    """``gist_loss_with_options`` with a GistOptions gives the loss and gradients of ``gist_loss`` with its fields."""
    options = GistOptions(temperature=0.2, margin=0.1, margin_strategy="relative", contrast_anchors=False, offset=3)
    student, guide = make_inputs(3, 9, 5, 4, 1, seed=9, requires_grad=True)
    by_options = function.gist_loss_with_options(student, guide, options, backend="torch")
    by_keywords = cgist.gist_loss(
        student, guide, temperature=0.2, margin=0.1, margin_strategy="relative", contrast_anchors=False, offset=3,
        backend="torch",
    )
    assert torch.equal(by_options, by_keywords)
    for a, b in zip(torch.autograd.grad(by_options, student), torch.autograd.grad(by_keywords, student)):
        assert torch.equal(a, b)
    assert not torch.equal(by_options, cgist.gist_loss(student, guide, offset=3, backend="torch"))


# Backend selection --------------------------------------------------------------------------------------------


def _call_on(device: str, similarity: str = "cos") -> types.SimpleNamespace:
    """What the router reads of a call (its score, device and dtypes), on ``device`` (no tensor is made there)."""
    return types.SimpleNamespace(options=GistOptions(similarity=similarity), device=torch.device(device),
                                 dtype=torch.float32, guide_dtype=torch.float32)


def test_auto_backend_on_cpu_is_streaming():
    assert route.select_stage(_call_on("cpu"), "auto") is pytorch_dense


def test_torch_backend_on_cuda_is_streaming():
    from cgist.stage.pytorch import maxsim

    assert route.select_stage(_call_on("cuda"), "torch") is pytorch_dense
    assert route.select_stage(_call_on("cuda", "maxsim"), "torch") is maxsim  # each score its module


def test_triton_backend_is_the_launcher(monkeypatch):
    from cgist.stage.triton import dense as triton_dense

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for device in ("cpu", "cuda"):
        assert route.select_stage(_call_on(device), "triton") is triton_dense


def test_auto_backend_falls_back_to_streaming_without_triton(monkeypatch):
    """On an sm_90 GPU, 'auto' picks the launcher, or the streaming path when cgist.stage.triton cannot provide it."""
    monkeypatch.setattr(route, "gpu_arch", lambda device: arch_for((9, 0)))
    _without_the_triton_backend(monkeypatch)
    assert route.auto_route(torch.device("cuda:0"), torch.float32, torch.float32)[0] == "torch"
    assert route.select_stage(_call_on("cuda:0"), "auto") is pytorch_dense


def test_check_backend_names_what_it_checks():
    """One check of a backend name: the loss's argument and the command line's flag get the same message."""
    assert [route.check_backend(name) for name in route.BACKENDS] == list(route.BACKENDS)
    with pytest.raises(ValueError, match=r"^--backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'$"):
        route.check_backend("cuda", "--backend")


# Input validation ---------------------------------------------------------------------------------------------

B, W, D, DG, K = 3, 2, 5, 4, 1  # anchors, world size (N = B * W), student dim, guide dim, negative sets
N = B * W
STUDENT, GUIDE = make_inputs(B, N, D, DG, K)


def _with(columns: list[torch.Tensor], index: int, value: object) -> list[object]:
    """``columns`` with column ``index`` replaced by ``value`` (a new list)."""
    return [value if i == index else c for i, c in enumerate(columns)]


def _poisoned(column: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of ``column`` with one entry set to ``value``."""
    out = column.clone()
    out[-1, -1] = value
    return out


def _check(error: type[Exception], match: str, **overrides) -> None:
    """``gist_loss`` on the valid inputs STUDENT, GUIDE and offset B, except ``overrides``, raises ``error`` matching ``match``."""
    kwargs = {"embeddings": STUDENT, "guide_embeddings": GUIDE, "offset": B, **overrides}
    with pytest.raises(error, match=match):
        cgist.gist_loss(**kwargs)


OPTION_CASES = [
    *BAD_OPTIONS,
    pytest.param(
        dict(backend="cuda"), ValueError, r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'", id="backend=unknown"
    ),
]


@pytest.mark.parametrize("overrides, error, match", OPTION_CASES)
def test_gist_loss_options(overrides, error, match):
    _check(error, match, **overrides)


TENSOR_CASES = [
    pytest.param(
        dict(embeddings=STUDENT[0]), TypeError, r"embeddings must be a list of 2-D tensors \[anchor, positive, \*negatives\], got Tensor",
        id="embeddings=tensor",
    ),
    pytest.param(dict(guide_embeddings="abc"), ValueError, r"guide_embeddings must be the guide's columns, 'self' or None, got 'abc'",
                 id="guide=str"),
    pytest.param(dict(guide_embeddings=GUIDE[0]), TypeError, r"guide_embeddings must be a list of 2-D tensors .*, got Tensor",
                 id="guide=tensor"),
    pytest.param(
        dict(embeddings=STUDENT[:1], guide_embeddings=GUIDE[:1]), ValueError,
        r"embeddings needs at least two columns \(anchor, positive\), got 1", id="one-column",
    ),
    pytest.param(
        dict(guide_embeddings=GUIDE[:2]), ValueError,
        r"guide_embeddings has 2 columns but embeddings has 3; they must hold the same columns", id="guide-columns",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, 1.0)), TypeError,
        r"embeddings\[2\] \(student negative 1\) must be a torch\.Tensor or a non-empty list of them \(row chunks\), "
        r"got float", id="not-a-tensor",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, [STUDENT[2][:3], [[1.0]]])), TypeError,
        r"embeddings\[2\] \(student negative 1\) chunk 1 must be a torch\.Tensor, got list", id="chunk-not-a-tensor",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, [[[1.0]]])), TypeError,
        r"embeddings\[2\] \(student negative 1\) must be a torch\.Tensor, got list", id="one-chunk-not-a-tensor",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, [])), TypeError,
        r"embeddings\[2\] \(student negative 1\) must be a torch\.Tensor or a non-empty list of them", id="no-chunks",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 1, [STUDENT[1][:3], STUDENT[1][3:, :-1]])), ValueError,
        r"embeddings\[1\] \(student positive\) chunk 1 has dim \d+, but embeddings\[0\] has dim \d+", id="chunk-dim",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 1, [GUIDE[1][:3], GUIDE[1][3:].float()])), TypeError,
        r"guide_embeddings\[1\] \(guide positive\) chunk 1 has dtype torch\.float32, but guide_embeddings\[0\] has "
        r"torch\.float64", id="chunk-dtype",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 2, [GUIDE[2][:3], GUIDE[2][:2]])), ValueError,
        r"guide_embeddings\[2\] \(guide negative 1\) has 5 rows, but the positives have \d+", id="chunk-rows",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 1, STUDENT[1].to(torch.int64))), TypeError,
        r"embeddings\[1\] \(student positive\) must have a floating dtype, got torch\.int64", id="dtype=int64",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 0, GUIDE[0] > 0)), TypeError,
        r"guide_embeddings\[0\] \(guide anchor\) must have a floating dtype, got torch\.bool", id="dtype=bool",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 0, STUDENT[0].to(torch.complex64))), TypeError,
        r"embeddings\[0\] \(student anchor\) must have a floating dtype, got torch\.complex64", id="dtype=complex",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, STUDENT[2].float())), TypeError,
        r"embeddings\[2\] \(student negative 1\) has dtype torch\.float32, but embeddings\[0\] has torch\.float64",
        id="mixed-dtypes",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 0, STUDENT[0][0])), ValueError,
        r"embeddings\[0\] \(student anchor\) must be 2-D \(rows x dim\), got shape \(5,\)", id="1-D",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 1, GUIDE[1][None])), ValueError,
        r"guide_embeddings\[1\] \(guide positive\) must be 2-D \(rows x dim\), got shape \(1, 6, 4\)", id="3-D",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 0, STUDENT[0][:0]), guide_embeddings=_with(GUIDE, 0, GUIDE[0][:0])), ValueError,
        r"embeddings\[0\] \(student anchor\) must be non-empty, got shape \(0, 5\)", id="empty-batch",
    ),
    pytest.param(
        dict(guide_embeddings=[g[:, :0] for g in GUIDE]), ValueError,
        r"guide_embeddings\[0\] \(guide anchor\) must be non-empty, got shape \(3, 0\)", id="empty-dim",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 1, STUDENT[1][:, :-1])), ValueError,
        r"embeddings\[1\] \(student positive\) has dim 4, but embeddings\[0\] has dim 5", id="student-dims",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 2, torch.cat([GUIDE[2], GUIDE[2]], 1))), ValueError,
        r"guide_embeddings\[2\] \(guide negative 1\) has dim 8, but guide_embeddings\[0\] has dim 4", id="guide-dims",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, STUDENT[2][:-1])), ValueError,
        r"embeddings\[2\] \(student negative 1\) has 5 rows, but the positives have 6", id="negative-rows",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 0, GUIDE[0][:-1])), ValueError,
        r"guide_embeddings\[0\] \(guide anchor\) has 2 rows, but embeddings\[0\] \(student anchor\) has 3", id="guide-anchor-rows",
    ),
    pytest.param(
        dict(embeddings=[STUDENT[0], STUDENT[1][:2], STUDENT[2][:2]], guide_embeddings=[GUIDE[0], GUIDE[1][:2], GUIDE[2][:2]]),
        ValueError, r"embeddings\[1\] \(student positive\) has 2 rows, fewer than the 3 anchors", id="N<B",
    ),
    pytest.param(
        dict(guide_embeddings=_with(GUIDE, 1, GUIDE[1].to("meta"))), ValueError,
        r"guide_embeddings\[1\] \(guide positive\) is on meta, but embeddings\[0\] \(student anchor\) is on cpu; "
        r"all embeddings must be on one device", id="devices",
    ),
    pytest.param(dict(offset=-1), ValueError, r"offset must be in \[0, N - B\] = \[0, 3\] .*got -1", id="offset<0"),
    pytest.param(dict(offset=N - B + 1), ValueError, r"offset must be in \[0, N - B\] = \[0, 3\] .*got 4", id="offset>N-B"),
]


@pytest.mark.parametrize("overrides, error, match", TENSOR_CASES)
def test_gist_loss_tensors(overrides, error, match):
    _check(error, match, **overrides)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("index, column", [(0, "anchor"), (1, "positive"), (2, "negative 1")], ids=["anchor", "positive", "negative1"])
@pytest.mark.parametrize("arg, side", [("embeddings", "student"), ("guide_embeddings", "guide")], ids=["student", "guide"])
def test_gist_loss_non_finite(arg, side, index, column, value):
    columns = dict(embeddings=STUDENT, guide_embeddings=GUIDE)[arg]
    match = rf"{arg}\[{index}\] \({side} {column}\) contains NaN or infinite values"
    _check(ValueError, match, **{arg: _with(columns, index, _poisoned(columns[index], value))})


def test_finite_values_whose_sum_overflows_pass():
    """The finiteness test sums each chunk first; a finite chunk whose sum overflows still passes, exactly."""
    huge = [t.float() for t in STUDENT]
    huge[2] = torch.full_like(huge[2], 3e38)
    assert not torch.isfinite(huge[2].sum())
    check_embeddings(huge, [g.float() for g in GUIDE], GistOptions(offset=B))
    huge[2][1, 2] = math.nan
    with pytest.raises(ValueError, match=r"embeddings\[2\] \(student negative 1\) contains NaN or infinite values"):
        check_embeddings(huge, [g.float() for g in GUIDE], GistOptions(offset=B))


def test_non_finite_chunk_is_named():
    chunks = [STUDENT[1][:2], _poisoned(STUDENT[1][2:], math.nan)]
    _check(ValueError, r"embeddings\[1\] \(student positive\) chunk 1 contains NaN or infinite values",
           embeddings=_with(STUDENT, 1, chunks))


@pytest.mark.parametrize("matryoshka", [None, (9, 4)], ids=["one-dim", "dims9.4"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_row_chunks_equal_the_concatenated_columns(backend, matryoshka):
    """Columns given as row chunks (uneven, one of them a single chunk) give the loss, the statistics and,
    chunk by chunk, the gradient rows of the same columns concatenated."""
    student, guide = make_inputs(6, 12, 9, 5, 2, seed=11, requires_grad=True)
    options = dict(temperature=0.1, margin=0.05, offset=6, matryoshka_dims=matryoshka, backend=backend,
                   return_stats=True)
    loss, stats = cgist.gist_loss(student, guide, **options)
    expected = torch.autograd.grad(loss, student)
    sizes = [[1, 5], [5, 4, 3], [12], [7, 5]]
    leaves = [[part.detach().clone().requires_grad_() for part in column.split(n)] for column, n in zip(student, sizes)]
    guide_chunks = [list(g.split(n)) for g, n in zip(guide, [[3, 3], [12], [2, 10], [6, 6]])]
    chunked_loss, chunked_stats = cgist.gist_loss(leaves, guide_chunks, **options)
    chunked_loss.backward()
    assert chunked_stats == stats
    assert_close("chunks", (loss, expected), (chunked_loss, [torch.cat([part.grad for part in c]) for c in leaves]),
                 (TIGHT, TIGHT))


def test_triton_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check(RuntimeError, r"backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1", backend="triton")


def _without_the_triton_backend(monkeypatch) -> None:
    """The Triton backend's modules cannot be imported (as where triton or the kernels are missing)."""
    for name in ("cgist.stage.triton", "cgist.stage.triton.dense", "cgist.stage.triton.maxsim"):
        monkeypatch.setitem(sys.modules, name, None)


def test_triton_unavailable_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _without_the_triton_backend(monkeypatch)
    _check(RuntimeError, r"backend='triton' is unavailable: import of cgist.stage.triton.dense halted",
           backend="triton")


#: Tensor methods that wait for the device to produce a value on the host.
SYNCING = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "numpy", "cpu", "equal", "is_nonzero"}


class _CountSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in SYNCING
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [0, 1, 3], ids=lambda k: f"k{k}")
def test_validation_costs_one_host_sync(k):
    student, guide = STUDENT[:2] + [STUDENT[2]] * k, GUIDE[:2] + [GUIDE[2]] * k
    with _CountSyncs() as syncs:
        options = GistOptions(temperature=0.05, margin=0.1, margin_strategy="relative", contrast_anchors=True,
                              contrast_positives=True, offset=B)
        check_embeddings(student, guide, options)
    assert syncs.count == 1


def test_valid_inputs_pass():
    """The catalogue's base inputs are valid, so each failure above comes from its one broken argument."""
    loss = cgist.gist_loss(STUDENT, GUIDE, offset=B, backend="torch")
    assert loss.dtype == torch.float64 and bool(torch.isfinite(loss))
