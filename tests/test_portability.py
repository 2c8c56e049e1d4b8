"""Every machine: no float64 in a float32 call, exact fingerprints, the backend "auto" takes, the fallback of a
failing kernel, ``CGIST_BACKEND``, and cgist without Triton.

A GPU that has no float64 (Apple's MPS) or runs it at 1/64 rate (consumer NVIDIA cards) must not meet float64
in a float32 call: a ``TorchDispatchMode`` records the dtype of every op's outputs. The Triton launcher runs
under the interpreter here; the devices "auto" decides for are simulated (``cgist.stage.devices``; every route of
docs/devices.md is a test in ``test_devices``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import make_inputs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cgist
from cgist import GistOptions
from cgist.stage import ties
from cgist.stage.devices import OLDEST_CHECKED_TRITON
from cgist.stage.dispatch import route
from cgist.stage.pytorch import dense as pytorch_dense

# No float64 unless the inputs are float64 ------------------------------------------------------------------------


class _Float64Ops(TorchDispatchMode):
    """Records every op that returns a float64 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_leaves(out)):
            self.ops.append(str(func))
        return out


CALLS = {
    "k1-stats": dict(k=1, options=dict(margin=0.1, offset=3)),
    "k2-chunked": dict(k=2, chunked=True, options=dict(margin=-0.05, margin_strategy="relative")),
    "matryoshka": dict(k=1, options=dict(margin=0.05, matryoshka_dims=(24, 8))),
    "two-pass": dict(k=1, options=dict(margin=0.1, block_bytes=1)),
}


def _inputs(dtype: torch.dtype, guide_dtype: torch.dtype, k: int, chunked: bool = False):
    """6 anchors against 9 candidates (drawn in float64 by make_inputs, so made outside the probe)."""
    student, guide = make_inputs(6, 9, 24, 16, k, seed=11)
    student = [s.to(dtype).requires_grad_() for s in student]
    columns = [list(s.split(4)) for s in student] if chunked else student
    return columns, [g.to(guide_dtype) for g in guide]


