"""bench/aot_compile.py: every Triton kernel builds for sm_80 and sm_90 without a GPU, spill-free.

Each build fits in shared memory, and the script's table covers every kernel, arch, input precision and
embedding size.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "aot_compile.py"
KERNELS = ("gist_fwd_kernel", "gist_bwd_rows_kernel", "gist_bwd_cols_kernel")


def test_aot_compile_all_kernels_sm80_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, f"aot_compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    header, *rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("kernel", "gist_"))]
    assert header[:3] == ["kernel", "arch", "dtype"]
    col = {name: i for i, name in enumerate(header)}
    seen = {(row[col["kernel"]], row[col["arch"]], row[col["dtype"]]) for row in rows}
    archs, dtypes = ("sm_80", "sm_90"), ("fp32", "tf32", "bf16")
    assert seen == {(k, arch, dtype) for k in KERNELS for arch in archs for dtype in dtypes}
    assert all(row[col["spill"]] == "0" for row in rows)
    sizes = {(row[col["D"]], row[col["Dg"]]) for row in rows}
    assert sizes == {("384,768,1024,4096", "384,1024")}, "every D and Dg must be covered (one binary here)"
    # tensor-core tiles of 64+ rows must use Hopper's warpgroup MMA on sm_90
    big_mma = [row for row in rows if row[col["arch"]] == "sm_90" and row[col["dtype"]] != "fp32"
               and int(row[col["tiles"]].split("x")[0]) >= 64]
    assert big_mma and all(row[col["wgmma"]] == "yes" for row in big_mma)
