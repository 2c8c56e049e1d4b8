"""What the test modules share: the device, random inputs, tolerances, option catalogues and one-thread runs.

API:
    DEVICE, CUDA                  "cuda" when a GPU is present, else "cpu" (Triton then runs under the interpreter).
    DTYPES, precision(dtype)      precision names ("fp64", "fp32", "tf32", "bf16", "fp16") and their input dtypes.
    TOL[kind][precision]          every tolerance of the suite, by the comparison it serves and the precision,
                                  derived from the precision's unit roundoff by the rule next to it (TAU, SCALE, C).
    Tol, EXACT, tolerance(...)    one tolerance of ``assert_close``; TOL[kind] as (loss, gradients) tolerances.
    assert_close(name, ref, got, tol)  the one comparator: losses, gradients, counts and statistics.
    make_inputs(...)              random student and guide columns [anchor, positive, *negatives].
    shape_id(...)                 the readable test id of a shape, ``B13-N26-D40-Dg24-k1``.
    loss_kwargs(options)          a GistOptions as keyword arguments of the loss classes.
    oracle_stats(...)             the GistStats counted on the dense oracle's masks (``score_groups``), every block.
    oracle_counters(...)          the same counts as a backend's counters (``cgist.stage.stats.COUNT_FIELDS``).
    BAD_OPTIONS                   invalid loss options, each with the error and message it must raise.
    single_thread(), one_thread   torch on one intra-op thread: a context manager, and a module-wide fixture.
    tf32(x, mode)                 fp32 rounded to tf32, to nearest or toward zero.
    tf32_addmm(mode)              ``out += a @ b`` on emulated tf32 tensor cores (one tf32 product).
    TF32X3_BOUND                  a tf32x3 product's error bound per unit of sum_k |a_k b_k|.
    LossStageCalls(monkeypatch)   counts the drop-ins' loss-stage calls while a test runs.
    xtr_gap(...)                  how far apart XTR's top_k-th and next similarities are, at the closest query token.
    AllocationProbe()             records every new storage the torch ops run under it return.
    unmeasured(env)               an environment for a process that coverage does not measure.

It imports only torch, pytest and cgist: the model builders that need sentence-transformers live in
``helpers_models``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cgist import GistOptions, GistStats
from cgist.stage.reference import score_groups

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

#: Input dtype of each precision; "tf32" is float32 inputs with TF32 matrix products.
DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def precision(dtype: torch.dtype) -> str:
    """The name of ``dtype``'s own precision ("fp32" for float32); also a readable test id."""
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


@dataclasses.dataclass(frozen=True)
class Tol:
    """A tolerance of ``assert_close``: ``|got - ref| <= atol + rtol * |ref|``, entry by entry. With ``scaled``, the
    atol is a fraction of the reference tensor's largest magnitude (gradients, whose scale follows 1/tau)."""

    rtol: float = 0.0
    atol: float = 0.0
    scaled: bool = False


#: Bitwise equality (what ``assert_close`` applies to counts whatever the tolerance).
EXACT = Tol()


_EPS = {name: torch.finfo(dtype).eps for name, dtype in DTYPES.items()}
#: A tf32x3 product's error bound per unit of sum_k |a_k b_k|, (5 + 4u) u^2 with u = 2^-11 (test_kernels_precision).
TF32X3_BOUND = (5 + 4 * 2.0**-11) * 2.0**-22

