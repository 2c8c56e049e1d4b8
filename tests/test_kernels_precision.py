"""fp32 on tensor cores: the tf32x3 split, its rounding and its error bound, emulated on the CPU.

At torch's default matmul precision ("highest") every product of the Triton backend's loss stage runs
as tf32x3: operands split into a tf32 high part and the fp32 rest, three tf32 tensor-core products
(``hi*hi + hi*lo + lo*hi``), in the kernels and in the backward's tf32x3 GEMM (``cgist.kernels.gemm``). Neither the
Triton interpreter nor a CPU has tf32, so the rounding is emulated (``helpers.tf32_addmm``, and the interpreter's tf32
dots through ``interpreter_dot.emulated_tf32_dot``): tf32 values and their exact products in float64, with the tensor
core's rounding of the low parts taken as truncation (the worst case) or round-to-nearest. The bound, per entry of a
product over K terms with u = 2^-11 (the unit roundoff of tf32's 11-bit significand):

    |tf32x3(a @ b) - a @ b| <= (5 + 4u) u^2 sum_k |a_k b_k|   (+ the fp32 accumulation of the terms)

A single tf32 product is ~2u: about 800 times the bound, which the test shows too (so it can fail).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
import torch
import triton
import triton.language as tl
from helpers import CUDA, DEVICE, TF32X3_BOUND, one_thread, tf32_addmm  # noqa: F401  (one_thread: autouse)
from interpreter_dot import emulated_tf32_dot

from cgist.kernels.gist import _round_tf32
from cgist.stage.devices import KNOWN_ARCHS, arch_for, gpu_arch
from cgist.stage.triton import dense as triton_dense
from cgist.stage.triton.common import input_precision
from cgist.stage.triton.dense import split_tf32
from cgist.stage.triton.tiles import (
    gemm_configs,
    gemm_shared_memory_estimate,
    operand_kind,
    shared_memory_estimate,
    tile_configs,
)

U = 2.0**-11
BOUND = TF32X3_BOUND


def _values(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1.2e-38, 1e-45, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11])
    return torch.cat([x, special])


def test_split_is_exact_and_high_part_is_tf32():
    x = _values(4096)
    high, low = split_tf32(x)
    assert torch.equal(high + low, x), "high + low must be x exactly"
    assert not (high.view(torch.int32) & 0x1FFF).any(), "high must have at most 10 mantissa bits"
    finite = high != 0
    assert bool((low[finite].abs() <= U * high[finite].abs() * (1 + U)).all()), "round to nearest: |low| <= u |x|"
    # ties to even: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10 and rounds to 1; 1 + 3 * 2^-11 rounds up
    assert split_tf32(torch.tensor([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11]))[0].tolist() == [1.0, 1.0 + 2.0**-9]


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _round_tf32(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


def test_kernel_rounding_equals_the_launcher_split():
    """The score-gradient kernel's tf32 split (``_round_tf32``) rounds bit for bit as ``split_tf32``."""
    x = _values(1000, seed=1).to(DEVICE)
    out = torch.full_like(x, float("nan"))
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    assert torch.equal(out.view(torch.int32), split_tf32(x)[0].view(torch.int32))


