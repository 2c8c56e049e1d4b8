"""Throughput of the Triton kernels, and the GPU check: each measured figure beside the estimate it should confirm.

    python bench/kernel_bench.py                              # per-kernel and per-block times, B = 4k and 16k
    python bench/kernel_bench.py --suite check --out OUTDIR   # the GPU check (bench/gpu_check.sh runs it)
    python bench/kernel_bench.py --suite warmup --dtype bf16  # compile and tune what the check runs (small sizes)
    python bench/kernel_bench.py --suite estimates            # the estimates alone, on any machine (no timing)

The check measures, on one GPU:

* calibrations: the GEMM ceiling (``torch.mm`` 8192^3 in bf16 and tf32), the device copy bandwidth, and
  the L2 bandwidth (a kernel that re-reads a resident buffer of about 25 MB);
* tie ids: ``torch.unique`` over the normalised guide rows against the fingerprint ids
  (``cgist.stage.ties.tie_ids``): the same partition, the time and the peak memory of each;
* at B = N = 16k and 64k, k = 1, D = 768, Dg = 384, for bf16/bf16, fp32/fp32 (tf32x3) and bf16/fp32:
  every kernel per block (forward row pass; the backward's score-gradient kernel and its GEMMs), the loss
  stage, the autotuner's pick and the peak memory; at 4k also the streaming path and sentence-transformers'
  loss stage;
* Matryoshka, bf16 at 64k and 16k: the same rows for five dimensions (768/512/256/128/64 at D = 768) with
  the GEMM backward, and their ratio to one dimension (the target: at most 1.6x).

Estimates. Every time has an estimate from counting the work, ``est_ms = max(flops / (eff * peak) +
elementwise, l2_bytes / l2_bw, hbm_bytes / hbm_bw)`` with H200 figures (``SPEC``: 989 TFLOP/s dense bf16,
495 tf32; L2 7 TB/s, as assumed in the count that motivated this design; HBM 4.8 TB/s) and ``eff`` 0.75
for the Triton tiles, 0.8 for cuBLAS. A tf32x3 product is three tf32 products. ``elementwise`` is the
tile's exp2 at the special-function rate plus its other element-wise ops (``MASK_OPS`` ... ``RADIAL_OPS``)
at the FP32 rate, added to the products because the same warps issue both (no warp specialisation).
``est_cal_ms`` is the same count with the calibrations measured in this run instead of the spec
figures. Per score (one entry of a block), with s and s_g the bytes of a student and a guide element,
BM x BN the tile and M Matryoshka dimensions (1 without):

* forward: 2 (D + Dg) flops, M exp2; L2 (1/BM + 1/BN)(D s + Dg s_g) bytes (each tile loads its rows
  and columns);
* score-gradient kernel: the same, plus the operands F written to HBM (M s bytes, twice for a tf32
  split); with M > 1 a second sweep over the prefixes up to the second-largest dimension d_{M-1}
  (D + d_{M-1} in the flops and the L2 bytes, 2M - 1 exp2);
* backward GEMMs, per segment of width w between consecutive dimensions (one segment, w = D, without
  Matryoshka), each bound by its own limit: 4 w flops (dQ = F K and dK = F^T Q) at cuBLAS's eff, or for tf32x3
  (``cgist.kernels.gemm``, a Triton kernel) the Triton tiles'; HBM: its F read twice, and per chunk the dK
  accumulator read and written (8 w / chunk rows bytes per score).

The estimates suite also counts the four ``MultipleNegativesRankingLoss`` directions in one softmax (``DIRECTIONS``,
both contrast flags off, GEMM backward): at B = N their score blocks (AP, AN_1..AN_k; QQ; DQ; DD over the
positives and each negative set: ``block_columns``) are 2 (1 + k) + 2 of B x B entries, six at k = 1, against
GIST's 3 + k, and each entry costs what a query-to-document one does, so the count scales with the entries
(the check does not measure this configuration).

Rows follow bench/common.py's schema; ``note`` carries the estimates, the ratio measured / estimate and
the autotuner's pick. Every row is built from ``common.make_embeddings``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch

#: On a GPU the real kernels run; without one (a smoke test of this script, tiny sizes only) the
#: Triton interpreter runs them on the CPU and the numbers mean nothing.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cuda":
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import (  # noqa: E402
    make_embeddings, measure_once, split_detached, split_leaves, time_cpu, time_cuda, write_csv,
)

import cgist  # noqa: E402
from cgist.stage.budget import backward_chunks  # noqa: E402
from cgist.stage.dispatch.direct import loss_and_grads  # noqa: E402
from cgist.stage.numerics import normalize  # noqa: E402
from cgist.stage.spec.options import GistOptions  # noqa: E402
from cgist.stage.ties import tie_ids  # noqa: E402
from cgist.stage.triton.dense import BackwardWork, forward_group, gist_forward  # noqa: E402

#: Student/guide dtype pairs of the check (fp32 at torch's default matmul precision: tf32x3).
PAIRS = {"bf16": (torch.bfloat16, torch.bfloat16), "fp32": (torch.float32, torch.float32),
         "bf16+fp32": (torch.bfloat16, torch.float32), "fp16": (torch.float16, torch.float16)}
OPTIONS = GistOptions(temperature=0.01, margin=0.05)
#: The (pair, B, Matryoshka) runs of the check, most telling first.
CHECK_ORDER = [("bf16", 65536, False), ("bf16", 65536, True), ("bf16", 16384, False), ("fp32", 65536, False),
               ("bf16+fp32", 65536, False), ("bf16", 16384, True), ("bf16", 4096, False), ("fp32", 16384, False),
               ("bf16+fp32", 16384, False)]
#: All four of sentence-transformers' ``MultipleNegativesRankingLoss`` directions, in one softmax: the estimates'
#: four-direction configuration.
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
#: (B, D, Dg, k) of the four-direction CPU measurement (``bench/loss_stage.py --directions``), whose GPU estimate
#: the check prints.
DIRECTIONS_SHAPE = (4096, 384, 384, 1)
#: The Matryoshka target: this many dimensions in at most this multiple of one dimension's loss stage.
MATRYOSHKA_TARGET = 1.6
#: Largest batch at which sentence-transformers' loss stage and the streaming path are timed.
ST_MAX_BATCH = 4096
ST_MINI_BATCH = 32


@dataclass(frozen=True)
class Machine:
    """The rates the estimates assume: tensor-core FLOP/s per operand class, L2 and HBM bytes/s, and the
    element-wise rates of the tiles: exp2 results/s of the special-function units, other ops/s of the FP32 lanes.
    """

    bf16: float
    tf32: float
    l2: float
    hbm: float
    mufu: float = 3.9e12
    alu: float = 33.5e12
    triton_eff: float = 0.75
    cublas_eff: float = 0.8

    def rate(self, dtype: torch.dtype) -> float:
        return self.bf16 if dtype in (torch.bfloat16, torch.float16) else self.tf32


#: H200 SXM figures: dense tensor-core peaks from the data sheet, L2 as assumed in the original count, HBM3e;
#: exp2 at 3.9e12/s (the special-function rate of an H100 SXM5, FlashAttention-3 paper, Shah et al. 2024, same
#: GH100 die), other element-wise ops at 33.5e12/s (67 TFLOP/s non-tensor FP32 on the data sheet, an FMA as 2).
SPEC = Machine(bf16=989e12, tf32=495e12, l2=7.0e12, hbm=4.8e12)
#: Element-wise ops per score entry besides exp2, counted from the kernels' code: the guide's verdict once per
#: tile (guide scaling, threshold and tie-id compares, label test, selects); per dimension in the forward (two
#: scalings, max, shift, sum) and in a score-gradient sweep (two scalings, shift, row weight, label select, both
#: inverse norms, conversion); per dimension in the first Matryoshka sweep also the radial term, its row and
#: column sums and the running segment sum.
MASK_OPS, FWD_OPS, GRAD_OPS, RADIAL_OPS = 8, 5, 9, 5


def _passes(dtype: torch.dtype) -> int:
    """Tensor-core products per fp32 product: 3 for tf32x3 (fp32 at "highest"), else 1."""
    return 3 if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else 1


def estimate(kernel: str, scores: float, dim: int, dim_g: int, dtype: torch.dtype, guide_dtype: torch.dtype,
             tiles: dict, chunk_rows: int, machine: Machine, dims: tuple[int, ...] | None = None) -> tuple[float, str]:
    """Estimated ms of ``kernel`` over ``scores`` score entries (see the module docstring), and its bound.

    ``dims``: the Matryoshka dimensions, ascending, the largest ``dim`` (default: ``dim`` alone).
    """
    dims = dims or (dim,)
    n = len(dims)
    s, s_g = torch.finfo(dtype).bits / 8, torch.finfo(guide_dtype).bits / 8
    bm, bn = tiles["BLOCK_M"], tiles["BLOCK_N"]
    # the score-gradient kernel's second sweep (Matryoshka): the prefixes again, up to the second-largest dimension
    swept = dim + (dims[-2] if n > 1 else 0) if kernel == "score_grad" else dim
    student = 2 * swept * _passes(dtype) / (machine.triton_eff * machine.rate(dtype))
    guide = 2 * dim_g * _passes(guide_dtype) / (machine.triton_eff * machine.rate(guide_dtype))
    tile_bytes = (1 / bm + 1 / bn) * (swept * s + dim_g * s_g)
    split = 2 if _passes(dtype) == 3 else 1
    sweeps = 2 * n - 1 if kernel == "score_grad" else n  # dimensions whose logits a sweep exponentiates
    ops = MASK_OPS + sweeps * (FWD_OPS if kernel == "fwd" else GRAD_OPS) + (n * RADIAL_OPS if n > 1 else 0)
    elementwise = sweeps / machine.mufu + ops / machine.alu  # issued by the same warps as the products
    if kernel == "fwd":
        parts = {"compute": student + guide + elementwise, "l2": tile_bytes / machine.l2}
    elif kernel == "score_grad":
        parts = {"compute": student + guide + elementwise, "l2": tile_bytes / machine.l2,
                 "hbm": n * split * s / machine.hbm}
    elif kernel == "gemms":  # one pair of GEMMs per segment, each bound by its own limit
        per_segment = []
        eff = machine.triton_eff if _passes(dtype) == 3 else machine.cublas_eff  # tf32x3: the Triton GEMM
        for width in (hi - lo for lo, hi in zip((0, *dims[:-1]), dims)):
            compute = 4 * width * _passes(dtype) / (eff * machine.rate(dtype))
            per_segment.append({"compute": compute, "hbm": (2 * split * s + 8 * width / chunk_rows) / machine.hbm})
        bounds = sorted({max(p, key=p.get) for p in per_segment})
        return sum(max(p.values()) for p in per_segment) * scores * 1e3, "+".join(bounds)
    else:
        raise ValueError(kernel)
    bound = max(parts, key=parts.get)
    return parts[bound] * scores * 1e3, bound


def matryoshka_dims(dim: int) -> tuple[int, ...]:
    """The check's Matryoshka dimensions for a student of ``dim``, ascending: 64/128/256/512/768 at 768."""
    return (dim // 12, dim // 6, dim // 3, 2 * dim // 3, dim)


def timed(fn: Callable[[], object], quick: bool = False) -> tuple[float, float, float]:
    """``(median, p20, p80)`` ms: ``do_bench`` on a GPU (``quick``: shorter, for calls of a second)."""
    if DEVICE.type != "cuda":
        fn()
        return time_cpu(fn, repeats=2)
    return time_cuda(fn, warmup_ms=1, rep_ms=50) if quick else time_cuda(fn)


def _device_name() -> str:
    """The GPU's name; on a CPU, what stands in for one (a simulated device, ``CGIST_SIMULATE_DEVICE``)."""
    from cgist.stage.devices import describe, simulated

    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name()
    return f"{describe(DEVICE)}, simulated" if simulated(DEVICE) else "cpu (interpreter smoke test)"


def _simulated_note() -> str:
    """The line a report on a CPU starts with: no figure in it is a GPU's."""
    return (f"SIMULATED: {_device_name()}: the kernels ran under the Triton interpreter on the CPU; every figure "
            "below is the CPU's, none is a GPU's")


def _row(impl, op, batch, n_cand, dim, dim_g, k, dtype_name, times, peak_mb=0.0, note="", impl_version=None):
    median, p20, p80 = times
    return dict(impl=impl, op=op, B=batch, N=n_cand, D=dim, Dg=dim_g, k=k, dtype=dtype_name, device=_device_name(),
                median_ms=median, p20_ms=p20, p80_ms=p80, peak_mb=peak_mb,
                version=impl_version or f"cgist {cgist.__version__}", note=note)


def _vs(measured_ms: float, est_ms: float, est_cal_ms: float | None = None) -> str:
    cal = f" est_cal={est_cal_ms:.4g}ms" if est_cal_ms is not None else ""
    return f"est={est_ms:.4g}ms{cal} measured/est={measured_ms / est_ms:.3g}"


# -- calibrations -----------------------------------------------------------------------------------------------


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, n_chunks, reps, CHUNK: tl.constexpr):
    """Each program reads ``reps`` chunks of the buffer, a different one each time, and sums them."""
    pid = tl.program_id(0)
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for r in range(reps):
        chunk = (pid + r) % n_chunks
        acc += tl.load(x_ptr + chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK))
    tl.store(out_ptr + pid * CHUNK + tl.arange(0, CHUNK), acc)


