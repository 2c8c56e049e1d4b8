"""Tests of bench/loss_stage.py (measuring) and bench/loss_stage_report.py (reporting).

The smoke test runs a tiny sweep through the real command line, then ``--from-csv`` on its CSV, and
checks the outputs' shape, never the timings: the CSV schema and one row per (provider, size),
measured rows with positive times and ordered quantiles, skip rows with a reason, the PNG, and the
markdown table printed last with its ratio columns. The other tests check the ``gemm`` provider's
work (its operators and flop count) and the table's ratios on made-up rows.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "loss_stage.py"
SCHEMA = ["impl", "op", "B", "N", "D", "Dg", "k", "dtype", "device",
          "median_ms", "p20_ms", "p80_ms", "peak_mb", "version"]
PROVIDERS = ["st", "st-cos_sim", "cgist-torch", "cgist-triton", "dense", "gemm"]
SIZES = [24, 40]
#: Table columns after the leading "|": B, D, k, impl, median, p20-p80, peak, then these.
VS_ST, VS_COS, X_GEMM, NOTE = 8, 9, 10, 11
VERSION_PREFIX = {"st": "sentence-transformers ", "st-cos_sim": "sentence-transformers ", "gemm": "torch "}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
ENV.pop("TRITON_INTERPRET", None)


@pytest.fixture()
def bench(monkeypatch):
    """The bench modules, imported from bench/ as the script imports them."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import loss_stage
    import loss_stage_report

    return loss_stage, loss_stage_report


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _table(stdout: str) -> tuple[list[str], list[list[str]]]:
    """The printed table (which must come last): its header cells and its body rows' cells."""
    lines = stdout.rstrip().splitlines()
    assert lines[-1].startswith("| ")
    start = max(i for i, line in enumerate(lines) if not line.startswith("|")) + 1
    header, rule, *body = lines[start:]
    assert set(rule) <= set("|-:")
    return _cells(header), [_cells(line) for line in body]


def _cells(line: str) -> list[str]:
    """A markdown table line split at "|": cell i of the table is item i + 1."""
    return [c.strip() for c in line.split("|")]


