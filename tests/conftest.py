"""Shared test setup.

* Without CUDA, the Triton kernels run under the interpreter: TRITON_INTERPRET must be set before
  anything imports them, so it is set here, at collection time.
* Every tensor the package allocates uninitialised is filled with NaN, so an output that a code path
  forgets to write fails the comparison instead of passing on leftover memory. The CPU workspace that
  ``cgist.stage.pytorch.dense`` keeps between calls (per thread) is refilled with NaN before and after each test, so no
  test reads what an earlier one left there.
* Under the interpreter, ``tl.dot`` multiplies bf16 operands as their values, not their bit patterns
  (``interpreter_dot``: what the interpreter does wrong, and why the fix cannot hide a kernel bug); a launch patches
  triton.language once, and under coverage each kernel specialization is traced on its first launch only
  (``interpreter_runs``).
* Under pytest-xdist, each worker takes its share of the cores (torch threads, OMP_NUM_THREADS).
* ``simulate``: CPU tensors standing in for a GPU, an AMD or an Apple device (``cgist.stage.devices``).
* The models (and the standard-library pairs) the test modules share are defined here, once (``helpers_models`` builds them). The guides are loaded
  once for the whole run: the losses only run a guide, and a test that switches one to training mode switches it
  back. Each module gets its own students, since tests train them, switch dropout on and leave gradients on them.
"""

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the machine's cores: each takes its share of torch's threads, and so do the subprocesses
# it starts (OMP_NUM_THREADS, unless set already). Left at one thread per core each, two workers on two cores run the
# suite at half the speed.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, len(os.sched_getaffinity(0)) // _workers) if hasattr(os, "sched_getaffinity") else 1
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)

import pytest  # noqa: E402

_empty, _empty_like = torch.empty, torch.empty_like
# torch.device(...) as a context (transformers builds models under torch.device("meta")) lists its factory functions
# once, on first use: listed while torch.empty is the NaN-filling one below, the meta device no longer takes it, and
# every later model is built and randomly initialised for real, which moves the random stream (a multi-vector model's
# projection, drawn after it, then differs with the order the tests run in). List them now, from torch's own.
import torch.utils._device  # noqa: E402

torch.utils._device._device_constructors()


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
    """The interpreter's ``tl.dot`` with bf16 operands multiplied by value (``interpreter_dot``), and its launches
    patching triton.language once, traced by coverage once per kernel specialization (``interpreter_runs``), for the
    whole run."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        yield
        return
    from interpreter_dot import patch_interpreter_dot
    from interpreter_runs import interpreter_runs

    with patch_interpreter_dot(), interpreter_runs():
        yield


@pytest.fixture
def simulate(monkeypatch):
    """CPU tensors standing in for the device the returned setter names (``cgist.stage.devices.SIMULATED``: the
    router, the tiles, the launchers, the first-use check and the fallback take its path, the kernels under the
    interpreter), with nothing "auto" remembers before or after the test (``route.reset``), no backend override and
    the first-use check off (a test turns it on)."""
    from cgist.stage import devices
    from cgist.stage.dispatch import route, selfcheck

    route.reset()
    monkeypatch.delenv(route.BACKEND_ENV, raising=False)
    monkeypatch.setenv(selfcheck.ENV, "0")

    def use(arch: str) -> devices.Simulated:
        monkeypatch.setenv(devices.SIMULATE_ENV, arch)
        return devices.SIMULATED[arch]

    yield use
    route.reset()


# Shared models ------------------------------------------------------------------------------------------------------
# helpers_models imports sentence-transformers: imported where a model is built, so that modules without one (and the
# distributed workers, which import this file) do not pay for it.


@pytest.fixture(scope="session")
def guide():
    """all-MiniLM-L6-v2 in float64, in eval mode."""
    from helpers_models import guide_model

    return guide_model(torch.float64)


@pytest.fixture(scope="session")
def guide32():
    """all-MiniLM-L6-v2 in float32, in eval mode."""
    from helpers_models import guide_model

    return guide_model(torch.float32)


@pytest.fixture(scope="session")
def guides(guide, guide32):
    """all-MiniLM-L6-v2 by dtype: float64 and float32."""
    return {torch.float64: guide, torch.float32: guide32}


@pytest.fixture(scope="session")
def tiny_guide(tmp_path_factory):
    """A tiny float64 BERT guide (seed 1, so not the student's weights) on the guide's tokenizer, in eval mode: where
    a loss needs a guide model but the test feeds it embeddings, or a guide of the student's size is wanted."""
    from helpers_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-guide"), seed=1)


@pytest.fixture(scope="session")
def tiny_guide32(tmp_path_factory):
    """``tiny_guide``'s weights in float32."""
    from helpers_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-guide-fp32"), dtype=torch.float32, seed=1)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    """The tiny float64 student (``helpers_models.tiny_model``: seed 0, dropout 0.1, the guide's tokenizer, so no
    retokenisation), in eval mode when built. One per module: its tests may train it, switch dropout on or leave
    gradients on it."""
    from helpers_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("student"), dropout=0.1)


@pytest.fixture(scope="module")
def student32(tmp_path_factory):
    """The tiny student in float32: the same weights (built from the same seed), dropout 0.1, in eval mode when built;
    one per module."""
    from helpers_models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("student-fp32"), dtype=torch.float32, dropout=0.1)


@pytest.fixture(scope="module")
def students(student, student32):
    """The tiny student by dtype: float64 and float32, the same weights."""
    return {torch.float64: student, torch.float32: student32}


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, str]]:
    """Real pairs from the standard library (anchor = docstring summary, positive = code)."""
    from cgist.cli.data import stdlib_pairs

    return stdlib_pairs(40, seed=1)
