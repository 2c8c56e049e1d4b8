"""Property-based fuzzing of ``cgist.gist_loss`` (both backends) against the float64 oracle.

What is drawn. Hypothesis draws the shapes (B, N = B * world, D, Dg, k), the offset, the temperature (log-uniform in
[1e-4, 10]), the margin (both signs, including margins that mask every candidate but the positive, or none), the
strategy, and every other option of ``GistOptions``: the GIST blocks, ``mask_self``, ``mask_duplicates`` (with text
ids, which then also decide the guide's ties), the directions with their partition mode and, for the directions
that score the anchors, every rank's anchors as one more column (``all_anchors``), the hardness mode and strength,
Matryoshka dimensions and weights, the similarity (cosine or dot product) and the workspace budget ``block_bytes``;
the guide (Gaussian rows, lattice rows, the student itself, or none) and the dtype (fp32 and fp64 on both backends,
bf16 and fp16 inputs on the PyTorch path). Then it edits rows: copies (duplicate texts, duplicates of a positive),
negations, zero vectors, power-of-two rescales and small perturbations (cosines near +-1).

Schedules. The PyTorch path cuts its anchors into row blocks of at least min(256, B) rows
(``cgist.stage.budget.row_blocks``), so about one example in eight draws B in [257, 320], with D, Dg <= 16 and k <= 1
(the oracle is dense), and a budget that forces several row blocks, in one pass or in two; the others draw B <= 8 and
either the default budget or one that forces two passes over tiles of a few columns. The budget is found by bisection
on ``row_blocks`` itself, so it follows the production formula. The Triton fuzz draws the interpreter's tile
(BLOCK_M x BLOCK_N x BLOCK_K, put in place of the kernel's one interpreter config while the example runs: a few
rows, so that B in (BLOCK_M, 2 BLOCK_M] and N in (BLOCK_N, ~2 BLOCK_N] cross a second row and column tile, and D a
second K tile, at the interpreter's cost of a few tiles) and a budget that cuts the backward into several chunks of
rows or of columns (found by bisection on ``cgist.stage.budget.backward_chunks``). On a GPU the kernels keep their
own tiles and B goes past the largest BLOCK_M of the tables.

How masks are compared honestly. A candidate is masked when its guide score is strictly greater than the
threshold T_i. The implementation decides that in its compute dtype (float32 for fp32, bf16 and fp16 inputs, which
it upcasts; float64 for fp64), the oracle in float64, so a guide score within rounding of T_i may legitimately fall
on different sides. Such draws are rejected by construction (``assume``), with the band set at 256 units of rounding
of the compute dtype, scaled by max(1, |T_i|), which is several times the worst-case error of a guide score with
Dg <= 64. Exact ties are not rounding noise, though: a bitwise duplicate of the positive must compare equal to
theta_i. Two guide modes cover both:
  * "real": Gaussian guide rows. Dot products of equal vectors are not reproducible across matrix products
    of different shapes here (BLAS picks different kernels), so real-valued exact ties are borderline too
    and are rejected like any other near-tie.
  * "lattice": every guide row has 1, 4 or 16 entries of +-2^e and zeros elsewhere, so its norm is a power
    of two and every normalised dot product is exact in any dtype and any summation order. Exact ties
    (gap == 0) are then kept, and the tie rule, self-pairs and fully masked rows are checked exactly.
"self" (the student as its own guide) is real-valued like "real". With B > 256 there are ~10^6 guide scores, and
some would always fall in a float32 band: large examples take the lattice guide or none, or real rows in fp64.
The tie rule on real-valued rows is pinned separately (``test_real_valued_duplicate_of_positive_is_a_tie``).
Student rows are never constrained: they only move values, not mask decisions.

Tolerances, from the rounding and the scale of each quantity (docs/design.md#the-loss). Let u be the unit roundoff
of the compute dtype (2^-24 for fp32, bf16 and fp16 inputs, 2^-53 for fp64):
  * A score is the dot product of two normalised rows: its error is at most ~(2D + 8) u times the largest score
    magnitude a row's entries can have (1 for cosines; ||x_i|| ||y_j|| for dot products). A logit is a score over
    tau plus the hardness penalty h * score, so its error is at most (2D + 8) u Z_i, with Z_i = (1/tau + h) times
    that magnitude for row i (over the row's unmasked entries, per Matryoshka dimension d: Z_i,d).
  * A softmax entry moves by at most 2 dz times itself for logit errors dz, and the blocked sums and products (BLAS,
    tiles) and the normalisation backward round far less than once per term. With K = 4 (D + 16) = 2 (2D + 8) + 48
    (twice the logit error, for the softmax, and 48 u for the rest):
  * The loss is a mean over rows of log-sum-exps minus the positive logit, and a log-sum-exp moves by at most the
    largest change of its logits: |loss error| <= K u sum_d |w_d| mean_i (1 + Z_i,d) (w_d the Matryoshka weights; 1
    without).
  * A gradient entry is sum_j G_ij dS_ij/dx over the score gradients G = dL/dS = w_d (softmax - onehot) / (tau B)
    (every one carries the 1/B of the mean), so its error is at most K u W, with W = sum_j A_ij (1 + Z_i,d)
    |dS_ij/dx| over every group and dimension where the entry's row is the row operand or the column operand,
    A = |G| plus w_d / (tau B) at each label (the label's -w_d/(tau B), which the oracle forms in float64 by
    cancellation), and |dS/dx| = 2 / max(||x[:d]||, 1e-8) for a cosine of the d-prefix (a unit vector through the
    projection of the normalisation), ||y[:d]|| for a dot product. G is the oracle's own: the score matrices of
    ``score_groups`` are captured while the oracle runs and differentiated with the embeddings. The streaming path
    also drops every softmax term below 2^(log2(smallest normal) + 24) of its shift (2^-102 in float32), all of
    whose weight is lost: W_dropped, the same sum over the unmasked entries with A = w_d 2^-102 / (tau B), is added.
  * Half inputs: the loss is computed in float32 from the same rounded inputs, so the float32 rule holds; each
    gradient is rounded to its dtype at the end, one more relative error of u_h of the entry itself (its unit
    roundoff: 2^-8 for bf16, 2^-11 for fp16; plus half of fp16's smallest subnormal, which no relative error covers,
    and an entry that may pass fp16's largest value, 65504, as a zero row's divided by 1e-8 can, must be the
    infinity of its sign). On a GPU the PyTorch path also multiplies the softmax weights and the normalised rows as
    half operands (``cgist.stage.numerics.half_products``), a relative error of u_h each: 2 u_h W more there.
The largest error/tolerance ratios are reported to Hypothesis as targets, per dtype (``--hypothesis-show-statistics``
prints them). In the "ci" profile the largest are, on the PyTorch path, 0.098 (fp32), 0.074 (fp64), 0.048 (bf16) and
0.0099 (fp16) for the loss and 0.037 (fp32) and 0.033 (fp64) for the gradients; through the Triton interpreter 0.019
and 0.0097 for the loss, 0.0068 and 0.0048 for the gradients. No comparison's largest is below 0.004: no tolerance is
more than ~250 times the largest error it meets. Half gradients reach 0.97, their final rounding being exactly at its
bound when it dominates.

Profiles: CI runs "ci" (a few hundred examples per test). The ``slow``-marked tests run the profile named
by CGIST_HYPOTHESIS_PROFILE (default "long", 10,000 examples):
    CGIST_HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py -m slow -q --hypothesis-show-statistics
The Triton backend runs a fifteenth of each budget (20 examples in "ci"), on smaller shapes, because the interpreter
is slow, and slower with every tile an example crosses.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from helpers import DEVICE, DTYPES, TOL, gist_loss_kwargs, loss_kwargs, make_inputs, one_thread, precision  # noqa: F401  (one_thread: autouse)
from hypothesis import HealthCheck, Phase, assume, event, given, settings, target
from hypothesis import strategies as st

import cgist
from cgist import GistOptions
from cgist.stage import reference
from cgist.stage.budget import backward_chunks, row_blocks
from cgist.stage.numerics import half_products, threshold
from cgist.stage.reference import gist_loss_reference, gist_scores
from cgist.stage.spec.options import ANCHOR_DIRECTIONS, HARDNESS_MODES

# "ci" replays the same examples on every run (a red CI is a bug, not bad luck); "long" explores afresh. The error /
# tolerance ratios are reported as targets; "ci" leaves out the phase that climbs toward them, which would spend its
# examples on variations of the few that score highest, and "long" keeps it, to search for a tolerance's edge.
settings.register_profile(
    "ci", max_examples=300, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow], phases=[phase for phase in Phase if phase != Phase.target],
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
CI = settings.get_profile("ci")
LONG = settings.get_profile(os.environ.get("CGIST_HYPOTHESIS_PROFILE", "long"))

PRECISIONS = ("fp32", "fp64")
#: The PyTorch path also takes half inputs, which it upcasts to float32.
TORCH_PRECISIONS = ("fp32", "fp64", "bf16", "fp16")
#: The dtype each input dtype computes in (cgist.stage.numerics.compute_dtype).
COMPUTE = {name: torch.float64 if name == "fp64" else torch.float32 for name in TORCH_PRECISIONS}
#: Near-tie band of the guide's mask decisions, in the compute dtype (see the module docstring).
BAND = {name: 256 * torch.finfo(COMPUTE[name]).eps for name in TORCH_PRECISIONS}
#: Unit roundoff of the compute dtype, and of each input dtype (the gradients are rounded to it).
UNIT = {name: torch.finfo(COMPUTE[name]).eps / 2 for name in TORCH_PRECISIONS}
INPUT_UNIT = {name: torch.finfo(DTYPES[name]).eps / 2 for name in TORCH_PRECISIONS}
#: 0: the default; +-2 and 2.5: exact ties and "everything but the positive masked" on the lattice;
#: 1e4 masks every candidate but the positive (relative too, when theta != 0); -1e4 masks none.
SPECIAL_MARGINS = (0.0, 2.0, -2.0, 2.5, 1e4, -1e4)
KINDS = ("copy", "negate", "zero", "rescale", "perturb")
OTHER_DIRECTIONS = ("query_to_query", "doc_to_query", "doc_to_doc")  # "query_to_doc" is always there
#: One PyTorch example in BIG_ODDS draws B in BIG_BATCH, beyond one row block (min(256, B) rows at least).
BIG_ODDS, BIG_BATCH, BIG_DIM = 8, (257, 320), 16
#: Interpreter tiles (BLOCK_M, BLOCK_N, BLOCK_K) of the Triton fuzz: small, so that a few rows cross a second tile (the
#: interpreter's time goes by tiles); BLOCK_M below, above and equal to BLOCK_N, and BLOCK_K below most D.
INTERPRETER_TILES = ((2, 4, 4), (4, 2, 8), (2, 2, 16))
#: The largest BLOCK_M / BLOCK_N of the GPU tile tables (cgist.stage.triton.tiles): B and N beyond them on a GPU.
GPU_TILE = (128, 128)


@dataclass(frozen=True)
class Edit:
    """Row ``dst`` of column ``dst_col`` becomes a function of row ``src`` of ``src_col`` on ``side``."""

    kind: str
    side: str  # "student", "guide" or "both" (a duplicated text)
    dst_col: int
    dst: int
    src_col: int
    src: int
    amount: float  # perturb: log10 of the relative noise; rescale: the power of two


@dataclass(frozen=True)
class Spec:
    """Everything a case is built from; hypothesis prints it on failure."""

    dtype: str
    batch: int
    world: int
    dim: int
    guide_dim: int
    k: int
    options: GistOptions  # with ``all_anchors`` the last column holds every rank's anchors
    guide: str  # "real", "lattice", "self" (the student) or "none"
    text_ids: bool  # whether the call gets text ids (always with mask_duplicates)
    seed: int
    edits: tuple[Edit, ...]
    schedule: str = "default"  # what the budget was drawn to force
    tiles: tuple[int, int, int] | None = None  # the Triton interpreter's (BLOCK_M, BLOCK_N, BLOCK_K)

    @property
    def lattice(self) -> bool:
        return self.guide == "lattice"

    @property
    def rows(self) -> list[int]:
        """Rows of each column: the anchors, then the positives, the negatives and every rank's anchors (N each)."""
        return [self.batch] + [self.batch * self.world] * (self.k + 1 + self.options.all_anchors)