def l2_bandwidth(nbytes: int, reps: int) -> tuple[tuple[float, float, float], float]:
    """Times of ``reps`` reads of a resident ``nbytes`` buffer, and the bytes/s they imply."""
    chunk = 4096
    n_chunks = nbytes // (4 * chunk)
    x = torch.randn(n_chunks * chunk, device=DEVICE)
    out = torch.empty_like(x)
    fn = lambda: _l2_read_kernel[(n_chunks,)](x, out, n_chunks, reps, CHUNK=chunk)  # noqa: E731
    fn()
    if DEVICE.type == "cuda":  # do_bench would flush L2 between calls: time back-to-back calls instead
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(5):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        samples.sort()
        times = (samples[2], samples[1], samples[3])
    else:
        times = time_cpu(fn, repeats=1)
    return times, reps * x.numel() * 4 / (times[0] * 1e-3)


def calibrations(mm_size: int, copy_bytes: int, l2_bytes: int, l2_reps: int) -> tuple[list[dict], Machine]:
    """The GEMM ceilings, copy and L2 bandwidth rows, and the machine they describe."""
    rows = []
    rates = {}
    for name, dtype, precision in (("bf16", torch.bfloat16, "highest"), ("tf32", torch.float32, "high")):
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            a = torch.randn(mm_size, mm_size, device=DEVICE, dtype=dtype)
            b = torch.randn(mm_size, mm_size, device=DEVICE, dtype=dtype)
            times = timed(lambda: torch.mm(a, b))
        finally:
            torch.set_float32_matmul_precision(previous)
        rates[name] = 2 * mm_size**3 / (times[0] * 1e-3)
        spec = getattr(SPEC, name)
        rows.append(_row("torch.mm", f"gemm {mm_size}^3", mm_size, mm_size, mm_size, 0, 0, name, times,
                         note=f"tflops={rates[name] / 1e12:.1f} spec={spec / 1e12:.0f} of_spec={rates[name] / spec:.2f}",
                         impl_version=f"torch {torch.__version__}"))
        a = b = None  # freed before the next dtype's operands
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    times = timed(lambda: dst.copy_(src))
    hbm = 2 * copy_bytes / (times[0] * 1e-3)
    rows.append(_row("copy", f"d2d {copy_bytes / 2**20:.0f}MiB", 0, 0, 0, 0, 0, "uint8", times,
                     note=f"GB/s={hbm / 1e9:.0f} (read+write) spec={SPEC.hbm / 1e9:.0f}",
                     impl_version=f"torch {torch.__version__}"))
    src = dst = None
    times, l2 = l2_bandwidth(l2_bytes, l2_reps)
    rows.append(_row("l2-read", f"{l2_bytes // 1024}KiB x{l2_reps}", 0, 0, 0, 0, 0, "fp32", times,
                     note=f"GB/s={l2 / 1e9:.0f} assumed={SPEC.l2 / 1e9:.0f}"))
    return rows, Machine(bf16=rates["bf16"], tf32=rates["tf32"], l2=l2, hbm=hbm)


