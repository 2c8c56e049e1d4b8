"""Tests of bench/loss_stage.py (measuring), bench/loss_stage_report.py (reporting), bench/stats_overhead.py
and bench/phases.py.

The smoke tests run tiny sweeps through the real command line (the default providers, then the
Matryoshka and statistics providers, then ``--directions`` and ``--mnrl``), then ``--from-csv`` on a CSV,
and check the outputs' shape, never the timings: the CSV schema and one row per (provider, size),
measured rows with positive times and ordered quantiles, skip rows with a reason, the Matryoshka
dimensions in the notes, the PNG, and the markdown table printed last with its ratio columns (each
against its own limit) and the comparison lines under it. The other tests check that compared
providers do the same work (equal losses and gradients, against the float64 oracle for the four
directions), the bare-GEMM providers' work (their operators and flop counts), the options, and the
table's ratios on made-up rows.
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
from helpers import unmeasured
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
DIRECTIONS = ["cgist-torch", "gemm", "dir-cgist-torch", "dir-gemm"]
MNRL = ["mnrl-st", "mnrl-cgist-torch", "mnrl-gemm"]
#: Providers without "vs st" ratios (other work than the baselines').
SEPARATE = [*MATRYOSHKA, "dir-cgist-torch", "dir-gemm", *MNRL]
#: Each provider's limit, where it is not gemm.
LIMITS = {"dir-cgist-torch": "dir-gemm", "dir-gemm": "dir-gemm", **dict.fromkeys(MNRL, "mnrl-gemm")}
GIST_HEADER = "Loss stage fwd+bwd, Dg=384"
MNRL_HEADER = "Loss stage fwd+bwd, CachedMultipleNegativesRankingLoss (scale=20, cos_sim, query_to_doc, no guide)"
SIZES = [24, 40]
#: The other sweeps' one size: what they add to the first sweep's checks is per provider, not per size.
ONE_SIZE = [24]
#: Table columns after the leading "|": B, D, k, impl, median, p20-p80, peak, then these.
VS_ST, VS_COS, X_GEMM, NOTE = 8, 9, 10, 11
VERSION_PREFIX = {"st": "sentence-transformers ", "st-cos_sim": "sentence-transformers ",
                  "mat-st-cos_sim": "sentence-transformers ", "mnrl-st": "sentence-transformers ", "gemm": "torch ",
                  "dir-gemm": "torch ", "mnrl-gemm": "torch "}
ENV = unmeasured({**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
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


def _report(stdout: str, heading: str = GIST_HEADER) -> tuple[str, list[str], list[list[str]], list[str]]:
    """The report printed last, whose header line starts with ``heading``: its text from that line on, the
    table's header cells, its body rows' cells and the lines under the table."""
    paragraphs = stdout.rstrip().split("\n\n")
    at = max(i for i, p in enumerate(paragraphs) if p.startswith("| "))
    assert at >= len(paragraphs) - 2 and paragraphs[at - 1].startswith(heading), paragraphs[at - 1]
    header, rule, *body = paragraphs[at].splitlines()
    assert set(rule) <= set("|-:")
    under = paragraphs[at + 1].splitlines() if at + 1 < len(paragraphs) else []
    return "\n\n".join(paragraphs[at - 1:]) + "\n", _cells(header), [_cells(line) for line in body], under


def _cells(line: str) -> list[str]:
    """A markdown table line split at "|": cell i of the table is item i + 1."""
    return [c.strip() for c in line.split("|")]


def _check(out: Path, stdout: str, *, dim: int, negatives: int, providers=PROVIDERS, stem="loss_stage_cpu",
           dims_note="", heading=GIST_HEADER, sizes=SIZES) -> tuple[list[list[str]], list[str]]:
    """Check a sweep's CSV, PNG and report; return the table's body cells and the lines under it.

    ``sizes``: the batch sizes swept. ``dims_note`` is the note of the Matryoshka providers' measured rows (and the end of their skip notes).
    """
    with (out / f"{stem}.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[: len(SCHEMA)] == SCHEMA
        assert reader.fieldnames[len(SCHEMA):] == ["note"]
        rows = list(reader)
    assert sorted((r["impl"], int(r["B"])) for r in rows) == sorted((p, b) for p in providers for b in sizes)
    timed = set()
    for r in rows:
        where = f"{r['impl']} B={r['B']}"
        guide_dim = "0" if r["impl"] in MNRL else "384"  # the mnrl-* providers have no guide
        assert (r["op"], r["N"], r["D"], r["Dg"], r["k"], r["dtype"], r["device"]) == (
            "fwd+bwd", r["B"], str(dim), guide_dim, str(negatives), "float32", "cpu"), where
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
    limits = {LIMITS.get(p, "gemm") for p in providers}
    assert {(limit, b) for limit in limits for b in sizes} <= timed

    png = (out / f"{stem}.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    text, header, body, under = _report(stdout, heading)
    assert header[VS_ST:NOTE + 1] == ["vs st", "vs st-cos_sim", "x gemm", "note"]
    assert len(body) == len(rows)
    assert [(int(c[1]), c[4]) for c in body] == [(b, p) for b in sizes for p in providers]  # size, then provider
    for c in body:
        if (c[4], int(c[1])) not in timed:
            assert c[NOTE].startswith("skipped") and c[VS_ST] == c[VS_COS] == c[X_GEMM] == "", c
            continue
        assert c[NOTE] == (dims_note if c[4] in MATRYOSHKA else ""), c
        # every limit is timed at every size; a cell against another limit than gemm names it
        limit = LIMITS.get(c[4])
        times = re.fullmatch(r"([0-9.]+)x" + (f" {limit}" if limit else ""), c[X_GEMM])
        assert times and float(times.group(1)) > 0, c
        if c[4] in SEPARATE:
            assert c[VS_ST] == c[VS_COS] == "", c  # other work than the baselines'
        for column, impl in ((VS_ST, "st"), (VS_COS, "st-cos_sim"), (X_GEMM, "gemm")):
            if c[4] == impl:
                assert c[column] == "1x", c  # a provider against itself
        if c[4] == limit:
            assert c[X_GEMM] == f"1x {limit}", c
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
                "--sizes", ",".join(map(str, ONE_SIZE)), "--dims", str(dim), "--negatives", "1",
                "--providers", ",".join(reversed(EXTRA)), "--matryoshka-dims", "4,16",
                "--repeats", "3", "--point-seconds", "0.01", "--budget", "600")
    _, under = _check(tmp_path, proc.stdout, dim=dim, negatives=1, providers=EXTRA,
                      dims_note="matryoshka_dims=16,4", sizes=ONE_SIZE)
    speedup = r"mat-fused at B={}, D=16, k=1 \(matryoshka_dims=16,4\): [0-9.]+x (faster|slower) than mat-loop, " \
              r"[0-9.]+x (faster|slower) than mat-st-cos_sim"
    overhead = r"statistics overhead at B={}, D=16, k=1: [+-][0-9]+\.[0-9]% " \
               r"\(cgist-torch [0-9.]+ ms, cgist-torch-nostats [0-9.]+ ms\)"
    chunks = r"mini-batches, node and hand-back overhead at B={}, D=16, k=1: [+-][0-9]+\.[0-9]% " \
             r"\(cgist-torch [0-9.]+ ms, cgist-torch-core [0-9.]+ ms\)"
    assert len(under) == 3 * len(ONE_SIZE), under
    for line, pattern in zip(under, [p.format(b) for b in ONE_SIZE for p in (speedup, overhead, chunks)]):
        assert re.fullmatch(pattern, line), (line, pattern)


@pytest.mark.parametrize("comparison", ["directions", "mnrl"])
def test_loss_stage_directions_and_mnrl_smoke(tmp_path, comparison):
    """--directions: both loss stages, each over its own bare GEMMs, side by side under the table;
    --mnrl: the drop-in's speed-up over sentence-transformers under it."""
    proc = _run("--device", "cpu", "--out", str(tmp_path), "--threads", "1", f"--{comparison}",
                "--sizes", ",".join(map(str, ONE_SIZE)), "--dims", "16", "--negatives", "1",
                "--repeats", "3", "--point-seconds", "0.01", "--budget", "600")
    providers, heading = (DIRECTIONS, GIST_HEADER) if comparison == "directions" else (MNRL, MNRL_HEADER)
    _, under = _check(tmp_path, proc.stdout, dim=16, negatives=1, providers=providers,
                      stem=f"loss_stage_cpu_{comparison}", heading=heading, sizes=ONE_SIZE)
    if comparison == "directions":
        pattern = r"loss stage over its bare GEMMs at B={}, D=16, k=1: cgist-torch [0-9.]+x gemm, " \
                  r"dir-cgist-torch [0-9.]+x dir-gemm"
    else:
        pattern = r"mnrl-cgist-torch at B={}, D=16, k=1: [0-9.]+x (faster|slower) than mnrl-st"
    assert len(under) == len(ONE_SIZE), under
    for line, b in zip(under, ONE_SIZE):
        assert re.fullmatch(pattern.format(b), line), (line, pattern)


