"""Compile every Triton kernel (GIST's and MaxSim's) ahead of time for every GPU architecture the tile tables know, on a
machine without a GPU.

For each architecture (``--arch``: compute capabilities, each through ``cgist.stage.devices.arch_for``; by default one per
tile family and sm_70), each kernel of ``cgist.kernels`` (the forward and the chunk score-gradient kernel of the
backward), each student/guide dtype pair the launcher can meet on a GPU, with the input precisions the launcher passes
there (``input_precision``: fp32 is tf32x3 or tf32 on tensor cores, "ieee" below sm_80), each tile config that
``tile_configs`` returns for the pair on that architecture (the score-gradient kernel reuses the forward's pick), and
every (D, Dg) below, this builds the real cubin with ``triton.compile``, specialised by the JIT's
own rules, and reads it back with the ``cuobjdump`` and ``nvdisasm`` shipped in the triton wheel. A Matryoshka
configuration (dimensions 768/512/256/128/64, five segments) is built too, for the forward and the score-gradient
kernel. Where the student's products are tf32x3 (fp32 at "highest" from sm_80 on), so is the backward's tf32x3 GEMM
(``tf32x3_addmm_kernel``) with its config (``gemm_configs``), once for each of its two uses: ``F @ x`` and ``F^T @ x``
(``GEMM_USES``; a unit stride is specialised, so they are two binaries), with Dg "-". Variants that specialise alike
are one binary, compiled once per architecture and listed with every size and pair it serves: D and Dg are runtime
arguments (all multiples of 16 here), and below sm_80, where fp32 runs at "ieee", the fp32 and tf32 pairs (and
bf16+fp32 and bf16+tf32) are the same source.

The MaxSim kernels (``cgist.kernels.maxsim``: forward, label logits, a slab's logits, the logits' gradients, the query
and the document gradients) are built for the student dtypes of the chosen pairs among ``MAXSIM_DTYPES`` (fp32, tf32,
bf16, fp16), on every architecture, at ColBERT's shapes: 32 and 128 query tokens (the ``LQ`` constexpr), documents
longer than a chunk of tokens, D = 128, each with the launch the launcher picks (``cgist.stage.triton.maxsim.launch_configs``: tiles,
warps, stages and register limit), which the table's ``tiles`` writes as ``LQ32-Q32xT64xK32xM32-w4-s2-r255``
(query lengths, then query tokens, document tokens and features per product, documents per program, warps, stages,
``.maxnreg``). The token counts and the batch are runtime arguments the kernels do not specialise on, so the query
gradient, whose grid spans the query's token blocks, is one binary for both lengths. The slab kernels (a slab's
logits, the query and the document gradients) are built again with their ``XTR`` constexpr (XTR's scores), which
``tiles`` ends with ``-xtr``. Their rows have D 128 and Dg "-", and their estimate is
``cgist.stage.triton.maxsim.shared_memory_estimate``.

Prints one row per binary: kernel, arch, dtype pairs, config, number of dimensions, D, Dg, registers, stack frame
and the bytes of it that ptxas spills registers to, shared memory, the tile tables' shared-memory estimate for the
config (``shared_memory_estimate``, which prunes the tables on GPUs they do not know; the MaxSim launcher's for its
kernels), whether the SASS uses
warpgroup MMA (``wgmma``: HGMMA, sm_90 only) and which tensor-core instructions it uses (``mma``: HMMA for
mma.sync on sm_80 to sm_89 and sm_120, HGMMA on sm_90, UTCHMMA for tcgen05 on sm_100; "-" for the FMA loops below
sm_80; "?" where the disassembler cannot read the architecture). Then one summary line per architecture: binaries,
the largest spill, the largest shared memory against
the architecture's limit (``cgist.stage.devices.KNOWN_ARCHS``) and the largest ratio of shared memory to estimate.
Exits non-zero on a compile error, any spill, shared memory over the limit, or shared memory over the estimate.

The table's first line records the arguments, the Triton version and a hash of the sources the binaries are built
from (``bench/compile_table.py``): bench/results/aot_compile.txt is the full default table under the newest Triton,
bench/results/aot_compile_triton-X.Y.Z.txt the table of ``--arch 80 86 89 90 --dtypes bf16 fp32`` under each older
release the launcher supports, and tests/test_triton_versions.py fails when one no longer matches the sources. It runs
under Triton 3.4 and newer: for another release, install its wheel beside the environment
(``pip install --no-deps --target DIR triton==X.Y.Z``) and run with ``PYTHONPATH=DIR``; the tile tables follow the
release (``cgist.stage.triton.tiles._OLDER_TRITON``).

    python bench/aot_compile.py [--arch 70 75 80 86 89 90 100 120] [--dtypes fp32 tf32 bf16 ...]
                                [--dims 384 768 1024 4096] [--guide-dims 384 1024] [--no-matryoshka] [--jobs N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter replaces @triton.jit; compile the real kernels
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)

import torch  # noqa: E402
import triton  # noqa: E402

#: The oldest Triton this tool runs under: 3.4 brought ``triton.knobs``, which it reads and sets.
OLDEST_TRITON = (3, 4)
if tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2]) < OLDEST_TRITON:
    raise SystemExit(f"Triton {triton.__version__}: bench/aot_compile.py runs under Triton "
                     f"{'.'.join(map(str, OLDEST_TRITON))} and newer")

import triton.backends.nvidia.compiler as nvidia_compiler  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

try:  # Triton 3.6 and newer: the JIT specialises its arguments in native code
    from triton.runtime.jit import native_specialize_impl  # noqa: E402
except ImportError:  # Triton 3.4 and 3.5: in Python, through the backend's ``get_arg_specialization``
    from triton.runtime.jit import create_specialize_impl  # noqa: E402

    _SPECIALIZE_IMPLS: dict[type, object] = {}

    def native_specialize_impl(backend_type, arg, is_const, specialize_value, align):
        impl = _SPECIALIZE_IMPLS.get(backend_type)
        if impl is None:
            impl = _SPECIALIZE_IMPLS[backend_type] = create_specialize_impl(backend_type.get_arg_specialization)
        return impl(arg, is_const, specialize_value, align)

import compile_table  # noqa: E402  (bench/, this script's folder)

from cgist.kernels.gemm import tf32x3_addmm_kernel  # noqa: E402
from cgist.kernels.gist import gist_fwd_kernel, gist_score_grad_kernel  # noqa: E402
from cgist.stage.devices import Arch, arch_for  # noqa: E402
from cgist.stage.numerics import compute_dtype  # noqa: E402
from cgist.stage.triton.common import TL_DTYPES, input_precision  # noqa: E402
from cgist.stage.triton.maxsim import KERNELS as MAXSIM_BY_NAME  # noqa: E402
from cgist.stage.triton.maxsim import Launch, launch_configs  # noqa: E402
from cgist.stage.triton.maxsim import shared_memory_estimate as maxsim_shared_memory_estimate  # noqa: E402
from cgist.stage.triton.tiles import (  # noqa: E402
    gemm_configs,
    gemm_shared_memory_estimate,
    operand_kind,
    shared_memory_estimate,
    tile_configs,
)

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUOBJDUMP, NVDISASM = TOOLS / "cuobjdump", TOOLS / "nvdisasm"
#: Compute capabilities compiled by default (major * 10 + minor): one per tile family, and sm_70 (V100), which
#: takes family 75's tiles.
DEFAULT_ARCHS = [70, 75, 80, 86, 89, 90, 100, 120]
#: SASS opcodes of the tensor cores: mma.sync (HMMA), Hopper's warpgroup MMA (HGMMA), Blackwell's tcgen05
#: (UTCHMMA and its integer and low-precision kinds), and the integer and fp8 mma.sync ones.
SASS_OPCODE = r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?"  # an instruction's offset and predicate, before its opcode
TENSOR_CORE_OPCODE = re.compile(SASS_OPCODE + r"((?:H|HG|I|Q|O|UTCH|UTCI|UTCQ|UTCO)MMA)\b", re.MULTILINE)
EXIT_OPCODE = re.compile(SASS_OPCODE + r"EXIT\b", re.MULTILINE)

#: Student/guide dtype pairs: each side's torch dtype, and ``torch.get_float32_matmul_precision()``, from
#: which the launcher's ``input_precision`` picks the ``tl.dot`` input precision of the fp32 sides.
PAIRS = {
    "fp32": (torch.float32, torch.float32, "highest"),
    "tf32": (torch.float32, torch.float32, "high"),
    "bf16": (torch.bfloat16, torch.bfloat16, "highest"),
    "fp16": (torch.float16, torch.float16, "highest"),
    "bf16+fp32": (torch.bfloat16, torch.float32, "highest"),
    "bf16+tf32": (torch.bfloat16, torch.float32, "high"),
    "fp64": (torch.float64, torch.float64, "highest"),
}
DEFAULT_PAIRS = ["fp32", "tf32", "bf16", "fp16", "bf16+fp32", "bf16+tf32"]
#: The Matryoshka configuration of the check, and the pairs it is built for.
MATRYOSHKA_DIMS = (64, 128, 256, 512, 768)
MATRYOSHKA_PAIRS = ("fp32", "tf32", "bf16", "bf16+fp32", "bf16+tf32")  # one per operand kind
#: The block kind (label, counting) is a runtime argument, so each kernel is one binary per config.
KERNELS = (gist_fwd_kernel, gist_score_grad_kernel)
MATRYOSHKA_KERNELS = (gist_fwd_kernel, gist_score_grad_kernel)
#: The tf32x3 GEMM's two uses in the backward, by the name its rows carry: ``h_rows += F @ k`` reads the operand F
#: along its rows, ``h_cols += F^T @ q`` across them.
GEMM_KERNEL = tf32x3_addmm_kernel
GEMM_USES = {"tf32x3_addmm_kernel(F)": False, "tf32x3_addmm_kernel(F^T)": True}
#: The MaxSim kernels (``cgist.kernels.maxsim``), in launch order, each with the launch its launcher picks
#: (``cgist.stage.triton.maxsim.launch_configs``); the input dtypes they are built for (by ``PAIRS``' name: the
#: student's dtype and matmul precision); ColBERT's shapes: 32 and 128 query tokens (``LQ``), documents longer than
#: a chunk of tokens, 128 features.
MAXSIM_KERNELS = tuple(MAXSIM_BY_NAME.values())
MAXSIM_DTYPES = ("fp32", "tf32", "bf16", "fp16")
MAXSIM_LQ = (32, 128)
MAXSIM_LD = 256
MAXSIM_D = 128
COLUMNS = ["kernel", "arch", "dtype", "tiles", "dims", "D", "Dg", "regs", "stack", "spill", "smem", "est", "wgmma",
           "mma"]
KEY = ("kernel", "arch", "dtype", "tiles", "dims", "D", "Dg")


def operands(pair: str, arch: Arch) -> tuple[torch.dtype, str, torch.dtype, str]:
    """``(dtype, precision, guide_dtype, guide_precision)`` of a pair as the launcher passes them on ``arch``."""
    dtype, guide_dtype, matmul = PAIRS[pair]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        return dtype, input_precision(dtype, arch), guide_dtype, input_precision(guide_dtype, arch)
    finally:
        torch.set_float32_matmul_precision(previous)


#: A block's runtime rules (kernels/gist.py, ``RULE_*``): every bit, though the value does not shape the binary (the
#: kernels do not specialise on it), so that a table row stands for every block kind.
RULES_ALL = 127


def launch_values(kernel, pair: tuple, dim: int, dim_g: int, config: triton.Config, n_dims: int = 1,
                  rows: int = 4096, cols: int = 4096) -> dict:
    """Argument values as the launcher passes them for a B = N = 4096 batch (tensors stand in for pointers).

    ``pair`` is ``(dtype, precision, guide_dtype, guide_precision)``, as ``operands`` returns it.
    """
    dtype, precision, guide_dtype, guide_precision = pair
    acc = compute_dtype(dtype)
    emb = torch.empty(1, dtype=dtype)
    guide = torch.empty(1, dtype=guide_dtype)
    vec = torch.empty(1, dtype=acc)
    ids = torch.empty(1, dtype=torch.int32)
    values = dict(
        q_ptr=emb, qg_ptr=guide, k_ptr=emb, kg_ptr=guide, rq_ptr=vec, rqg_ptr=vec, rk_ptr=vec, rkg_ptr=vec,
        col_id_ptr=ids, partner_id_ptr=ids, dims_ptr=ids, thr_ptr=vec, theta_masked_ptr=torch.empty(1, dtype=torch.int8),
        theta_ptr=vec, pos_ptr=vec, m_ptr=vec, l_ptr=vec, rw_ptr=vec, masked_ptr=ids, left_ptr=ids, scalars_ptr=vec,
        grad_ptr=vec, f_ptr=emb, row_part_ptr=vec, col_part_ptr=vec,
        n_rows=rows, n_cols=cols, row_stop=rows, col_stop=cols, row_start=0, col_start=0,
        dim=dim, dim_g=dim_g, offset=0, partner_start=0, b_bucket=rows, n_bucket=cols,
        stride_q=dim, stride_qg=dim_g, stride_k=dim, stride_kg=dim_g, stride_grad=dim,
        stride_rq=rows, stride_rk=cols, stride_state=rows,
        stride_f_seg=2 * rows * cols, stride_f_part=rows * cols, stride_f_row=cols,
        stride_rp_dim=rows * 64, stride_rp_tile=rows, stride_cp_dim=cols * 64, stride_cp_tile=cols,
        col_text_ptr=ids, row_text_ptr=ids, excluded_offset=0, unmasked_offset=0, stride_text=rows, rules=RULES_ALL,
        relative=0, count=1, ACC=TL_DTYPES[acc], PRECISION=precision, PRECISION_G=guide_precision,
        N_DIMS=n_dims, DIMS_P2=triton.next_power_of_2(n_dims), SPLIT=precision == "tf32x3", **config.kwargs,
    )
    return {name: values[name] for name in kernel.arg_names}


def gemm_values(transposed: bool, dim: int, config: triton.Config, rows: int = 4096, cols: int = 4096) -> dict:
    """``tf32x3_addmm_kernel``'s argument values as the launcher passes them for a chunk of ``rows`` x ``cols`` scores
    and D = ``dim`` (one segment): ``F @ k`` into the rows' ``h``, or with ``transposed`` ``F^T @ q`` into the
    columns'."""
    f = torch.empty(1, dtype=torch.float32)
    m, k = (cols, rows) if transposed else (rows, cols)
    stride_am, stride_ak = (1, cols) if transposed else (cols, 1)
    return dict(out_ptr=f, a_hi_ptr=f, a_lo_ptr=f, b_hi_ptr=f, b_lo_ptr=f, M=m, N=dim, K=k, stride_om=dim, stride_on=1,
                stride_am=stride_am, stride_ak=stride_ak, stride_bk=dim, stride_bn=1, **config.kwargs)