# -- tie ids ----------------------------------------------------------------------------------------------------


def tie_id_rows(batch: int, dim_g: int, dtype: torch.dtype, dtype_name: str) -> list[dict]:
    """Fingerprint ids against ``torch.unique`` ids on the guide columns: agreement, time, peak memory."""
    _, guide = make_embeddings(batch, batch, 8, dim_g, 1, device=DEVICE, dtype=dtype)
    guide[1][: batch // 8] = guide[0][: batch // 8]  # duplicates across columns, so ties exist
    acc = torch.float32

    def unique_ids():
        rows = torch.cat([normalize(g, acc)[0] for g in guide])
        return torch.unique(rows, dim=0, return_inverse=True)[1]

    def fingerprint_ids():
        return torch.cat(tie_ids(guide, acc))

    a, b = unique_ids(), fingerprint_ids()
    pairs = torch.unique(torch.stack([a, b.to(a.dtype)]), dim=1).shape[1]
    agree = pairs == int(a.max()) + 1 == int(torch.unique(b).numel())
    out = []
    for impl, fn in (("torch.unique", unique_ids), ("fingerprint", fingerprint_ids)):
        _, peak = measure_once(fn, DEVICE)
        out.append(_row(f"tie-ids {impl}", "ids", batch, batch, 0, dim_g, 1, dtype_name, timed(fn), peak,
                        note=f"same partition={agree} classes={pairs}"))
    return out


# -- the loss stage, per kernel and per block --------------------------------------------------------------------


def _options(dims: tuple[int, ...] | None) -> GistOptions:
    return OPTIONS if dims is None else dataclasses.replace(OPTIONS, matryoshka_dims=dims[::-1])


def _stage_name(dims: tuple[int, ...] | None) -> str:
    """The rows' name of a run: "gemm" (the GEMM backward), with Matryoshka "gemm-mat" and the number of dimensions."""
    return "gemm" if dims is None else f"gemm-mat{len(dims)}"


def stage_rows(batch: int, dim: int, dim_g: int, k: int, pair: str, machines: dict[str, Machine],
               dims: tuple[int, ...] | None = None) -> list[dict]:
    """Per-kernel and per-block times of the loss stage at one size, the totals, the pick and the peak memory;
    with Matryoshka ``dims`` (ascending), over those dimensions."""
    dtype, guide_dtype = PAIRS[pair]
    student, guide = make_embeddings(batch, batch, dim, dim_g, k, device=DEVICE, dtype=dtype)
    guide = [g.to(guide_dtype) for g in guide]
    options = _options(dims)
    rows: list[dict] = []

    def add(impl, op, times, est_kernel=None, scores=0.0, tiles=None, chunk_rows=1, peak=0.0, note=""):
        if est_kernel is not None:
            ests = {name: estimate(est_kernel, scores, dim, dim_g, dtype, guide_dtype, tiles, chunk_rows, m, dims)
                    for name, m in machines.items()}
            est, bound = ests["spec"]
            note = f"{_vs(times[0], est, ests['calibrated'][0] if 'calibrated' in ests else None)} bound={bound} {note}"
        rows.append(_row(impl, op, batch, batch, dim, dim_g, k, pair, times, peak, note.strip()))
        print(_format([rows[-1]], header=False), flush=True)
        return rows[-1]

    name = _stage_name(dims)
    loss, state = gist_forward(student, guide, options)  # tunes the forward
    tiles = state.tiles
    pick = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}-w{num_warps}-s{num_stages}".format(**tiles)
    work = BackwardWork(state)
    totals = {"fwd": 0.0, "bwd": 0.0, "est_fwd": 0.0, "est_bwd": 0.0}
    for group in state.groups:
        scores = state.batch * group.n_cols
        fwd = add(f"triton/{name}", f"fwd {group.name}", timed(lambda: forward_group(state, group)), "fwd",
                  scores, tiles, note=f"pick={pick}")
        totals["fwd"] += fwd["median_ms"]
        totals["est_fwd"] += estimate("fwd", scores, dim, dim_g, dtype, guide_dtype, tiles, 1, SPEC, dims)[0]
        chunks = work.chunks(group)
        chunk_rows = work.buffers()[0].rows

        def score_grads():
            for chunk in chunks:
                work.score_grad_chunk(group, *chunk)

        def gemms():
            for chunk in chunks:
                work.chunk_gemms(group, *chunk)

        parts = [add(f"triton/{name}", f"bwd {group.name} score-grad", timed(score_grads), "score_grad",
                     scores, tiles, chunk_rows,
                     note=f"chunks={len(chunks)} chunk={chunk_rows}x{work.buffers()[0].cols}"),
                 add(f"triton/{name}", f"bwd {group.name} gemms", timed(gemms), "gemms", scores, tiles, chunk_rows)]
        totals["bwd"] += sum(p["median_ms"] for p in parts)
        totals["est_bwd"] += sum(
            estimate(kind, scores, dim, dim_g, dtype, guide_dtype, tiles, chunk_rows, SPEC, dims)[0]
            for kind in ("score_grad", "gemms"))
    del loss
    work = state = None  # freed before the whole stage is timed
    add(f"triton/{name}", "fwd (sum of blocks)", (totals["fwd"],) * 3,
        note=f"{_vs(totals['fwd'], totals['est_fwd'])} pick={pick}")
    add(f"triton/{name}", "bwd (sum of blocks)", (totals["bwd"],) * 3, note=_vs(totals["bwd"], totals["est_bwd"]))

    def stage():
        loss, state = gist_forward(student, guide, options)
        return loss, BackwardWork(state).run()

    stage()
    _, peak = measure_once(stage, DEVICE)
    times = timed(stage, quick=True)
    add(f"triton/{name}", "fwd+bwd", times, peak=peak,
        note=f"{_vs(times[0], totals['est_fwd'] + totals['est_bwd'])} "
             f"est_peak={_estimated_peak_mb(batch, dim, k, dtype):.0f}MB pick={pick}")
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    if batch <= ST_MAX_BATCH and dims is None:
        rows += reference_rows(batch, dim, dim_g, k, pair, student, guide)
    return rows


