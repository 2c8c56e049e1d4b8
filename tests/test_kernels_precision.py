"""fp32 on tensor cores: the tf32x3 split, its rounding and its error bound, emulated on the CPU.

At torch's default matmul precision ("highest") every product of the Triton backend's loss stage runs
as tf32x3: operands split into a tf32 high part and the fp32 rest, three tf32 tensor-core products
(``hi*hi + hi*lo + lo*hi``). Neither the Triton interpreter nor a CPU has tf32, so the rounding is
emulated here: tf32 values and their exact products in float64, with the tensor core's rounding of
the low parts taken as truncation (the worst case) or round-to-nearest. The bound, per entry of a
product over K terms with u = 2^-11 (the unit roundoff of tf32's 11-bit significand):

    |tf32x3(a @ b) - a @ b| <= (5 + 4u) u^2 sum_k |a_k b_k|   (+ the fp32 accumulation of the terms)

A single tf32 product is ~2u: about 800 times the bound, which the test shows too (so it can fail).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, one_thread  # noqa: F401  (one_thread: autouse)

from cgist.kernels import launch
from cgist.kernels.gist import _round_tf32, operand_kind, tile_configs
from cgist.kernels.launch import input_precision, split_tf32

U = 2.0**-11
BOUND = (5 + 4 * U) * U**2


def _tf32(x: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 ``x`` rounded to tf32: "rn" to nearest (ties to even), "rz" toward zero (truncation)."""
    if mode == "rn":
        return split_tf32(x)[0]
    return (x.contiguous().view(torch.int32) & -8192).view(torch.float32)


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


def _emulated_addmm(mode: str):
    """``out += tf32(a) @ tf32(b)``: tf32 operands, exact products and sums (float64)."""
    def addmm_(out, a, b):
        out.add_(_tf32(a, mode).double() @ _tf32(b, mode).double())
    return addmm_


@pytest.mark.parametrize("mode", ["rz", "rn"])
def test_tf32x3_products_meet_the_bound(monkeypatch, mode):
    """The launcher's three-product composition (``_gemm_acc``), with every product on emulated tf32 cores."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(64, 300, generator=gen) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=gen).float())
    b = torch.randn(300, 48, generator=gen)
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    monkeypatch.setattr(launch, "_addmm_", _emulated_addmm(mode))

    split = torch.zeros(64, 48, dtype=torch.float64)
    launch._gemm_acc(split, split_tf32(a), split_tf32(b))
    ratio = ((split - exact).abs() / scale).max().item()
    assert ratio <= BOUND, f"tf32x3 error {ratio:.3g} x sum|ab| > bound {BOUND:.3g}"

    single = torch.zeros(64, 48, dtype=torch.float64)
    launch._gemm_acc(single, (a,), (b,))
    assert ((single - exact).abs() / scale).max().item() > 50 * BOUND, "one tf32 pass should miss the bound"


def test_fp32_runs_split_at_highest_and_tf32_below():
    previous = torch.get_float32_matmul_precision()
    try:
        for setting, want in (("highest", "tf32x3"), ("high", "tf32"), ("medium", "tf32")):
            torch.set_float32_matmul_precision(setting)
            assert input_precision(torch.float32) == want
    finally:
        torch.set_float32_matmul_precision(previous)
    assert input_precision(torch.bfloat16) == "ieee"  # ignored by tl.dot for half operands


@pytest.mark.parametrize("arch", [8, 9])
@pytest.mark.parametrize(("student", "guide"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_no_dtype_pair_falls_back_to_fma_tiles(arch, student, guide, precision):
    """Every pair but fp64 gets tensor-core tiles (64+ rows, BLOCK_K >= 16) and a tensor-core input precision."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        pair = (student, input_precision(student), guide, input_precision(guide))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert all(p != "ieee" for d, p in zip(pair[::2], pair[1::2]) if d == torch.float32)
    assert operand_kind(*pair) != "fp64"
    for n_dims in (1, 5):
        configs = tile_configs(*pair, n_dims, arch=arch, interpret=False)
        assert configs and all(c.kwargs["BLOCK_M"] >= 64 and c.kwargs["BLOCK_K"] >= 16 for c in configs)
