"""The tile configs of the GIST kernels (``cgist.kernels``): which tiles (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages)
each architecture family, operand kind and number of Matryoshka dimensions gets, under each Triton release; the
shared-memory estimate that checks a table against an architecture the tables do not know; the autotuned forward
(``tuned_fwd_kernel``) and its pruning; and the one config of the tf32x3 GEMM (``gemm_configs``). Measured per family
(spills, shared memory): ``bench/aot_compile.py`` compiles every entry and fails on a spill; its tables
(``bench/results/aot_compile*.txt``) record the result.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from cgist.kernels.gist import gist_fwd_kernel
from cgist.stage.devices import Arch, arch_for, simulated, triton_release

__all__ = [
    "ALL_CONFIGS", "DEFAULT_ARCH", "FMA_CONFIGS", "GEMM_INTERPRET_CONFIGS", "INTERPRET", "INTERPRET_CONFIGS", "TRITON",
    "SHARED_OVERHEAD", "gemm_configs", "gemm_shared_memory_estimate", "operand_kind", "pipelined_loads",
    "shared_memory_estimate", "tile_configs", "tuned_fwd_kernel",
]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: The running Triton's release, ``(major, minor)``: the tile tables part by it (``_OLDER_TRITON``).
TRITON = triton_release(triton.__version__)


def _configs(tiles) -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in tiles
    ]


#: The architecture ``tile_configs`` assumes when given none: sm_90 (H100, H200).
DEFAULT_ARCH = arch_for((9, 0))

# Tile configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by tile family (``cgist.stage.devices.Arch.family``) and operand
# kind (``operand_kind``): for each, the largest configs that every kernel using them compiles for on that
# architecture without spills and within its shared memory (bench/aot_compile.py builds each one): the forward and
# the score-gradient kernel, which reuses the forward's pick. Spills below are ptxas's bytes of spill stores.
#
# mma.sync (sm_80, 86, 89, 120) and tcgen05 (sm_100): 128 x 128 spills on 8 warps (the forward 188 to 524 B, the
# score-gradient kernel 52 to 92 B with mma.sync), and on 16 warps, where the registers are capped at 128; 128 x 64
# fits on 8 warps. tf32x3 splits its operands in registers, so it takes BLOCK_K = 16.
_MMA_HALF = [(128, 64, 64, 8, 3), (64, 64, 64, 4, 3)]
_MMA_TF32 = [(128, 64, 32, 8, 3), (64, 64, 32, 4, 3)]
_MMA_TF32X3 = [(128, 64, 16, 8, 3), (64, 64, 16, 4, 3)]
# Hopper's warpgroup MMA reads its operands from shared memory: 128 x 128 fits for half and tf32, which it takes
# unsplit (tf32x3 splits them in registers).
_WGMMA_HALF = [(128, 128, 64, 8, 3), *_MMA_HALF]
_WGMMA_TF32 = [(128, 128, 32, 8, 3), *_MMA_TF32]
# Below sm_80 Triton has no tensor-core MMA: ``tl.dot`` runs as FMA loops, whose operands and products live in
# registers. On 8 warps 64 x 32 and 32 x 32 spill (8 and 12 B in the fp32 forward); on 4 warps 64 x 32 x 16 with one
# stage fits every kernel with a half student but spills 4 to 8 B with an fp32 one, which takes 32 x 32 x 8 (a half
# ``tl.dot`` needs BLOCK_K >= 16).
_TILES = {
    (75, "fma"): [(32, 32, 8, 4, 2)],
    (75, "fma-half"): [(64, 32, 16, 4, 1)],
    **{(family, kind): tiles for family in (80, 86, 89, 90, 100, 120) for kind, tiles in (
        ("half", _WGMMA_HALF if family == 90 else _MMA_HALF), ("tf32", _WGMMA_TF32 if family == 90 else _MMA_TF32),
        ("mixed", _WGMMA_TF32 if family == 90 else _MMA_TF32), ("tf32x3", _MMA_TF32X3), ("mixed3", _MMA_TF32X3))},
    # tf32's 64 x 64 x 32 forward spills 52 B on 4 warps with 3 stages; 2 stages fit
    **{(120, kind): [(128, 64, 32, 8, 3), (64, 64, 32, 4, 2)] for kind in ("tf32", "mixed")},
    # ptxas gives sm_100's 8-warp score-gradient kernel 128 registers: 128 x 64 x 32 spills 12 B with a half
    # student, 128 x 64 x 16 8 B with an fp32 one, so the two tf32 kinds part there
    (100, "mixed"): [(128, 64, 16, 8, 3), (64, 64, 32, 4, 3)],
    # 64 x 64 x 16 on 4 warps: the forward spills 8 B on sm_86 and sm_89, the score-gradient kernel 12 B on sm_100
    **{(family, "tf32x3"): [(128, 64, 16, 8, 3)] for family in (86, 89, 100)},
    (80, "mixed3"): [(64, 64, 16, 4, 3)],  # the 128 x 64 forward spills 8 B
    (120, "mixed3"): [(128, 64, 16, 8, 3)],  # the 64 x 64 forward on 4 warps spills 68 B
}
#: Several Matryoshka dimensions carry a second tile (the running segment sum) through the score-gradient
#: kernel: 64 x 64 on 8 warps (128 x 64 spills; on 4 warps the score-gradient kernel spills 120 B on sm_86).
_MATRYOSHKA_TILES = {
    **{(75, kind): [(32, 64, 16, 8, 2)] for kind in ("fma", "fma-half")},  # 64 x 32 spills 56 B in the fp32 forward
    **{(family, kind): tiles for family in (80, 86, 89, 90, 100, 120) for kind, tiles in (
        ("half", [(64, 64, 64, 8, 3)]), ("tf32", [(64, 64, 32, 8, 3)]), ("mixed", [(64, 64, 32, 8, 3)]),
        ("tf32x3", [(64, 64, 32, 8, 3)]), ("mixed3", [(64, 64, 16, 8, 3)]))},
    # tf32x3: at 64 x 64 x 32 the score-gradient kernel spills 184 B on sm_80, at 64 x 64 x 16 144 B; the forward
    # spills 24 B at 64 x 32 x 16 on 4 warps
    (80, "tf32x3"): [(32, 32, 32, 4, 3)],
    # on sm_86 at 64 x 32 x 32 on 4 warps the score-gradient kernel spills 76 B, at 32 x 32 x 32 the forward 76 B;
    # on 8 warps 64 x 32 x 32 fits both
    **{(family, "tf32x3"): [(64, 32, 32, 8, 3)] for family in (86, 89)},
    (120, "tf32x3"): [(64, 64, 16, 8, 3)],
    (100, "tf32"): [(64, 32, 16, 4, 3)],  # 64 x 64 x 16 on 8 warps spills 20 B in the forward
    (100, "mixed"): [(64, 64, 16, 8, 3)],  # at BLOCK_K = 32 the forward spills 80 B
    (100, "mixed3"): [(64, 32, 16, 4, 3)],  # 64 x 64 spills 52 B in the forward on 8 warps, 36 B in the other on 4
}
# The tables above are Triton 3.9's. Older releases spill with some of their configs: a release (major, minor) in
# _OLDER_TRITON takes its entries over the tables' ("gemm": _TILES, "matryoshka": _MATRYOSHKA_TILES): where a config
# spills under it, the first smaller one found that compiles spill-free with every kernel using it (bench/aot_compile.py
# under each release: bench/results/aot_compile_triton-*.txt, sm_80 to sm_90 with bf16 and fp32). Spills below are
# ptxas's under the release named.
#
# With mma.sync, half operands at BLOCK_K = 64 spill under 3.4 to 3.7: the forward 4 to 48 B on sm_80 to sm_89;
# BLOCK_K = 32 fits.
_HALF_K32 = {(family, "half"): [(128, 64, 32, 8, 3), (64, 64, 32, 4, 3)] for family in (80, 86, 89)}
_OLDER_TRITON: dict[tuple[int, int], dict[str, dict[tuple[int, str], list[tuple[int, ...]]]]] = {
    (3, 8): {
        # the score-gradient kernel at 128 x 64 x 16 spills 4 B on sm_86 and sm_89
        "gemm": {(family, "tf32x3"): [(128, 32, 16, 8, 3)] for family in (86, 89)},
        # the score-gradient kernel spills 28 B at 32 x 32 x 32 on sm_80, 8 B at 64 x 64 x 32 on sm_90, where the
        # forward's shared memory (56 KiB) also passes the estimate
        "matryoshka": {(80, "tf32x3"): [(32, 32, 16, 4, 3)], (90, "tf32x3"): [(64, 64, 16, 8, 3)]},
    },
    (3, 7): {
        "gemm": _HALF_K32,
        "matryoshka": {(90, "tf32x3"): [(64, 64, 16, 8, 3)]},  # 64 x 64 x 32: the score-gradient kernel spills 4 B
    },
    (3, 6): {"gemm": _HALF_K32},
    (3, 5): {
        # sm_90's 128 x 128 x 64 forward spills 100 B; sm_80's 64 x 64 x 16 tf32x3 forward on 4 warps 20 B
        "gemm": {**_HALF_K32, (90, "half"): _MMA_HALF, (80, "tf32x3"): [(128, 64, 16, 8, 3)]},
        # the score-gradient kernel spills 40 B at 64 x 32 x 32 on sm_86 and sm_89, 52 B at 64 x 64 x 32 on sm_90
        "matryoshka": {**{(family, "tf32x3"): [(64, 32, 16, 8, 3)] for family in (86, 89)},
                       (90, "tf32x3"): [(64, 64, 16, 8, 3)]},
    },
    (3, 4): {
        "gemm": {**_HALF_K32, (80, "tf32x3"): [(128, 64, 16, 8, 3)]},  # 64 x 64 x 16 on 4 warps: the forward spills 8 B
        # the score-gradient kernel spills 28 B at 32 x 32 x 32 on sm_80, 32 B at 64 x 32 x 32 on sm_86 and sm_89; on
        # sm_90 64 x 64 x 32 takes 57 KiB of shared memory, over the estimate
        "matryoshka": {(80, "tf32x3"): [(32, 32, 16, 4, 3)],
                       **{(family, "tf32x3"): [(64, 32, 16, 8, 3)] for family in (86, 89)},
                       (90, "tf32x3"): [(64, 64, 16, 8, 3)]},
    },
}
#: fp64 dots (tests) run on the FMA units; their operands live in registers, so small tiles.
_FP64_TILES = [(64, 32, 16, 4, 2)]
FMA_CONFIGS = _configs(_FP64_TILES)
INTERPRET_CONFIGS = _configs([(16, 16, 16, 1, 1)])
#: Every config a table can return under any release: the autotuner's list, fixed when the kernel is decorated.
ALL_CONFIGS = _configs(sorted({t for group in (*_TILES.values(), *_MATRYOSHKA_TILES.values(),
                                               *(tiles for older in _OLDER_TRITON.values()
                                                 for table in older.values() for tiles in table.values()),
                                               _FP64_TILES) for t in group}))


@functools.lru_cache(maxsize=None)
def _tables(release: tuple[int, int]) -> dict[str, dict[tuple[int, str], list[tuple[int, ...]]]]:
    """The tile tables ("gemm", "matryoshka") of a Triton release (``_OLDER_TRITON``)."""
    tables = {"gemm": dict(_TILES), "matryoshka": dict(_MATRYOSHKA_TILES)}
    for name, entries in _OLDER_TRITON.get(release, {}).items():
        tables[name].update(entries)
    return tables


def operand_kind(dtype: torch.dtype, precision: str, guide_dtype: torch.dtype, guide_precision: str,
                 arch: Arch | None = None) -> str:
    """The class of a dtype pair for the tile configs on ``arch`` (None: ``DEFAULT_ARCH``).

    "half" (bf16/fp16 on both sides), "tf32" (an fp32 student at "high"/"medium"), "mixed" (a half student
    with an fp32 guide at "high"/"medium"), "tf32x3" (an fp32 student at "highest"), "mixed3" (a half
    student with an fp32 guide at "highest"), "fma" and "fma-half" (an fp32 or a half student on an
    architecture without tensor-core MMA, where every ``tl.dot`` is FMA loops and fp32 runs at "ieee") or
    "fp64".
    """
    if torch.float64 in (dtype, guide_dtype):
        return "fp64"
    if not (arch or DEFAULT_ARCH).mma:
        return "fma" if dtype == torch.float32 else "fma-half"
    if precision == "tf32x3":
        return "tf32x3"
    if guide_precision == "tf32x3":
        return "mixed3"
    if dtype == torch.float32:
        return "tf32"
    return "mixed" if guide_dtype == torch.float32 else "half"


#: Shared memory a kernel takes beyond its buffers: barriers and alignment (sm_100 adds 16 B).
SHARED_OVERHEAD = 1024


def pipelined_loads(stages: int, rows: int, cols: int, block_k: int, element: int) -> int:
    """The shared memory (bytes) of a K loop's pipelined loads: ``stages`` buffers of a ``(rows, block_k)`` and a
    ``(cols, block_k)`` slice of ``element``-byte operands (Triton keeps ``num_stages - 1`` buffers with mma.sync and
    FMA loops, ``num_stages`` with wgmma and tcgen05). Every kernel's estimate counts its loads with it."""
    return stages * (rows + cols) * block_k * element