def _call(inputs, backend: str, options: dict):
    """gist_loss with statistics and its backward."""
    loss, stats = cgist.gist_loss(*inputs, temperature=0.05, backend=backend, return_stats=True, **options)
    loss.backward()
    return loss, stats


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CALLS))
@pytest.mark.parametrize("pair", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16+fp32"])
def test_a_float32_call_creates_no_float64_tensor(pair, case, backend):
    spec = dict(CALLS[case])
    inputs = _inputs(*pair, spec.pop("k"), spec.pop("chunked", False))
    with _Float64Ops() as probe:
        loss, stats = _call(inputs, backend, spec["options"])
    assert probe.ops == []
    assert torch.isfinite(loss) and sum(stats.masked.values()) > 0


def test_the_float64_probe_sees_float64():
    """A float64 call does create float64 tensors: the probe above can fail."""
    inputs = _inputs(torch.float64, torch.float64, 1)
    with _Float64Ops() as probe:
        _call(inputs, "torch", CALLS["k1-stats"]["options"])
    assert len(probe.ops) > 10


# Fingerprints: exact integer arithmetic --------------------------------------------------------------------------


def _integer_fingerprint(words: torch.Tensor) -> torch.Tensor:
    """``ties.fingerprint_words`` computed in int64 only, from its definition (no float product)."""
    data = words.contiguous().view(torch.int8).to(torch.int64)
    coefficients, fold = ties._fingerprint_coefficients(data.shape[1], words.device)
    p = ties._FINGERPRINT_PRIME
    sums = (data.unsqueeze(2) * coefficients.to(torch.int64)).sum(dim=1) % p
    h1, h2 = (((sums * fold[:, j]) % p).sum(dim=1) % p for j in (0, 1))
    return h1 * p + h2


@pytest.mark.parametrize("width", [1, 7, 128, 129, 384, 1000])
def test_fingerprints_are_the_exact_integer_sums(width):
    """The float32 products give exactly the integer result, also for rows of extreme bytes (-128 and 127
    everywhere: the largest sums there are) and over several spans of 512 bytes."""
    gen = torch.Generator().manual_seed(width)
    words = torch.randint(-(2**31), 2**31 - 1, (40, width), generator=gen, dtype=torch.int32)
    words[0] = -0x7F7F7F80  # bytes 0x80: -128
    words[1] = 0x7F7F7F7F  # bytes 127
    assert torch.equal(ties.fingerprint_words(words), _integer_fingerprint(words))


def test_fingerprints_do_not_depend_on_position_or_batch():
    """A row gets the same key wherever it sits and however many rows are fingerprinted with it."""
    rows = torch.nn.functional.normalize(torch.randn(300, 96, generator=torch.Generator().manual_seed(1)), dim=1)
    keys = ties._fingerprint(rows)
    assert keys.unique().numel() == 300
    assert torch.equal(ties._fingerprint(rows[137:138]), keys[137:138])
    assert torch.equal(ties._fingerprint(rows.flip(0)), keys.flip(0))
    zeros = torch.zeros(2, 96)
    zeros[1] = -0.0
    assert ties._fingerprint(zeros).unique().numel() == 1  # -0.0 equals 0.0


def test_tie_ids_find_equal_normalised_rows():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(50, 32, generator=gen), torch.randn(70, 32, generator=gen)
    b[10] = 4.0 * a[3]  # a power of two: bitwise equal once normalised
    ids_a, ids_b = ties.tie_ids([a, b], torch.float32)
    assert ids_b[10] == ids_a[3]
    assert torch.cat([ids_a, ids_b]).unique().numel() == 119


# The backend "auto" takes --------------------------------------------------------------------------------------


CPU = torch.device("cpu")


def _call_on(device: torch.device, dtype: torch.dtype = torch.float32) -> types.SimpleNamespace:
    """What the router reads of a dense call (its score, device and dtypes), on ``device`` (no tensor is made there)."""
    return types.SimpleNamespace(options=GistOptions(), device=device, dtype=dtype, guide_dtype=dtype)


def test_cgist_backend_overrides_auto(simulate, monkeypatch):
    from cgist.stage.triton import dense as triton_dense

    simulate("sm_90")
    monkeypatch.setenv(route.BACKEND_ENV, "torch")
    assert route.select_stage(_call_on(CPU), "auto") is pytorch_dense
    monkeypatch.setenv(route.BACKEND_ENV, "triton")
    assert route.select_stage(_call_on(CPU), "auto") is triton_dense
    assert route.select_stage(_call_on(CPU), "torch") is pytorch_dense  # only "auto" is overridden
    monkeypatch.setenv(route.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=r"CGIST_BACKEND must be one of \('auto', 'torch', 'triton'\) .*got 'cuda'"):
        route.select_stage(_call_on(CPU), "auto")


def _import_error(name: str) -> str:
    """The message of the ImportError that importing ``name`` raises now."""
    with pytest.raises(ImportError) as failed:
        __import__(name)
    return str(failed.value)


def test_auto_says_once_why_the_kernels_cannot_be_imported(simulate, monkeypatch, caplog):
    """On a GPU the kernels serve (a simulated sm_90), "auto" without an importable Triton backend takes the PyTorch
    path and logs one line per cause, naming the ImportError and the fix; ``route.reset`` forgets that it did."""
    simulate("sm_90")
    oldest = ".".join(map(str, OLDEST_CHECKED_TRITON))
    # Triton cannot be imported: the backend is imported afresh, and fails at its `import triton`
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in [m for m in sys.modules if m == "cgist.stage.triton" or m.startswith("cgist.stage.triton.")]:
        monkeypatch.delitem(sys.modules, name)
    no_triton = _import_error("triton")

    def notices() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    with caplog.at_level(logging.WARNING, logger="cgist"):
        for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
            assert route.select_stage(_call_on(CPU, dtype), "auto") is pytorch_dense
        chosen, why = route.auto_route(CPU, torch.float16, torch.float16)
        assert chosen == "torch" and no_triton in why
        assert len(notices()) == 1, notices()
        assert notices()[0].startswith(f"cgist: the Triton kernels cannot be imported ({no_triton})")
        assert "backend='auto' runs the PyTorch path" in notices()[0]
        assert f"pip install 'triton>={oldest}'" in notices()[0] and "\n" not in notices()[0]

        # another cause: Triton imports, the backend does not
        monkeypatch.setitem(sys.modules, "cgist.stage.triton", None)
        no_backend = _import_error("cgist.stage.triton.dense")
        for _ in range(2):
            assert route.auto_route(CPU, torch.bfloat16, torch.bfloat16)[0] == "torch"
        assert len(notices()) == 2 and f"({no_backend})" in notices()[1]

        route.reset()  # the notices are forgotten: the next call logs its cause again
        route.auto_route(CPU, torch.bfloat16, torch.bfloat16)
        assert len(notices()) == 3 and notices()[2] == notices()[1]


# A kernel that fails to build or launch --------------------------------------------------------------------------


class _FailingKernel:
    """Stands in for a Triton kernel: every launch raises ``OutOfResources``, as a too-large tile does."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.runtime.errors import OutOfResources

            self.launches += 1
            raise OutOfResources(300000, 232448, "shared memory")

        return launch


def test_a_failing_kernel_falls_back_once_logged_and_remembered(simulate, monkeypatch, caplog):
    """Under a simulated sm_90 with "auto", a launch error runs the streaming path instead, logs once (device, dtypes,
    error) and is remembered for that device and dtype pair; "triton" raises it."""
    from cgist.stage.triton import dense as triton_dense

    kernel = _FailingKernel()
    monkeypatch.setattr(triton_dense, "tuned_fwd_kernel", lambda arch: kernel)
    simulate("sm_90")
    student, guide = make_inputs(5, 10, 12, 8, 1, torch.float32, seed=3, requires_grad=True)
    options = dict(temperature=0.05, margin=0.1, offset=5)
    want = cgist.gist_loss(student, guide, backend="torch", **options)
    want_grads = torch.autograd.grad(want, student)

    with caplog.at_level(logging.WARNING, logger="cgist"):
        for _ in range(2):
            got = cgist.gist_loss(student, guide, backend="auto", **options)
            assert torch.equal(got, want)
            assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, student), want_grads))
    assert kernel.launches == 1  # the second call went straight to the streaming path
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "cpu simulating NVIDIA H100 80GB HBM3 (sm_90)" in message and "OutOfResources" in message
    assert "float32 embeddings with a float32 guide" in message
    assert list(route.kernel_failures()) == [("dense", "cpu@sm_90", torch.float32, torch.float32)]

    # another dtype pair is tried on its own
    cgist.gist_loss([s.double() for s in student], [g.double() for g in guide], backend="auto", **options)
    assert kernel.launches == 2

    from triton.runtime.errors import OutOfResources

    with pytest.raises(OutOfResources):
        cgist.gist_loss(student, guide, backend="triton", **options)


def test_the_fallback_keeps_every_argument(simulate, monkeypatch):
    """A call with text ids (duplicates masked, no guide) falls back with them: the streaming path's result."""
    from cgist.stage.triton import dense as triton_dense

    monkeypatch.setattr(triton_dense, "tuned_fwd_kernel", lambda arch: _FailingKernel())
    simulate("sm_90")
    student, _ = make_inputs(4, 8, 6, 6, 1, torch.float32, seed=5)
    text_ids = [torch.arange(4), torch.arange(8) % 5, torch.arange(8) % 3]  # duplicates across the columns
    options = dict(temperature=0.05, offset=4, text_ids=text_ids)
    want = cgist.gist_loss(student, None, backend="torch", **options)
    assert not torch.equal(want, cgist.gist_loss(student, None, backend="torch", mask_duplicates=False, **options))
    assert torch.equal(cgist.gist_loss(student, None, backend="auto", **options), want)


def test_out_of_memory_is_not_a_kernel_failure(simulate):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    from cgist.stage.spec.dense import dense_call

    stage = route._WithFallback(types.SimpleNamespace(forward=out_of_memory, backward=out_of_memory), pytorch_dense)
    call = dense_call(*make_inputs(3, 3, 4, 4, 0, torch.float32), GistOptions())
    with pytest.raises(torch.cuda.OutOfMemoryError):
        stage.forward(call, False, False)
    state = route._KernelState(None)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        stage.backward(call, state, torch.ones(()))
    assert route.kernel_failures() == {}


# Without Triton ------------------------------------------------------------------------------------------------

NO_TRITON = """
import importlib.abc, json, sys
sys.path.insert(0, {tests!r})

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {{name!r}}")

sys.meta_path.insert(0, NoTriton())
import torch
import cgist


student = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
guide = [torch.randn(4, 6) for _ in range(3)]
loss, stats = cgist.gist_loss(student, guide, margin=0.1, return_stats=True)
loss.backward()
try:
    cgist.gist_loss(student, guide, backend="triton")
    triton_error = None
except RuntimeError as err:
    triton_error = str(err)

from helpers_models import guide_model, tiny_model
guide_st = guide_model(torch.float32)
student_st = tiny_model({tmp!r}, dtype=torch.float32)
fused = cgist.FusedCachedGISTLoss(student_st, guide_st, mini_batch_size=2, margin=0.05)
columns = [["a cat", "a dog", "two birds"], ["the cat sat", "dogs bark", "birds fly"]]
value = fused([student_st.preprocess(texts) for texts in columns], None)
value.backward()
grads = [p.grad for p in student_st.parameters() if p.grad is not None]
print(json.dumps({{
    "triton_loaded": "triton" in sys.modules,
    "loss": float(loss), "grad": bool(all(torch.isfinite(s.grad).all() for s in student)),
    "masked": sum(stats.masked.values()), "triton_error": triton_error,
    "fused": float(value), "fused_grads": len(grads) > 0 and all(bool(torch.isfinite(g).all()) for g in grads),
}}))
"""


def test_cgist_works_without_triton(tmp_path):
    """``import triton`` fails: cgist imports, gist_loss and FusedCachedGISTLoss train on the PyTorch path, and
    backend='triton' says why it cannot run."""
    # With the interpreter asked for, backend='triton' gets as far as importing the launcher.
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    script = NO_TRITON.format(tests=str(Path(__file__).parent), tmp=str(tmp_path / "student"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["triton_loaded"]
    assert result["grad"] and result["fused_grads"]
    assert math.isfinite(result["loss"]) and math.isfinite(result["fused"]) and result["masked"] > 0
    assert result["triton_error"].startswith("backend='triton' is unavailable: No module named 'triton'")
