"""Tests of bench/loss_stage.py (measuring), bench/loss_stage_report.py (reporting), bench/stats_overhead.py
and bench/phases.py.

The smoke tests run tiny sweeps through the real command line (the default providers, then the
Matryoshka and statistics providers), then ``--from-csv`` on a CSV, and check the outputs' shape,
never the timings: the CSV schema and one row per (provider, size), measured rows with positive times
and ordered quantiles, skip rows with a reason, the Matryoshka dimensions in the notes, the PNG, and
the markdown table printed last with its ratio columns and the comparison lines under it. The other
tests check that compared providers do the same work (equal losses and gradients), the ``gemm``
provider's work (its operators and flop count), the options, and the table's ratios on made-up rows.
"""

import csv
import math
import os
import re
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
#: The providers of the second smoke test, in table order.
EXTRA = ["cgist-torch", "cgist-torch-nostats", "cgist-torch-core", "mat-st-cos_sim", "mat-loop", "mat-fused", "gemm"]
MATRYOSHKA = ["mat-st-cos_sim", "mat-loop", "mat-fused"]
SIZES = [24, 40]
#: Table columns after the leading "|": B, D, k, impl, median, p20-p80, peak, then these.
VS_ST, VS_COS, X_GEMM, NOTE = 8, 9, 10, 11
VERSION_PREFIX = {"st": "sentence-transformers ", "st-cos_sim": "sentence-transformers ",
                  "mat-st-cos_sim": "sentence-transformers ", "gemm": "torch "}
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


def _report(stdout: str) -> tuple[str, list[str], list[list[str]], list[str]]:
    """The report printed last: its text from the header line on, the table's header cells, its body
    rows' cells and the lines under the table."""
    paragraphs = stdout.rstrip().split("\n\n")
    at = max(i for i, p in enumerate(paragraphs) if p.startswith("| "))
    assert at >= len(paragraphs) - 2 and paragraphs[at - 1].startswith("Loss stage fwd+bwd, Dg=384")
    header, rule, *body = paragraphs[at].splitlines()
    assert set(rule) <= set("|-:")
    under = paragraphs[at + 1].splitlines() if at + 1 < len(paragraphs) else []
    return "\n\n".join(paragraphs[at - 1:]) + "\n", _cells(header), [_cells(line) for line in body], under


def _cells(line: str) -> list[str]:
    """A markdown table line split at "|": cell i of the table is item i + 1."""
    return [c.strip() for c in line.split("|")]