def shared_memory_estimate(config: triton.Config, kind: str) -> int:
    """An upper bound on the shared memory (bytes) of any kernel compiled with ``config`` for operands of ``kind``.

    The largest of two buffers, plus 1 KiB for barriers and alignment (sm_100 adds 16 B):
    - the pipelined operand loads of the K loops, ``num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * e`` with ``e``
      the largest operand element size (Triton keeps num_stages - 1 buffers with mma.sync and num_stages with
      wgmma and tcgen05), taken as 4 for both FMA kinds ("fma-half" also takes an fp32 guide);
    - a score tile in the student's element size ``s`` (4 for the FMA kinds; twice with tf32x3: a high and a low
      part) beside ``num_stages + 1`` buffers of (BLOCK_M, BLOCK_K / 2) student rows,
      ``parts * BLOCK_M * BLOCK_N * s + (num_stages + 1) * BLOCK_M * BLOCK_K / 2 * s``. It was sized for the
      fused backward's column pass, since removed, and stays because some binaries hold more than their loads:
      the tf32x3 forward and score-gradient kernel on sm_90 take 40960 B at 128 x 64 x 16 under Triton 3.8,
      over the 37888 B of the first term.
    bench/aot_compile.py checks it against every binary it builds.
    """
    bm, bn, bk = (config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    stages = config.num_stages
    e = 2 if kind == "half" else 4
    s = 2 if kind in ("half", "mixed", "mixed3") else 4
    parts = 2 if kind == "tf32x3" else 1
    loads = pipelined_loads(stages, bm, bn, bk, e)
    column = parts * bm * bn * s + (stages + 1) * bm * (bk // 2) * s
    return max(loads, column) + SHARED_OVERHEAD


def tile_configs(dtype: torch.dtype, precision: str, guide_dtype: torch.dtype, guide_precision: str, n_dims: int = 1,
                 arch: Arch | None = None, interpret: bool = INTERPRET,
                 release: tuple[int, int] | None = None) -> list[triton.Config]:
    """Tile configs the forward autotunes over for these operands (the backward reuses its pick).

    On a GPU of architecture ``arch`` (a ``cgist.stage.devices.Arch``, a simulated device's too) the configs are its
    family's: from sm_80 on every dtype pair but fp64 runs on the tensor cores (fp32 as tf32 or tf32x3), below it on
    FMA loops. On an architecture the tables do not know (``arch.known`` false) only the configs whose
    ``shared_memory_estimate`` fits its shared memory are kept, or the smallest one if none does. Without an
    ``arch``: under the interpreter (CPU tensors) exactly one, small enough that tests with odd sizes cross several
    row, column and K tiles; else ``DEFAULT_ARCH``'s. The tables are those of Triton ``release`` (``(major, minor)``;
    None: the running one, ``TRITON``).
    """
    if arch is None and interpret:
        return INTERPRET_CONFIGS
    arch = arch or DEFAULT_ARCH
    kind = operand_kind(dtype, precision, guide_dtype, guide_precision, arch)
    if kind == "fp64":
        return FMA_CONFIGS
    key = arch.family, kind
    tables = _tables(release or TRITON)
    configs = _configs(tables["matryoshka" if n_dims > 1 else "gemm"][key])
    return _fitting(configs, lambda c: shared_memory_estimate(c, kind), arch)


def _fitting(configs: list[triton.Config], estimate, arch: Arch) -> list[triton.Config]:
    """``configs`` on a known ``arch``; on one the tables do not know, those whose ``estimate`` (bytes) fits its shared
    memory, or the smallest one if none does."""
    if arch.known:
        return configs
    return [c for c in configs if estimate(c) <= arch.shared_bytes] or [min(configs, key=estimate)]


def _prune(configs, named_args, arch: Arch | None, **kwargs) -> list[triton.Config]:
    """The autotuner's pruning: the configs ``tile_configs`` gives on ``arch`` for a launch's operands and
    dimensions. A simulated device has no timings to choose by, so it takes the first (docs/devices.md#simulated-devices)."""
    args = {**named_args, **kwargs}  # keyword launches leave named_args empty
    configs = tile_configs(args["q_ptr"].dtype, args["PRECISION"], args["qg_ptr"].dtype, args["PRECISION_G"],
                           args["N_DIMS"], arch)
    return configs[:1] if simulated(args["q_ptr"].device) is not None else configs


@functools.lru_cache(maxsize=None)
def tuned_fwd_kernel(arch: Arch | None) -> triton.runtime.Autotuner:
    """The forward row pass (``cgist.kernels.gist.gist_fwd_kernel``) autotuned over the tile configs of ``arch``
    (``cgist.stage.triton.common.arch_of``; None: the interpreter's one), per batch and column bucket, dimensions and input precisions; the
    running state it updates is restored between trials. One autotuner per architecture, so that a pick made for one
    device is never another's. The score-gradient kernel takes its pick (``best_config``)."""
    return triton.autotune(
        configs=INTERPRET_CONFIGS if arch is None else ALL_CONFIGS,
        key=["b_bucket", "n_bucket", "dim", "dim_g", "PRECISION", "PRECISION_G", "N_DIMS"],
        prune_configs_by={"early_config_prune": functools.partial(_prune, arch=arch)},
        restore_value=["m_ptr", "l_ptr", "masked_ptr", "left_ptr"],
    )(gist_fwd_kernel)


# The tf32x3 GEMM of the backward (``cgist.kernels.gemm.tf32x3_addmm_kernel``): one config (BLOCK_M, BLOCK_N, BLOCK_K,
# warps, stages) per tile family from sm_80 on (below it fp32 runs at "ieee", unsplit). Each K step loads four
# fp32 tiles, the high and low parts of both operands, and issues three tf32 products.
_GEMM_TILES = {
    80: [(128, 128, 16, 8, 3)],
    86: [(128, 64, 16, 4, 3)],
    89: [(128, 64, 16, 4, 3)],
    90: [(128, 128, 16, 8, 3)],
    100: [(128, 128, 16, 8, 3)],
    120: [(128, 64, 16, 4, 3)],
}
#: The interpreter's cost is per program and K step: a larger tile than the kernels' keeps the GEMMs cheap there, and
#: the tests' sizes still cross several of it.
GEMM_INTERPRET_CONFIGS = _configs([(32, 32, 32, 1, 1)])


def gemm_shared_memory_estimate(config: triton.Config) -> int:
    """An upper bound on the shared memory (bytes) of ``tf32x3_addmm_kernel`` compiled with ``config``: the pipelined
    loads of its K loop, ``num_stages`` buffers of the four fp32 tiles ``2 * (BLOCK_M + BLOCK_N) * BLOCK_K * 4``, plus
    1 KiB for barriers and alignment. bench/aot_compile.py checks it against every binary it builds."""
    bm, bn, bk = (config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    return 2 * pipelined_loads(config.num_stages, bm, bn, bk, 4) + SHARED_OVERHEAD


def gemm_configs(arch: Arch | None = None, interpret: bool = INTERPRET) -> list[triton.Config]:
    """The configs of the tf32x3 GEMM on ``arch``, the first of which the launcher runs: its family's (on an
    architecture the tables do not know, pruned as ``tile_configs`` prunes); without one, under the interpreter
    ``GEMM_INTERPRET_CONFIGS``, else ``DEFAULT_ARCH``'s."""
    if arch is None and interpret:
        return GEMM_INTERPRET_CONFIGS
    arch = arch or DEFAULT_ARCH
    if not arch.mma:
        raise ValueError(f"{arch.name}: no tensor-core MMA, so no tf32x3 products")
    return _fitting(_configs(_GEMM_TILES[arch.family]), gemm_shared_memory_estimate, arch)