# How the tolerances are derived (docs/correctness.md#tolerances). A loss is a log-sum-exp of logits of size up to
# 1/tau minus the positive's logit: every logit carries about (1 + 1/tau) units u of rounding, u the unit roundoff of
# the precision the loss stage computes in, and the result its own size's, so a loss is off by at most
#     C * u * (|loss| + SCALE)                    -> Tol(rtol=C u, atol=C u SCALE)
# A gradient is the softmax's weights times the rows, each weight off by about SCALE units relative (the logits'
# absolute error, exponentiated), so an entry is off by a fraction of the gradient's largest entry:
#     C * u * SCALE * (max |g| + |g_i|)           -> Tol(C u SCALE, C u SCALE, scaled=True)
# SCALE is 1 + 1/tau at TAU, the smallest temperature of the comparisons that use these (the loss's default); at a
# larger tau the tolerance only has more room. C = 8: the largest errors measured on the CPU are 1.3 units of
# (|loss| + SCALE) for a loss and 0.5 of SCALE (max |g| + |g_i|) for a gradient, in float32 and float64 alike, on
# both backends, so no error there passes a fifth of its tolerance, while a wrong term of about C u SCALE (in
# float64, a candidate of softmax weight 1e-11 masked by mistake) fails. dot_score logits are not bounded by 1/tau:
# the tiny models here stay within the rule (measured at 2 units), and test_differential adds a floor of its own.
#: The smallest temperature that the fixed tolerances below serve: logits up to 1/TAU.
TAU = 0.01
#: The logits' scale at TAU, in units of their rounding.
SCALE = 1.0 + 1.0 / TAU
#: Units of rounding per unit of scale that a loss or a gradient may be off (see above).
C = 8
#: Unit roundoff of each precision a loss stage computes in; tf32 has 10 mantissa bits.
_U = {"fp64": _EPS["fp64"] / 2, "fp32": _EPS["fp32"] / 2, "bf16": _EPS["bf16"] / 2, "fp16": _EPS["fp16"] / 2,
      "tf32": 2.0**-11}


def _loss(computed_in: str) -> Tol:
    """The loss rule: ``|got - ref| <= C u (|ref| + SCALE)``, u the unit roundoff of ``computed_in``."""
    return Tol(rtol=C * _U[computed_in], atol=C * _U[computed_in] * SCALE)


def _gradients(computed_in: str) -> Tol:
    """The gradient rule: ``|got - ref| <= C u SCALE (max |ref| + |ref|)``, entry by entry."""
    unit = C * _U[computed_in] * SCALE
    return Tol(rtol=unit, atol=unit, scaled=True)