def maxsim_values(kernel, dtype: torch.dtype, launch: Launch, lq: int, ld: int = MAXSIM_LD, dim: int = MAXSIM_D,
                  batch: int = 4096, docs: int = 4096) -> dict:
    """A MaxSim kernel's argument values as ``cgist.stage.triton.maxsim`` passes them for ``batch`` queries of ``lq``
    tokens and ``docs`` documents of ``ld`` tokens, ``dim`` features (tensors stand in for pointers; the token counts
    and the batch are not specialised on)."""
    acc = compute_dtype(dtype)
    emb = torch.empty(1, dtype=dtype)
    vec = torch.empty(1, dtype=acc)
    values = dict(q_ptr=emb, w_ptr=vec, tau_ptr=vec, fill_ptr=vec, d_ptr=emb,
                  dmask_ptr=torch.empty(1, dtype=torch.int8), width_ptr=torch.empty(1, dtype=torch.int32),
                  scalars_ptr=vec, peak_ptr=vec, total_ptr=vec, label_ptr=vec, out_ptr=vec, z_ptr=vec, g_ptr=vec,
                  dq_ptr=vec, dd_ptr=vec, n_docs=docs, n_rows=batch, offset=0, q_start=0, lq=lq, ld=ld, dim=dim,
                  **launch.meta)
    return {name: values[name] for name in kernel.arg_names}