def _widths(options: GistOptions, rows: list[int]) -> list[int]:
    """Columns of each column group of a call with these column sizes (``GistOptions.column_groups``)."""
    return [rows[g.column] for g in options.column_groups(len(rows))[0]]


def _smallest(ok, high: int = 2**40) -> int:
    """The smallest budget in [1, high] that satisfies ``ok``, by bisection (``ok(high)`` must hold; ``ok`` is
    monotone: a larger budget never cuts finer)."""
    low = 1
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return high


def _streaming_budget(draw, dtype: str, options: GistOptions, rows: list[int], top: int) -> tuple[int | None, str]:
    """``(block_bytes, schedule)``: a budget that makes the streaming path cut the call as drawn.

    With B > 256: several row blocks, in one pass or in two; otherwise the default (one block, one pass) or two passes
    over tiles of a few columns. Found by bisection on ``row_blocks`` with the arguments the streaming path gives it.
    """
    batch, widths, n_dims = rows[0], _widths(options, rows), len(options.dims(top))
    half = half_products(torch.device(DEVICE), DTYPES[dtype]) is not None and n_dims == 1
    itemsize = torch.finfo(COMPUTE[dtype]).bits // 8

    def plan(block_bytes: int):
        return row_blocks(batch, widths, top, n_dims, itemsize, block_bytes, torch.device(DEVICE), half=half)

    floor = min(256, batch)
    schedule = draw(st.sampled_from(("blocks", "two-pass blocks") if batch > floor else ("default", "two-pass")))
    if schedule == "default":
        return None, schedule
    if schedule == "blocks":
        want = draw(st.integers(floor, batch - 1))
        block_bytes = _smallest(lambda b: plan(b).one_pass and plan(b).rows >= want)
    else:
        # the widest tile two passes reach, just below the budget of one pass (at most the tile of one pass)
        widest = plan(_smallest(lambda b: plan(b).one_pass) - 1).cols
        # tiles of a few columns are cheap with a few rows; with hundreds, at least 64 columns keep the count down
        want = draw(st.integers(1 if batch <= 8 else min(64, widest), widest))
        block_bytes = _smallest(lambda b: plan(b).one_pass or plan(b).cols >= want)
    got = plan(block_bytes)
    # the draw is what it says (a check of this test's construction, not of the package)
    assert got.one_pass == (schedule == "blocks") and (got.rows < batch or schedule == "two-pass"), (schedule, got)
    return block_bytes, schedule


