"""Compile every GIST kernel ahead of time for sm_80 and sm_90, on a machine without a GPU.

For each kernel (the forward, the chunk score-gradient kernel of the GEMM backward, and the fused
backward's row and column passes), each tile config the forward autotunes over for the dtype pair
(the backward reuses the forward's pick), every student/guide dtype pair the launcher can meet on a
GPU, and every (D, Dg) below, this builds the real cubin with ``triton.compile``, specialised by the
JIT's own rules, and reads its resource usage back with the ``cuobjdump`` shipped in the triton wheel.
A Matryoshka configuration (dimensions 768/512/256/128/64, five segments) is built too, for the
forward and the score-gradient kernel. D and Dg are runtime arguments: sizes that the launcher
specialises alike (all multiples of 16 here) share one binary, which is compiled once and listed
with every size it serves.

Prints one row per binary: kernel, arch, dtype pair, config, number of dimensions, D, Dg, registers,
spills, shared memory and, on sm_90, whether the cubin's SASS uses warpgroup MMA (HGMMA). Exits
non-zero on a compile error, any spill, or shared memory over the arch limit.

    python bench/aot_compile.py [--arch 80 90] [--dtypes fp32 tf32 bf16 ...] [--dims 384 768 1024 4096]
                                [--guide-dims 384 1024] [--no-matryoshka]
"""

from __future__ import annotations

import argparse
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
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from cgist.kernels.gist import (  # noqa: E402
    gist_bwd_cols_kernel, gist_bwd_rows_kernel, gist_fwd_kernel, gist_score_grad_kernel, tile_configs,
)
from cgist.kernels.launch import TL_DTYPES  # noqa: E402
from cgist.numerics import compute_dtype  # noqa: E402

#: Largest dynamic shared memory per block, bytes.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

#: Student/guide dtype pairs: each side's torch dtype and the ``tl.dot`` input precision the launcher picks
#: for it. fp32 is tf32x3 at ``torch.get_float32_matmul_precision() == "highest"`` and tf32 at "high"/"medium".
PAIRS = {
    "fp32": (torch.float32, "tf32x3", torch.float32, "tf32x3"),
    "tf32": (torch.float32, "tf32", torch.float32, "tf32"),
    "bf16": (torch.bfloat16, "ieee", torch.bfloat16, "ieee"),
    "fp16": (torch.float16, "ieee", torch.float16, "ieee"),
    "bf16+fp32": (torch.bfloat16, "ieee", torch.float32, "tf32x3"),
    "bf16+tf32": (torch.bfloat16, "ieee", torch.float32, "tf32"),
    "fp64": (torch.float64, "ieee", torch.float64, "ieee"),
}
DEFAULT_PAIRS = ["fp32", "tf32", "bf16", "fp16", "bf16+fp32", "bf16+tf32"]
#: The Matryoshka configuration of the check, and the pairs it is built for.
MATRYOSHKA_DIMS = (64, 128, 256, 512, 768)
MATRYOSHKA_PAIRS = ("fp32", "bf16", "bf16+fp32")
#: The block kind (label, counting) is a runtime argument, so each kernel is one binary per config. Each
#: kernel with the tile set the forward autotunes over when it runs (the fused passes follow a forward
#: tuned over the "fused" set).
KERNELS = {gist_fwd_kernel.fn: "gemm", gist_score_grad_kernel: "gemm", gist_bwd_rows_kernel: "fused",
           gist_bwd_cols_kernel: "fused"}
MATRYOSHKA_KERNELS = {gist_fwd_kernel.fn: "gemm", gist_score_grad_kernel: "gemm"}


def launch_values(kernel, pair: str, dim: int, dim_g: int, config: triton.Config, n_dims: int = 1,
                  rows: int = 4096, cols: int = 4096) -> dict:
    """Argument values as the launcher passes them for a B = N = 4096 batch (tensors stand in for pointers)."""
    dtype, precision, guide_dtype, guide_precision = PAIRS[pair]
    acc = compute_dtype(dtype)
    emb = torch.empty(1, dtype=dtype)
    guide = torch.empty(1, dtype=guide_dtype)
    vec = torch.empty(1, dtype=acc)
    ids = torch.empty(1, dtype=torch.int32)
    values = dict(
        q_ptr=emb, qg_ptr=guide, k_ptr=emb, kg_ptr=guide, rq_ptr=vec, rqg_ptr=vec, rk_ptr=vec, rkg_ptr=vec,
        col_id_ptr=ids, partner_id_ptr=ids, dims_ptr=ids, thr_ptr=vec, theta_masked_ptr=torch.empty(1, dtype=torch.int8),
        theta_ptr=vec, pos_ptr=vec, m_ptr=vec, l_ptr=vec, rw_ptr=vec, masked_ptr=ids, kept_ptr=ids, scalars_ptr=vec,
        grad_ptr=vec, f_ptr=emb, row_part_ptr=vec, col_part_ptr=vec,
        n_rows=rows, n_cols=cols, row_stop=rows, col_stop=cols, row_start=0, col_start=0,
        dim=dim, dim_g=dim_g, offset=0, partner_start=0, b_bucket=rows, n_bucket=cols,
        stride_q=dim, stride_qg=dim_g, stride_k=dim, stride_kg=dim_g, stride_grad=dim,
        stride_rq=rows, stride_rk=cols, stride_state=rows,
        stride_f_seg=2 * rows * cols, stride_f_part=rows * cols, stride_f_row=cols,
        stride_rp_dim=rows * 64, stride_rp_tile=rows, stride_cp_dim=cols * 64, stride_cp_tile=cols,
        tile_set=0, has_label=1, relative=0, count=1, ACC=TL_DTYPES[acc], PRECISION=precision, PRECISION_G=guide_precision,
        N_DIMS=n_dims, DIMS_P2=triton.next_power_of_2(n_dims), SPLIT=precision == "tf32x3", **config.kwargs,
    )
    return {name: values[name] for name in kernel.arg_names}


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
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, and whether its SASS has HGMMA."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    fields["HGMMA"] = "HGMMA" in sass
    return fields


