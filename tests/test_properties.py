"""Property-based fuzzing of ``cgist.gist_loss`` (both backends) against the float64 oracle.

Hypothesis draws the shapes (B, N = B * world, D, Dg, k), the offset, the temperature (log-uniform in
[1e-4, 10]), the margin (both signs, including margins that mask every candidate but the positive, or
none), the strategy, the flags and the dtype; then edits rows: copies (duplicate texts, duplicates of a
positive), negations, zero vectors, power-of-two rescales and small perturbations (cosines near +-1).

How masks are compared honestly. A candidate is masked when its guide score is strictly greater than the
threshold T_i. The implementation decides that in the input dtype, the oracle in float64, so a guide score
within rounding of T_i may legitimately fall on different sides. Such draws are rejected by construction
(``assume``), with the band set at 256 units of rounding of the input dtype, scaled by max(1, |T_i|), which is
several times the worst-case error of a guide score with Dg <= 64. Exact ties are not rounding noise, though:
a bitwise duplicate of the positive must compare equal to theta_i. Two guide modes cover both:
  * "real": Gaussian guide rows. Dot products of equal vectors are not reproducible across matrix products
    of different shapes here (BLAS picks different kernels), so real-valued exact ties are borderline too
    and are rejected like any other near-tie.
  * "lattice": every guide row has 1, 4 or 16 entries of +-2^e and zeros elsewhere, so its norm is a power
    of two and every normalised dot product is exact in any dtype and any summation order. Exact ties
    (gap == 0) are then kept, and the tie rule, self-pairs and fully masked rows are checked exactly.
The tie rule on real-valued rows is pinned separately (``test_real_valued_duplicate_of_positive_is_a_tie``).
Student rows are never constrained: they only move values, not mask decisions.

Tolerances: a student score is known to ~D units of rounding, and a logit to that over tau, so the loss
tolerance is TOL["fuzz"] * (1 + 1/tau). Gradients are compared after multiplying each row by
max(||x||, 1e-8) (the same positive factor on both sides: it undoes the 1/||x|| of the normalisation, so
zero rows and rescaled rows share one scale); that gradient on the unit sphere is at most 2/tau, with errors
~1/tau times the logit error, hence TOL["fuzz"] * (1 + 1/tau)^2.

Profiles: CI runs "ci" (a few hundred examples per test). The ``slow``-marked tests run the profile named
by CGIST_HYPOTHESIS_PROFILE (default "long", 10,000 examples):
    CGIST_HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py -m slow -q --hypothesis-show-statistics
The Triton backend runs a tenth of each budget, on smaller shapes, because the interpreter is slow.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from helpers import DEVICE, DTYPES, TOL, gist_loss_kwargs, loss_kwargs, make_inputs, one_thread, precision  # noqa: F401  (one_thread: autouse)
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import cgist
from cgist import GistOptions
from cgist.stage.numerics import threshold
from cgist.stage.reference import gist_loss_reference, gist_scores

# "ci" replays the same examples on every run (a red CI is a bug, not bad luck); "long" explores afresh.
settings.register_profile(
    "ci", max_examples=300, derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=10_000, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
CI = settings.get_profile("ci")
LONG = settings.get_profile(os.environ.get("CGIST_HYPOTHESIS_PROFILE", "long"))

PRECISIONS = ("fp32", "fp64")
BAND = {DTYPES[name]: 256 * torch.finfo(DTYPES[name]).eps for name in PRECISIONS}
#: 0: the default; +-2 and 2.5: exact ties and "everything but the positive masked" on the lattice;
#: 1e4 masks every candidate but the positive (relative too, when theta != 0); -1e4 masks none.
SPECIAL_MARGINS = (0.0, 2.0, -2.0, 2.5, 1e4, -1e4)
KINDS = ("copy", "negate", "zero", "rescale", "perturb")


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
    options: GistOptions
    lattice: bool
    seed: int
    edits: tuple[Edit, ...]


@st.composite
def specs(draw, max_batch: int = 8, max_world: int = 3, max_dim: int = 64, max_edits: int = 8) -> Spec:
    batch, world = draw(st.integers(1, max_batch)), draw(st.integers(1, max_world))
    n_cand = batch * world
    offset = draw(st.one_of(st.integers(0, world - 1).map(lambda rank: rank * batch), st.integers(0, n_cand - batch)))
    k = draw(st.integers(0, 3))
    rows = [batch] + [n_cand] * (k + 1)
    magnitude = draw(st.one_of(st.sampled_from(SPECIAL_MARGINS), st.floats(0.01, 3.0)))
    edits = []
    for _ in range(draw(st.integers(0, max_edits))):
        kind = draw(st.sampled_from(KINDS))
        dst_col = draw(st.integers(0, k + 1))
        if draw(st.booleans()):  # from the positive of some anchor: ties and near-ties with theta
            src_col, src = 1, offset + draw(st.integers(0, batch - 1))
        else:
            src_col = draw(st.integers(0, k + 1))
            src = draw(st.integers(0, rows[src_col] - 1))
        amount = draw(st.floats(-6, -1)) if kind == "perturb" else float(draw(st.integers(-10, 10)))
        side = draw(st.sampled_from(("student", "guide", "both")))
        edits.append(Edit(kind, side, dst_col, draw(st.integers(0, rows[dst_col] - 1)), src_col, src, amount))
    # Drawn in this order: dtype, dims, temperature, margin sign, strategy, flags, guide mode, seed.
    dtype = draw(st.sampled_from(PRECISIONS))
    dim, guide_dim = draw(st.integers(1, max_dim)), draw(st.integers(1, max_dim))
    options = GistOptions(
        temperature=min(10.0, 10.0 ** draw(st.floats(-4, 1))),
        margin=magnitude if draw(st.booleans()) else -magnitude,
        margin_strategy=draw(st.sampled_from(("absolute", "relative"))),
        contrast_anchors=draw(st.booleans()),
        contrast_positives=draw(st.booleans()),
        offset=offset,
    )
    return Spec(
        dtype=dtype, batch=batch, world=world, dim=dim, guide_dim=guide_dim, k=k, options=options,
        lattice=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)), edits=tuple(edits),
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


def build(spec: Spec) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Student and guide columns of ``spec``, in its dtype."""
    gen = torch.Generator().manual_seed(spec.seed)
    student, guide = make_inputs(spec.batch, spec.batch * spec.world, spec.dim, spec.guide_dim, spec.k, seed=gen)
    if spec.lattice:
        guide = [_lattice_rows(g.shape[0], spec.guide_dim, gen) for g in guide]
    for edit in spec.edits:
        if edit.side in ("student", "both"):
            _apply(edit, student, gen, exact=False)
        if edit.side in ("guide", "both"):
            _apply(edit, guide, gen, exact=spec.lattice)
    dtype = DTYPES[spec.dtype]
    return [s.to(dtype) for s in student], [g.to(dtype) for g in guide]