def _tf32x3_terms(a: torch.Tensor, b: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The three products of a tf32x3 ``a @ b``, small terms first: ``(lo, hi), (hi, lo), (hi, hi)``."""
    (a_hi, a_lo), (b_hi, b_lo) = split_tf32(a), split_tf32(b)
    return [(a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)]


def _gemm_block_k() -> int:
    """BLOCK_K of the tf32x3 GEMM the launcher runs on ``DEVICE``."""
    arch = gpu_arch(torch.device(DEVICE)) if CUDA else None
    return gemm_configs(arch)[0].kwargs["BLOCK_K"]


def _accumulation_bound(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per entry, what the tf32x3 GEMM's fp32 accumulator may add to the error of ``out + a @ b``: one rounding per
    tf32 product of a K step (three per step) and one for the sum into ``out``, each at most 2^-24 of the largest
    partial sum, ``|out| + sum_k`` of the three terms' ``|a_k b_k|`` (float64)."""
    steps = 3 * math.ceil(a.shape[1] / _gemm_block_k()) + 1
    terms = sum(x.double().abs() @ y.double().abs() for x, y in _tf32x3_terms(a, b))
    return steps * 2.0**-24 * (out.double().abs() + terms)


@contextmanager
def _tensor_cores(mode: str) -> Iterator[None]:
    """The tf32 products of the launcher's GEMMs as tensor cores round them ``mode``: the interpreter's dots emulated
    (``interpreter_dot.emulated_tf32_dot``); a GPU's own."""
    with ExitStack() as stack:
        if not CUDA:
            stack.enter_context(emulated_tf32_dot(mode))
        yield


@pytest.mark.parametrize("mode", ["rz", "rn"])
def test_tf32x3_products_meet_the_bound(mode):
    """The three tf32 products of the split, on emulated tensor cores, meet the bound and one tf32 product does not;
    the launcher's tf32x3 GEMM (``_gemm_acc`` on split operands) adds exactly those three products, rounding only
    its fp32 accumulator (on a GPU, its own tensor cores: the bound and the accumulator's rounding)."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(64, 300, generator=gen) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=gen).float())
    b = torch.randn(300, 48, generator=gen)
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()

    three = torch.zeros(64, 48, dtype=torch.float64)
    for x, y in _tf32x3_terms(a, b):
        tf32_addmm(mode)(three, x, y)
    ratio = ((three - exact).abs() / scale).max().item()
    assert ratio <= BOUND, f"tf32x3 error {ratio:.3g} x sum|ab| > bound {BOUND:.3g}"

    single = torch.zeros(64, 48, dtype=torch.float64)
    tf32_addmm(mode)(single, a, b)
    assert ((single - exact).abs() / scale).max().item() > 50 * BOUND, "one tf32 pass should miss the bound"

    out = torch.zeros(64, 48, device=DEVICE)
    with _tensor_cores(mode):
        triton_dense._gemm_acc(out, split_tf32(a.to(DEVICE)), split_tf32(b.to(DEVICE)))
    want, slack = (exact, BOUND * scale) if CUDA else (three, 0.0)
    assert bool(((out.cpu().double() - want).abs() <= slack + _accumulation_bound(torch.zeros(64, 48), a, b)).all())


def test_tf32x3_gemm_reads_strided_views_across_tiles():
    """``tf32x3_addmm_`` into a column slice of a wider matrix from a transposed view and a column slice, the sizes
    odd and larger than a tile in every dimension: ``out + a @ b`` with the three products of the split (emulated
    tensor cores under the interpreter), and the columns beside the slice untouched."""
    gen = torch.Generator().manual_seed(4)
    m, k, n = 70, 75, 45  # two or three GEMM tiles each way, under the interpreter (32 x 32 x 32) as on a GPU
    a = torch.randn(k, m, generator=gen).T  # F^T: the rows are strided
    b = torch.randn(k, n + 7, generator=gen)[:, 3 : 3 + n]
    wide = torch.randn(m, n + 5, generator=gen)
    out0 = wide[:, 2 : 2 + n].clone()
    three = out0.double()
    for x, y in _tf32x3_terms(a, b):
        tf32_addmm("rn")(three, x, y)

    target = wide.to(DEVICE)
    split_a = tuple(part.T for part in split_tf32(a.T.to(DEVICE)))  # parts with a's strides, as the launcher's F^T
    assert split_a[0].stride() == split_a[1].stride() == a.stride()
    with _tensor_cores("rn"):
        triton_dense.tf32x3_addmm_(target[:, 2 : 2 + n], split_a, split_tf32(b.to(DEVICE)))
    got = target.cpu()
    assert torch.equal(got[:, :2], wide[:, :2]) and torch.equal(got[:, 2 + n :], wide[:, 2 + n :])
    slack = BOUND * (a.double().abs() @ b.double().abs()) if CUDA else 0.0  # a GPU's own rounding of the low parts
    assert bool(((got[:, 2 : 2 + n].double() - three).abs() <= slack + _accumulation_bound(out0, a, b)).all())


def test_tf32x3_gemm_needs_its_parts_alike():
    """The high and the low part of an operand must share their strides: the kernel reads both with one."""
    a = torch.randn(8, 16, device=DEVICE)
    hi, lo = split_tf32(a)
    with pytest.raises(ValueError, match="share their strides"):
        triton_dense.tf32x3_addmm_(torch.zeros(8, 8, device=DEVICE), (hi, lo.T.contiguous().T),
                             split_tf32(torch.randn(16, 8, device=DEVICE)))


@contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(precision)`` for the duration; the setting before is restored after."""
    with ExitStack() as restore:
        restore.callback(torch.set_float32_matmul_precision, torch.get_float32_matmul_precision())
        torch.set_float32_matmul_precision(precision)
        yield


def test_fp32_runs_split_at_highest_and_tf32_below():
    for setting, want in (("highest", "tf32x3"), ("high", "tf32"), ("medium", "tf32")):
        with _matmul_precision(setting):
            assert input_precision(torch.float32) == want
    assert input_precision(torch.bfloat16) == "ieee"  # ignored by tl.dot for half operands


#: One architecture of each tile family, by family: the oldest compute capability that uses it.
FAMILIES = {}
for _capability in sorted(KNOWN_ARCHS):
    FAMILIES.setdefault(KNOWN_ARCHS[_capability][0], arch_for(_capability))
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
         (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]


def _launcher_pair(student, guide, precision, arch):
    """The pair as the launcher passes it on ``arch`` at ``torch.set_float32_matmul_precision(precision)``."""
    with _matmul_precision(precision):
        return student, input_precision(student, arch), guide, input_precision(guide, arch)


def _every_list(pair, arch):
    """``tile_configs`` for one and five dimensions, as ``(n_dims, configs)``."""
    return [(n_dims, tile_configs(*pair, n_dims, arch=arch, interpret=False)) for n_dims in (1, 5)]


@pytest.mark.parametrize("arch", [a for family, a in FAMILIES.items() if family >= 80], ids=lambda a: a.name)
@pytest.mark.parametrize(("student", "guide"), PAIRS)
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_no_dtype_pair_falls_back_to_fma_tiles(arch, student, guide, precision):
    """On every family with tensor cores, every pair but fp64 gets tensor-core tiles (BLOCK_K >= 16, and 64+ rows
    on sm_90, a warpgroup's MMA; 32+ elsewhere) and a tensor-core input precision."""
    pair = _launcher_pair(student, guide, precision, arch)
    assert all(p != "ieee" for d, p in zip(pair[::2], pair[1::2]) if d == torch.float32)
    assert operand_kind(*pair, arch) not in ("fp64", "fma")
    for _, configs in _every_list(pair, arch):
        rows = 64 if arch.wgmma else 32
        assert configs and all(c.kwargs["BLOCK_M"] >= rows and c.kwargs["BLOCK_K"] >= 16 for c in configs)


@pytest.mark.parametrize("capability", [c for c in KNOWN_ARCHS if KNOWN_ARCHS[c][0] == 75])
@pytest.mark.parametrize(("student", "guide"), PAIRS)
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_fma_tiles_for_every_pair_without_tensor_cores(capability, student, guide, precision):
    """Below sm_80 fp32 runs at "ieee" and every pair gets the FMA tiles of its student's element size, whatever the
    precisions."""
    arch = arch_for(capability)
    pair = _launcher_pair(student, guide, precision, arch)
    assert pair[1::2] == ("ieee", "ieee")
    split = (student, "tf32x3", guide, "tf32x3" if guide == torch.float32 else "ieee")
    kind = "fma" if student == torch.float32 else "fma-half"
    assert operand_kind(*pair, arch) == operand_kind(*split, arch) == kind
    fma = {str(c) for n_dims in (1, 5) for c in tile_configs(student, "ieee", student, "ieee", n_dims,
                                                               arch=arch, interpret=False)}
    for candidate in (pair, split):
        for _, configs in _every_list(candidate, arch):
            assert configs and {str(c) for c in configs} <= fma
            assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 32 for c in configs)