def _chunk_budget(draw, dtype: str, options: GistOptions, rows: list[int], top: int,
                  tiles: tuple[int, int, int] | None) -> tuple[int | None, str]:
    """``(block_bytes, schedule)``: a budget that cuts the Triton backward into several chunks of rows or of columns,
    found by bisection on ``backward_chunks`` with the arguments the launcher gives it. On a GPU, whose tiles the
    autotuner picks at run time, a small budget drawn log-uniformly."""
    if tiles is None:
        return 2 ** draw(st.integers(12, 24)), "gpu budget"
    from cgist.stage.triton.common import input_precision

    batch, widest, n_dims = rows[0], max(_widths(options, rows)), len(options.dims(top))
    parts = 2 if input_precision(DTYPES[dtype]) == "tf32x3" else 1  # fp32 operands split for tf32x3 products
    itemsize = torch.finfo(DTYPES[dtype]).bits // 8
    shape = {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}

    def plan(block_bytes: int):
        return backward_chunks(batch, widest, shape, n_dims, parts * itemsize, itemsize, block_bytes,
                               torch.device(DEVICE))

    bm, bn = tiles[:2]
    schedule = draw(st.sampled_from(("row chunks", "column chunks")))
    if schedule == "row chunks":
        want = bm * draw(st.integers(1, -(-batch // bm) - 1))
        block_bytes = _smallest(lambda b: plan(b).cols == widest and plan(b).rows >= want)
    else:
        want = bn * draw(st.integers(1, -(-widest // bn) - 1))
        block_bytes = _smallest(lambda b: plan(b).rows > bm or plan(b).cols >= want)
    got = plan(block_bytes)
    assert got.rows < batch or got.cols < widest, (schedule, got)  # several chunks: this test's construction
    return block_bytes, schedule


@st.composite
def specs(draw, backend: str = "torch", max_batch: int = 8, max_world: int = 3, max_dim: int = 64,
          max_edits: int = 8, max_k: int = 3, max_dims: int = 3) -> Spec:
    tiles, interpreted = None, os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton":  # B and N beyond one tile, not far beyond: the interpreter's time goes by tiles
        tiles = draw(st.sampled_from(INTERPRETER_TILES)) if interpreted else None
        block_m, block_n = tiles[:2] if tiles else GPU_TILE
        batch = draw(st.integers(block_m + 1, 2 * block_m))
        fewest = -(-(block_n + 1) // batch)  # the fewest ranks for N > BLOCK_N
        world = draw(st.integers(fewest, max(fewest, min(max_world, 2 * block_n // batch))))
        big, precisions = False, PRECISIONS
    else:
        big = draw(st.integers(0, BIG_ODDS - 1)) == BIG_ODDS - 1  # shrinks toward small
        batch = draw(st.integers(*BIG_BATCH)) if big else draw(st.integers(1, max_batch))
        world = draw(st.integers(1, 2 if big else max_world))
        precisions = TORCH_PRECISIONS
    if big:  # large B only with small rows and few columns: the oracle is dense
        max_dim, max_edits = BIG_DIM, 2 * max_edits
    n_cand = batch * world
    offset = draw(st.one_of(st.integers(0, world - 1).map(lambda rank: rank * batch), st.integers(0, n_cand - batch)))
    k = draw(st.integers(0, 1 if big else max_k))
    # The options. "per_direction" needs every direction to hold the positive pair: query-to-document and
    # document-to-query only, without GIST's contrast blocks; query-to-query and document-to-document contain them.
    partition_mode = draw(st.sampled_from(("joint", "per_direction")))
    if partition_mode == "per_direction":
        directions = ("query_to_doc", *(("doc_to_query",) if draw(st.booleans()) else ()))
        contrast_anchors = contrast_positives = False
    else:
        directions = ("query_to_doc", *draw(st.lists(st.sampled_from(OTHER_DIRECTIONS), unique=True, max_size=3)))
        contrast_anchors = "query_to_query" not in directions and draw(st.booleans())
        contrast_positives = "doc_to_doc" not in directions and draw(st.booleans())
    all_anchors = any(d in ANCHOR_DIRECTIONS for d in directions) and draw(st.booleans())
    hardness_mode = draw(st.sampled_from(HARDNESS_MODES))
    hardness_strength = draw(st.sampled_from((0.0, 1.0)) | st.floats(0.0, 20.0))
    similarity = draw(st.sampled_from(("cos", "dot")))
    rows = [batch] + [n_cand] * (k + 1 + all_anchors)
    magnitude = draw(st.one_of(st.sampled_from(SPECIAL_MARGINS), st.floats(0.01, 3.0)))
    edits = []
    for _ in range(draw(st.integers(0, max_edits))):
        kind = draw(st.sampled_from(KINDS))
        dst_col = draw(st.integers(0, len(rows) - 1))
        if draw(st.booleans()):  # from the positive of some anchor: ties and near-ties with theta
            src_col, src = 1, offset + draw(st.integers(0, batch - 1))
        else:
            src_col = draw(st.integers(0, len(rows) - 1))
            src = draw(st.integers(0, rows[src_col] - 1))
        amount = draw(st.floats(-6, -1)) if kind == "perturb" else float(draw(st.integers(-10, 10)))
        side = draw(st.sampled_from(("student", "guide", "both")))
        edits.append(Edit(kind, side, dst_col, draw(st.integers(0, rows[dst_col] - 1)), src_col, src, amount))
    # Drawn in this order: dtype, dims, Matryoshka, temperature, margin sign, strategy, flags, guide, budget, seed.
    dtype = draw(st.sampled_from(precisions))
    dim, guide_dim = draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim))
    matryoshka_dims = matryoshka_weights = None
    if draw(st.integers(0, 3)) == 3:  # one in four; shrinks toward none
        matryoshka_dims = tuple(draw(st.lists(st.integers(1, dim), min_size=1, max_size=max_dims, unique=True)))
        if draw(st.booleans()):  # signed weights, none near 0 (a zero weight would make its dimension vacuous)
            signs = draw(st.lists(st.booleans(), min_size=len(matryoshka_dims), max_size=len(matryoshka_dims)))
            sizes = draw(st.lists(st.floats(0.125, 2.0), min_size=len(matryoshka_dims), max_size=len(matryoshka_dims)))
            matryoshka_weights = tuple(-w if s else w for s, w in zip(signs, sizes))
    mask_duplicates = draw(st.booleans())
    options = GistOptions(
        temperature=min(10.0, 10.0 ** draw(st.floats(-4, 1))),
        margin=magnitude if draw(st.booleans()) else -magnitude,
        margin_strategy=draw(st.sampled_from(("absolute", "relative"))),
        contrast_anchors=contrast_anchors, contrast_positives=contrast_positives,
        mask_self=draw(st.booleans()), mask_duplicates=mask_duplicates,
        directions=directions, partition_mode=partition_mode,
        hardness_mode=hardness_mode, hardness_strength=hardness_strength, similarity=similarity,
        all_anchors=all_anchors, offset=offset,
        matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights,
    )
    # ~10^6 real-valued guide scores would always put some within a float32 band of their threshold
    guides = ("real", "lattice", "self", "none") if not big or dtype == "fp64" else ("lattice", "none")
    guide = draw(st.sampled_from(guides))
    text_ids = mask_duplicates or draw(st.booleans())
    top = max(matryoshka_dims) if matryoshka_dims else dim
    if backend == "triton":
        block_bytes, schedule = _chunk_budget(draw, dtype, options, rows, top, tiles)
    else:
        block_bytes, schedule = _streaming_budget(draw, dtype, options, rows, top)
    return Spec(
        dtype=dtype, batch=batch, world=world, dim=dim, guide_dim=guide_dim, k=k,
        options=options.replace(block_bytes=block_bytes), guide=guide, text_ids=text_ids,
        seed=draw(st.integers(0, 2**32 - 1)), edits=tuple(edits), schedule=schedule, tiles=tiles,
    )


def _lattice_rows(rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Rows with c in {1, 4, 16} (c <= dim) entries of +-2^e, zeros elsewhere: norms are powers of two."""
    out = torch.zeros(rows, dim, dtype=torch.float64)
    counts = [c for c in (1, 4, 16) if c <= dim]
    for row in out:
        count = counts[int(torch.randint(len(counts), (), generator=gen))]
        where = torch.randperm(dim, generator=gen)[:count]
        signs = torch.randint(2, (count,), generator=gen, dtype=torch.float64) * 2 - 1
        row[where] = signs * 2.0 ** int(torch.randint(-3, 4, (), generator=gen))
    return out


def _apply(edit: Edit, columns: list[torch.Tensor], gen: torch.Generator, exact: bool) -> None:
    """Apply one edit in place; ``exact`` (lattice guide) turns a perturbation into a copy."""
    src = columns[edit.src_col][edit.src].clone()
    kind = "copy" if exact and edit.kind == "perturb" else edit.kind
    if kind == "copy":
        new = src
    elif kind == "negate":
        new = -src
    elif kind == "zero":
        new = torch.zeros_like(src)
    elif kind == "rescale":
        new = columns[edit.dst_col][edit.dst] * 2.0**edit.amount
    else:
        noise = torch.randn(src.shape, generator=gen, dtype=torch.float64)
        new = src + 10.0**edit.amount * src.norm() / math.sqrt(src.numel()) * noise
    columns[edit.dst_col][edit.dst] = new


def build(spec: Spec) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Student columns, guide columns (None for the "self" and "none" guides) and text ids (None unless the call
    gets them) of ``spec``, in its dtype; with ``all_anchors`` the last column holds every rank's anchors, this
    rank's (the anchor column itself: same vectors, same texts) at the offset."""
    gen = torch.Generator().manual_seed(spec.seed)
    options, rows = spec.options, spec.rows
    student, guide = make_inputs(spec.batch, rows[1], spec.dim, spec.guide_dim, len(rows) - 2, seed=gen)
    if options.similarity == "dot":  # rows of norm ~1, as cosines have: logits of ~1/tau
        student = [s / math.sqrt(spec.dim) for s in student]
    if spec.lattice:
        guide = [_lattice_rows(g.shape[0], spec.guide_dim, gen) for g in guide]
    own_guide = spec.guide in ("real", "lattice")
    # One text per row; an edit that copies every vector of a row (student and, if any, its own guide) copies its
    # text, any other edit makes a new one.
    texts = list(torch.arange(sum(rows)).split(rows))
    fresh = sum(rows)
    for edit in spec.edits:
        on_student = edit.side in ("student", "both")
        on_guide = edit.side in ("guide", "both") and own_guide
        if on_student:
            _apply(edit, student, gen, exact=False)
        if on_guide:
            _apply(edit, guide, gen, exact=spec.lattice)
        if edit.kind == "copy" and on_student and (on_guide or not own_guide):
            texts[edit.dst_col][edit.dst] = texts[edit.src_col][edit.src]
        elif on_student or on_guide:
            texts[edit.dst_col][edit.dst], fresh = fresh, fresh + 1
    if options.all_anchors:
        here = slice(options.offset, options.offset + spec.batch)
        for columns in (student, guide, texts):
            columns[-1][here] = columns[0]
    dtype = DTYPES[spec.dtype]
    return ([s.to(dtype) for s in student], [g.to(dtype) for g in guide] if own_guide else None,
            texts if spec.text_ids else None)


def guide_gaps(spec: Spec, guide: list[torch.Tensor], text_ids: list[torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(guide score - T_i, T_i) of every score entry in float64, in the oracle's block order; NaN at the labels.

    The oracle's ``gist_scores`` with the guide as the student (cosines, one dimension) and a margin that masks nothing
    returns the guide scores themselves (-inf where a rule excludes the entry whatever its score).
    """
    guide64 = [g.double() for g in guide]
    options = spec.options.replace(margin=-3.0, margin_strategy="absolute", similarity="cos", matryoshka_dims=None,
                                   matryoshka_weights=None)
    scores = gist_scores(guide64, guide64, options, text_ids)
    rows = torch.arange(spec.batch)
    limit = threshold(scores[rows, rows + options.offset].unsqueeze(1), spec.options.margin, spec.options.relative)
    gaps = scores - limit
    gaps[rows, rows + options.offset] = math.nan
    return gaps, limit


def admissible(spec: Spec, guide: list[torch.Tensor] | None, text_ids: list[torch.Tensor] | None) -> bool:
    """No mask decision within rounding of its threshold, except exact lattice ties; records coverage events."""
    event(f"guide {spec.guide}")
    if guide is None:
        return True
    gaps, limit = guide_gaps(spec, guide, text_ids)
    near = gaps.abs() < BAND[spec.dtype] * limit.abs().clamp_min(1.0)
    if spec.lattice:
        near &= gaps != 0
    if bool(near.any()):
        return False
    if bool((gaps == 0).any()):
        event("exact ties kept")
    labels = gaps.isnan()
    if bool((labels | (gaps > 0)).all()):
        event("every candidate but the positive masked")
    if bool((labels | (gaps <= 0)).all()):
        event("nothing masked")
    return True


def _oracle(student: list[torch.Tensor], guide: list[torch.Tensor] | None, options: GistOptions,
            text_ids: list[torch.Tensor] | None):
    """The oracle's loss and gradients on the same (upcast) inputs, with its score groups (one list per Matryoshka
    dimension, in the order of ``matryoshka_dims``) and their score gradients dL/dS.

    The groups are captured as ``gist_loss_reference`` gets them from ``score_groups``; nothing in them is changed.
    """
    leaves = [s.double().requires_grad_() for s in student]
    calls, score_groups = [], reference.score_groups

    def captured(*args, **kwargs):
        calls.append(score_groups(*args, **kwargs))
        return calls[-1]

    with mock.patch.object(reference, "score_groups", captured):
        loss = gist_loss_reference(leaves, None if guide is None else [g.double() for g in guide], options, text_ids)
    scores = [group.scores for groups in calls for group in groups]
    grads = torch.autograd.grad(loss, leaves + scores)
    return loss.detach(), grads[: len(leaves)], calls, grads[len(leaves):]


def _scales(student: list[torch.Tensor], options: GistOptions, calls, score_grads, compute: torch.dtype):
    """The scales of the module docstring's tolerances, from the oracle's score groups and score gradients.

    Returns ``(loss_scale, plain, scaled, dropped)``: sum_d |w_d| mean_i (1 + Z_i,d) for the loss, and per column (a
    tensor over its rows) W = sum_j A_ij |dS_ij/dx| without and with the factor (1 + Z_i,d) of each score's row, and
    the most the terms the streaming path drops can weigh there: it drops every softmax term below 2^cutoff of the
    largest it shifts by (cutoff = log2(smallest normal) + 24 of the compute dtype: -102 in float32), so such an
    entry's |G| is below |w_d| 2^cutoff / (tau B), all of which is lost. Z_i,d = (1/tau + h) times the largest |score|
    row i's unmasked entries can have: 1 for cosines, ||x_i[:d]|| ||y_j[:d]|| for dot products.
    """
    x = [s.detach().double() for s in student]
    tau, batch, offset = options.temperature, x[0].shape[0], options.offset
    rows = torch.arange(batch)
    labels = rows + offset
    cosine = options.similarity == "cos"
    specs_ = options.column_groups(len(x))[0]
    dims = options.matryoshka_dims or (x[0].shape[1],)
    weights = options.matryoshka_weights or (1.0,)
    plain, scaled, dropped = ([torch.zeros(c.shape[0], dtype=torch.float64) for c in x] for _ in range(3))
    loss_scale = 0.0
    cutoff = 2.0 ** (math.log2(torch.finfo(compute).tiny) + 24) / (tau * batch)
    grads = iter(score_grads)
    for d, w, groups in zip(dims, weights, calls):
        # the oracle's groups are the options' (DN_k counts as DD there), in the same order
        assert [{"dn": "dd"}.get(g.name, g.name) for g in groups] == [s.name for s in specs_]
        norms = [c[:, :d].norm(dim=1) for c in x]
        reach = [2.0 / n.clamp_min(1e-8) for n in norms]  # |d cos / dx| of a unit vector through the normalisation
        sides = [(0, rows) if s.row == "a" else (1, labels) for s in specs_]
        # Z of each row: its largest possible |score| over the unmasked entries of every group, times 1/tau + h
        largest = torch.ones(batch, dtype=torch.float64)
        if not cosine:
            largest = torch.stack([
                norms[side][index] * torch.where(torch.isfinite(g.scores), norms[s.column], 0.0).amax(dim=1)
                for s, g, (side, index) in zip(specs_, groups, sides)
            ]).amax(dim=0)
        one_z = 1.0 + largest * (1.0 / tau + options.hardness)
        loss_scale += abs(w) * float(one_z.mean())
        for s, g, (side, index) in zip(specs_, groups, sides):
            a = next(grads).abs()
            if s.label:  # the label's -w/(tau B), formed by cancellation in the oracle
                a[rows, labels] += abs(w) / (tau * batch)
            lost = abs(w) * cutoff * torch.isfinite(g.scores.detach()).double()
            for out, a_z in ((plain, a), (scaled, a * one_z.unsqueeze(1)), (dropped, lost)):
                if cosine:
                    out[side].index_add_(0, index, a_z.sum(dim=1) * reach[side][index])
                    out[s.column] += a_z.sum(dim=0) * reach[s.column]
                else:
                    out[side].index_add_(0, index, a_z @ norms[s.column])
                    out[s.column] += a_z.T @ norms[side][index]
    return loss_scale, plain, scaled, dropped


@contextlib.contextmanager
def _interpreter_tiles(tiles: tuple[int, int, int] | None):
    """The Triton forward's one interpreter config replaced by ``tiles`` while the body runs (the score-gradient
    kernel and the backward's chunks take the forward's pick); nothing without."""
    if tiles is None:
        yield
        return
    import triton

    from cgist.stage.triton.tiles import tuned_fwd_kernel

    config = triton.Config(dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), tiles)), num_warps=1, num_stages=1)
    interpreted = tuned_fwd_kernel(None)  # the CPU tensors' autotuner
    with mock.patch.object(interpreted, "configs", [config]):
        yield
    assert interpreted.best_config is config, "the kernel ran with another tile"


def _events(spec: Spec, student: list[torch.Tensor]) -> None:
    options = spec.options
    event(f"{spec.dtype}, {options.similarity}")
    event(f"schedule: {spec.schedule}")
    event(f"directions: {'+'.join(d.split('_')[0][0] + d.split('_')[-1][0] for d in options.directions)}, "
          f"{options.partition_mode}")
    if options.hardness:
        event(f"hardness {options.hardness_mode}")
    if options.matryoshka_dims:
        event("matryoshka")
    if options.mask_duplicates:
        event("mask_duplicates")
    if options.all_anchors:
        event("all_anchors")
    if options.temperature < 1e-3:
        event("tau < 1e-3")
    if any(bool((s == 0).all(dim=1).any()) for s in student):
        event("zero student row")


def _check(spec: Spec, backend: str) -> None:
    """gist_loss on ``spec`` equals the float64 oracle on the same (upcast) inputs within the module docstring's
    tolerances, and is finite."""
    student, guide, text_ids = build(spec)
    assume(all(bool(torch.isfinite(s).all()) for s in student))  # fp16 overflows past 65504 (rescaled twice)
    assume(admissible(spec, student if spec.guide == "self" else guide, text_ids))
    _events(spec, student)
    options, n = spec.options, spec.k + 2  # gist_loss takes every rank's anchors apart from its columns
    leaves = [s.to(DEVICE).requires_grad_() for s in student]
    kwargs = gist_loss_kwargs(options)
    if text_ids is not None:
        kwargs["text_ids"] = [t.to(DEVICE) for t in text_ids[:n]]
    if options.all_anchors:
        kwargs["all_anchors"] = leaves[-1]
        if guide is not None:
            kwargs["all_anchors_guide"] = guide[-1].to(DEVICE)
        if text_ids is not None:
            kwargs["all_anchors_text_ids"] = text_ids[-1].to(DEVICE)
    called_guide = "self" if spec.guide == "self" else None if guide is None else [g.to(DEVICE) for g in guide[:n]]
    with _interpreter_tiles(spec.tiles):
        loss = cgist.gist_loss(leaves[:n], called_guide, backend=backend, **kwargs)
        grads = torch.autograd.grad(loss, leaves)
    loss = loss.detach()
    expected, expected_grads, calls, score_grads = _oracle(student, student if spec.guide == "self" else guide,
                                                           options, text_ids)
    loss_scale, plain, scaled, dropped = _scales(student, options, calls, score_grads, COMPUTE[spec.dtype])

    dtype = student[0].dtype
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool(torch.isfinite(loss)), f"non-finite loss {loss}"
    unit, factor = UNIT[spec.dtype], 4 * (spec.dim + 16)
    loss_tol = factor * unit * loss_scale
    loss_error = abs(float(loss) - float(expected))
    target(loss_error / loss_tol, label=f"loss error / tolerance, {spec.dtype}")
    assert loss_error <= loss_tol, (f"loss {float(loss)!r}, oracle {float(expected)!r}: "
                                    f"error {loss_error:.3g} > {loss_tol:.3g}")

    half = dtype in (torch.bfloat16, torch.float16)
    rounding = INPUT_UNIT[spec.dtype] if half else 0.0  # the gradients' final rounding to the input dtype
    # On a GPU the half products' operands (softmax weights, normalised rows) are rounded to the input dtype too.
    operands = 2 * rounding if half and half_products(torch.device(DEVICE), dtype) is not None else 0.0
    # fp16's subnormal gradients round to a multiple of its smallest subnormal, which no relative rounding covers
    subnormal = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2 if half else 0.0
    worst = 0.0
    for i, (got, want, s) in enumerate(zip(grads, expected_grads, student)):
        assert got.dtype == dtype and got.shape == s.shape
        got = got.double().cpu()
        tol = ((factor * unit * scaled[i] * (1 + rounding) + operands * plain[i] + dropped[i]).unsqueeze(1)
               + rounding * want.abs() + subnormal)
        # An entry that may lie beyond the dtype's range (fp16's 65504: a zero row's gradient is divided by 1e-8)
        # rounds to the infinity of its sign, as the oracle's value would.
        overflow = torch.isinf(got) & (got.sign() == want.sign()) & (want.abs() + tol >= torch.finfo(dtype).max)
        assert bool((torch.isfinite(got) | overflow).all()), f"non-finite gradient of column {i}"
        error = torch.where(overflow, 0.0, got - want).abs()
        ratio = torch.where(error == 0, 0.0, error / tol)
        worst = max(worst, float(ratio.max()))
        if not bool((ratio <= 1).all()):
            r, c = divmod(int(ratio.argmax()), ratio.shape[1])
            raise AssertionError(f"gradient of column {i}, entry [{r}, {c}]: {float(got[r, c])!r}, oracle "
                                 f"{float(want[r, c])!r}, error {float(error[r, c]):.3g} > {float(tol[r, c]):.3g}")
        if bool(overflow.any()):
            event("gradient beyond the dtype's range")
    target(worst, label=f"gradient error / tolerance, {spec.dtype}")


def _fuzz(backend: str, profile: settings, **sizes) -> object:
    """A hypothesis test of ``backend`` under ``profile`` (a fifteenth of it for Triton), on ``specs(**sizes)``."""
    budget = profile.max_examples if backend == "torch" else max(10, profile.max_examples // 15)

    @settings(profile, max_examples=budget)
    @given(spec=specs(backend, **sizes))
    def test(spec: Spec) -> None:
        _check(spec, backend)

    return test


TRITON_SIZES = dict(max_world=3, max_dim=16, max_edits=6, max_k=1, max_dims=2)

test_torch_matches_oracle = _fuzz("torch", CI)
test_triton_matches_oracle = _fuzz("triton", CI, **TRITON_SIZES)
test_torch_matches_oracle_long = pytest.mark.slow(_fuzz("torch", LONG))
test_triton_matches_oracle_long = pytest.mark.slow(_fuzz("triton", LONG, **TRITON_SIZES))


def _tie_case(where: str, dtype: torch.dtype, seed: int) -> tuple[Spec, list[torch.Tensor], list[torch.Tensor]]:
    """Real-valued rows where, for anchor i, one candidate is a bitwise copy of its positive (student and guide).

    ``where`` puts the copy among the other positives (AP), the anchors (AA, as anchor i + 1, for even i) or the
    first negatives (AN); the candidate rows 0..B-1 used are never labels, since the offset is B.
    """
    spec = Spec(
        dtype=precision(dtype), batch=6, world=2, dim=12, guide_dim=10, k=1,
        options=GistOptions(temperature=0.05, margin=0.0, margin_strategy="absolute", offset=6),
        guide="real", text_ids=False, seed=seed, edits=(),
    )
    offset = spec.options.offset
    student, guide, _ = build(spec)
    labels = slice(offset, offset + spec.batch)
    student[0] = student[1][labels] + 0.3 * student[0]  # anchors near their positives, so that ties weigh
    column = {"positive": 1, "anchor": 0, "negative": 2}[where]
    # Anchor i + 1 becomes the copy for even i only, so that every anchor i with a tie keeps its own vectors.
    for i in range(0, spec.batch, 2) if where == "anchor" else range(spec.batch):
        row = i + 1 if where == "anchor" else i
        for side in (student, guide):  # a duplicated text: same student and guide vectors
            side[column][row] = side[1][offset + i]
    return spec, student, guide


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [DTYPES[name] for name in PRECISIONS], ids=PRECISIONS)
@pytest.mark.parametrize("where", ["positive", "anchor", "negative"])
def test_real_valued_duplicate_of_positive_is_a_tie(where, dtype, backend):
    """At margin 0, a guide candidate bitwise equal to the positive's has guide score == theta_i: kept, not masked.

    The expected loss is the oracle's with the margin moved by -eps, which keeps the ties whatever their
    rounding, with eps below every other entry's distance to its threshold (checked), so nothing else moves.
    Moving it by +eps masks them instead, which must change the loss (the case is not vacuous).
    """
    checked = 0
    for seed in range(12):
        spec, student, guide = _tie_case(where, dtype, seed)
        gaps, _ = guide_gaps(spec, guide)
        ties = gaps.abs() < BAND["fp64"]
        eps = gaps[~ties].abs().nan_to_num(math.inf).min().item() / 2
        if eps < 2 * BAND[precision(dtype)]:
            continue  # another entry lies within rounding of its threshold: not a clean tie case
        leaves = [s.double() for s in student]
        expected = gist_loss_reference(leaves, [g.double() for g in guide], spec.options.replace(margin=-eps))
        masked = gist_loss_reference(leaves, [g.double() for g in guide], spec.options.replace(margin=eps))
        loss = cgist.gist_loss(
            [s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide], backend=backend,
            **gist_loss_kwargs(spec.options),
        )
        atol = TOL["fuzz"][precision(dtype)] * (1 + 1 / spec.options.temperature)
        assert abs(float(masked) - float(expected)) > 100 * atol
        torch.testing.assert_close(loss.double().cpu(), expected, rtol=0, atol=atol, msg=lambda m: f"seed {seed}: {m}")
        checked += 1
    assert checked >= 4, f"only {checked} clean tie cases"


# Small losses keep their relative precision -------------------------------------------------------------------


def _precise_loss(student: list[torch.Tensor], guide: list[torch.Tensor], options: GistOptions) -> float:
    """The loss in float64, formed as mean_i log1p(sum over unmasked j != label of exp(z_ij - z_pos)).

    Written so that it is accurate to float64's relative precision however small the loss (the oracle's
    cross entropy carries the absolute rounding of numbers near 1/tau instead).
    """
    scores = gist_scores([s.double() for s in student], [g.double() for g in guide], options) / options.temperature
    rows = torch.arange(scores.shape[0])
    positive = scores[rows, rows + options.offset]
    others = torch.exp(scores - positive.unsqueeze(1))
    others[rows, rows + options.offset] = 0.0
    return float(torch.log1p(others.sum(dim=1)).mean())


@st.composite
def strong_positives(draw) -> tuple[list[torch.Tensor], list[torch.Tensor], GistOptions]:
    """fp32 inputs whose positives are near copies of their anchors, a few unrelated candidates, tau >= 0.05."""
    batch, world = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    dim, guide_dim, k = draw(st.integers(8, 32)), draw(st.integers(2, 16)), draw(st.integers(0, 2))
    options = GistOptions(
        temperature=draw(st.floats(0.05, 0.25)), margin=draw(st.sampled_from([0.0, 0.05, -0.02])),
        contrast_anchors=draw(st.booleans()), contrast_positives=draw(st.booleans()),
        offset=batch * draw(st.integers(0, world - 1)),
    )
    student, guide = make_inputs(batch, batch * world, dim, guide_dim, k, seed=draw(st.integers(0, 2**32 - 1)))
    labels = slice(options.offset, options.offset + batch)
    closeness = 10.0 ** draw(st.floats(-3.0, -1.0))
    student[1][labels] = student[0] + closeness * student[1][labels]
    return [s.float() for s in student], [g.float() for g in guide], options


def _small_loss_case(backend: str, budget: int) -> object:
    @settings(CI, max_examples=budget, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=strong_positives())
    def test(case) -> None:
        student, guide, options = case
        expected = _precise_loss(student, guide, options)
        assume(0.0 < expected < 1e-3)
        event(f"loss < 1e-{min(12, int(-math.log10(expected)))}")
        got = float(cgist.gist_loss([s.to(DEVICE) for s in student], [g.to(DEVICE) for g in guide],
                                    backend=backend, **loss_kwargs(options), offset=options.offset))
        # A logit is known to ~D float32 roundings over tau; the loss, a sum of exp(logit gaps), to that relative.
        bound = TOL["fuzz"]["fp32"] * (1.0 + 1.0 / options.temperature)
        assert abs(got - expected) <= bound * expected, f"relative error {abs(got - expected) / expected:.3g} > {bound:.3g}"

    return test


test_torch_small_losses_keep_relative_precision = _small_loss_case("torch", 150)
test_triton_small_losses_keep_relative_precision = _small_loss_case("triton", 20)