def compile_one(row: dict, src: ASTSource, target: GPUTarget, backend, config: triton.Config) -> dict:
    """Compile one binary; return its table row, with a ``failure`` entry when it breaks a limit."""
    arch = target.arch
    options = backend.parse_options({"num_warps": config.num_warps, "num_stages": config.num_stages})
    try:
        compiled = triton.compile(src, target=target, options=options.__dict__)
    except Exception as err:  # noqa: BLE001 - report every failing variant, then fail
        return {**row, "regs": "-", "spill": "-", "smem": "-", "wgmma": "ERROR", "failure": f"compile error: {err}"}
    usage = resource_usage(compiled.asm["cubin"])
    smem = compiled.metadata.shared
    spill = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    row = {**row, "regs": usage.get("REG", "?"), "spill": spill, "smem": smem,
           "wgmma": ("yes" if usage["HGMMA"] else "no") if arch >= 90 else "n/a"}
    if spill:
        row["failure"] = f"{spill} bytes of spills"
    elif smem > SHARED_LIMIT[arch]:
        row["failure"] = f"shared memory {smem} B > {SHARED_LIMIT[arch]} B"
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 768, 1024, 4096])
    parser.add_argument("--guide-dims", type=int, nargs="+", default=[384, 1024])
    parser.add_argument("--dtypes", nargs="+", default=DEFAULT_PAIRS, choices=list(PAIRS))
    parser.add_argument("--no-matryoshka", action="store_true", help="skip the Matryoshka configuration")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "k/n": compile jobs k, k + n, ... and print JSON rows
    args = parser.parse_args(argv)

    variants = [(pair, 1, KERNELS, args.dims) for pair in args.dtypes]
    if not args.no_matryoshka:
        variants += [(pair, len(MATRYOSHKA_DIMS), MATRYOSHKA_KERNELS, [MATRYOSHKA_DIMS[-1]])
                     for pair in args.dtypes if pair in MATRYOSHKA_PAIRS]
    jobs = []
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        for pair, n_dims, kernels, dims in variants:
            for kernel, tile_set in kernels.items():
                for config in tile_configs(*PAIRS[pair], n_dims, tile_set, arch // 10, interpret=False):
                    tiles = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**config.kwargs)
                    binaries: dict[str, tuple[ASTSource, list]] = {}
                    for dim in dims:
                        for dim_g in args.guide_dims:
                            values = launch_values(kernel, pair, dim, dim_g, config, n_dims)
                            src = specialise(kernel, values, backend)
                            binaries.setdefault(src.hash(), (src, []))[1].append((dim, dim_g))
                    for src, sizes in binaries.values():
                        row = dict(kernel=kernel.__name__, arch=f"sm_{arch}", dtype=pair,
                                   tiles=f"{tiles}-w{config.num_warps}-s{config.num_stages}", dims=str(n_dims),
                                   D=",".join(sorted({str(d) for d, _ in sizes}, key=int)),
                                   Dg=",".join(sorted({str(g) for _, g in sizes}, key=int)))
                        jobs.append((row, src, target, backend, config))

    if args.worker:
        k, n = map(int, args.worker.split("/"))
        for job in jobs[k::n]:
            print(json.dumps(compile_one(*job)), flush=True)
        return 0

    # triton.compile holds the GIL for most of its work: one process per core, each taking every n-th job.
    start = time.time()
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--jobs")]
    n = max(1, min(args.jobs, len(jobs)))
    workers = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", f"{k}/{n}"], stdout=subprocess.PIPE,
                                text=True) for k in range(n)]
    outputs = [w.communicate()[0] for w in workers]
    if any(w.returncode for w in workers):
        print("FAIL: a compiling process exited with an error", file=sys.stderr)
        return 1
    done = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith("{")]
    order = {json.dumps({h: r[h] for h in ("kernel", "arch", "dtype", "tiles", "dims", "D", "Dg")}): i
             for i, (r, *_) in enumerate(jobs)}
    rows = sorted(done, key=lambda r: order[json.dumps({h: r[h] for h in ("kernel", "arch", "dtype", "tiles", "dims",
                                                                              "D", "Dg")})])
    if len(rows) != len(jobs):
        print(f"FAIL: {len(jobs) - len(rows)} binaries missing from the workers' output", file=sys.stderr)
        return 1
    failures = [f"{r['kernel']} {r['arch']} {r['dtype']} {r['tiles']} dims={r['dims']}: {r['failure']}"
                for r in rows if "failure" in r]
    header = ["kernel", "arch", "dtype", "tiles", "dims", "D", "Dg", "regs", "spill", "smem", "wgmma"]
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in header}
    print("  ".join(h.ljust(widths[h]) for h in header))
    for r in rows:
        print("  ".join(str(r[h]).ljust(widths[h]) for h in header))
    print(f"{len(rows)} binaries in {time.time() - start:.0f} s")
    for failure in failures:
        print("FAIL:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