def maxsim_launches(pair: str, arch: Arch, lq: int, xtr: bool = False) -> dict[str, Launch]:
    """The launcher's ``launch_configs`` for the MaxSim kernels with ``pair``'s dtype and matmul precision on
    ``arch``, at ColBERT's shapes; with ``xtr`` the slab kernels' XTR variants."""
    dtype, _, matmul = PAIRS[pair]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul)
    try:
        return launch_configs(dtype, arch, lq, MAXSIM_LD, MAXSIM_D, xtr=xtr)
    finally:
        torch.set_float32_matmul_precision(previous)


def specialise(kernel, values: dict, backend) -> ASTSource:
    """The ASTSource the JIT would build for these values (same int/pointer specialisation rules)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
            continue
        kind, attr = native_specialize_impl(type(backend), value, False, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str):  # None: not specialised (do_not_specialize)
            attrs[(i,)] = backend.parse_attr(attr)
    return ASTSource(kernel, signature, constexprs, attrs)


def resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel (cuobjdump), and the tensor-core opcodes of its SASS.

    The SASS comes from nvdisasm without its dataflow analysis (branch-target annotations), a quarter faster
    than ``cuobjdump -sass``: the disassembly is most of this function's time. The wheel's nvdisasm (CUDA 13)
    no longer reads sm_70: there ``mma`` is None.
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([NVDISASM, "--print-code", "--no-dataflow", f.name], capture_output=True, text=True)
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    if "REG" not in fields:
        raise RuntimeError("cuobjdump printed no resource usage")
    if sass.returncode and "is deprecated" in sass.stderr:
        fields["mma"] = None
    elif sass.returncode or not EXIT_OPCODE.search(sass.stdout):
        raise RuntimeError(f"nvdisasm printed no SASS: {sass.stderr.strip()}")
    else:
        fields["mma"] = sorted(set(TENSOR_CORE_OPCODE.findall(sass.stdout)))
    return fields


class _PtxasPrintingSubprocess:
    """``subprocess`` as Triton's NVIDIA backend sees it under Triton 3.4, which has no ``dump_ptxas_log``: its
    ``run`` also prints what ptxas writes to the log file it is given (``-v``: registers, stack, spills)."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def run(cmd, *args, check=False, stderr=None, **kwargs):
        proc = subprocess.run(cmd, *args, stderr=subprocess.PIPE, **kwargs)
        text = proc.stderr.decode(errors="replace") if isinstance(proc.stderr, bytes) else proc.stderr
        if isinstance(getattr(stderr, "name", None), str):  # the log file, opened for reading: the backend's error
            Path(stderr.name).write_text(text)
        print(text)
        if check and proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc


