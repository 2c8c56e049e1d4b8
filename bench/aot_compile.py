"""Compile every GIST kernel ahead of time for sm_80 and sm_90, on a machine without a GPU.

For each tile config the forward autotunes over (the backward reuses the forward's pick), each kernel
variant the launcher uses, fp32 and bf16 inputs and every (D, Dg) below, this builds the real cubin with
``triton.compile`` and reads its resource usage back with the ``cuobjdump`` shipped in the triton wheel.
D and Dg are runtime arguments: sizes that the launcher specialises alike (all multiples of 16 here)
share one binary, which is compiled once and listed with every size it serves.

Prints one row per binary: kernel, arch, dtype, config, D, Dg, registers, spills, shared memory and,
on sm_90, whether the cubin's SASS uses warpgroup MMA (HGMMA). Exits non-zero on a compile error, any
spill, or shared memory over the arch limit.

    python bench/aot_compile.py [--arch 80 90] [--dims 384 768 1024 4096] [--guide-dims 384 1024]
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
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from cgist.kernels.gist import gist_bwd_cols_kernel, gist_bwd_rows_kernel, gist_fwd_kernel, tile_configs  # noqa: E402
from cgist.kernels.launch import input_precision  # noqa: E402

#: Largest dynamic shared memory per block, bytes.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: (kernel, HAS_LABEL, ACCUMULATE, launched for): every variant the launcher issues. The AN column pass
#: (no label, first writer of its negative's gradient) only runs when there are negatives.
VARIANTS = [
    (gist_fwd_kernel.fn, True, None, "AP"),
    (gist_fwd_kernel.fn, False, None, "AA/PP/AN"),
    (gist_bwd_rows_kernel, True, False, "AP"),
    (gist_bwd_rows_kernel, False, True, "AA/PP/AN"),
    (gist_bwd_cols_kernel, True, False, "AP"),
    (gist_bwd_cols_kernel, False, True, "AA/PP"),
    (gist_bwd_cols_kernel, False, False, "AN (negatives)"),
]


def launch_values(kernel, dtype: torch.dtype, dim: int, dim_g: int, has_label: bool, accumulate: bool | None,
                  config: triton.Config, rows: int = 4096, cols: int = 4096) -> dict:
    """Argument values as the launcher passes them for a B = N = 4096 batch (tensors stand in for pointers)."""
    acc = torch.float32
    emb = torch.empty(1, dtype=dtype)
    vec = torch.empty(1, dtype=acc)
    values = dict(
        q_ptr=emb, qg_ptr=emb, k_ptr=emb, kg_ptr=emb, rq_ptr=vec, rqg_ptr=vec, rk_ptr=vec, rkg_ptr=vec,
        thr_ptr=vec, pos_ptr=vec, m_ptr=vec, l_ptr=vec, lse_ptr=vec, scal_ptr=vec, dq_ptr=vec, dk_ptr=vec,
        n_rows=rows, n_cols=cols, dim=dim, dim_g=dim_g, offset=0, b_bucket=rows, n_bucket=cols,
        stride_qm=dim, stride_qd=1, stride_qgm=dim_g, stride_qgd=1, stride_kn=dim, stride_kd=1,
        stride_kgn=dim_g, stride_kgd=1, stride_dqm=dim, stride_dqd=1, stride_dkn=dim, stride_dkd=1,
        HAS_LABEL=has_label, RELATIVE=False, ACCUMULATE=accumulate, ACC=tl.float32,
        PRECISION=input_precision(dtype), PRECISION_G=input_precision(dtype), **config.kwargs,
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
        kind, attr = native_specialize_impl(type(backend), value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = attr
        else:
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
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args(argv)

    jobs = []
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        for dtype_name in args.dtypes:
            for config in tile_configs(interpret=False):
                for kernel, has_label, accumulate, used_for in VARIANTS:
                    binaries: dict[str, tuple[ASTSource, list]] = {}
                    for dim in args.dims:
                        for dim_g in args.guide_dims:
                            values = launch_values(kernel, DTYPES[dtype_name], dim, dim_g, has_label, accumulate,
                                                   config)
                            src = specialise(kernel, values, backend)
                            binaries.setdefault(src.hash(), (src, []))[1].append((dim, dim_g))
                    for src, sizes in binaries.values():
                        tiles = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**config.kwargs)
                        row = dict(kernel=f"{kernel.__name__}[{used_for}]", arch=f"sm_{arch}", dtype=dtype_name,
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