@pytest.mark.parametrize("arch", [a for family, a in FAMILIES.items() if family >= 80], ids=lambda a: a.name)
def test_the_tf32x3_gemm_has_tensor_core_tiles_within_shared_memory(arch):
    """Every family with tensor cores has a config for the backward's tf32x3 GEMM (BLOCK_K >= 16, and 64+ rows on
    sm_90) whose shared-memory estimate fits it; below sm_80 there is none (fp32 runs unsplit there)."""
    configs = gemm_configs(arch, interpret=False)
    rows = 64 if arch.wgmma else 32
    assert configs and all(c.kwargs["BLOCK_M"] >= rows and c.kwargs["BLOCK_K"] >= 16 for c in configs)
    assert all(gemm_shared_memory_estimate(c) <= arch.shared_bytes for c in configs)
    with pytest.raises(ValueError, match="no tensor-core MMA"):
        gemm_configs(arch_for((7, 5)), interpret=False)


@pytest.mark.parametrize("shared_kib", [99, 48])
def test_unknown_capability_takes_the_newest_family_pruned_to_its_shared_memory(shared_kib):
    """A future GPU gets the newest family's tiles, keeping those whose estimate fits its shared memory (the
    smallest one where none does): never an empty list."""
    arch = arch_for((13, 0), shared_bytes=shared_kib * 1024)
    newest = arch_for(max(KNOWN_ARCHS))
    assert not arch.known and arch.family == newest.family and arch.shared_bytes == shared_kib * 1024
    pruned_any = False
    for student, guide in PAIRS:
        for precision in ("highest", "high"):
            pair = _launcher_pair(student, guide, precision, arch)
            kind = operand_kind(*pair, arch)
            for (n_dims, configs), (_, full) in zip(_every_list(pair, arch), _every_list(pair, newest)):
                fits = [c for c in full if shared_memory_estimate(c, kind) <= arch.shared_bytes]
                want = fits or [min(full, key=lambda c: shared_memory_estimate(c, kind))]
                assert configs and [str(c) for c in configs] == [str(c) for c in want], (pair, n_dims)
                pruned_any |= len(configs) < len(full)
    assert pruned_any == (shared_kib < 99)
    full = gemm_configs(newest, interpret=False)
    fits = [c for c in full if gemm_shared_memory_estimate(c) <= arch.shared_bytes]
    want = fits or [min(full, key=gemm_shared_memory_estimate)]
    assert [str(c) for c in gemm_configs(arch, interpret=False)] == [str(c) for c in want]