@contextlib.contextmanager
def ptxas_log():
    """Collect what Triton's ptxas runs print with ``-v`` into a StringIO: through ``TRITON_DUMP_PTXAS_LOG``
    (Triton 3.5 and newer), else by giving the backend a ``subprocess`` that prints ptxas's log."""
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        if hasattr(knobs.nvidia, "dump_ptxas_log"):
            knobs.nvidia.dump_ptxas_log = True
            yield log
            return
        nvidia_compiler.subprocess = _PtxasPrintingSubprocess()
        try:
            yield log
        finally:
            nvidia_compiler.subprocess = subprocess


def spill_stores(log: str) -> int | None:
    """Bytes of spill stores in a ptxas ``-v`` log, or None for a log without them."""
    found = re.findall(r"(\d+) bytes spill stores", log)
    return sum(map(int, found)) if found else None


def compile_one(row: dict, src: ASTSource, target: GPUTarget, backend, config: triton.Config, arch: Arch,
                estimate: int) -> dict:
    """Compile one binary; return its table row, with a ``failure`` entry when it breaks a limit.

    ``stack`` is the binary's stack frame (local memory), ``spill`` the part of it ptxas spills registers to
    (asked only where there is a frame): a frame can also hold a local variable, such as two int8 values that
    LLVM packs through memory for sm_86 and newer.
    """
    options = backend.parse_options({"num_warps": config.num_warps, "num_stages": config.num_stages,
                                     "maxnreg": config.maxnreg})
    row = {**row, "est": estimate}
    try:
        with ptxas_log() as log:
            compiled = triton.compile(src, target=target, options=options.__dict__)
        usage = resource_usage(compiled.asm["cubin"])
        stack = usage.get("STACK", 0) + usage.get("LOCAL", 0)
        spill = spill_stores(log.getvalue()) if stack else 0
        if spill is None:  # a binary from Triton's cache: run its ptxas again for the log
            with ptxas_log() as log:
                backend.make_cubin(compiled.asm["ptx"], {}, options, target.arch)
            if (spill := spill_stores(log.getvalue())) is None:
                raise RuntimeError("ptxas printed no spill counts")
    except Exception as err:  # noqa: BLE001 - report every failing variant, then fail
        return {**row, "regs": "-", "stack": "-", "spill": "-", "smem": "-", "wgmma": "-", "mma": "ERROR",
                "failure": f"compile error: {err}"}
    smem = compiled.metadata.shared
    row = {**row, "regs": usage["REG"], "stack": stack, "spill": spill, "smem": smem,
           "wgmma": ("yes" if "HGMMA" in usage["mma"] else "no") if arch.wgmma else "n/a",
           "mma": "?" if usage["mma"] is None else "+".join(usage["mma"]) or "-"}
    if spill:
        row["failure"] = f"{spill} bytes of spill stores"
    elif smem > arch.shared_bytes:
        row["failure"] = f"shared memory {smem} B > {arch.shared_bytes} B"
    elif smem > estimate:
        row["failure"] = f"shared memory {smem} B > its estimate {estimate} B"
    return row