def _check(out: Path, stdout: str, *, dim: int, negatives: int, providers=PROVIDERS, stem="loss_stage_cpu",
           dims_note="") -> tuple[list[list[str]], list[str]]:
    """Check a sweep's CSV, PNG and report; return the table's body cells and the lines under it.

    ``dims_note`` is the note of the Matryoshka providers' measured rows (and the end of their skip notes).
    """
    with (out / f"{stem}.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[: len(SCHEMA)] == SCHEMA
        assert reader.fieldnames[len(SCHEMA):] == ["note"]
        rows = list(reader)
    assert sorted((r["impl"], int(r["B"])) for r in rows) == sorted((p, b) for p in providers for b in SIZES)
    timed = set()
    for r in rows:
        where = f"{r['impl']} B={r['B']}"
        assert (r["op"], r["N"], r["D"], r["Dg"], r["k"], r["dtype"], r["device"]) == (
            "fwd+bwd", r["B"], str(dim), "384", str(negatives), "float32", "cpu"), where
        assert r["version"].startswith(VERSION_PREFIX.get(r["impl"], "cgist ")), where
        note = r["note"].removesuffix(f"; {dims_note}") if r["impl"] in MATRYOSHKA else r["note"]
        if note != (dims_note if r["impl"] in MATRYOSHKA else ""):
            assert note.startswith("skipped"), f"{where}: {r['note']}"
            assert not any(r[c] for c in ("median_ms", "p20_ms", "p80_ms", "peak_mb")), where
            continue
        timed.add((r["impl"], int(r["B"])))
        p20, median, p80, peak = (float(r[c]) for c in ("p20_ms", "median_ms", "p80_ms", "peak_mb"))
        assert 0 < p20 <= median <= p80 and math.isfinite(p80), where
        assert peak >= 0 and math.isfinite(peak), where
    assert {impl for impl, _ in timed} >= set(providers) - {"cgist-triton"}
    assert {("gemm", b) for b in SIZES} <= timed

    png = (out / f"{stem}.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    text, header, body, under = _report(stdout)
    assert header[VS_ST:NOTE + 1] == ["vs st", "vs st-cos_sim", "x gemm", "note"]
    assert len(body) == len(rows)
    assert [(int(c[1]), c[4]) for c in body] == [(b, p) for b in SIZES for p in providers]  # size, then provider
    for c in body:
        if (c[4], int(c[1])) not in timed:
            assert c[NOTE].startswith("skipped") and c[VS_ST] == c[VS_COS] == c[X_GEMM] == "", c
            continue
        assert c[NOTE] == (dims_note if c[4] in MATRYOSHKA else ""), c
        assert c[X_GEMM].endswith("x") and float(c[X_GEMM][:-1]) > 0, c  # gemm is timed at every size
        if c[4] in MATRYOSHKA:
            assert c[VS_ST] == c[VS_COS] == "", c  # other work than the baselines'
        for column, impl in ((VS_ST, "st"), (VS_COS, "st-cos_sim"), (X_GEMM, "gemm")):
            if c[4] == impl:
                assert c[column] == "1x", c  # a provider against itself
    assert (out / f"{stem}.md").read_text() == text  # header line, table, the lines under it
    return body, under


@pytest.mark.parametrize("dim,negatives", [(16, 1)], ids=["D16-k1"])
def test_loss_stage_smoke(tmp_path, dim, negatives):
    proc = _run("--device", "cpu", "--out", str(tmp_path), "--threads", "1",
                "--sizes", ",".join(map(str, SIZES)), "--dims", str(dim), "--negatives", str(negatives),
                "--repeats", "3", "--point-seconds", "0.01", "--budget", "600")
    body, under = _check(tmp_path, proc.stdout, dim=dim, negatives=negatives)
    assert under == []  # no Matryoshka or statistics-free providers to compare

    csv_path = tmp_path / "loss_stage_cpu.csv"
    written = csv_path.read_bytes()
    (tmp_path / "loss_stage_cpu.png").unlink()
    (tmp_path / "loss_stage_cpu.md").unlink()
    redrawn = _run("--from-csv", str(csv_path), "--threads", "1")
    assert csv_path.read_bytes() == written and f"wrote {csv_path}" not in redrawn.stdout
    again, _ = _check(tmp_path, redrawn.stdout, dim=dim, negatives=negatives)
    # the same rows and notes; ratios may differ in the last digit (the CSV keeps 3 decimals)
    assert [c[1:5] + c[NOTE:] for c in again] == [c[1:5] + c[NOTE:] for c in body]


def test_loss_stage_matryoshka_and_statistics_smoke(tmp_path):
    dim = 16
    proc = _run("--device", "cpu", "--out", str(tmp_path), "--threads", "1",
                "--sizes", ",".join(map(str, SIZES)), "--dims", str(dim), "--negatives", "1",
                "--providers", ",".join(reversed(EXTRA)), "--matryoshka-dims", "4,16",
                "--repeats", "3", "--point-seconds", "0.01", "--budget", "600")
    _, under = _check(tmp_path, proc.stdout, dim=dim, negatives=1, providers=EXTRA,
                      dims_note="matryoshka_dims=16,4")
    speedup = r"mat-fused at B={}, D=16, k=1 \(matryoshka_dims=16,4\): [0-9.]+x faster than mat-loop, " \
              r"[0-9.]+x faster than mat-st-cos_sim"
    overhead = r"statistics overhead at B={}, D=16, k=1: [+-][0-9]+\.[0-9]% " \
               r"\(cgist-torch [0-9.]+ ms, cgist-torch-nostats [0-9.]+ ms\)"
    chunks = r"mini-batches, checks and hand-back overhead at B={}, D=16, k=1: [+-][0-9]+\.[0-9]% " \
             r"\(cgist-torch [0-9.]+ ms, cgist-torch-core [0-9.]+ ms\)"
    assert len(under) == 3 * len(SIZES), under
    for line, pattern in zip(under, [p.format(b) for b in SIZES for p in (speedup, overhead, chunks)]):
        assert re.fullmatch(pattern, line), (line, pattern)


@pytest.mark.parametrize("negatives", [0, 1], ids=["k0", "k1"])
def test_compared_providers_do_the_same_work(bench, negatives):
    """mat-fused, mat-loop and mat-st-cos_sim: the same Matryoshka loss and gradients; cgist-torch,
    cgist-torch-nostats and cgist-torch-core (on the whole columns): the same loss and gradients."""
    loss_stage, _ = bench
    student, guide = loss_stage.common.make_embeddings(40, 56, 24, 12, negatives, seed=3)
    groups = {("mat-fused", "mat-loop", "mat-st-cos_sim"): (24, 12, 5), ("cgist-torch", "cgist-torch-nostats"): ()}
    for impls, dims in groups.items():
        results = []
        for impl in impls:
            reps = loss_stage.common.split_leaves(student, loss_stage.MINI_BATCH_SIZE)
            reps_guided = loss_stage.common.split_detached(guide, loss_stage.MINI_BATCH_SIZE)
            loss = loss_stage.make_step(impl, dims)(reps, reps_guided)
            results.append((impl, loss, [torch.cat([leaf.grad for leaf in col]) for col in reps]))
        if not dims:
            loss, grads, _ = loss_stage.core_step(student, guide)()
            results.append((loss_stage.CORE, loss, grads))
        (first, loss0, grads0), *rest = results
        for impl, loss, grads in rest:
            torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6, msg=f"{impl} vs {first}: loss")
            for col, (g, g0) in enumerate(zip(grads, grads0)):
                # float32 with temperature 0.01: gradients of order 1/0.01, compared on that scale
                torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-5 * float(g0.abs().max()),
                                           msg=f"{impl} vs {first}: column {col}")


