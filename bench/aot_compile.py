"""Compile every GIST kernel ahead of time for sm_80 and sm_90, on a machine without a GPU.

For each of the three kernels, each tile config the forward autotunes over for the input precision
(the backward reuses the forward's pick), fp32 (IEEE, FMA units), tf32 and bf16 inputs and every
(D, Dg) below, this builds the real cubin with ``triton.compile``, specialised by the JIT's own rules,
and reads its resource usage back with the ``cuobjdump`` shipped in the triton wheel.
D and Dg are runtime arguments: sizes that the launcher specialises alike (all multiples of 16 here)
share one binary, which is compiled once and listed with every size it serves.

Prints one row per binary: kernel, arch, dtype, config, D, Dg, registers, spills, shared memory and,
on sm_90, whether the cubin's SASS uses warpgroup MMA (HGMMA). Exits non-zero on a compile error, any
spill, or shared memory over the arch limit.

    python bench/aot_compile.py [--arch 80 90] [--dtypes fp32 tf32 bf16] [--dims 384 768 1024 4096]
                                [--guide-dims 384 1024]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter replaces @triton.jit; compile the real kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from cgist.kernels.gist import (  # noqa: E402
    gist_bwd_cols_kernel, gist_bwd_rows_kernel, gist_fwd_kernel, tile_configs,
)
from cgist.kernels.launch import TL_DTYPES  # noqa: E402
from cgist.numerics import compute_dtype  # noqa: E402

#: Largest dynamic shared memory per block, bytes.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

#: Input precisions: the torch dtype and the ``tl.dot`` input precision the launcher picks for it
#: ("fp32" is ``torch.get_float32_matmul_precision() == "highest"``, "tf32" is "high"/"medium").
PRECISIONS = {
    "fp32": (torch.float32, "ieee"),
    "tf32": (torch.float32, "tf32"),
    "bf16": (torch.bfloat16, "ieee"),
    "fp16": (torch.float16, "ieee"),
    "fp64": (torch.float64, "ieee"),
}
#: The block kind (label, first writer) is a runtime argument, so each kernel is one binary per config.
KERNELS = [gist_fwd_kernel.fn, gist_bwd_rows_kernel, gist_bwd_cols_kernel]


def launch_values(kernel, precision: str, dim: int, dim_g: int, config: triton.Config,
                  rows: int = 4096, cols: int = 4096) -> dict:
    """Argument values as the launcher passes them for a B = N = 4096 batch (tensors stand in for pointers)."""
    dtype, dot_precision = PRECISIONS[precision]
    acc = compute_dtype(dtype)
    emb = torch.empty(1, dtype=dtype)
    vec = torch.empty(1, dtype=acc)
    ids = torch.empty(1, dtype=torch.int32)
    values = dict(
        q_ptr=emb, qg_ptr=emb, k_ptr=emb, kg_ptr=emb, rq_ptr=vec, rqg_ptr=vec, rk_ptr=vec, rkg_ptr=vec,
        col_id_ptr=ids, partner_id_ptr=ids, thr_ptr=vec, theta_masked_ptr=torch.empty(1, dtype=torch.int8),
        pos_ptr=vec, m_ptr=vec, l_ptr=vec, rw_ptr=vec, scalars_ptr=vec, grad_ptr=vec,
        n_rows=rows, n_cols=cols, dim=dim, dim_g=dim_g, offset=0, partner_start=0, b_bucket=rows, n_bucket=cols,
        stride_q=dim, stride_qg=dim_g, stride_k=dim, stride_kg=dim_g, stride_grad=dim,
        has_label=1, relative=0, accumulate=1, ACC=TL_DTYPES[acc], PRECISION=dot_precision,
        PRECISION_G=dot_precision, **config.kwargs,
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
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "tf32", "bf16"], choices=list(PRECISIONS))
    args = parser.parse_args(argv)

    jobs = []
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        for precision in args.dtypes:
            dtype, dot_precision = PRECISIONS[precision]
            for config in tile_configs(dtype, dot_precision, dtype, dot_precision, interpret=False):
                tiles = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**config.kwargs)
                for kernel in KERNELS:
                    binaries: dict[str, tuple[ASTSource, list]] = {}
                    for dim in args.dims:
                        for dim_g in args.guide_dims:
                            src = specialise(kernel, launch_values(kernel, precision, dim, dim_g, config), backend)
                            binaries.setdefault(src.hash(), (src, []))[1].append((dim, dim_g))
                    for src, sizes in binaries.values():
                        row = dict(kernel=kernel.__name__, arch=f"sm_{arch}", dtype=precision,
                                   tiles=f"{tiles}-w{config.num_warps}-s{config.num_stages}",
                                   D=",".join(sorted({str(d) for d, _ in sizes}, key=int)),
                                   Dg=",".join(sorted({str(g) for _, g in sizes}, key=int)))
                        jobs.append((row, src, target, backend, config))

    start = time.time()
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        rows = list(pool.map(lambda job: compile_one(*job), jobs))
    failures = [f"{r['kernel']} {r['arch']} {r['dtype']} {r['tiles']}: {r['failure']}" for r in rows
                if "failure" in r]
    header = ["kernel", "arch", "dtype", "tiles", "D", "Dg", "regs", "spill", "smem", "wgmma"]
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
