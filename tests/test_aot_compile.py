"""bench/aot_compile.py builds every kernel for sm_80 and sm_90 without a GPU, spill-free and within
shared memory, and its table covers every kernel, arch and dtype."""

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
    seen = {(row[0].split("[")[0], row[1], row[2]) for row in rows}
    assert seen == {(k, arch, dtype) for k in KERNELS for arch in ("sm_80", "sm_90") for dtype in ("fp32", "bf16")}
    assert all(row[header.index("spill")] == "0" for row in rows)
    sizes = {(row[header.index("D")], row[header.index("Dg")]) for row in rows}
    assert sizes == {("384,768,1024,4096", "384,1024")}, "every D and Dg must be covered (one binary here)"
