"""Shared test setup.

* Without CUDA, the Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  anything imports them, so it is set here, at collection time.
* Every tensor the package allocates uninitialised is filled with NaN, so an output that a code path
  forgets to write fails the comparison instead of passing on leftover memory.
"""

import os

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