def build_jobs(args) -> list[tuple]:
    """One ``compile_one`` argument tuple per distinct binary, in table order."""
    variants = [(pair, 1, KERNELS, args.dims) for pair in args.dtypes]
    if not args.no_matryoshka:
        variants += [(pair, len(MATRYOSHKA_DIMS), MATRYOSHKA_KERNELS, [MATRYOSHKA_DIMS[-1]])
                     for pair in args.dtypes if pair in MATRYOSHKA_PAIRS]
    jobs = []
    for capability in args.arch:
        arch = arch_for(divmod(capability, 10))
        if arch is None:
            raise SystemExit(f"sm_{capability}: no tile tables below compute capability 7.0")
        target = GPUTarget("cuda", capability, 32)
        backend = make_backend(target)
        # by source and launch options: the pairs and sizes that specialise alike share one binary
        binaries: dict[tuple, dict] = {}
        for pair, n_dims, kernels, dims in variants:
            ops = operands(pair, arch)
            kind = operand_kind(*ops, arch)
            configs = tile_configs(*ops, n_dims, arch, interpret=False)
            builds = [(kernel.__name__, kernel, config, dim, dim_g,
                       launch_values(kernel, ops, dim, dim_g, config, n_dims), shared_memory_estimate(config, kind))
                      for kernel in kernels for config in configs for dim in dims for dim_g in args.guide_dims]
            if ops[1] == "tf32x3" and n_dims == 1:  # the backward's tf32x3 GEMMs
                builds += [(name, GEMM_KERNEL, config, dim, "-", gemm_values(transposed, dim, config),
                            gemm_shared_memory_estimate(config))
                           for name, transposed in GEMM_USES.items() for config in gemm_configs(arch, interpret=False)
                           for dim in dims]
            for name, kernel, config, dim, dim_g, values, estimate in builds:
                src = specialise(kernel, values, backend)
                entry = binaries.setdefault((src.hash(), config.num_warps, config.num_stages), dict(
                    kernel=name, dims=str(n_dims), src=src, config=config, pairs=[], sizes=[], estimate=estimate))
                entry["pairs"] += [] if pair in entry["pairs"] else [pair]
                entry["sizes"].append((dim, dim_g))
        for entry in binaries.values():
            c = entry["config"]
            guide_dims = sorted({str(g) for _, g in entry["sizes"]}, key=lambda g: int(g) if g != "-" else 0)
            row = dict(kernel=entry["kernel"], arch=arch.name, dtype=",".join(entry["pairs"]),
                       tiles="{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}",
                       dims=entry["dims"], D=",".join(sorted({str(d) for d, _ in entry["sizes"]}, key=int)),
                       Dg=",".join(guide_dims))
            jobs.append((row, entry["src"], target, backend, c, arch, entry["estimate"]))
        # the MaxSim kernels: one binary per source and launch, listed with every dtype and query length it serves
        # (the query-gradient kernel's grid spans the query's token blocks, so one binary serves both lengths), and
        # the slab kernels' XTR variants (the others are the same source either way)
        maxsim: dict[tuple, dict] = {}
        for pair in (p for p in args.dtypes if p in MAXSIM_DTYPES):
            for lq, xtr in itertools.product(MAXSIM_LQ, (False, True)):
                for name, launch in maxsim_launches(pair, arch, lq, xtr).items():
                    kernel = MAXSIM_BY_NAME[name]
                    dtype = PAIRS[pair][0]
                    src = specialise(kernel, maxsim_values(kernel, dtype, launch, lq), backend)
                    entry = maxsim.setdefault((src.hash(), launch.num_warps, launch.num_stages, launch.maxnreg), dict(
                        kernel=name, src=src, launch=launch, pairs=[], lqs=[],
                        estimate=maxsim_shared_memory_estimate(launch, dtype)))
                    entry["pairs"] += [] if pair in entry["pairs"] else [pair]
                    entry["lqs"] += [] if lq in entry["lqs"] else [lq]
        for entry in maxsim.values():
            launch = entry["launch"]
            row = dict(kernel=entry["kernel"], arch=arch.name, dtype=",".join(entry["pairs"]),
                       tiles=f"LQ{','.join(map(str, entry['lqs']))}-{launch.tiles}", dims="1", D=str(MAXSIM_D), Dg="-")
            config = triton.Config({}, num_warps=launch.num_warps, num_stages=launch.num_stages,
                                   maxnreg=launch.maxnreg)
            jobs.append((row, entry["src"], target, backend, config, arch, entry["estimate"]))
    return jobs