def test_options(bench):
    loss_stage, _ = bench
    args = loss_stage.parse_args(["--matryoshka", "--dims", "96,10"])
    assert args.providers == MATRYOSHKA + ["gemm"] and loss_stage.output_stem(args) == "loss_stage_cpu_matryoshka"
    dims = {(p.impl, p.D): p.matryoshka_dims for p in loss_stage.build_points(args)}
    assert dims == {**{(m, 96): (96, 48, 24, 12) for m in MATRYOSHKA}, **{(m, 10): (10, 5, 2, 1) for m in MATRYOSHKA},
                    ("gemm", 96): (), ("gemm", 10): ()}
    args = loss_stage.parse_args(["--providers", "mat-loop,cgist-torch", "--dims", "24", "--matryoshka-dims", "8,24"])
    assert {(p.impl, p.matryoshka_dims) for p in loss_stage.build_points(args)} == {
        ("mat-loop", (24, 8)), ("cgist-torch", ())}  # largest first
    assert loss_stage.output_stem(args) == "loss_stage_cpu"
    assert loss_stage.parse_args([]).providers == PROVIDERS
    for argv in (["--matryoshka", "--providers", "gemm"], ["--providers", "st", "--matryoshka-dims", "8"],
                 ["--matryoshka", "--dims", "24,8", "--matryoshka-dims", "16"],
                 ["--matryoshka", "--matryoshka-dims", "8,8"], ["--providers", "mat-loops"]):
        with pytest.raises(SystemExit):
            loss_stage.parse_args(argv)


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
    assert report.comparisons(rows, legend) == []


