"""Smoke test of bench/loss_stage.py: a tiny sweep through the real command line.

It checks the outputs' shape, never the timings: the CSV schema and one row per (provider, size),
measured rows with positive times and ordered quantiles, skip rows with a reason, the PNG, and the
markdown table printed last.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "loss_stage.py"
SCHEMA = ["impl", "op", "B", "N", "D", "Dg", "k", "dtype", "device",
          "median_ms", "p20_ms", "p80_ms", "peak_mb", "version"]
PROVIDERS = ["st", "st-cos_sim", "cgist-torch", "cgist-triton", "dense"]
SIZES = [24, 40]


def _check(out: Path, stdout: str, *, dim: int, negatives: int) -> None:
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
        assert r["version"].startswith("sentence-transformers " if r["impl"].startswith("st") else "cgist "), where
        if r["note"]:
            assert r["note"].startswith("skipped"), f"{where}: {r['note']}"
            assert not any(r[c] for c in ("median_ms", "p20_ms", "p80_ms", "peak_mb")), where
            continue
        p20, median, p80, peak = (float(r[c]) for c in ("p20_ms", "median_ms", "p80_ms", "peak_mb"))
        assert 0 < p20 <= median <= p80 and math.isfinite(p80), where
        assert peak >= 0 and math.isfinite(peak), where
    timed = {r["impl"] for r in rows if not r["note"]}
    assert timed >= {"st", "st-cos_sim", "cgist-torch", "dense"}

    png = (out / "loss_stage_cpu.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    table = stdout.rstrip().splitlines()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| B ")]
    assert table[-1].startswith("| ") and len(body) == len(rows)
    for line in body:
        if "| st |" in line and "skipped" not in line:
            assert line.split("|")[8].strip() == "1x", line  # st against itself


@pytest.mark.parametrize("dim,negatives", [(16, 1)], ids=["D16-k1"])
def test_loss_stage_smoke(tmp_path, dim, negatives):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), "--threads", "1",
           "--sizes", ",".join(map(str, SIZES)), "--dims", str(dim), "--negatives", str(negatives),
           "--repeats", "3", "--point-seconds", "0.01", "--budget", "600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(tmp_path, proc.stdout, dim=dim, negatives=negatives)