def summary(rows: list[dict], arch: Arch) -> str:
    """One architecture's line: binaries, the largest spill, the largest shared memory and smem / estimate."""
    mine = [r for r in rows if r["arch"] == arch.name and isinstance(r["smem"], int)]
    if not mine:
        return f"{arch.name}: no binary built"
    top = max(mine, key=lambda r: r["smem"])
    ratio = max(r["smem"] / r["est"] for r in mine)
    return (f"{arch.name}: {len(mine)} binaries, max spill {max(r['spill'] for r in mine)} B, largest shared memory "
            f"{top['smem']} B of {arch.shared_bytes} B ({top['kernel']} {top['dtype']} {top['tiles']} "
            f"dims={top['dims']}), largest smem/estimate {ratio:.2f}")


def table_args(argv: list[str]) -> list[str]:
    """The arguments that shape a table, for its header: ``argv`` without ``--jobs``."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == "--jobs" or arg.startswith("--jobs="):
            skip = arg == "--jobs"
            continue
        kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=DEFAULT_ARCHS,
                        help="compute capabilities, major * 10 + minor")
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 768, 1024, 4096])
    parser.add_argument("--guide-dims", type=int, nargs="+", default=[384, 1024])
    parser.add_argument("--dtypes", nargs="+", default=DEFAULT_PAIRS, choices=list(PAIRS))
    parser.add_argument("--no-matryoshka", action="store_true", help="skip the Matryoshka configuration")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "k/n": compile jobs k, k + n, ... and print JSON rows
    args = parser.parse_args(argv)
    jobs = build_jobs(args)

    if args.worker:
        k, n = map(int, args.worker.split("/"))
        for job in jobs[k::n]:
            print(json.dumps(compile_one(*job)), flush=True)
        return 0

    # triton.compile holds the GIL for most of its work: one process per core, each taking every n-th job.
    start = time.time()
    argv = sys.argv[1:] if argv is None else argv
    n = max(1, min(args.jobs, len(jobs)))
    workers = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", f"{k}/{n}"], stdout=subprocess.PIPE,
                                text=True) for k in range(n)]
    outputs = [w.communicate()[0] for w in workers]
    if any(w.returncode for w in workers):
        print("FAIL: a compiling process exited with an error", file=sys.stderr)
        return 1
    done = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
    order = {json.dumps({h: r[h] for h in KEY}): i for i, (r, *_) in enumerate(jobs)}
    rows = sorted(done, key=lambda r: order[json.dumps({h: r[h] for h in KEY})])
    if len(rows) != len(jobs):
        print(f"FAIL: {len(jobs) - len(rows)} binaries missing from the workers' output", file=sys.stderr)
        return 1
    failures = [f"{r['kernel']} {r['arch']} {r['dtype']} {r['tiles']} dims={r['dims']}: {r['failure']}"
                for r in rows if "failure" in r]
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in COLUMNS}
    print(compile_table.header(table_args(argv), triton.__version__))
    print("  ".join(h.ljust(widths[h]) for h in COLUMNS))
    for r in rows:
        print("  ".join(str(r[h]).ljust(widths[h]) for h in COLUMNS))
    for arch in dict.fromkeys(job[5] for job in jobs):
        print(summary(rows, arch))
    print(f"{len(rows)} binaries in {time.time() - start:.0f} s")
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