def test_table_comparisons(bench):
    _, report = bench
    legend = report.Legend(order=("st", "cgist-torch", "nostats", "mat-st", "mat-loop", "mat-fused", "gemm"),
                           baselines=("st",), limit="gemm", featured=(), header="h", title="t",
                           separate=("mat-st", "mat-loop", "mat-fused"),
                           speedups=(("mat-fused", ("mat-loop", "mat-st")),),
                           overheads=(("statistics", "cgist-torch", "nostats"),))
    dims = "matryoshka_dims=8,4"

    def row(impl, b, ms=None, note=""):
        values = dict(median_ms=ms, p20_ms=ms, p80_ms=ms, peak_mb=1.0) if ms else dict.fromkeys(
            ("median_ms", "p20_ms", "p80_ms", "peak_mb"), "")
        return dict(impl=impl, B=b, D=8, k=1, note=note, **values)

    rows = [row("st", 64, 400.0), row("cgist-torch", 64, 10.5), row("nostats", 64, 10.0), row("gemm", 64, 2.0),
            row("mat-st", 64, 400.0, dims), row("mat-loop", 64, 35.0, dims), row("mat-fused", 64, 10.0, dims),
            row("mat-loop", 128, note=f"skipped: over budget; {dims}"), row("mat-fused", 128, 30.0, dims),
            row("mat-st", 128, 1200.0, dims), row("cgist-torch", 128, 40.0), row("nostats", 128, note="skipped")]
    cells = {(int(c[1]), c[4]): c for c in map(_cells, report.markdown_table(rows, legend).splitlines()[2:])}
    assert cells[64, "cgist-torch"][VS_ST:VS_ST + 3] == ["38.1x", "5.25x", ""]  # one baseline: x gemm comes next
    assert cells[64, "mat-fused"][VS_ST:VS_ST + 3] == ["", "5x", dims]  # timed, with a note; no "vs st"
    assert cells[128, "mat-loop"][VS_ST:VS_ST + 3] == ["", "", f"skipped: over budget; {dims}"]
    assert report.comparisons(rows, legend) == [
        f"mat-fused at B=64, D=8, k=1 ({dims}): 3.5x faster than mat-loop, 40x faster than mat-st",
        "statistics overhead at B=64, D=8, k=1: +5.0% (cgist-torch 10.5 ms, nostats 10.0 ms)",
        f"mat-fused at B=128, D=8, k=1 ({dims}): 40x faster than mat-st",
    ]


def test_stats_overhead_smoke():
    """bench/stats_overhead.py runs a few pairs and reports both medians and the paired difference."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "stats_overhead.py"), "--batch", "48", "--dim", "16",
                           "--pairs", "3", "--threads", "1"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.fullmatch(r"B=48, D=Dg=16, k=1, 3 alternating pairs on cpu \(1 threads\): with statistics ([\d.]+) ms, "
                         r"without ([\d.]+) ms, medians [+-][\d.]+%, median paired difference [+-][\d.]+%\n", proc.stdout)
    assert match and all(float(v) > 0 for v in match.groups()), proc.stdout



def test_phases_smoke():
    """bench/phases.py times every phase of the streaming call (each wrapper is reached) beside the GEMMs."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "phases.py"), "--batch", "48", "--dim", "16",
                           "--calls", "2", "--threads", "1"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header, rule, *rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert _cells(header)[1:-1] == ["B", "call", "GEMMs", "call / GEMMs", "set-up", "row blocks", "gradients", "rest"]
    assert len(rows) == 1 and _cells(rows[0])[1] == "48"
    call, gemm = (float(c) for c in _cells(rows[0])[2:4])
    phases = [float(re.fullmatch(r"([\d.]+) \(\d+%\)", c).group(1)) for c in _cells(rows[0])[5:8]]
    assert call > 0 and gemm > 0 and all(p > 0 for p in phases), rows[0]