@pytest.mark.parametrize("negatives", [0, 1], ids=["k0", "k1"])
def test_compared_providers_do_the_same_work(bench, negatives):
    """mat-fused, mat-loop and mat-st-cos_sim: the same Matryoshka loss and gradients; cgist-torch,
    cgist-torch-nostats and cgist-torch-core (on the whole columns): the same loss and gradients; mnrl-st and
    mnrl-cgist-torch (no guide): the same loss and gradients."""
    loss_stage, _ = bench
    student, guide = loss_stage.common.make_embeddings(40, 56, 24, 12, negatives, seed=3)
    groups = {("mat-fused", "mat-loop", "mat-st-cos_sim"): (24, 12, 5), ("cgist-torch", "cgist-torch-nostats"): (),
              ("mnrl-st", "mnrl-cgist-torch"): ()}
    for impls, dims in groups.items():
        results = []
        for impl in impls:
            reps = loss_stage.common.split_leaves(student, loss_stage.MINI_BATCH_SIZE)
            reps_guided = (None if impl in loss_stage.UNGUIDED
                           else loss_stage.common.split_detached(guide, loss_stage.MINI_BATCH_SIZE))
            loss = loss_stage.make_step(impl, dims)(reps, reps_guided)
            results.append((impl, loss, [torch.cat([leaf.grad for leaf in col]) for col in reps]))
        if impls[0] == "cgist-torch":
            loss, grads, _ = loss_stage.core_step(student, guide)()
            results.append((loss_stage.CORE, loss, grads))
        (first, loss0, grads0), *rest = results
        for impl, loss, grads in rest:
            torch.testing.assert_close(loss, loss0, rtol=1e-5, atol=1e-6, msg=f"{impl} vs {first}: loss")
            for col, (g, g0) in enumerate(zip(grads, grads0)):
                # float32 with temperature 0.01 (0.05 for mnrl-*): gradients of order 1/temperature, compared on
                # that scale
                torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-5 * float(g0.abs().max()),
                                           msg=f"{impl} vs {first}: column {col}")


