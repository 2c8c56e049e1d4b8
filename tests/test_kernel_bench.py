"""bench/kernel_bench.py, the GPU check's measuring script: its counting model, and bench/gpu_check.sh run end to end on
the CPU standing in for an H100.

The run goes through the real command lines under a simulated sm_90 (CGIST_SIMULATE_DEVICE) at a tiny size (the
numbers mean nothing there, and the files say so) and checks that every figure the check must report is in its CSV:
the calibrations, the tie ids both ways, each block's kernels, the totals with their estimates and the autotuner's
pick, the loss stage with its peak memory, the references at small B, and the summary.
The counting model is checked against the hand count that motivated the GEMM backward (128 x 64 tiles, B = 64k,
bf16, H200): forward ~135 ms.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import unmeasured

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import kernel_bench

    return kernel_bench


def test_estimates_reproduce_the_hand_count(bench):
    tiles = {"BLOCK_M": 128, "BLOCK_N": 64}
    scores = 65536 * 65536 * 4  # AP, AA, PP and one AN block
    ms, bound = bench.estimate("fwd", scores, 768, 384, torch.bfloat16, torch.bfloat16, tiles, 8192, bench.SPEC)
    assert bound == "l2" and ms == pytest.approx(135, rel=0.03)


def test_the_gemm_backward_meets_the_target_by_count(bench):
    """By count, bf16 at B = 64k: the GEMM backward with 128 x 128 tiles meets the 250 ms target."""
    rows = {(r["impl"], r["op"]): r["median_ms"] for r in bench.paper_estimates(65536, 768, 384, 1, "bf16")}
    assert rows["estimate/gemm", "fwd+bwd"] <= 250


def test_matryoshka_estimate_counts_each_dimension(bench):
    """One dimension given as ``dims`` is the one-dimension count; five add the second sweep and the segment GEMMs."""
    tiles = {"BLOCK_M": 64, "BLOCK_N": 64}
    args = (65536 * 65536 * 4, 768, 384, torch.bfloat16, torch.bfloat16, tiles, 1536, bench.SPEC)
    dims = bench.matryoshka_dims(768)
    assert dims == (64, 128, 256, 512, 768)
    for kernel in ("fwd", "score_grad", "gemms"):
        assert bench.estimate(kernel, *args, dims=(768,)) == bench.estimate(kernel, *args)
    # both L2-bound at 64 x 64: the second sweep reads the student prefixes up to 512 again
    (one, one_bound), (five, five_bound) = (bench.estimate("score_grad", *args, dims=d) for d in (None, dims))
    assert one_bound == five_bound == "l2"
    assert five / one == pytest.approx((2 * (768 + 512) + 2 * 384) / (2 * 768 + 2 * 384))
    # the segments cover D once: more than one pair of GEMMs (the narrow ones read F at HBM speed), far below five
    gemms_one, gemms_five = (bench.estimate("gemms", *args, dims=d)[0] for d in (None, dims))
    assert gemms_one < gemms_five < 2 * gemms_one


def test_paper_estimates_give_the_matryoshka_ratio(bench):
    rows = {(r["impl"], r["op"]): r for r in bench.paper_estimates(65536, 768, 384, 1, "bf16", (64, 128, 256, 512, 768))}
    one, five = rows["estimate/gemm", "fwd+bwd"], rows["estimate/gemm-mat5", "fwd+bwd"]
    assert f"vs_one_dim={five['median_ms'] / one['median_ms']:.2f}" in five["note"]
    assert "tiles=64x64x64" in five["note"]  # the Matryoshka tiles (a second tile in the score-gradient kernel)
    assert five["median_ms"] == pytest.approx(sum(rows["estimate/gemm-mat5", k]["median_ms"]
                                                  for k in ("fwd", "score_grad", "gemms")))


def test_four_direction_estimate_is_the_per_entry_cost_times_its_entries(bench):
    """The four directions in one softmax (B = N = 64k, k = 1, bf16, GEMM backward): six B x B blocks, the ones the
    loss runs, each entry costing what a query-to-document entry costs in each kernel."""
    from cgist.stage.spec.options import GistOptions

    batch, k = 65536, 1
    rows = {(r["impl"], r["op"]): r for r in bench.paper_estimates(batch, 768, 384, k, "bf16",
                                                                    directions=bench.DIRECTIONS)}
    groups, _, _ = GistOptions(contrast_anchors=False, contrast_positives=False,
                               directions=bench.DIRECTIONS).column_groups(2 + k)
    assert [g.name for g in groups] == ["ap", "an", "qq", "dq", "dd", "dd"]  # the blocks block_columns counts
    assert bench.block_columns(batch, k, bench.DIRECTIONS) == [batch] * len(groups)
    entries = batch * batch * len(groups)
    total = 0.0
    for kernel in ("fwd", "score_grad", "gemms"):
        row = rows["estimate/gemm-dir4", kernel]
        tiles = dict(zip(("BLOCK_M", "BLOCK_N"), map(int, row["note"].split("tiles=")[1].split("x")[:2])))
        chunk_rows = int(row["note"].split("chunk_rows=")[1])
        per_entry, _ = bench.estimate(kernel, 1.0, 768, 384, torch.bfloat16, torch.bfloat16, tiles, chunk_rows,
                                      bench.SPEC)
        assert row["median_ms"] == pytest.approx(per_entry * entries)
        assert row["median_ms"] == pytest.approx(rows["estimate/gemm", kernel]["median_ms"] * 6 / 4)  # AP, AA, PP, AN
        total += row["median_ms"]
    four = rows["estimate/gemm-dir4", "fwd+bwd"]
    assert four["median_ms"] == pytest.approx(total) and "vs_gist=1.50" in four["note"]


def test_the_gpu_check_runs_end_to_end_under_a_simulated_sm_90(tmp_path):
    """bench/gpu_check.sh, the script that will first meet a GPU, from its first line to its last on the CPU standing
    in for an H100 (at a tiny size; the tests collected, not run): its exit status, the doctor's verdict, the warm-ups,
    and every figure the check must report, each file marked as simulated."""
    # the script runs `python`: this interpreter's, whether or not its environment is activated
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = unmeasured({**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--simulate", "sm_90"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-4000:])
    assert (tmp_path / "device.txt").read_text().startswith("SIMULATED: sm_90 on the CPU")
    doctor = (tmp_path / "doctor.txt").read_text()
    assert "device: cpu simulating NVIDIA H100 80GB HBM3 (sm_90)" in doctor
    assert "verdict: ok: the kernels agree with the PyTorch path under the Triton interpreter" in doctor
    assert " tests collected" in (tmp_path / "tests.txt").read_text()
    assert all("warm: " in (tmp_path / f"warmup_{pair}.log").read_text() for pair in ("bf16", "fp32", "bf16+fp32"))
    assert (tmp_path / "gpu_check.txt").read_text().startswith("SIMULATED: cpu simulating NVIDIA H100 80GB HBM3 "
                                                                "(sm_90), simulated: the kernels ran under the Triton")
    with (tmp_path / "gpu_check.csv").open() as f:
        rows = list(csv.DictReader(f))
    ops = {(r["impl"], r["op"]) for r in rows}
    assert {("torch.mm", "gemm 32^3"), ("copy", "d2d 1MiB"), ("l2-read", "64KiB x2")} <= ops
    assert {("tie-ids torch.unique", "ids"), ("tie-ids fingerprint", "ids")} <= ops
    assert all("same partition=True" in r["note"] for r in rows if r["impl"].startswith("tie-ids"))
    for kind in ("ap", "aa", "pp", "an"):
        assert {("triton/gemm", f"fwd {kind}"), ("triton/gemm", f"bwd {kind} score-grad"),
                ("triton/gemm", f"bwd {kind} gemms")} <= ops
    total = next(r for r in rows if r["impl"] == "triton/gemm" and r["op"] == "fwd+bwd")
    assert "est=" in total["note"] and "pick=" in total["note"] and "est_peak=" in total["note"]
    assert float(total["median_ms"]) > 0
    for kind in ("ap", "aa", "pp", "an"):  # Matryoshka (five dimensions), GEMM backward
        assert {("triton/gemm-mat5", f"fwd {kind}"), ("triton/gemm-mat5", f"bwd {kind} score-grad"),
                ("triton/gemm-mat5", f"bwd {kind} gemms")} <= ops
    assert ("triton/gemm-mat5", "fwd+bwd") in ops
    assert "target: 5 Matryoshka dims <= 1.6x one dimension (fp32, B=24)" in proc.stdout
    # the four directions by count, beside one, at the CPU measurement's shape
    estimates = {r["impl"]: r for r in rows if r["op"] == "fwd+bwd" and r["impl"].startswith("estimate/")}
    assert set(estimates) == {"estimate/gemm", "estimate/gemm-dir4"}
    assert all((r["B"], r["D"], r["Dg"]) == ("4096", "384", "384") for r in estimates.values())
    assert "vs_gist=" in estimates["estimate/gemm-dir4"]["note"]
    assert {("streaming", "fwd+bwd"), ("sentence-transformers", "fwd+bwd")} <= ops
    assert all("measured/est=" in r["note"] for r in rows if r["impl"].startswith("triton/") and " " in r["op"])
    assert all(r["device"] == "cpu simulating NVIDIA H100 80GB HBM3 (sm_90), simulated" for r in rows)
    assert "target: bf16" not in proc.stdout and "loss stage fwd+bwd (D=16, Dg=8, k=1)" in proc.stdout