#: Every tolerance, by kind of comparison; the kinds measure different things, so their values differ.
TOL = {
    # Triton launcher against the float64 oracle: (loss, gradients). fp64 and fp32 follow the rule in their own
    # precision. bf16 and fp16 (GPU-only: the interpreter runs them in test_kernels_dtypes, held to "pairs") sum
    # exact half products in float32, so the loss meets fp32's rule, and the gradients come back rounded to the half
    # dtype: 4 of its units u of the largest entry, as "pairs" derives. tf32 (GPU-only, not measured on a CPU: neither
    # the CPU nor the interpreter has tf32): a plain tf32 product is off by about 2 u_tf32 of sum |a_k b_k|, and the
    # GPU cases run at tau = 0.05, so 3 u_tf32 (1 + 1/0.05) ~ 3e-2 for the loss and of the gradients' largest entry.
    "triton": {
        "fp64": (_loss("fp64"), _gradients("fp64")),
        "fp32": (_loss("fp32"), _gradients("fp32")),
        "tf32": (Tol(3e-2, 3e-2), Tol(3e-2, 3e-2, scaled=True)),
        "bf16": (_loss("fp32"), Tol(atol=4 * _U["bf16"], scaled=True)),
        "fp16": (_loss("fp32"), Tol(atol=4 * _U["fp16"], scaled=True)),
    },
    # The launcher in each dtype pair of test_kernels_dtypes against the float64 oracle on the same rounded inputs:
    # (loss, gradients). The loss's tolerance is in units of the logits' scale 1 + 1/tau: half products are exact in
    # float32 and summed in float32 (on the tensor cores, and under the interpreter with its bf16 dot fixed), so the
    # loss is as accurate as fp32's, 16 float32 roundings per unit. The gradients' is a fraction of their largest
    # entry: u, the student dtype's unit roundoff, for the final rounding to that dtype, plus the score gradient's
    # rounding to it (up to 2u per entry: the interpreter truncates fp32 to bf16, a GPU rounds to nearest) carried
    # through F @ K and the normalisation backward, taken as 3u: 4u in all. A pair's guide dtype moves only the
    # guide's mask, which the counters check exactly. tf32x3 adds its products' bound (twice: a row's log-sum-exp and
    # its positive) to the loss's unit, and its gradients meet fp32's tolerance.
    "pairs": {
        "bf16": (16 * _EPS["fp32"] / 2, 4 * _EPS["bf16"] / 2),
        "fp16": (16 * _EPS["fp32"] / 2, 4 * _EPS["fp16"] / 2),
        "bf16-fp32guide": (16 * _EPS["fp32"] / 2, 4 * _EPS["bf16"] / 2),
        "fp16-fp32guide": (16 * _EPS["fp32"] / 2, 4 * _EPS["fp16"] / 2),
        "tf32x3": (16 * _EPS["fp32"] / 2 + 2 * TF32X3_BOUND, 1e-5),
        "tf32x3-bf16guide": (16 * _EPS["fp32"] / 2 + 2 * TF32X3_BOUND, 1e-5),
    },
    # PyTorch streaming path against the float64 oracle: (loss, gradients), the rule in fp64 and fp32. Half inputs
    # are upcast and accumulated in float32, so the loss meets fp32's rule; their gradients come back rounded to the
    # input dtype (up to u of each entry) on top of float32's rounding: u of (max |g| + |g_i|) in all, measured at
    # 0.45 of it, most of it that final rounding, which no tighter tolerance could leave room for.
    "streaming": {
        "fp64": (_loss("fp64"), _gradients("fp64")),
        "fp32": (_loss("fp32"), _gradients("fp32")),
        "bf16": (_loss("fp32"), Tol(_U["bf16"], _U["bf16"], scaled=True)),
        "fp16": (_loss("fp32"), Tol(_U["fp16"], _U["fp16"], scaled=True)),
    },
    # Property tests: the unit of the absolute tolerance, scaled by (1 + 1/tau) (see test_properties).
    "fuzz": {"fp64": 64 * _EPS["fp64"], "fp32": 64 * _EPS["fp32"]},
    # float64 paths on the same embeddings: oracle, gist_loss and ST's calculate_loss, autograd compositions, the
    # normalisation. One rtol and atol for every tensor: twice the gradients' unit C u SCALE, as the atol is not
    # scaled and these gradients reach about 20 (measured at 0.18 of it, in an autograd composition whose gradients
    # reach 22; the loss, through ``tolerance``, meets the loss rule).
    "embeddings": {"fp64": dict(rtol=2 * C * _U["fp64"] * SCALE, atol=2 * C * _U["fp64"] * SCALE)},
    # Full forward and backward through models (ST's and the fused loss, every parameter gradient), one rtol and atol
    # for the loss and every parameter gradient. The gradients set it, so it is far looser than a loss needs:
    # ``tolerance`` holds the loss to the loss rule instead, and only the tests that apply the dict itself
    # (test_guide_sources, and test_distributed's ranks below) hold a loss to it. A parameter
    # gradient carries the embeddings' gradient's rounding (the rule) through the model's Jacobian, and entries cancel
    # (between texts, between ranks), so no rule in u alone bounds them: float64 is measured at up to 0.1 of
    # (1e-10, 1e-12) in the differential fuzz (which adds an absolute floor of its own for what cancels), and float32,
    # the embeddings' own rounding (another padding, another mini-batch) magnified by 1/tau, at 0.08 of (2e-4, 2e-5).
    "models": {"fp64": dict(rtol=1e-10, atol=1e-12), "fp32": dict(rtol=2e-4, atol=2e-5)},
    # Ranks of a gloo group against ST's loss, the oracle and the exact gradients. float64 is the models' tolerance:
    # the all-reduce adds one rounding of sums that the models' gradients already carry (measured at 0.02 of it).
    # float32 stays at the models' too: sentence-transformers' own float32 parameter gradients are measured at 0.8
    # of it against the exact ones, cgist's at 0.32, so it cannot be tighter
    # (docs/correctness.md#parity-with-sentence-transformers-on-real-models).
    "distributed": {"fp64": dict(rtol=1e-10, atol=1e-12), "fp32": dict(rtol=2e-4, atol=2e-5)},
}