@pytest.mark.parametrize("negatives", [0, 1, 2], ids=["k0", "k1", "k2"])
def test_four_directions_provider_is_the_oracle_loss(bench, negatives):
    """dir-cgist-torch: the float64 oracle's loss and gradients over all four directions in one softmax, with the
    guide's mask, and not the one-direction loss."""
    from cgist.stage.reference import gist_loss_reference
    from cgist.stage.spec.options import GistOptions

    loss_stage, _ = bench
    student, guide = loss_stage.common.make_embeddings(40, 56, 24, 12, negatives, seed=3)
    reps = loss_stage.common.split_leaves(student, loss_stage.MINI_BATCH_SIZE)
    reps_guided = loss_stage.common.split_detached(guide, loss_stage.MINI_BATCH_SIZE)
    loss = loss_stage.make_step("dir-cgist-torch")(reps, reps_guided)
    options = GistOptions(margin=loss_stage.MARGIN, contrast_anchors=False, contrast_positives=False,
                          directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"))
    exact = [c.double().requires_grad_() for c in student]
    expected = gist_loss_reference(exact, [g.double() for g in guide], options)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for col, (leaves, x) in enumerate(zip(reps, exact)):
        g, g0 = torch.cat([leaf.grad for leaf in leaves]).double(), x.grad
        torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-5 * float(g0.abs().max()), msg=f"column {col}")
    one = gist_loss_reference([c.double() for c in student], [g.double() for g in guide],
                              options.replace(directions=("query_to_doc",)))
    assert abs(float(one) - float(expected.detach())) > 1e-3


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
    for name, providers in (("directions", DIRECTIONS), ("mnrl", MNRL)):
        args = loss_stage.parse_args([f"--{name}", "--quick", "--sizes", "1024,4096"])
        assert args.providers == providers and loss_stage.output_stem(args) == f"loss_stage_cpu_quick_{name}"
        assert {(p.impl, p.Dg) for p in loss_stage.build_points(args)} == {
            (impl, 0 if impl in MNRL else 384) for impl in providers}
    for argv in (["--matryoshka", "--providers", "gemm"], ["--providers", "st", "--matryoshka-dims", "8"],
                 ["--directions", "--mnrl"], ["--matryoshka", "--directions"], ["--mnrl", "--providers", "mnrl-st"],
                 ["--matryoshka", "--dims", "24,8", "--matryoshka-dims", "16"],
                 ["--matryoshka", "--matryoshka-dims", "8,8"], ["--providers", "mat-loops"]):
        with pytest.raises(SystemExit):
            loss_stage.parse_args(argv)


