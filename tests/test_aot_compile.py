"""bench/aot_compile.py: every Triton kernel builds for every architecture the tiles know, without a GPU, spill-free.

One run of the script over the architectures of the tile tables (sm_75 to sm_120; sm_86 and sm_89, whose builds
every release's compile summary holds, left out: ``LIVE_ARCHS``) for the two operand kinds at
the ends of the tables: bf16 (2-byte operands, the largest tiles) and fp32 at "highest" (tf32x3, operands split in
registers, and the backward's tf32x3 GEMM from sm_80 on), with the Matryoshka configuration of five dimensions, and
the MaxSim kernels at 32 and 128 query tokens of 128 features. It must cover every kernel, arch, pair and embedding
size, with exactly the tile configs the launcher's ``tile_configs`` (``gemm_configs`` for the GEMM,
``cgist.stage.triton.maxsim.launch_configs`` for the MaxSim kernels) can pick there. Each build fits the
arch's shared memory and the tables' estimate. The SASS shows the tensor cores: HMMA (mma.sync) on sm_80 to sm_89
and sm_120, warpgroup MMA (HGMMA) on sm_90, where the 128 x 128 tiles are, tcgen05 (UTCHMMA) on sm_100 (HMMA for
the MaxSim kernels there, whose tiles have 32 rows), and none on sm_75, where ``tl.dot`` is FMA loops.

The script's full default table (sm_70 too, and the tf32, fp16 and mixed bf16/fp32 pairs: about 500 binaries) is
more than the test suite's time allows; ``python bench/aot_compile.py`` runs it, and
``bench/results/aot_compile.txt`` holds its last output, with a hash of what it was built from that
tests/test_triton_versions.py checks against the sources.
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import unmeasured

pytest.importorskip("triton")

from cgist.stage.devices import arch_for  # noqa: E402
from cgist.stage.triton.common import input_precision  # noqa: E402
from cgist.stage.triton.maxsim import KERNELS as MAXSIM_KERNELS  # noqa: E402
from cgist.stage.triton.maxsim import launch_configs  # noqa: E402
from cgist.stage.triton.maxsim import shared_memory_estimate as maxsim_shared_memory_estimate  # noqa: E402
from cgist.stage.triton.tiles import gemm_configs, tile_configs  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "aot_compile.py"
#: The kernels, each built with the configs the forward autotunes over (the score-gradient kernel reuses its pick).
KERNELS = ("gist_fwd_kernel", "gist_score_grad_kernel")
MATRYOSHKA_KERNELS = ("gist_fwd_kernel", "gist_score_grad_kernel")
#: The backward's tf32x3 GEMM, one row per use (``F @ x``, ``F^T @ x``), where the student's products are tf32x3.
GEMM_KERNELS = ("tf32x3_addmm_kernel(F)", "tf32x3_addmm_kernel(F^T)")
#: Student and guide dtypes, and the fp32 matmul precision of each pair.
PAIRS = {"fp32": (torch.float32, torch.float32, "highest"), "tf32": (torch.float32, torch.float32, "high"),
         "bf16": (torch.bfloat16, torch.bfloat16, "highest"), "fp16": (torch.float16, torch.float16, "highest"),
         "bf16+fp32": (torch.bfloat16, torch.float32, "highest"), "bf16+tf32": (torch.bfloat16, torch.float32, "high")}
MATRYOSHKA_PAIRS = ("fp32", "tf32", "bf16", "bf16+fp32", "bf16+tf32")
#: Every architecture of the tile tables, and the pairs at the ends of the tables.
CHECKED_ARCHS = (75, 80, 86, 89, 90, 100, 120)
CHECKED_PAIRS = ("bf16", "fp32")
#: What this test compiles: every architecture but sm_86 and sm_89, whose builds (mma.sync, as sm_80's and sm_120's)
#: every release's compile summary holds, each checked spill-free against the launcher's configs
#: (tests/test_triton_versions.py), as the full table, bench/results/aot_compile.txt, holds every one's.
LIVE_ARCHS = (75, 80, 90, 100, 120)
#: The tensor-core opcode each arch's SASS must show: none below sm_80, where ``tl.dot`` is FMA loops ("?": the
#: wheel's nvdisasm no longer reads sm_70).
MMA_OPCODE = {"sm_70": "?", "sm_75": "-", "sm_80": "HMMA", "sm_86": "HMMA", "sm_89": "HMMA", "sm_90": "HGMMA",
              "sm_100": "UTCHMMA", "sm_120": "HMMA"}
#: The MaxSim kernels' products are tiles of 32 query tokens: mma.sync (HMMA) from sm_80 on, sm_90 and sm_100
#: included (warpgroup MMA and tcgen05 take 64 rows and more).
MAXSIM_MMA_OPCODE = {**MMA_OPCODE, "sm_90": "HMMA", "sm_100": "HMMA"}
#: The query lengths and the feature dimension the MaxSim kernels are built for (ColBERT's shapes), and the document
#: length (past one chunk of tokens).
MAXSIM_LQ = (32, 128)
MAXSIM_D = 128
MAXSIM_LD = 256
#: The default table's architectures, by name.
ARCH = {f"sm_{a}": arch_for(divmod(a, 10)) for a in CHECKED_ARCHS}


def _operands(arch: str, pair: str) -> tuple:
    """``(dtype, precision, guide_dtype, guide_precision)`` of a pair as the launcher passes them on this arch."""
    dtype, guide_dtype, matmul = PAIRS[pair]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        return dtype, input_precision(dtype, ARCH[arch]), guide_dtype, input_precision(guide_dtype, ARCH[arch])
    finally:
        torch.set_float32_matmul_precision(previous)


def _names(configs) -> set[str]:
    """Tile configs as the table writes them."""
    return {"{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}" for c in configs}


def launcher_tiles(arch: str, pair: str, n_dims: int, release: tuple[int, int] | None = None) -> set[str]:
    """The configs the launcher can run a kernel with on this arch under Triton ``release`` (None: the running one),
    as the table writes them."""
    return _names(tile_configs(*_operands(arch, pair), n_dims, ARCH[arch], interpret=False, release=release))


def maxsim_launches(arch: str, pair: str, lq: int) -> list[dict]:
    """The launch of each MaxSim kernel on this arch for a pair's student dtype, by kernel name: MaxSim's, and the
    slab kernels' XTR variants."""
    dtype, _, matmul = PAIRS[pair]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        return [launch_configs(dtype, ARCH[arch], lq, MAXSIM_LD, MAXSIM_D, xtr=xtr) for xtr in (False, True)]
    finally:
        torch.set_float32_matmul_precision(previous)


