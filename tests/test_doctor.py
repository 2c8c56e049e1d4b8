"""``cgist doctor`` on this CPU machine: without the interpreter, under it, with kernels made to disagree, and simulating
every device docs/devices.md names (``--simulate``, ``CGIST_SIMULATE_DEVICE``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
from test_selfcheck import _wrong_count

import cgist.stage.triton.dense  # noqa: F401 - imported while conftest's TRITON_INTERPRET=1 holds, so interpreted
from cgist import compat
from cgist.cli import main
from cgist.cli.doctor import sentence_transformers_line
from cgist.stage import devices


def _doctor(capsys) -> tuple[int, list[str]]:
    status = main(["doctor"])
    return status, capsys.readouterr().out.splitlines()


def test_doctor_without_the_interpreter_says_what_it_checked(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status, lines = _doctor(capsys)
    assert status == 0
    assert lines[0].startswith("device: cpu; torch ")
    installed = compat.installed_version("sentence-transformers")
    assert lines[1].startswith(f"sentence-transformers {installed}: in the tested range (tested: "
                               f"{compat.SENTENCE_TRANSFORMERS_OLDEST} to {compat.NEWEST_TESTED}")
    assert lines[2] == 'backend "auto" per dtype pair (student, guide):'
    assert [line.split()[0] for line in lines[3:7]] == ["fp32", "bf16", "fp16", "bf16"]
    assert all(" torch " in line for line in lines[3:7])
    assert any(line.startswith("kernels: not run (cpu tensors; TRITON_INTERPRET=1 cgist doctor") for line in lines)
    assert any(line.startswith("loss stage, forward and backward (B=N=1024") and "bare GEMMs" in line for line in lines)
    assert lines[-1].startswith("verdict: ok: the PyTorch path runs on cpu; the Triton kernels were not checked")


#: The checks the doctor runs under the interpreter: every score's kernels (both MaxSim paths), fp64 and fp32.
CHECKED = [f"{name} {dtype}" for name in ("dense", "maxsim", "maxsim, guided", "xtr") for dtype in ("fp64", "fp32")]


def _checked(lines: list[str], verdict: str) -> list[str]:
    """The names of the checks whose line says ``verdict`` (``agree``, ``DISAGREE``), in the doctor's order."""
    names = [line.split(f" {verdict}: ")[0].strip() for line in lines if f" {verdict}: loss " in line]
    return sorted(names, key=lambda name: (name.split()[-1], name))