def _estimated_peak_mb(batch: int, dim: int, k: int, dtype: torch.dtype) -> float:
    """Extra memory of the loss stage by count (B = N): the fp32 sums ``h`` and the gradients of every
    embedding, one fp32 copy of an embedding in the normalisation backward, and the default chunk budget.
    """
    rows = batch * (2 + k)
    size = torch.finfo(dtype).bits // 8
    chunk = min(2**30, torch.cuda.mem_get_info()[0] // 8) if DEVICE.type == "cuda" else 16 * 2**20
    return (rows * dim * (4 + size) + batch * dim * 4 + chunk) / 2**20


def st_loss_stage(mini_batch_size: int = ST_MINI_BATCH):
    """sentence-transformers' CachedGISTEmbedLoss with only the attributes its ``calculate_loss`` reads."""
    from sentence_transformers.sentence_transformer.losses.cached_gist_embed import CachedGISTEmbedLoss

    loss = CachedGISTEmbedLoss.__new__(CachedGISTEmbedLoss)
    torch.nn.Module.__init__(loss)
    loss.__dict__.update(
        temperature=OPTIONS.temperature, margin=OPTIONS.margin, margin_strategy=OPTIONS.margin_strategy,
        contrast_anchors=OPTIONS.contrast_anchors, contrast_positives=OPTIONS.contrast_positives,
        gather_across_devices=False, mini_batch_size=mini_batch_size, show_progress_bar=False,
    )
    loss.similarity_fct = torch.nn.CosineSimilarity(dim=-1)
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
    return loss


def reference_rows(batch, dim, dim_g, k, pair, student, guide) -> list[dict]:
    """fwd+bwd of the streaming path and of sentence-transformers' loss stage, with peak memory."""
    fns = {"streaming": lambda: loss_and_grads("torch", student, guide, OPTIONS, need_grads=True)}
    if student[0].dtype == guide[0].dtype:
        st = st_loss_stage()
        reps, reps_guided = split_leaves(student, ST_MINI_BATCH), split_detached(guide, ST_MINI_BATCH)
        fns["sentence-transformers"] = lambda: st.calculate_loss(reps, reps_guided, with_backward=True)
    rows = []
    for impl, fn in fns.items():
        fn()
        _, peak = measure_once(fn, DEVICE)
        impl_version = f"sentence-transformers {version('sentence-transformers')}" if impl.startswith("sent") else None
        rows.append(_row(impl, "fwd+bwd", batch, batch, dim, dim_g, k, pair, timed(fn, quick=True), peak,
                         impl_version=impl_version))
        print(_format([rows[-1]], header=False), flush=True)
    return rows


def _chunk_rows(batch: int, tiles: dict, n_dims: int, dtype: torch.dtype) -> int:
    """Rows of a GEMM-backward chunk at B = N by the launcher's own plan, with the default budget on an H200 (1 GiB)."""
    parts = 2 if _passes(dtype) == 3 else 1
    return backward_chunks(batch, batch, tiles, n_dims, parts * torch.finfo(dtype).bits // 8, 4, 2**30, DEVICE,
                      (2**31 - 1) // (n_dims * parts)).rows


def block_columns(batch: int, k: int, directions: tuple[str, ...] | None = None) -> list[int]:
    """Columns of each score block at B = N (every block has B rows), one per column group of the call
    (``GistOptions.column_groups``): GIST's AP, AA, PP, AN_1..AN_k, or with ``directions`` (both contrast flags
    off) their blocks: AP and AN_1..AN_k for query-to-document, QQ, DQ, and DD over the positives and each
    negative set for document-to-document."""
    options = GistOptions() if directions is None else GistOptions(
        contrast_anchors=False, contrast_positives=False, directions=directions)
    return [batch] * len(options.column_groups(2 + k)[0])


def paper_estimates(batch: int, dim: int, dim_g: int, k: int, pair: str, dims: tuple[int, ...] | None = None,
                    directions: tuple[str, ...] | None = None) -> list[dict]:
    """The estimates of one size by count alone (``SPEC``), with the largest tile of each set taken as the pick.

    With Matryoshka ``dims`` (ascending), also the GEMM backward over those dimensions and its ratio to one.
    With ``directions``, also the GEMM backward over those directions' blocks (``block_columns``), each entry
    counted as a query-to-document one, and its ratio to GIST's blocks.
    """
    from cgist.stage.triton.common import input_precision
    from cgist.stage.triton.tiles import tile_configs

    dtype, guide_dtype = PAIRS[pair]
    rows, totals = [], {}
    runs = [(None, None)]
    if dims is not None:
        runs.append((dims, None))
    if directions is not None:
        runs.append((None, directions))
    for run_dims, run_directions in runs:
        n_dims = len(run_dims or (dim,))
        config = tile_configs(dtype, input_precision(dtype), guide_dtype, input_precision(guide_dtype), n_dims,
                              interpret=False)[0]  # the H200's tiles (DEFAULT_ARCH, sm_90)
        tiles = config.kwargs
        pick = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**tiles)
        chunk_rows = _chunk_rows(batch, tiles, n_dims, dtype)
        name = f"estimate/{_stage_name(run_dims)}"
        if run_directions is not None:
            name += f"-dir{len(run_directions)}"
        scores = batch * sum(block_columns(batch, k, run_directions))
        total = 0.0
        for kernel in ("fwd", "score_grad", "gemms"):
            ms, bound = estimate(kernel, scores, dim, dim_g, dtype, guide_dtype, tiles, chunk_rows, SPEC, run_dims)
            total += ms
            rows.append(_row(name, kernel, batch, batch, dim, dim_g, k, pair, (ms,) * 3,
                             note=f"bound={bound} tiles={pick} chunk_rows={chunk_rows}"))
        totals[name] = total
        note = f"tiles={pick}"
        if run_dims is not None:
            note += f" dims={'/'.join(map(str, run_dims[::-1]))} vs_one_dim={total / totals['estimate/gemm']:.2f}"
        if run_directions is not None:
            note += f" directions={'+'.join(run_directions)} joint vs_gist={total / totals['estimate/gemm']:.2f}"
        rows.append(_row(name, "fwd+bwd", batch, batch, dim, dim_g, k, pair, (total,) * 3, note=note))
    return rows


def warmup(pairs: list[str], dim: int, dim_g: int, k: int, batch: int = 512) -> None:
    """Compile and tune every kernel variant the check runs, at a small size (``batch`` rows) with the same
    specialisation."""
    for pair in pairs:
        dtype, guide_dtype = PAIRS[pair]
        student, guide = make_embeddings(batch, batch, dim, dim_g, k, device=DEVICE, dtype=dtype)
        guide = [g.to(guide_dtype) for g in guide]
        loss_and_grads("triton", student, guide, OPTIONS, need_grads=True, need_stats=True)
        if (pair, True) in {(p, mat) for p, _, mat in CHECK_ORDER}:
            loss_and_grads("triton", student, guide, _options(matryoshka_dims(dim)), need_grads=True)
        print(f"warm: {pair}", flush=True)


def summary(rows: list[dict]) -> str:
    """The figures that settle the design: each loss stage against its estimate, and the targets."""
    stage = {(r["impl"], r["dtype"], r["B"]): r for r in rows if r["op"] == "fwd+bwd" and r["impl"].startswith("triton")}
    shapes = sorted({f"D={r['D']}, Dg={r['Dg']}, k={r['k']}" for r in stage.values()})
    lines = [f"loss stage fwd+bwd ({'; '.join(shapes)}), measured against the estimate by count:"]
    for (impl, pair, batch), r in sorted(stage.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
        lines.append(f"  {pair:10} B={batch:<6} {impl:16} {r['median_ms']:9.2f} ms  peak {r['peak_mb']:8.0f} MB  {r['note']}")
    big = max((b for _, _, b in stage), default=None)
    bf16 = stage.get(("triton/gemm", "bf16", big))
    fp32 = stage.get(("triton/gemm", "fp32", big))
    if bf16 is not None:
        lines.append(f"target: bf16 at B={big} <= 250 ms: {bf16['median_ms']:.1f} ms "
                     f"({'met' if bf16['median_ms'] <= 250 else 'missed'})")
    if bf16 is not None and fp32 is not None:
        ratio = fp32["median_ms"] / bf16["median_ms"]
        lines.append(f"target: fp32 (tf32x3) <= 2x bf16 at B={big}: {ratio:.2f}x ({'met' if ratio <= 2 else 'missed'})")
    for (impl, pair, batch), r in sorted(stage.items(), key=lambda item: (item[0][1], -item[0][2])):
        one = stage.get(("triton/gemm", pair, batch))
        if "-mat" not in impl or one is None:
            continue
        ratio, est_ratio = r["median_ms"] / one["median_ms"], _estimated_ms(r) / _estimated_ms(one)
        lines.append(f"target: {impl.split('-mat')[1]} Matryoshka dims <= {MATRYOSHKA_TARGET}x one dimension "
                     f"({pair}, B={batch}): {ratio:.2f}x measured, {est_ratio:.2f}x by count "
                     f"({'met' if ratio <= MATRYOSHKA_TARGET else 'missed'})")
    return "\n".join(lines)


def _estimated_ms(row: dict) -> float:
    """The spec estimate a measured row carries in its note (``est=...ms``)."""
    return float(re.search(r"\best=([0-9.e+-]+)ms", row["note"]).group(1))


def _format(rows: list[dict], header: bool = True) -> str:
    cols = ["impl", "op", "B", "D", "Dg", "dtype", "median_ms", "peak_mb", "note"]
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [" ".join(c.ljust(w) for c, w in zip(cols, widths))] if header else []
    lines += [" ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["kernels", "check", "warmup", "estimates"], default="kernels")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--guide-dim", type=int, default=384)
    parser.add_argument("--negatives", type=int, default=1)
    parser.add_argument("--dtype", nargs="+", default=None, choices=list(PAIRS))
    parser.add_argument("--mm-size", type=int, default=8192, help="side of the torch.mm ceiling GEMM")
    parser.add_argument("--copy-mib", type=int, default=1024, help="MiB copied for the bandwidth row")
    parser.add_argument("--l2-kib", type=int, default=24 * 1024, help="KiB of the resident buffer the L2 row re-reads")
    parser.add_argument("--l2-reps", type=int, default=64, help="reads of that buffer")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="skip what would start after this")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    pairs = args.dtype or (["bf16", "fp32", "bf16+fp32"] if args.suite == "check" else ["bf16"])
    if DEVICE.type != "cuda":
        print("no CUDA GPU: smoke test under the Triton interpreter, the numbers mean nothing", file=sys.stderr)
    if args.suite == "warmup":
        warmup(pairs, args.dim, args.guide_dim, args.negatives, *(args.batch or [])[:1])
        return 0
    if args.suite == "estimates":
        rows = [r for pair in (args.dtype or ["bf16", "fp32", "bf16+fp32"]) for batch in (args.batch or [16384, 65536])
                for r in paper_estimates(batch, args.dim, args.guide_dim, args.negatives, pair,
                                         matryoshka_dims(args.dim), DIRECTIONS)]
        print(_format(rows))
        return 0

    start = time.time()
    rows, calibrated = calibrations(args.mm_size, args.copy_mib * 2**20, args.l2_kib * 1024, args.l2_reps)
    print(_format(rows), flush=True)
    machines = {"spec": SPEC, "calibrated": calibrated}
    if args.batch:  # the check adds Matryoshka for the first pair
        runs = [(pair, batch, False) for pair in pairs for batch in args.batch]
        runs += [(pairs[0], batch, True) for batch in args.batch if args.suite == "check"]
    elif args.suite == "check":  # what settles the design first, in case the time budget runs out
        runs = [run for run in CHECK_ORDER if run[0] in pairs]
    else:
        runs = [(pair, batch, False) for pair in pairs for batch in (4096, 16384)]
    rows += tie_id_rows(max(batch for _, batch, _ in runs), args.guide_dim, torch.float32, "fp32")
    if args.suite == "check":  # by count: the four directions at the shape bench/loss_stage.py --directions times
        rows += [r for pair in pairs for r in paper_estimates(*DIRECTIONS_SHAPE, pair, directions=DIRECTIONS)
                 if r["impl"] in ("estimate/gemm", f"estimate/gemm-dir{len(DIRECTIONS)}")]
    skipped = []
    for pair, batch, matryoshka in runs:
        if time.time() - start > args.budget_s:
            skipped.append(f"{pair} B={batch}{' Matryoshka' if matryoshka else ''}")
            continue
        rows += stage_rows(batch, args.dim, args.guide_dim, args.negatives, pair, machines,
                           matryoshka_dims(args.dim) if matryoshka else None)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    name = "gpu_check" if args.suite == "check" else "kernel_bench"
    path = write_csv(args.out / f"{name}.csv", rows)
    table = _format(rows) + "\n\n" + summary(rows)
    if DEVICE.type != "cuda":
        table = _simulated_note() + "\n" + table
    if skipped:
        table += f"\nskipped (time budget of {args.budget_s:.0f} s): {', '.join(skipped)}"
    (args.out / f"{name}.txt").write_text(table + "\n")
    print(f"\nwrote {path}\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
