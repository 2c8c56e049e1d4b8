"""Check problems that can fail: every input the kernels read, perturbed in their launch by 0.2% or by one token or
row, makes the first-use check of its score fail (docs/design.md#dispatch).

A first-use check is only as good as its problem: a kernel that reads its scale 0.2% too large, stops a document one
token short, weighs a query token 0.2% too much or takes the label one column over must move the check's loss or
gradients beyond its tolerance (float32's, 1e-4) or its mask counts. Each perturbation goes into the launches of
every kernel that reads that input (``_Perturbed``), on each path of each score: the dense kernels, MaxSim's
streamed and held paths, XTR's. The same check without a perturbation passes, so what fails it is the perturbation.
"""

from __future__ import annotations

import pytest
import torch

from cgist.stage.dispatch import route, selfcheck
from cgist.stage.spec import dense, maxsim, xtr
from cgist.stage.triton import dense as triton_dense
from cgist.stage.triton import maxsim as triton_maxsim
from cgist.stage.triton import tiles

CPU = torch.device("cpu")
#: The dense check problem's rows here (``selfcheck.ROWS`` on a GPU: 256 rows take minutes under the interpreter).
#: MaxSim's and XTR's take their own (``CHECK_ROWS``, 8) whatever this is.
ROWS = 16


def _scale(args: dict) -> None:
    """The scale (``scalars_ptr[0]``: ``log2(e) / tau`` of the dense kernels, MaxSim's ``scale``) 0.2% too large."""
    scalars = args["scalars_ptr"].clone()
    scalars[0] *= 1.002
    args["scalars_ptr"] = scalars


def _width(args: dict) -> None:
    """The first document of more than one token one token short."""
    widths = args["width_ptr"].clone()
    widths[int((widths > 1).nonzero()[0])] -= 1
    args["width_ptr"] = widths


def _weight(args: dict) -> None:
    """The first weighted query token 0.2% heavier."""
    weights = args["w_ptr"].clone()
    flat = weights.view(-1)
    flat[int((flat != 0).nonzero()[0])] *= 1.002
    args["w_ptr"] = weights


def _offset(args: dict) -> None:
    """The diagonal offset one row over: every query's label is the next column."""
    args["offset"] += 1


PERTURBATIONS = {"scale": ("scalars_ptr", _scale), "width": ("width_ptr", _width), "weight": ("w_ptr", _weight),
                 "offset": ("offset", _offset)}
#: (score's spec, the sample call's name, the perturbations of the inputs its kernels read)
PATHS = {
    "dense": (dense, "dense", ("scale", "offset")),
    "maxsim-streamed": (maxsim, "maxsim", ("scale", "width", "weight", "offset")),
    "maxsim-held": (maxsim, "maxsim, guided", ("scale", "width", "weight")),
    "xtr": (xtr, "xtr", ("scale", "width", "weight")),
}


class _Perturbed:
    """A kernel whose launches get ``edit`` applied to their keyword arguments that hold ``name``."""

    def __init__(self, kernel, name: str, edit) -> None:
        self.kernel, self.name, self.edit, self.launches = kernel, name, edit, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            if self.name in kwargs:
                self.edit(kwargs)
                self.launches += 1
            return launch(*args, **kwargs)

        return run

    def __getattr__(self, attribute):
        return getattr(self.kernel, attribute)


def _perturb(monkeypatch, perturbation: str) -> list[_Perturbed]:
    """Every kernel the launchers reach, perturbed; the wrappers (their launch counts)."""
    name, edit = PERTURBATIONS[perturbation]
    wrapped = []

    def wrap(kernel):
        wrapped.append(_Perturbed(kernel, name, edit))
        return wrapped[-1]

    tuned = tiles.tuned_fwd_kernel
    forward = {}
    monkeypatch.setattr(triton_dense, "tuned_fwd_kernel",
                        lambda arch: forward.setdefault(arch, wrap(tuned(arch))))
    for module, names in ((triton_dense, ("gist_score_grad_kernel", "tf32x3_addmm_kernel")),
                          (triton_maxsim, tuple(triton_maxsim.KERNELS))):
        for kernel_name in names:
            monkeypatch.setattr(module, kernel_name, wrap(getattr(module, kernel_name)))
    return wrapped


def _check(spec, name: str) -> selfcheck.Check:
    call = spec.sample_calls(CPU, torch.float32, torch.float32, 16, 8)[name]
    return route.check_kernels(call, ROWS)


@pytest.mark.parametrize("path", list(PATHS))
def test_the_check_passes_the_kernels_as_they_are(path):
    spec, name, _ = PATHS[path]
    check = _check(spec, name)
    assert check.ok, check.numbers()


@pytest.mark.parametrize("path, perturbation", [(p, q) for p, (_, _, qs) in PATHS.items() for q in qs])
def test_a_perturbed_kernel_input_fails_the_check(monkeypatch, path, perturbation):
    spec, name, _ = PATHS[path]
    wrapped = _perturb(monkeypatch, perturbation)
    check = _check(spec, name)
    assert sum(w.launches for w in wrapped) > 0, "no launch reads the perturbed input"
    assert not check.ok, check.numbers()