def test_doctor_under_the_interpreter_compares_every_scores_kernels(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, lines = _doctor(capsys)
    assert status == 0, "\n".join(lines)
    assert _checked(lines, "agree") == sorted(CHECKED, key=lambda name: (name.split()[-1], name))
    assert lines[-1].startswith("verdict: ok: the kernels agree with the PyTorch path under the Triton interpreter "
                                "(8 checks: ")


def test_doctor_fails_when_the_kernels_disagree(capsys, monkeypatch):
    """Dense kernels whose loss is 1% off and that miscount one masked entry: the doctor says which checks disagree,
    with the numbers (the count's both ways), and exits 1; the other scores' kernels still agree."""
    from cgist.stage.triton import dense as triton_dense

    loss = triton_dense.ForwardState.loss
    monkeypatch.setattr(triton_dense.ForwardState, "loss", lambda self: loss(self) * 1.01)
    _wrong_count(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, lines = _doctor(capsys)
    assert status == 1
    disagree = [line for line in lines if " DISAGREE: " in line]
    assert [line.split(" DISAGREE")[0].strip() for line in disagree] == ["dense fp64", "dense fp32"]
    for line in disagree:
        assert " DISAGREE: loss 1.0e-02, " in line
        kernels, torch_path = map(int, re.search(r"mask counts masked_an (\d+) vs (\d+) \(", line).groups())
        assert kernels == torch_path + 1
    assert len(_checked(lines, "agree")) == len(CHECKED) - 2
    assert lines[-1].startswith("verdict: FAIL: the kernels disagree with the PyTorch path under the Triton "
                                "interpreter for dense fp64, dense fp32; train with backend='torch'")


@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_doctor_refuses_a_missing_device(capsys, device):
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is present")
    assert main(["doctor", "--device", device]) == 2
    assert "CUDA is not available on this machine" in capsys.readouterr().err


@pytest.mark.parametrize("version, says", [
    ("6.2.0", "6.2.0: in the tested range"), ("6.3.0", "6.3.0: in the tested range"),
    ("6.4.0", "6.4.0: newer than the newest tested (6.3.0)"), ("7.0.0", "7.0.0: beyond the supported range"),
    ("6.1.0", "6.1.0: older than supported: import cgist fails"),
])
def test_doctor_says_which_release_a_result_belongs_to(version, says, monkeypatch):
    monkeypatch.setattr(compat, "NEWEST_TESTED", "6.3.0")
    monkeypatch.setattr(compat, "installed_version", lambda distribution: version)
    line = sentence_transformers_line()
    assert line.startswith(f"sentence-transformers {says}")
    rule = "always excluded" if compat.release_rules(version).self_pairs_excluded else "left to the guide"
    assert f"GIST self-pairs {rule}" in line


def test_doctor_says_when_sentence_transformers_is_missing(monkeypatch):
    """Without sentence-transformers the doctor says what still works; the rules are then the newest release's."""
    monkeypatch.setattr(compat, "installed_version", lambda distribution: None)
    assert sentence_transformers_line().startswith("sentence-transformers: not installed (tested: ")
    assert sentence_transformers_line().endswith("the drop-ins need it, gist_loss does not")
    assert compat.tested_range_status() == "not installed"
    compat.release_rules.cache_clear()
    try:
        assert compat.release_rules() is compat.NEWEST_RULES
    finally:
        compat.release_rules.cache_clear()


def test_an_installed_version_of_a_missing_distribution_is_none():
    assert compat.installed_version("cgist-no-such-distribution") is None


def test_doctor_names_a_missing_triton(monkeypatch):
    from cgist.cli.doctor import _describe_device

    monkeypatch.setitem(sys.modules, "triton", None)
    assert _describe_device(torch.device("cpu")).endswith(", triton not installed")


def test_doctor_names_a_score_without_kernels(capsys, monkeypatch):
    """A score that registers no Triton backend is named, not checked (the checks: the registry's other scores)."""
    from cgist.stage.spec import scores

    torch_only = dataclasses.replace(scores.DENSE, backends={"torch": scores.DENSE.backend("torch")})
    monkeypatch.setattr(scores, "SCORES", [torch_only])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, lines = _doctor(capsys)
    assert status == 0
    assert "  dense                    no Triton kernels: the PyTorch path" in lines
    assert not any(" agree: " in line for line in lines)


def test_doctor_cannot_simulate_after_the_kernels_were_compiled_for_a_gpu(capsys, monkeypatch):
    """In a process whose kernels were imported without the interpreter, ``--simulate`` says to start a new one."""
    from cgist.stage.triton import tiles

    monkeypatch.setattr(tiles, "INTERPRET", False)
    assert main(["doctor", "--simulate", "sm_90"]) == 2
    assert "--simulate: the Triton kernels were imported without the interpreter in this process" in \
        capsys.readouterr().err
    assert os.environ.get(devices.SIMULATE_ENV) is None


# Every device docs/devices.md names, simulated ----------------------------------------------------------------------

#: The backend "auto" takes on each simulated device (every dtype pair), and why.
ROUTES = {"sm_70": "torch", "sm_75": "torch", "rocm": "torch", "mps": "torch"}


@pytest.mark.parametrize("arch", list(devices.SIMULATED))
def test_doctor_shows_what_a_simulated_device_would_run(capsys, arch):
    """``cgist doctor --simulate ARCH``: the device as it would be read, "auto"'s route and tiles per dtype pair, and
    where "auto" takes the kernels, the first-use check of every score's kernels, all agreeing; exit 0."""
    sim = devices.SIMULATED[arch]
    status = main(["doctor", "--simulate", arch])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0, "\n".join(lines)
    assert lines[0].startswith(f"device: cpu simulating {sim.name} (")
    backend = ROUTES.get(arch, "triton")
    routes = lines[3:7]
    assert [line.split()[0] for line in routes] == ["fp32", "bf16", "fp16", "bf16"]
    assert all(f" {backend} " in line for line in routes)
    if backend == "triton":
        assert all("; tiles dense " in line and "; token scores Q" in line for line in routes)
        assert _checked(lines, "agree") == sorted(CHECKED, key=lambda name: (name.split()[-1], name))
        assert lines[-1].startswith(f"verdict: ok: the kernels agree with the PyTorch path under the Triton "
                                    f"interpreter, cpu simulating {sim.name}")
    else:
        assert not any(" agree: " in line for line in lines)
        assert any(line.startswith("kernels: not run (") for line in lines)
        assert lines[-1].startswith("verdict: ok: the PyTorch path runs")
    assert "loss stage timing: not measured (a simulated device's time would be the CPU's)" in lines
    assert os.environ.get(devices.SIMULATE_ENV) is None  # the simulation ends with the doctor


def test_doctor_simulates_from_the_environment_in_a_new_process():
    """``CGIST_SIMULATE_DEVICE=rocm cgist doctor``, as a user runs it: the simulated device, "auto"'s route there."""
    env = {**os.environ, devices.SIMULATE_ENV: "rocm", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "cgist", "doctor"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("device: cpu simulating AMD Instinct MI300X (ROCm)")
    assert "kernels: not run (ROCm: the Triton kernels are untested on AMD GPUs)" in lines


@pytest.mark.parametrize("argv, error", [
    (["--simulate", "sm_91"], "argument --simulate: invalid choice: 'sm_91'"),
    (["--simulate", "sm_90", "--device", "cuda"], "--simulate: a simulated device's tensors are the CPU's"),
])
def test_doctor_refuses_a_bad_simulation(capsys, argv, error):
    with pytest.raises(SystemExit) if "invalid choice" in error else contextlib.nullcontext():
        assert main(["doctor", *argv]) == 2
    assert error in capsys.readouterr().err
