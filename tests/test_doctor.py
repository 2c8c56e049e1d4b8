"""``cgist doctor`` on this CPU machine: without the interpreter, under it, and with kernels made to disagree."""

from __future__ import annotations

import re

import pytest
from test_selfcheck import _wrong_count

import cgist.stage.triton.dense  # noqa: F401 - imported while conftest's TRITON_INTERPRET=1 holds, so interpreted
from cgist import compat
from cgist.cli import main
from cgist.cli.doctor import sentence_transformers_line


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


def test_doctor_under_the_interpreter_compares_the_kernels(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, lines = _doctor(capsys)
    assert status == 0, "\n".join(lines)
    compared = [line.split()[0] for line in lines if " agree: loss " in line]
    assert compared == ["fp64", "fp32"]
    assert lines[-1].startswith("verdict: ok: the kernels agree with the PyTorch path under the Triton interpreter")


def test_doctor_fails_when_the_kernels_disagree(capsys, monkeypatch):
    """A launcher whose loss is 1% off: the doctor says which pairs disagree and exits 1."""
    from cgist.stage.triton import dense as triton_dense

    loss = triton_dense.ForwardState.loss
    monkeypatch.setattr(triton_dense.ForwardState, "loss", lambda self: loss(self) * 1.01)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, lines = _doctor(capsys)
    assert status == 1
    assert sum(" DISAGREE: loss 1.0e-02" in line for line in lines) == 2
    assert lines[-1].startswith("verdict: FAIL: the kernels disagree with the PyTorch path on cpu for fp64, fp32")


@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_doctor_refuses_a_missing_device(capsys, device):
    if __import__("torch").cuda.is_available():
        pytest.skip("CUDA is present")
    assert main(["doctor", "--device", device]) == 2
    assert "CUDA is not available on this machine" in capsys.readouterr().err


def test_doctor_prints_the_first_use_check(capsys, monkeypatch):
    """The doctor runs the check "auto" runs (``cgist.stage.dispatch.selfcheck``): a kernel that miscounts one masked entry is
    named with both counts, its loss and gradients agreeing."""
    _wrong_count(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    status, lines = _doctor(capsys)
    assert status == 1
    (header,) = [line for line in lines if line.startswith("first-use check, ")]
    assert header.startswith("first-use check, kernels against the PyTorch path under the Triton interpreter (B=N=13, ")
    checked = [line for line in lines if "DISAGREE: loss " in line]
    assert [line.split()[0] for line in checked] == ["fp64", "fp32"]
    for line in checked:
        loss, grads = (float(line.split(word)[1].split(",")[0].split()[0]) for word in ("loss ", "gradients "))
        assert loss <= 1e-4 and grads <= 1e-4
        kernels, torch_path = map(int, re.search(r"mask counts masked_an (\d+) vs (\d+) \(", line).groups())
        assert kernels == torch_path + 1


@pytest.mark.parametrize("version, says", [
    ("6.2.0", "6.2.0: in the tested range"), ("6.3.0", "6.3.0: in the tested range"),
    ("6.4.0", "6.4.0: newer than the newest tested (6.3.0)"), ("7.0.0", "7.0.0: beyond the supported range"),
])
def test_doctor_says_which_release_a_result_belongs_to(version, says, monkeypatch):
    monkeypatch.setattr(compat, "NEWEST_TESTED", "6.3.0")
    monkeypatch.setattr(compat, "installed_version", lambda distribution: version)
    line = sentence_transformers_line()
    assert line.startswith(f"sentence-transformers {says}")
    rule = "always excluded" if compat.release_rules(version).self_pairs_excluded else "left to the guide"
    assert f"GIST self-pairs {rule}" in line