def tolerance(kind: str, dtype: torch.dtype | str) -> tuple[Tol, Tol]:
    """``TOL[kind]`` at ``dtype`` (or a precision name) as the (loss, gradients) tolerances of ``assert_close``.

    "triton" and "streaming" hold the pair as it is. The kinds of keyword dicts ("embeddings", "models",
    "distributed") hold one rtol and atol for every tensor, which is what their gradients get here; their loss, one
    number whose rounding the loss rule bounds whatever produced the embeddings, gets that rule (``_loss``) in the
    loss's precision (float32 below float64).
    """
    name = dtype if isinstance(dtype, str) else precision(dtype)
    value = TOL[kind][name]
    if isinstance(value, dict):
        return _loss("fp64" if name == "fp64" else "fp32"), Tol(**value)
    if kind in ("triton", "streaming"):
        return value
    raise KeyError(f"TOL[{kind!r}] is not a (loss, gradients) tolerance")


def assert_close(name: str, ref: object, got: object, tol: Tol | tuple[Tol, Tol] = EXACT) -> None:
    """``got`` equals ``ref`` within ``tol``; a failure names the entry (``name[key][i]``) and how far it is off.

    ``ref`` and ``got`` are tensors, numbers or None, or lists, tuples, dicts or dataclasses (``GistStats``) of them,
    with the same length or keys; floating values compare in float64 on the CPU, NaN never equal. Ints and integer
    tensors (counts) compare exactly, whatever ``tol``. A pair of tolerances ``(loss, gradients)`` compares a pair
    ``(loss, gradients)``: the loss with the first, every gradient with the second.

    Tolerances come from ``TOL`` (or ``tolerance``), whose values follow the rule written above it: a few units of
    the precision's rounding times the logits' scale 1 + 1/TAU, a small multiple of the largest error measured, so a
    wrong term worth more than that rounding (a candidate masked that should not be, a weight off by 1e-12 in float64)
    fails rather than hides under a loose bound.
    """
    if isinstance(tol, tuple):
        assert isinstance(got, (tuple, list)) and len(got) == 2, f"{name}: expected (loss, gradients), got {got!r}"
        assert_close(f"{name} loss", ref[0], got[0], tol[0])
        assert_close(f"{name} gradients", ref[1], got[1], tol[1])
        return
    if dataclasses.is_dataclass(ref):
        assert type(got) is type(ref), f"{name}: {type(got).__name__}, expected {type(ref).__name__}"
        ref, got = dataclasses.asdict(ref), dataclasses.asdict(got)
    if isinstance(ref, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(ref), f"{name}: keys {sorted(got)}, expected {sorted(ref)}"
        for key in ref:
            assert_close(f"{name}[{key!r}]", ref[key], got[key], tol)
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), f"{name}: {len(got)} entries, expected {len(ref)}"
        for i, (r, g) in enumerate(zip(ref, got)):
            assert_close(f"{name}[{i}]", r, g, tol)
    elif ref is None or isinstance(ref, (bool, int, str)):
        assert got == ref and type(got) is type(ref), f"{name}: {got!r}, expected {ref!r} exactly"
    elif isinstance(ref, torch.Tensor) and not (ref.is_floating_point() or ref.is_complex()):
        assert isinstance(got, torch.Tensor) and torch.equal(got.cpu(), ref.cpu()), f"{name}: {got}, expected {ref}"
    else:
        # a Python float as float64 (torch.as_tensor would make it float32 first and round it)
        ref = (ref if isinstance(ref, torch.Tensor) else torch.tensor(ref, dtype=torch.float64)).detach().cpu().double()
        assert got is not None, f"{name}: None, expected a value"
        got = (got if isinstance(got, torch.Tensor) else torch.tensor(got, dtype=torch.float64)).detach().cpu().double()
        atol = tol.atol * float(ref.abs().max()) if tol.scaled and ref.numel() else tol.atol
        torch.testing.assert_close(got, ref, rtol=tol.rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def make_inputs(
    batch: int,
    n_cand: int,
    dim: int,
    dim_g: int,
    k: int,
    dtype: torch.dtype = torch.float64,
    seed: int | torch.Generator = 0,
    *,
    requires_grad: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random student columns [anchor (batch x dim), positive, *k negatives (n_cand x dim)] and the guide's (dim_g).

    Every value is drawn in float64, the student columns first, and then cast to ``dtype``, so a seed gives
    the same values in every dtype up to rounding. ``seed`` is an int, or a generator to draw from (the caller
    may go on drawing from it). ``requires_grad`` makes the student columns leaves that require a gradient.
    """
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    rows = [batch] + [n_cand] * (1 + k)
    student = [torch.randn(r, dim, generator=gen, dtype=torch.float64) for r in rows]
    guide = [torch.randn(r, dim_g, generator=gen, dtype=torch.float64) for r in rows]
    student = [x.to(dtype).requires_grad_(requires_grad) for x in student]
    return student, [g.to(dtype) for g in guide]


def shape_id(batch: int, n_cand: int, dim: int, dim_g: int, k: int) -> str:
    """``B13-N26-D40-Dg24-k1``: the shape part of a test id."""
    return f"B{batch}-N{n_cand}-D{dim}-Dg{dim_g}-k{k}"


#: The fields of ``GistOptions`` that are arguments of sentence-transformers' ``CachedGISTEmbedLoss``.
LOSS_FIELDS = ("temperature", "margin", "margin_strategy", "contrast_anchors", "contrast_positives")


def loss_kwargs(options: GistOptions) -> dict:
    """``options`` as keyword arguments of ``CachedGISTEmbedLoss`` / ``FusedCachedGISTLoss``."""
    return {name: getattr(options, name) for name in LOSS_FIELDS}


def gist_loss_kwargs(options: GistOptions) -> dict:
    """``options`` as keyword arguments of ``cgist.gist_loss``: every field but ``all_anchors``, a flag of the column
    layout that ``gist_loss`` sets itself when it is given the tensor of that name, and the token scores' own fields
    (``token_score_fields``)."""
    skipped = {"all_anchors", *token_score_fields()}
    return {k: v for k, v in dataclasses.asdict(options).items() if k not in skipped}


def token_score_fields() -> set[str]:
    """The fields of ``GistOptions`` that only the token scores take (``cgist.stage.spec.scores``: the registry's
    options of each score, less the dense score's, and ``score_options``, where the dense score has none), which
    ``cgist.gist_loss`` does not."""
    from cgist.stage.spec.scores import DENSE, SCORES

    assert not DENSE.score_options
    return {"score_options", *(name for score in SCORES for name in score.options)} - set(DENSE.options)


#: Invalid options, as keyword arguments of ``GistOptions`` and ``gist_loss``: (overrides, error, message regex).
BAD_OPTIONS = [
    pytest.param(dict(temperature=0.0), ValueError, r"temperature must be a positive finite number, got 0\.0", id="temperature=0"),
    pytest.param(dict(temperature=-0.05), ValueError, r"temperature must be a positive finite number, got -0\.05", id="temperature<0"),
    pytest.param(dict(temperature=math.inf), ValueError, r"temperature must be a positive finite number, got inf", id="temperature=inf"),
    pytest.param(dict(temperature=math.nan), ValueError, r"temperature must be a positive finite number, got nan", id="temperature=nan"),
    pytest.param(dict(temperature="0.01"), TypeError, r"temperature must be a real number, got str", id="temperature=str"),
    pytest.param(dict(temperature=True), TypeError, r"temperature must be a real number, got bool", id="temperature=bool"),
    pytest.param(dict(margin=math.inf), ValueError, r"margin must be a finite number, got inf", id="margin=inf"),
    pytest.param(dict(margin=-math.inf), ValueError, r"margin must be a finite number, got -inf", id="margin=-inf"),
    pytest.param(dict(margin=math.nan), ValueError, r"margin must be a finite number, got nan", id="margin=nan"),
    pytest.param(dict(margin=None), TypeError, r"margin must be a real number, got NoneType", id="margin=None"),
    pytest.param(
        dict(margin_strategy="percent"), ValueError, r"margin_strategy must be one of \('absolute', 'relative'\), got 'percent'",
        id="strategy=unknown",
    ),
    pytest.param(dict(margin_strategy=None), ValueError, r"margin_strategy must be one of .*, got None", id="strategy=None"),
    pytest.param(dict(contrast_anchors=1), TypeError, r"contrast_anchors must be a bool, got int", id="contrast_anchors=int"),
    pytest.param(dict(contrast_positives="no"), TypeError, r"contrast_positives must be a bool, got str", id="contrast_positives=str"),
    pytest.param(dict(offset=1.0), TypeError, r"offset must be an int, got float", id="offset=float"),
    pytest.param(dict(offset=True), TypeError, r"offset must be an int, got bool", id="offset=bool"),
]


def gradient_addresses(monkeypatch: pytest.MonkeyPatch, backend: object) -> list[list[int]]:
    """Patch ``backend.forward`` (a backend module) to note where each forward's gradients (``Grads.inputs``) are:
    their data pointers, a list per forward (holding the tensors themselves would make autograd copy them)."""
    made: list[list[int]] = []
    original = backend.forward

    def forward(*args):
        loss, grads, counters = original(*args)
        made.append([g.data_ptr() for g in grads.inputs])
        return loss, grads, counters

    monkeypatch.setattr(backend, "forward", forward)
    return made


@contextmanager
def single_thread() -> Iterator[None]:
    """Run the body with ``torch.set_num_threads(1)``, restoring the previous count afterwards.

    The tensors of the tests are tiny: extra OpenMP threads only add hand-off latency, a lot of it on a busy machine.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Every test of a module that imports this fixture runs on one thread (``single_thread``)."""
    with single_thread():
        yield


def _unit(x: torch.Tensor) -> torch.Tensor:
    """Rows over ``max(norm, 1e-8)``, in float64 (docs/design.md#the-loss: normalisation)."""
    x = x.detach().double().cpu()
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-8)


def _thresholds(guide_embeddings: list[torch.Tensor], options: GistOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """theta_i, the guide's cosine of anchor i and its positive ``offset + i``, and T_i (docs/design.md#the-loss)."""
    anchors = _unit(guide_embeddings[0])
    theta = (anchors * _unit(guide_embeddings[1])[options.offset : options.offset + anchors.shape[0]]).sum(dim=1)
    return theta, theta - options.margin * (theta.abs() if options.margin_strategy == "relative" else 1.0)


def oracle_stats(
    embeddings: list[torch.Tensor], guide_embeddings: list[torch.Tensor] | None, options: GistOptions,
    text_ids: list[torch.Tensor] | None = None,
) -> GistStats:
    """The ``GistStats`` of a call, counted on the masks of the dense oracle (``cgist.stage.reference.score_groups``,
    in float64 on the CPU: a masked entry is -inf there), so that the statistics check the backends against the same
    rules as the loss: per block the entries left out and the candidates (every entry but the one per row that is
    never masked, ``ScoredGroup.unmasked``: AP's label, DQ's pair), the anchors whose every entry but the label is
    left out, and the means of theta_i and T_i (None without a guide).

    Columns ``[anchor, positive, *negatives]`` and, with ``options.all_anchors``, every rank's anchors last; the DN
    groups count in DD. Matryoshka dimensions do not change the masks, so the oracle scores the full embeddings once.
    """
    one = options.replace(matryoshka_dims=None, matryoshka_weights=None)
    groups = score_groups(
        [e.detach().double().cpu() for e in embeddings],
        None if guide_embeddings is None else [g.detach().double().cpu() for g in guide_embeddings], one,
        None if text_ids is None else [t.cpu() for t in text_ids],
    )
    masked, candidates, kept = {}, {}, 0
    for group in groups:
        block = {"dn": "dd"}.get(group.name, group.name)
        mask = torch.isneginf(group.scores)
        masked[block] = masked.get(block, 0) + int(mask.sum())
        candidates[block] = candidates.get(block, 0) + mask.numel() - (0 if group.unmasked is None else mask.shape[0])
        kept = kept + (~mask).sum(dim=1)  # the label always among them
    means = (None, None)
    if guide_embeddings is not None:
        means = tuple(float(t.mean()) for t in _thresholds(guide_embeddings, options))
    return GistStats(masked=masked, candidates=candidates, positive_only=int((kept == 1).sum()),
                     anchors=embeddings[0].shape[0], theta_mean=means[0], threshold_mean=means[1])


def oracle_counters(
    embeddings: list[torch.Tensor], guide_embeddings: list[torch.Tensor] | None, options: GistOptions,
    text_ids: list[torch.Tensor] | None = None,
) -> dict[str, int]:
    """``oracle_stats``' counts by the names of a backend's counters (``COUNT_FIELDS``; 0 for an absent block)."""
    from cgist.stage.stats import COUNT_FIELDS

    stats = oracle_stats(embeddings, guide_embeddings, options, text_ids)
    counts = {f"masked_{name}": count for name, count in stats.masked.items()}
    counts["positive_only"] = stats.positive_only
    return {field: counts.get(field, 0) for field in COUNT_FIELDS}


def tf32(x: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 ``x`` rounded to tf32 (10 mantissa bits): "rn" to nearest (ties to even), "rz" toward zero (truncation)."""
    if mode == "rn":
        from cgist.stage.triton.dense import split_tf32

        return split_tf32(x)[0]
    return (x.contiguous().view(torch.int32) & -8192).view(torch.float32)


def tf32_addmm(mode: str):
    """One product on tf32 tensor cores, emulated: ``out += tf32(a) @ tf32(b)``, the products and their sums exact
    (float64), the operands rounded as ``tf32(x, mode)``. Neither a CPU nor the Triton interpreter has tf32, so this is
    the reference the tests hold the launcher's tf32x3 GEMMs to (``interpreter_dot.emulated_tf32_dot`` rounds the
    interpreter's tf32 ``tl.dot`` the same way)."""
    def addmm_(out, a, b):
        out.add_(tf32(a, mode).double() @ tf32(b, mode).double())
    return addmm_


class LossStageCalls:
    """Counts the drop-ins' loss-stage calls (``cgist.losses.base.run``, the loss stage's one entry) while a test
    runs."""

    def __init__(self, monkeypatch) -> None:
        import cgist.losses.base

        self.calls = 0
        real = cgist.losses.base.run

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cgist.losses.base, "run", counted)


def xtr_gap(queries: torch.Tensor, query_mask: torch.Tensor, documents: list[torch.Tensor],
            document_masks: list[torch.Tensor], top_k: int) -> float:
    """The smallest gap, over the real query tokens, between the ``top_k``-th largest similarity with every real
    document token of the columns (XTR's pool) and the next one, in float64 (inf where the pool holds at most
    ``top_k``): a batch is tie-free for XTR when it is well above the products' rounding."""
    pool = torch.cat([d.double()[m.bool()] for d, m in zip(documents, document_masks)])
    if pool.shape[0] <= top_k:
        return math.inf
    similarities = queries.double()[query_mask.bool()] @ pool.T
    top = similarities.topk(top_k + 1, dim=1).values
    return float((top[:, top_k - 1] - top[:, top_k]).min())


class AllocationProbe(TorchDispatchMode):
    """Records every new storage an op returns: (bytes, elements, op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.allocations.append((t.untyped_storage().nbytes(), t.numel(), str(func)))
        return out


def unmeasured(env: dict[str, str]) -> dict[str, str]:
    """``env`` without coverage's variable for the processes a test starts (pyproject.toml's ``patch =
    ["subprocess"]``): for a benchmark's or the compiler's processes, whose lines of the package the suite executes
    in-process, and where the tracer would cost up to 2.5 times their time (Triton's compiler and interpreter are
    Python)."""
    return {name: value for name, value in env.items() if name != "COVERAGE_PROCESS_CONFIG"}