def maxsim_tiles(arch: str, pair: str, lq: int) -> dict[str, set[str]]:
    """``maxsim_launches`` as the table writes them (``LQ`` aside)."""
    launches = maxsim_launches(arch, pair, lq)
    return {name: {each[name].tiles for each in launches} for name in launches[0]}


def parse_table(lines: list[str]) -> list[dict]:
    """The rows of a table printed by bench/aot_compile.py, each a dict by column."""
    header, *table = [line.split() for line in lines if line.startswith(("kernel ", "gist_", "tf32x3_", "maxsim_"))]
    assert header == ["kernel", "arch", "dtype", "tiles", "dims", "D", "Dg", "regs", "stack", "spill", "smem", "est",
                      "wgmma", "mma"]
    assert all(len(r) == len(header) for r in table)
    return [dict(zip(header, r)) for r in table]


def tiles_seen(rows: list[dict]) -> dict[tuple, set]:
    """``(kernel, arch, pair, dims)`` -> the configs a table built it with; for a MaxSim kernel
    ``(kernel, arch, pair, "LQ<n>")`` for each query length its binary serves."""
    seen: dict[tuple, set] = {}
    for r in rows:
        for pair in r["dtype"].split(","):
            if r["kernel"] in MAXSIM_KERNELS:
                lengths, tiles = r["tiles"].split("-", 1)
                for lq in lengths.removeprefix("LQ").split(","):
                    seen.setdefault((r["kernel"], r["arch"], pair, f"LQ{lq}"), set()).add(tiles)
                continue
            seen.setdefault((r["kernel"], r["arch"], pair, r["dims"]), set()).add(r["tiles"])
    return seen