#: ``gemm_step``'s score blocks per limit provider: (queries, keys) with "a" the anchors, "p" the positives 0..B-1,
#: keys 0 the anchors, 1 the positives, 2.. the negatives (two negative columns here).
BLOCKS = {
    "gemm": [("a", 1), ("a", 0), ("p", 1), ("a", 2), ("a", 3)],  # AP, AA, PP, AN_1, AN_2
    "dir-gemm": [("a", 1), ("a", 2), ("a", 3), ("a", 0), ("p", 0), ("p", 1), ("p", 2), ("p", 3)],  # QD, QQ, DQ, DD
    "mnrl-gemm": [("a", 1), ("a", 2), ("a", 3)],  # query-to-document
}


@pytest.mark.parametrize("impl", ["gemm", "dir-gemm", "mnrl-gemm"])
@pytest.mark.parametrize("batch,n_cand,negatives,rows", [(40, 72, 2, 16), (24, 24, 0, 256)])
def test_gemm_step_runs_the_loss_stage_gemms_only(bench, impl, batch, n_cand, negatives, rows):
    """Each limit: the student's and (but for mnrl-gemm) the guide's score products and the two gradient products
    of every score block of its loss stage, and nothing else."""
    loss_stage, _ = bench
    dim, guide_dim = 8, 12
    blocks = [b for b in BLOCKS[impl] if b[1] < 2 + negatives]
    assert loss_stage.score_blocks(2 + negatives, loss_stage.GEMMS[impl]) == blocks
    student, guide = loss_stage.common.make_embeddings(batch, n_cand, dim, guide_dim, negatives)
    guided = impl not in loss_stage.UNGUIDED
    call = loss_stage.gemm_step(student, guide if guided else None, directions=loss_stage.GEMMS[impl], rows=rows)

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
    columns = sum(batch if key == 0 else n_cand for _, key in blocks)
    counts = {str(op): n for op, n in flops.get_flop_counts()["Global"].items()}
    assert counts == {"aten.mm": 2 * batch * columns * (dim + guide_dim * guided),
                      "aten.addmm": 4 * batch * columns * dim}
    if impl == "gemm":
        assert columns == n_cand + batch + n_cand + negatives * n_cand  # AP, AA, PP, AN_1..AN_k
    elif impl == "dir-gemm":
        assert columns == 2 * (1 + negatives) * n_cand + 2 * batch  # QD and DD over every document, QQ and DQ


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


