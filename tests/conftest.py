"""Shared test setup.

* Without CUDA, the Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  anything imports them, so it is set here, at collection time.
* Every tensor the package allocates uninitialised is filled with NaN, so an output that a code path
  forgets to write fails the comparison instead of passing on leftover memory. The CPU workspace that
  ``cgist.stage.pytorch.streaming`` keeps between calls (per thread) is refilled with NaN before and after each test, so no
  test reads what an earlier one left there.
* Under the interpreter, ``tl.dot`` multiplies bf16 operands as their values, not their bit patterns
  (``interpreter_dot``: what the interpreter does wrong, and why the fix cannot hide a kernel bug).
"""

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_empty, _empty_like = torch.empty, torch.empty_like


def _poison(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
        t.fill_(float("nan"))
    return t


def _nan_empty(*args, **kwargs):
    return _poison(_empty(*args, **kwargs))


def _nan_empty_like(*args, **kwargs):
    return _poison(_empty_like(*args, **kwargs))


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    """torch.empty / torch.empty_like return NaN-filled floating tensors for the duration of each test."""
    monkeypatch.setattr(torch, "empty", _nan_empty)
    monkeypatch.setattr(torch, "empty_like", _nan_empty_like)
    yield


def _poison_kept_workspace() -> None:
    """NaN into every workspace buffer that ``cgist.stage.pytorch.workspace`` keeps for this thread (the one the tests run in;
    a thread that a test starts takes its buffers with it when it ends)."""
    workspace = sys.modules.get("cgist.stage.pytorch.workspace")  # not imported yet: nothing kept
    if workspace is not None:
        for buffer in getattr(workspace._THREAD, "buffers", {}).values():
            _poison(buffer)


@pytest.fixture(autouse=True)
def nan_poisoned_workspace():
    """The kept CPU workspace holds NaN when each test starts and after it ends."""
    _poison_kept_workspace()
    yield
    _poison_kept_workspace()


@pytest.fixture(autouse=True, scope="session")
def exact_bf16_interpreter_dot():
    """The interpreter's ``tl.dot`` with bf16 operands multiplied by value (``interpreter_dot``), for the whole run."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        yield
        return
    from interpreter_dot import patch_interpreter_dot

    with patch_interpreter_dot():
        yield
