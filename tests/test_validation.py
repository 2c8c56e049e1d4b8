"""Bad-input catalogue: every argument of ``gist_loss`` and ``FusedCachedGISTLoss`` is validated.

Each case builds valid random inputs, breaks exactly one thing, and expects a ValueError or TypeError whose
message names the argument (and, for tensors, the column and side) and says what was expected.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

import cgist
from cgist.function import check_embeddings, check_options

B, W, D, DG, K = 3, 2, 5, 4, 1  # anchors, world size (N = B * W), student dim, guide dim, negative sets
N = B * W


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Valid random ``[anchor, positive, negative]`` columns for the student (dim D) and the guide (dim DG)."""
    g = torch.Generator().manual_seed(0)
    student = [torch.randn(rows, D, generator=g, dtype=dtype) for rows in (B, N, N)]
    guide = [torch.randn(rows, DG, generator=g, dtype=dtype) for rows in (B, N, N)]
    return student, guide


def _with(columns: list[torch.Tensor], index: int, value: object) -> list[object]:
    """``columns`` with column ``index`` replaced by ``value`` (a new list)."""
    return [value if i == index else c for i, c in enumerate(columns)]


def _poisoned(column: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of ``column`` with one entry set to ``value``."""
    out = column.clone()
    out[-1, -1] = value
    return out


def _check(error: type[Exception], match: str, *, call=cgist.gist_loss, **overrides) -> None:
    """``call`` with valid random inputs, except ``overrides``, raises ``error`` with a message matching ``match``."""
    student, guide = _inputs()
    kwargs = dict(embeddings=student, guide_embeddings=guide, offset=B) if call is cgist.gist_loss else {}
    kwargs.update(overrides)
    with pytest.raises(error, match=match):
        call(**kwargs)


STUDENT, GUIDE = _inputs()

OPTION_CASES = [
    pytest.param(dict(temperature=0.0), ValueError, r"temperature must be a positive finite number, got 0\.0", id="temperature=0"),
    pytest.param(dict(temperature=-0.05), ValueError, r"temperature must be a positive finite number, got -0\.05", id="temperature<0"),
    pytest.param(dict(temperature=math.inf), ValueError, r"temperature must be a positive finite number, got inf", id="temperature=inf"),
    pytest.param(dict(temperature=math.nan), ValueError, r"temperature must be a positive finite number, got nan", id="temperature=nan"),
    pytest.param(dict(temperature="0.01"), TypeError, r"temperature must be a real number, got str", id="temperature=str"),
    pytest.param(dict(temperature=True), TypeError, r"temperature must be a real number, got bool", id="temperature=bool"),
    pytest.param(dict(margin=math.inf), ValueError, r"margin must be a finite number, got inf", id="margin=inf"),
    pytest.param(dict(margin=-math.inf), ValueError, r"margin must be a finite number, got -inf", id="margin=-inf"),
    pytest.param(dict(margin=math.nan), ValueError, r"margin must be a finite number, got nan", id="margin=nan"),
    pytest.param(dict(margin=None), TypeError, r"margin must be a real number, got NoneType", id="margin=None"),
    pytest.param(
        dict(margin_strategy="percent"), ValueError, r"margin_strategy must be one of \('absolute', 'relative'\), got 'percent'",
        id="strategy=unknown",
    ),
    pytest.param(dict(margin_strategy=None), ValueError, r"margin_strategy must be one of .*, got None", id="strategy=None"),
    pytest.param(dict(contrast_anchors=1), TypeError, r"contrast_anchors must be a bool, got int", id="contrast_anchors=int"),
    pytest.param(dict(contrast_positives="no"), TypeError, r"contrast_positives must be a bool, got str", id="contrast_positives=str"),
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
    pytest.param(dict(guide_embeddings="abc"), TypeError, r"guide_embeddings must be a list of 2-D tensors .*, got str", id="guide=str"),
    pytest.param(
        dict(embeddings=STUDENT[:1], guide_embeddings=GUIDE[:1]), ValueError,
        r"embeddings needs at least two columns \(anchor, positive\), got 1", id="one-column",
    ),
    pytest.param(
        dict(guide_embeddings=GUIDE[:2]), ValueError,
        r"guide_embeddings has 2 columns but embeddings has 3; they must hold the same columns", id="guide-columns",
    ),
    pytest.param(
        dict(embeddings=_with(STUDENT, 2, [[1.0]])), TypeError,
        r"embeddings\[2\] \(student negative 1\) must be a torch\.Tensor, got list", id="not-a-tensor",
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
        r"guide_embeddings\[0\] \(guide anchor\) has 2 rows, but embeddings\[0\] has 3", id="guide-anchor-rows",
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
    pytest.param(dict(offset=1.0), TypeError, r"offset must be an int, got float", id="offset=float"),
    pytest.param(dict(offset=True), TypeError, r"offset must be an int, got bool", id="offset=bool"),
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


def test_triton_needs_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _check(RuntimeError, r"backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1", backend="triton")


def test_triton_unavailable_says_why(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "cgist.kernels", types.ModuleType("cgist.kernels"))
    _check(RuntimeError, r"backend='triton' is unavailable: cannot import name 'gist_loss_and_grads'", backend="triton")


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
    student, guide = _inputs()
    student, guide = student[:2] + [student[2]] * k, guide[:2] + [guide[2]] * k
    with _CountSyncs() as syncs:
        check_options(temperature=0.05, margin=0.1, margin_strategy="relative", contrast_anchors=True, contrast_positives=True)
        check_embeddings(student, guide, B)
    assert syncs.count == 1


def test_valid_inputs_pass():
    """The catalogue's base inputs are valid, so each failure above comes from its one broken argument."""
    student, guide = _inputs()
    loss = cgist.gist_loss(student, guide, offset=B, backend="torch")
    assert loss.dtype == torch.float64 and bool(torch.isfinite(loss))


# FusedCachedGISTLoss ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"), dtype=torch.float32)


LOSS_CASES = [
    pytest.param(dict(temperature=0), ValueError, r"temperature must be a positive finite number, got 0", id="temperature=0"),
    pytest.param(dict(temperature=math.nan), ValueError, r"temperature must be a positive finite number, got nan", id="temperature=nan"),
    pytest.param(dict(temperature=None), TypeError, r"temperature must be a real number, got NoneType", id="temperature=None"),
    pytest.param(dict(margin=math.inf), ValueError, r"margin must be a finite number, got inf", id="margin=inf"),
    pytest.param(dict(margin="0.1"), TypeError, r"margin must be a real number, got str", id="margin=str"),
    pytest.param(dict(margin_strategy="abs"), ValueError, r"margin_strategy must be one of .*, got 'abs'", id="strategy=unknown"),
    pytest.param(dict(contrast_anchors=None), TypeError, r"contrast_anchors must be a bool, got NoneType", id="contrast_anchors=None"),
    pytest.param(dict(contrast_positives=0), TypeError, r"contrast_positives must be a bool, got int", id="contrast_positives=int"),
    pytest.param(dict(mini_batch_size=0), ValueError, r"mini_batch_size must be at least 1, got 0", id="mini_batch_size=0"),
    pytest.param(dict(mini_batch_size=8.0), TypeError, r"mini_batch_size must be an int, got float", id="mini_batch_size=float"),
    pytest.param(dict(mini_batch_size=True), TypeError, r"mini_batch_size must be an int, got bool", id="mini_batch_size=bool"),
    pytest.param(
        dict(mini_batch_num_tokens=-5), ValueError, r"mini_batch_num_tokens must be at least 1, got -5", id="num_tokens<0"
    ),
    pytest.param(
        dict(mini_batch_num_tokens=512.0), TypeError, r"mini_batch_num_tokens must be an int or None, got float", id="num_tokens=float"
    ),
    pytest.param(
        dict(gather_across_devices="yes"), TypeError, r"gather_across_devices must be a bool, got str", id="gather=str"
    ),
    pytest.param(dict(backend="gpu"), ValueError, r"backend must be one of \('auto', 'torch', 'triton'\), got 'gpu'", id="backend=unknown"),
    pytest.param(dict(model="all-MiniLM-L6-v2"), TypeError, r"model must be a SentenceTransformer, got str", id="model=str"),
    pytest.param(dict(guide=torch.nn.Linear(2, 2)), TypeError, r"guide must be a SentenceTransformer, got Linear", id="guide=module"),
]


@pytest.mark.parametrize("overrides, error, match", LOSS_CASES)
def test_fused_loss_arguments(tiny, overrides, error, match):
    _check(error, match, call=cgist.FusedCachedGISTLoss, **{"model": tiny, "guide": tiny, **overrides})


def test_fused_loss_valid_arguments_pass(tiny):
    loss = cgist.FusedCachedGISTLoss(tiny, tiny, mini_batch_size=2, mini_batch_num_tokens=64, margin=-0.1, backend="torch")
    assert loss.get_config_dict()["backend"] == "torch"

