"""bench/aot_compile.py: every Triton kernel builds for sm_80 and sm_90 without a GPU, spill-free.

Each build fits in shared memory, and the script's table covers every kernel, arch, dtype pair (fp32 at
both matmul precisions, the half types and the mixed bf16/fp32 pairs), tile config the launcher can pick
and embedding size (the script takes the configs from the launcher's ``tile_configs``), plus a Matryoshka
configuration of five dimensions. On sm_90 every tensor-core tile of 64+ rows uses warpgroup MMA.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "aot_compile.py"
KERNELS = ("gist_fwd_kernel", "gist_score_grad_kernel", "gist_bwd_rows_kernel", "gist_bwd_cols_kernel")
PAIRS = ("fp32", "tf32", "bf16", "fp16", "bf16+fp32", "bf16+tf32")
MATRYOSHKA = {("gist_fwd_kernel", pair) for pair in ("fp32", "bf16", "bf16+fp32")} | {
    ("gist_score_grad_kernel", pair) for pair in ("fp32", "bf16", "bf16+fp32")}


def test_aot_compile_all_kernels_sm80_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, f"aot_compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    header, *rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("kernel", "gist_"))]
    assert header[:3] == ["kernel", "arch", "dtype"]
    col = {name: i for i, name in enumerate(header)}
    seen = {(r[col["kernel"]], r[col["arch"]], r[col["dtype"]], r[col["dims"]]) for r in rows}
    archs = ("sm_80", "sm_90")
    want = {(k, arch, pair, "1") for k in KERNELS for arch in archs for pair in PAIRS}
    want |= {(k, arch, pair, "5") for k, pair in MATRYOSHKA for arch in archs}
    assert seen == want
    assert all(r[col["spill"]] == "0" for r in rows)
    sizes = {(r[col["D"]], r[col["Dg"]]) for r in rows if r[col["dims"]] == "1"}
    assert sizes == {("384,768,1024,4096", "384,1024")}, "every D and Dg must be covered (one binary here)"
    # the large tiles are there, and tensor-core tiles of 64+ rows use Hopper's warpgroup MMA on sm_90
    assert any(r[col["tiles"]].startswith("128x128") for r in rows if r[col["arch"]] == "sm_90")
    big_mma = [r for r in rows if r[col["arch"]] == "sm_90" and int(r[col["tiles"]].split("x")[0]) >= 64]
    assert big_mma and all(r[col["wgmma"]] == "yes" for r in big_mma)
