"""cgist.stage.numerics: accumulation dtype, normalisation and its backward, guide threshold, guide mask and tie ids."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES, TOL, make_inputs, precision

from cgist.stage.numerics import EPS, compute_dtype, guide_mask, normalize, threshold
from cgist.stage.spec.problem import normalization_backward_
from cgist.stage.ties import TieIndex, tie_ids


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=precision)
def test_compute_dtype(dtype):
    assert compute_dtype(dtype) == (torch.float64 if dtype == torch.float64 else torch.float32)


def _rows_with_small_ones() -> torch.Tensor:
    """Random float64 rows, one of them zero and one with a norm below EPS (clamped)."""
    x = make_inputs(6, 6, 5, 1, 0, seed=11)[0][0]
    x[2] = 0.0
    x[4] *= EPS / 10 / x[4].norm()
    return x


def test_normalize_returns_unit_rows_and_their_norms():
    x = _rows_with_small_ones()
    x_hat, norm = normalize(x)
    assert x_hat.shape == x.shape and norm.shape == (x.shape[0], 1)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(x, dim=1, keepdim=True), rtol=0, atol=0)
    big = norm.squeeze(1) >= EPS
    torch.testing.assert_close(x_hat[big].norm(dim=1), torch.ones(int(big.sum()), dtype=x.dtype), **TOL["embeddings"]["fp64"])
    assert torch.equal(x_hat[2], torch.zeros_like(x[2])) and torch.equal(x_hat[4], x[4] / EPS)


def test_normalize_computes_in_the_requested_dtype():
    x = _rows_with_small_ones().float()
    x_hat, norm = normalize(x, torch.float64)
    assert x_hat.dtype == norm.dtype == torch.float64
    expected = normalize(x.double())
    assert torch.equal(x_hat, expected[0]) and torch.equal(norm, expected[1])
    assert normalize(x)[0].dtype == torch.float32


def test_normalization_backward_is_the_gradient_of_normalize():
    """``cgist.stage.spec.problem.normalization_backward_`` with one dimension, as the streaming path calls it (normalised rows,
    kappa 1 but 0 below EPS, then divided by the norm); also on the zero row and the row below EPS, where the
    clamped gradient is g / EPS."""
    x = _rows_with_small_ones().requires_grad_()
    grad_hat = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(12))
    x_hat, norm = normalize(x)
    (expected,) = torch.autograd.grad(x_hat, x, grad_hat)
    kappa = (norm.detach() >= EPS).to(x.dtype).T  # 1 x rows
    got = normalization_backward_(grad_hat.clone(), x_hat.detach(), kappa, None, [(0, x.shape[1])])
    got = got / norm.detach().clamp_min(EPS)
    torch.testing.assert_close(got, expected, **TOL["embeddings"]["fp64"])
    torch.testing.assert_close(got[2], grad_hat[2] / EPS, **TOL["embeddings"]["fp64"])


@pytest.mark.parametrize("margin", [0.0, 0.25, -0.5])
def test_threshold(margin):
    theta = torch.tensor([[0.8], [0.1], [0.0], [-0.3], [-1.0]], dtype=torch.float64)
    assert torch.equal(threshold(theta, margin, relative=False), theta - margin)
    relative = threshold(theta, margin, relative=True)
    # theta - |theta| * margin: the margin scales the distance below theta by |theta|, whatever theta's sign.
    tol = TOL["embeddings"]["fp64"]
    torch.testing.assert_close(relative[theta > 0], (theta * (1 - margin))[theta > 0], **tol)
    torch.testing.assert_close(relative[theta < 0], (theta * (1 + margin))[theta < 0], **tol)
    assert torch.equal(relative[theta == 0], theta[theta == 0])


def test_guide_mask_masks_strictly_above_the_limit_and_ties_by_the_flag():
    guide = torch.tensor([[0.5, 0.5, 0.2], [0.1, 0.9, 0.9]], dtype=torch.float64)
    limit = torch.tensor([[0.5], [0.3]], dtype=torch.float64)
    theta_masked = torch.tensor([[True], [False]])
    col_ids, partner_ids = torch.tensor([0, 1, 2]), torch.tensor([1, 2])
    mask = guide_mask(guide, limit, theta_masked, TieIndex(col_ids).pairs(partner_ids, 0, 3))
    tie = col_ids[None, :] == partner_ids[:, None]
    # Off the ties: strictly greater than the limit (0.5 is not above 0.5). On them: the row's flag, whatever the score.
    assert torch.equal(mask[~tie], (guide > limit)[~tie])
    assert torch.equal(mask[tie], theta_masked.squeeze(1))
    assert mask[0, 1] and not mask[0, 0] and not mask[1, 2] and mask[1, 1]


def test_guide_mask_of_a_column_range_finds_the_ties_inside_it():
    """The same rule on columns lo:hi of a block: the block's tie index gives the ties inside the range."""
    gen = torch.Generator().manual_seed(14)
    guide = torch.rand(5, 40, dtype=torch.float64, generator=gen)
    limit = torch.rand(5, 1, dtype=torch.float64, generator=gen)
    theta_masked = torch.tensor([[True], [False], [True], [False], [True]])
    col_ids = torch.randint(0, 12, (40,), generator=gen)  # many repeated ids
    partner_ids = torch.tensor([3, 3, 11, 40, 0])  # 40: no column ties with that row
    ties = TieIndex(col_ids)
    whole = guide_mask(guide, limit, theta_masked, ties.pairs(partner_ids, 0, 40))
    tie = col_ids[None, :] == partner_ids[:, None]
    assert torch.equal(whole, torch.where(tie, theta_masked, guide > limit)) and int(tie.sum()) > 5
    for lo, hi in [(0, 7), (7, 8), (8, 40), (13, 29)]:
        part = guide_mask(guide[:, lo:hi], limit, theta_masked, ties.pairs(partner_ids, lo, hi))
        assert torch.equal(part, whole[:, lo:hi]), (lo, hi)