def test_table_own_limits_and_headers(bench):
    """A provider against its own limit (named in the cell), the beside line, and the header of an MNRL-only table."""
    _, report = bench
    legend = report.Legend(order=("st", "cgist-torch", "gemm", "dir", "dir-gemm", "mnrl-st", "mnrl", "mnrl-gemm"),
                           baselines=("st",), limit="gemm", featured=(), header="gist", title="gist plot",
                           separate=("dir", "dir-gemm", "mnrl-st", "mnrl", "mnrl-gemm"),
                           speedups=(("mnrl", ("mnrl-st",)),),
                           limits=(("dir", "dir-gemm"), ("mnrl-st", "mnrl-gemm"), ("mnrl", "mnrl-gemm")),
                           beside=(("over its GEMMs", ("cgist-torch", "dir")),),
                           headers=((("mnrl-st", "mnrl", "mnrl-gemm"), "mnrl table", "mnrl plot"),))

    def row(impl, b, ms):
        return dict(impl=impl, B=b, D=8, k=1, note="", median_ms=ms, p20_ms=ms, p80_ms=ms, peak_mb=1.0)

    rows = [row("st", 64, 100.0), row("cgist-torch", 64, 25.0), row("gemm", 64, 20.0), row("dir", 64, 39.0),
            row("dir-gemm", 64, 30.0), row("cgist-torch", 128, 80.0), row("gemm", 128, 64.0), row("dir", 128, 120.0)]
    cells = {(int(c[1]), c[4]): c for c in map(_cells, report.markdown_table(rows, legend).splitlines()[2:])}
    assert cells[64, "cgist-torch"][VS_ST:VS_ST + 2] == ["4x", "1.25x"]
    assert cells[64, "dir"][VS_ST:VS_ST + 2] == ["", "1.3x dir-gemm"]
    assert cells[64, "dir-gemm"][VS_ST:VS_ST + 2] == ["", "1x dir-gemm"]
    assert cells[128, "dir"][VS_ST:VS_ST + 2] == ["", ""]  # no dir-gemm row at B=128
    assert report.comparisons(rows, legend) == [
        "over its GEMMs at B=64, D=8, k=1: cgist-torch 1.25x gemm, dir 1.3x dir-gemm"]  # none at 128: no dir-gemm
    assert legend.heading([r["impl"] for r in rows]) == ("gist", "gist plot")
    mnrl = [row("mnrl-st", 64, 500.0), row("mnrl", 64, 20.0), row("mnrl-gemm", 64, 16.0)]
    cells = {c[4]: c for c in map(_cells, report.markdown_table(mnrl, legend).splitlines()[2:])}
    assert [cells[impl][VS_ST + 1] for impl in ("mnrl-st", "mnrl", "mnrl-gemm")] == [
        "31.2x mnrl-gemm", "1.25x mnrl-gemm", "1x mnrl-gemm"]
    assert report.comparisons(mnrl, legend) == ["mnrl at B=64, D=8, k=1: 25x faster than mnrl-st"]
    slower = [row("mnrl-st", 64, 20.0), row("mnrl", 64, 50.0)]
    assert report.comparisons(slower, legend) == ["mnrl at B=64, D=8, k=1: 2.5x slower than mnrl-st"]
    assert legend.heading([r["impl"] for r in mnrl]) == ("mnrl table", "mnrl plot")
    assert legend.heading([r["impl"] for r in mnrl + rows]) == ("gist", "gist plot")