def tiles_wanted(archs, pairs, release: tuple[int, int] | None = None) -> dict[tuple, set]:
    """What ``tiles_seen`` must give for a table of these archs (names) and pairs under Triton ``release``."""
    want = {(k, a, pair, "1"): launcher_tiles(a, pair, 1, release) for k in KERNELS for a in archs for pair in pairs}
    want |= {(k, a, pair, "5"): launcher_tiles(a, pair, 5, release)
             for k in MATRYOSHKA_KERNELS for a in archs for pair in pairs if pair in MATRYOSHKA_PAIRS}
    want |= {(k, a, pair, "1"): _names(gemm_configs(ARCH[a], interpret=False))
             for k in GEMM_KERNELS for a in archs for pair in pairs if _operands(a, pair)[1] == "tf32x3"}
    # the MaxSim kernels: one launch each (the launcher's tables do not part by Triton release)
    want |= {(k, a, pair, f"LQ{lq}"): tiles for a in archs for pair in pairs for lq in MAXSIM_LQ
             for k, tiles in maxsim_tiles(a, pair, lq).items()}
    return want


def test_aot_compile_every_kernel_for_every_arch():
    env = unmeasured({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    command = [sys.executable, str(SCRIPT), "--arch", *map(str, LIVE_ARCHS), "--dtypes", *CHECKED_PAIRS]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    assert proc.returncode == 0, f"aot_compile failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    rows = parse_table(lines)

    # exactly the configs the launcher can pick under this Triton, for every kernel, arch, pair and dimension count
    live = [f"sm_{a}" for a in LIVE_ARCHS]
    assert tiles_seen(rows) == tiles_wanted(live, CHECKED_PAIRS)
    sizes = {(r["D"], r["Dg"]) for r in rows if r["dims"] == "1" and r["kernel"] in KERNELS}
    assert sizes == {("384,768,1024,4096", "384,1024")}, "every D and Dg must be covered (one binary here)"
    assert {(r["D"], r["Dg"]) for r in rows if r["kernel"] in GEMM_KERNELS} == {("384,768,1024,4096", "-")}

    for r in rows:
        assert r["spill"] == "0", r
        assert int(r["smem"]) <= min(ARCH[r["arch"]].shared_bytes, int(r["est"])), r
        if r["kernel"] in MAXSIM_KERNELS:  # mma.sync from sm_80 on, at D = 128
            assert MAXSIM_MMA_OPCODE[r["arch"]] in r["mma"].split("+"), r
            assert r["wgmma"] == ("no" if r["arch"] == "sm_90" else "n/a"), r
            assert (r["dims"], r["D"], r["Dg"]) == ("1", str(MAXSIM_D), "-"), r
            continue
        # tensor cores from sm_80 on, and warpgroup MMA on sm_90 (where every tile has 64+ rows)
        assert MMA_OPCODE[r["arch"]] in r["mma"].split("+"), r
        assert r["wgmma"] == ("yes" if r["arch"] == "sm_90" else "n/a"), r
    # the MaxSim launcher's estimate, computed in this process for each launch the table built, is the table's
    for r in (r for r in rows if r["kernel"] in MAXSIM_KERNELS):
        lengths, tiles = r["tiles"].split("-", 1)
        for pair, lq in itertools.product(r["dtype"].split(","), lengths.removeprefix("LQ").split(",")):
            estimates = {maxsim_shared_memory_estimate(each[r["kernel"]], PAIRS[pair][0])
                         for each in maxsim_launches(r["arch"], pair, int(lq)) if each[r["kernel"]].tiles == tiles}
            assert estimates == {int(r["est"])}, r
    big = {(r["kernel"], r["dtype"]) for r in rows if r["arch"] == "sm_90" and r["tiles"].startswith("128x128")}
    # not tf32x3 (but for its GEMM, whose operands are split before it loads them)
    assert big == {(k, "bf16") for k in KERNELS} | {(k, "fp32") for k in GEMM_KERNELS}

    summaries = [line for line in lines if line.startswith("sm_")]
    assert [line.split(":")[0] for line in summaries] == live
    assert all(", max spill 0 B," in line for line in summaries)