@pytest.mark.parametrize("name", ["fp64", "fp32"])
def test_tie_ids_are_equal_exactly_for_equal_normalised_rows(name):
    dtype = DTYPES[name]
    _, columns = make_inputs(4, 6, 1, 3, 1, dtype, seed=13)
    columns[1][5] = columns[0][2]  # copies across columns and within one
    columns[2][0] = columns[0][2]
    columns[2][3] = columns[2][1]
    columns[1][1] = -columns[1][0]  # a negation is another vector
    columns[0][3] = 4.0 * columns[0][1]  # a power-of-two rescale normalises to the same bits
    columns[1][2] = -0.0 * columns[1][2]  # zero rows, with negative zeros in one
    columns[1][4] = 0.0 * columns[1][4]
    ids = tie_ids(columns, dtype)
    assert [i.shape[0] for i in ids] == [c.shape[0] for c in columns] and all(i.dtype == torch.int32 for i in ids)
    rows, flat = torch.cat([normalize(c)[0] for c in columns]), torch.cat(ids)
    same_vector = (rows[:, None, :] == rows[None, :, :]).all(dim=2)
    assert torch.equal(flat[:, None] == flat[None, :], same_vector)
    assert int(same_vector.sum()) > rows.shape[0] + 8  # the copies are there


@pytest.mark.parametrize("name", ["fp64", "fp32"])
def test_tie_ids_agree_with_sorting_the_normalised_rows(name):
    """Fingerprints against torch.unique over the whole normalised copy, across chunk boundaries."""
    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(15)
    rows = torch.randn(9000, 24, dtype=torch.float64, generator=gen).to(dtype)
    for dst, src in [(8999, 3), (4096, 4095), (5000, 17), (17, 6000)]:
        rows[dst] = rows[src] * (2.0 if dst % 2 else 1.0)
    rows[100] = rows[101] + 0.0
    rows[100, 5] = -rows[100, 5]  # differs from row 101 in one sign bit only
    ids = tie_ids([rows[:5000], rows[5000:]], dtype)
    unique = torch.unique(normalize(rows)[0], dim=0, return_inverse=True)[1]
    flat = torch.cat(ids)
    assert torch.equal(flat[:, None] == flat[None, :], unique[:, None] == unique[None, :])


# Half products into float32: each way a device offers ------------------------------------------------------------

_ADDMM, _MM = torch.addmm, torch.mm


def _addmm_into_float32(input, a, b, *, beta=1.0, alpha=1.0, out_dtype=None, **kwargs):
    """``torch.addmm`` with CUDA's ``out_dtype`` (half operands, a float32 result), emulated by widening them."""
    if out_dtype is None:
        return _ADDMM(input, a, b, beta=beta, alpha=alpha, **kwargs)
    return _ADDMM(input, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, **kwargs)


def _mm_into_float32(a, b, *, out_dtype=None, **kwargs):
    """``torch.mm`` with CUDA's ``out_dtype``, emulated likewise."""
    return _MM(a, b, **kwargs) if out_dtype is None else _MM(a.to(out_dtype), b.to(out_dtype), **kwargs)


def _no_out_dtype(*args, out_dtype=None, **kwargs):
    if out_dtype is not None:
        raise TypeError("out_dtype is not supported here")
    return _ADDMM(*args, **kwargs)


@pytest.mark.parametrize("how", ["addmm", "mm", "upcast"])
def test_half_products_accumulate_in_float32_each_way_a_device_offers(monkeypatch, how):
    """``half_accumulation`` probes which call multiplies half operands into float32 (CUDA's ``out_dtype`` calls,
    emulated here by widening, as a product of two half values is exact in float32), and ``addmm_`` takes it:
    ``beta * out + alpha * a @ b`` as the widened product gives it, a ``beta`` of 0 reading nothing of ``out``."""
    from cgist.stage import numerics

    if how != "upcast":
        monkeypatch.setattr(torch, "addmm", _addmm_into_float32 if how == "addmm" else _no_out_dtype)
        monkeypatch.setattr(torch, "mm", _mm_into_float32)
    assert numerics.half_accumulation.__wrapped__("cpu") == how
    monkeypatch.setattr(numerics, "half_accumulation", lambda device_type: how)
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(5, 7, generator=gen).to(torch.bfloat16), torch.randn(7, 4, generator=gen).to(torch.bfloat16))
    start = torch.randn(5, 4, generator=gen)
    for beta, alpha in ((1.0, 1.0), (0.5, -2.0), (0.0, 3.0)):
        out = start.clone()
        if beta == 0:
            out[0, 0] = float("nan")  # not read
        want = beta * start + alpha * (a.float() @ b.float()) if beta else alpha * (a.float() @ b.float())
        torch.testing.assert_close(numerics.addmm_(out, a, b, beta=beta, alpha=alpha), want, rtol=1e-6, atol=1e-6)