def _check(out: Path, stdout: str, *, dim: int, negatives: int) -> list[list[str]]:
    with (out / "loss_stage_cpu.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[: len(SCHEMA)] == SCHEMA
        assert reader.fieldnames[len(SCHEMA):] == ["note"]
        rows = list(reader)
    assert sorted((r["impl"], int(r["B"])) for r in rows) == sorted((p, b) for p in PROVIDERS for b in SIZES)
    for r in rows:
        where = f"{r['impl']} B={r['B']}"
        assert (r["op"], r["N"], r["D"], r["Dg"], r["k"], r["dtype"], r["device"]) == (
            "fwd+bwd", r["B"], str(dim), "384", str(negatives), "float32", "cpu"), where
        assert r["version"].startswith(VERSION_PREFIX.get(r["impl"], "cgist ")), where
        if r["note"]:
            assert r["note"].startswith("skipped"), f"{where}: {r['note']}"
            assert not any(r[c] for c in ("median_ms", "p20_ms", "p80_ms", "peak_mb")), where
            continue
        p20, median, p80, peak = (float(r[c]) for c in ("p20_ms", "median_ms", "p80_ms", "peak_mb"))
        assert 0 < p20 <= median <= p80 and math.isfinite(p80), where
        assert peak >= 0 and math.isfinite(peak), where
    timed = {(r["impl"], int(r["B"])) for r in rows if not r["note"]}
    assert {impl for impl, _ in timed} >= {"st", "st-cos_sim", "cgist-torch", "dense", "gemm"}
    assert {("gemm", b) for b in SIZES} <= timed

    png = (out / "loss_stage_cpu.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    header, body = _table(stdout)
    assert header[VS_ST:NOTE + 1] == ["vs st", "vs st-cos_sim", "x gemm", "note"]
    assert len(body) == len(rows)
    assert [(int(c[1]), c[4]) for c in body] == [(b, p) for b in SIZES for p in PROVIDERS]  # size, then provider
    for c in body:
        if c[NOTE]:
            assert c[VS_ST] == c[VS_COS] == c[X_GEMM] == "", c
            continue
        assert c[X_GEMM].endswith("x") and float(c[X_GEMM][:-1]) > 0, c  # gemm is timed at every size
        for column, impl in ((VS_ST, "st"), (VS_COS, "st-cos_sim"), (X_GEMM, "gemm")):
            if c[4] == impl:
                assert c[column] == "1x", c  # a provider against itself
    md = (out / "loss_stage_cpu.md").read_text()
    assert md == "\n\n".join(stdout.rstrip().split("\n\n")[-2:]) + "\n"  # header line and table
    return body


@pytest.mark.parametrize("dim,negatives", [(16, 1)], ids=["D16-k1"])
def test_loss_stage_smoke(tmp_path, dim, negatives):
    proc = _run("--device", "cpu", "--out", str(tmp_path), "--threads", "1",
                "--sizes", ",".join(map(str, SIZES)), "--dims", str(dim), "--negatives", str(negatives),
                "--repeats", "3", "--point-seconds", "0.01", "--budget", "600")
    body = _check(tmp_path, proc.stdout, dim=dim, negatives=negatives)

    csv_path = tmp_path / "loss_stage_cpu.csv"
    written = csv_path.read_bytes()
    (tmp_path / "loss_stage_cpu.png").unlink()
    (tmp_path / "loss_stage_cpu.md").unlink()
    redrawn = _run("--from-csv", str(csv_path), "--threads", "1")
    assert csv_path.read_bytes() == written and f"wrote {csv_path}" not in redrawn.stdout
    again = _check(tmp_path, redrawn.stdout, dim=dim, negatives=negatives)
    # the same rows and notes; ratios may differ in the last digit (the CSV keeps 3 decimals)
    assert [c[1:5] + c[NOTE:] for c in again] == [c[1:5] + c[NOTE:] for c in body]


@pytest.mark.parametrize("batch,n_cand,negatives,rows", [(40, 72, 2, 16), (24, 24, 0, 256)])
def test_gemm_step_runs_the_loss_stage_gemms_only(bench, batch, n_cand, negatives, rows):
    loss_stage, _ = bench
    dim, guide_dim = 8, 12
    student, guide = loss_stage.common.make_embeddings(batch, n_cand, dim, guide_dim, negatives)
    call = loss_stage.gemm_step(student, guide, rows=rows)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops, FlopCounterMode(display=False) as flops:
        call()
    assert ops.seen == {"aten.mm.out", "aten.addmm.out"}
    columns = n_cand + batch + n_cand + negatives * n_cand  # AP, AA, PP, AN_1..AN_k
    counts = {str(op): n for op, n in flops.get_flop_counts()["Global"].items()}
    assert counts == {"aten.mm": 2 * batch * columns * (dim + guide_dim), "aten.addmm": 4 * batch * columns * dim}


def test_table_ratios(bench):
    _, report = bench
    legend = report.Legend(order=("st", "st-cos_sim", "cgist-torch", "gemm"), baselines=("st", "st-cos_sim"),
                           limit="gemm", featured=("cgist-torch",), header="h", title="t")

    def row(impl, b, ms=None, note=""):
        if ms is None:
            values = dict.fromkeys(("median_ms", "p20_ms", "p80_ms", "peak_mb"), "")
        else:
            values = dict(median_ms=ms, p20_ms=ms, p80_ms=ms, peak_mb=1.0)
        return dict(impl=impl, B=b, D=8, k=1, note=note, **values)

    rows = [row("gemm", 64, 10.0), row("cgist-torch", 64, 25.0), row("st", 64, 47880.0), row("st-cos_sim", 64, 100.0),
            row("cgist-torch", 128, 90.0), row("st", 128, note="skipped: over budget"), row("st-cos_sim", 128, 180.0)]
    body = report.markdown_table(rows, legend).splitlines()[2:]
    cells = {(int(c[1]), c[4]): c for c in map(_cells, body)}
    assert cells[64, "gemm"][VS_ST:NOTE] == ["4790x", "10x", "1x"]
    assert cells[64, "cgist-torch"][VS_ST:NOTE] == ["1920x", "4x", "2.5x"]
    assert cells[64, "st"][VS_ST:NOTE] == ["1x", "0.00209x", "4790x"]
    assert cells[128, "cgist-torch"][VS_ST:NOTE] == ["", "2x", ""]  # no st time, no gemm row at B=128
    assert cells[128, "st"][VS_ST:] == ["", "", "", "skipped: over budget", ""]
    assert [k for k in cells] == [(64, "st"), (64, "st-cos_sim"), (64, "cgist-torch"), (64, "gemm"),
                                  (128, "st"), (128, "st-cos_sim"), (128, "cgist-torch")]
    assert report.acceptance(rows, legend, size=(64, 8, 1)) == [
        "cgist-torch at B=64, D=8, k=1: 1920x faster than st, 4x faster than st-cos_sim; peak 1.0 MB vs 1.0 MB (st-cos_sim)"
    ]