def test_stats_overhead_smoke():
    """bench/stats_overhead.py runs a few pairs and reports both medians and the paired difference."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "stats_overhead.py"), "--batch", "48", "--dim", "16",
                           "--pairs", "3", "--threads", "1"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.fullmatch(r"B=48, D=Dg=16, k=1, 3 alternating pairs on cpu \(1 threads\): with statistics ([\d.]+) ms, "
                         r"without ([\d.]+) ms, medians [+-][\d.]+%, median paired difference [+-][\d.]+%\n", proc.stdout)
    assert match and all(float(v) > 0 for v in match.groups()), proc.stdout



def test_loss_stage_without_matplotlib_names_the_command_that_installs_it(tmp_path):
    """Before measuring anything: one line naming ``pip install "cgist[bench]"``, exit 2, no traceback."""
    from test_install import SITECUSTOMIZE

    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**ENV, "CGIST_HIDDEN_MODULES": "matplotlib",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), ENV.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "loss_stage.py"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines() == [
        "loss_stage: error: bench/loss_stage.py's plot needs the matplotlib package, which is not installed; install "
        'it with: pip install "cgist[bench]"']
    assert not (tmp_path / "out").exists()


def test_options_cost_smoke():
    """bench/options_cost.py times each drop-in's options, unchanged and after an assignment, and one loss stage."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "options_cost.py"), "--calls", "20", "--batch", "32",
                           "--dim", "32"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:4]]
    assert [r[0] for r in rows] == ["FusedCachedGISTLoss", "FusedCachedMultipleNegativesRankingLoss",
                                    "FusedCachedMultipleNegativesSymmetricRankingLoss"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), proc.stdout
    assert re.fullmatch(r"one loss-stage call, B = N = 32, D = 32, k = 1: [\d.]+ ms", proc.stdout.splitlines()[4])


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


# The plain losses (--plain) -------------------------------------------------------------------------------------

PLAIN_PAIRS = [("plain-gist-st", "plain-gist-cgist"), ("plain-mnrl-st", "plain-mnrl-cgist"),
               ("plain-msrl-st", "plain-msrl-cgist"), ("plain-mat-gist-st", "plain-mat-gist-cgist")]


@pytest.mark.parametrize("negatives", [0, 1], ids=["k0", "k1"])
def test_plain_providers_do_the_same_work(bench, negatives):
    """Each plain drop-in and sentence-transformers' class (each column one leaf, the models stand-ins that hand back
    the bench's embeddings): the same loss and gradients, also under MatryoshkaLoss."""
    loss_stage, _ = bench
    student, guide = loss_stage.common.make_embeddings(40, 40, 24, 12, negatives, seed=5)
    for pair in PLAIN_PAIRS:
        dims = (24, 12, 6) if "mat" in pair[0] else ()
        results = []
        for impl in pair:
            reps = loss_stage.common.split_leaves(student, 40)
            reps_guided = None if impl in loss_stage.UNGUIDED else loss_stage.common.split_detached(guide, 40)
            if "msrl" in impl:  # the symmetric losses take pairs
                reps, reps_guided = reps[:2], None
            loss = loss_stage.make_step(impl, dims)(reps, reps_guided)
            results.append((loss, [leaf.grad for column in reps for leaf in column]))
        (want, want_grads), (got, grads) = results
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{pair}: loss")
        for g, g0 in zip(grads, want_grads):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-5 * float(g0.abs().max()), msg=f"{pair}: gradients")


def test_loss_stage_plain_smoke(tmp_path):
    """--plain: every plain provider and limit measured, each drop-in's speed-up over sentence-transformers' class
    under the table."""
    proc = _run("--device", "cpu", "--out", str(tmp_path), "--threads", "1", "--plain", "--sizes", "24",
                "--dims", "16", "--negatives", "1", "--matryoshka-dims", "16,8", "--repeats", "3",
                "--point-seconds", "0.01", "--budget", "600")
    with (tmp_path / "loss_stage_cpu_plain.csv").open(newline="") as f:
        rows = {r["impl"]: r for r in csv.DictReader(f)}
    assert set(rows) == {impl for pair in PLAIN_PAIRS for impl in pair} | {"gemm", "mnrl-gemm", "msrl-gemm"}
    assert all(float(r["median_ms"]) > 0 for r in rows.values()), rows
    assert {impl for impl, r in rows.items() if r["Dg"] == "0"} == {"plain-mnrl-st", "plain-mnrl-cgist",
                                                                   "plain-msrl-st", "plain-msrl-cgist", "mnrl-gemm",
                                                                   "msrl-gemm"}
    for st, ours in PLAIN_PAIRS:
        assert re.search(rf"^{ours} at B=24, D=16, k=1.*: [0-9.]+x (faster|slower) than {st}$", proc.stdout, re.M), \
            proc.stdout