def guide_gaps(spec: Spec, guide: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(guide score - T_i, T_i) of every score entry in float64, in the oracle's block order; NaN at the labels.

    The oracle's ``gist_scores`` with the guide as the student and a margin that masks nothing returns the
    guide scores themselves.
    """
    guide64 = [g.double() for g in guide]
    options = spec.options
    scores = gist_scores(guide64, guide64, options.replace(margin=-3.0, margin_strategy="absolute"))
    rows = torch.arange(spec.batch)
    limit = threshold(scores[rows, rows + options.offset].unsqueeze(1), options.margin, options.relative)
    gaps = scores - limit
    gaps[rows, rows + options.offset] = math.nan
    return gaps, limit


def admissible(spec: Spec, guide: list[torch.Tensor]) -> bool:
    """No mask decision within rounding of its threshold, except exact lattice ties; records coverage events."""
    gaps, limit = guide_gaps(spec, guide)
    near = gaps.abs() < BAND[DTYPES[spec.dtype]] * limit.abs().clamp_min(1.0)
    if spec.lattice:
        near &= gaps != 0
    if bool(near.any()):
        return False
    event(f"guide {'lattice' if spec.lattice else 'real'}")
    if bool((gaps == 0).any()):
        event("exact ties kept")
    labels = gaps.isnan()
    if bool((labels | (gaps > 0)).all()):
        event("every candidate but the positive masked")
    if bool((labels | (gaps <= 0)).all()):
        event("nothing masked")
    return True


def _check(spec: Spec, backend: str) -> None:
    """gist_loss on ``spec`` equals the float64 oracle on the same (upcast) inputs, and is finite."""
    student, guide = build(spec)
    assume(admissible(spec, guide))
    dtype = student[0].dtype
    if spec.options.temperature < 1e-3:
        event("tau < 1e-3")
    if any(bool((s == 0).all(dim=1).any()) for s in student):
        event("zero student row")

    leaves = [s.to(DEVICE).requires_grad_() for s in student]
    loss = cgist.gist_loss(leaves, [g.to(DEVICE) for g in guide], backend=backend, **gist_loss_kwargs(spec.options))
    grads = torch.autograd.grad(loss, leaves)
    leaves64 = [s.double().requires_grad_() for s in student]
    expected = gist_loss_reference(leaves64, [g.double() for g in guide], spec.options)
    expected_grads = torch.autograd.grad(expected, leaves64)

    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool(torch.isfinite(loss)), f"non-finite loss {loss}"
    tol = TOL["fuzz"][precision(dtype)]
    scale = 1.0 + 1.0 / spec.options.temperature
    torch.testing.assert_close(loss.double().cpu(), expected.detach(), rtol=0, atol=tol * scale)
    for i, (got, want, s) in enumerate(zip(grads, expected_grads, student)):
        assert got.dtype == dtype and got.shape == s.shape
        assert bool(torch.isfinite(got).all()), f"non-finite gradient of column {i}"
        norm = s.double().norm(dim=1, keepdim=True).clamp_min(1e-8)
        torch.testing.assert_close(
            got.double().cpu() * norm, want * norm, rtol=0, atol=tol * scale**2, msg=lambda m: f"column {i}: {m}"
        )


def _fuzz(backend: str, profile: settings, **sizes) -> object:
    """A hypothesis test of ``backend`` under ``profile`` (a tenth of it for Triton), on ``specs(**sizes)``."""
    budget = profile.max_examples if backend == "torch" else max(10, profile.max_examples // 10)

    @settings(profile, max_examples=budget)
    @given(spec=specs(**sizes))
    def test(spec: Spec) -> None:
        _check(spec, backend)

    return test


TRITON_SIZES = dict(max_batch=6, max_dim=24, max_edits=6)

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
        lattice=False, seed=seed, edits=(),
    )
    offset = spec.options.offset
    student, guide = build(spec)
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
        ties = gaps.abs() < BAND[torch.float64]
        eps = gaps[~ties].abs().nan_to_num(math.inf).min().item() / 2
        if eps < 2 * BAND[dtype]:
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
