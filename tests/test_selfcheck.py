"""The first-use check of ``backend="auto"``: each kernel variant agrees with the PyTorch path before it is used.

The interpreted kernels stand in for a GPU's (a simulated sm_90: ``cgist.stage.devices``), on a check problem of
``ROWS_HERE`` rows instead of ``selfcheck.ROWS`` (256 rows take about a minute under the interpreter). Kernels made wrong in one number each (the loss, one gradient, one mask count) must be caught.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from helpers import make_inputs
from test_kernels import _HostReads

import cgist
from cgist import GistOptions
from cgist.stage.dispatch import route, selfcheck
from cgist.stage.pytorch import dense as pytorch_dense
from cgist.stage.spec import dense
from cgist.stage.spec.dense import dense_call
from cgist.stage.triton import dense as triton_dense

ROWS_HERE = 24
OPTIONS = dict(temperature=0.05, margin=0.1, offset=5)


@pytest.fixture
def auto_runs_kernels(simulate, monkeypatch):
    """``auto`` takes the (interpreted) kernels on the CPU simulating sm_90, with nothing remembered before or after
    and the first-use check on; returns the list of the checks run."""
    simulate("sm_90")
    monkeypatch.setattr(selfcheck, "ROWS", ROWS_HERE)
    monkeypatch.delenv(selfcheck.ENV, raising=False)
    checks = []
    check_call = selfcheck.check_call

    def counted(*args, **kwargs):
        checks.append(check_call(*args, **kwargs))
        return checks[-1]

    monkeypatch.setattr(selfcheck, "check_call", counted)
    return checks


def _check(variant: dense.DenseVariant, options: GistOptions, n_columns: int) -> selfcheck.Check:
    """The first-use check of ``variant`` (the dense score's check problem) on the interpreted kernels."""
    student, guide, checked, text_ids = dense.check_inputs(variant, options, n_columns, torch.device("cpu"),
                                                           ROWS_HERE)
    problem = dense_call(student, guide, checked, text_ids=text_ids)
    return selfcheck.check_call(triton_dense, pytorch_dense, problem, variant)


def _inputs(dtype=torch.float32):
    return make_inputs(5, 10, 12, 8, 1, dtype, seed=3, requires_grad=True)


def _loss_and_grads(student, guide, backend, **options):
    loss = cgist.gist_loss(student, guide, backend=backend, **{**OPTIONS, **options})
    return loss, torch.autograd.grad(loss, student)


def _same(a, b) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return torch.equal(loss_a, loss_b) and all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))


def _wrong_loss(monkeypatch):
    loss = triton_dense.ForwardState.loss
    monkeypatch.setattr(triton_dense.ForwardState, "loss", lambda self: loss(self) * 1.01)


def _wrong_gradient(monkeypatch):
    """The first negative's gradient 1% too large."""
    gradients = triton_dense.BackwardWork.gradients

    def wrong(self):
        grads = gradients(self)
        grads[2] = grads[2] * 1.01
        return grads

    monkeypatch.setattr(triton_dense.BackwardWork, "gradients", wrong)


def _wrong_count(monkeypatch):
    """One masked entry too many in the anchor-negative block."""
    counters = triton_dense.ForwardState.counters

    def wrong(self):
        counts, sums = counters(self)
        return counts + (torch.arange(len(counts)) == 3), sums

    monkeypatch.setattr(triton_dense.ForwardState, "counters", wrong)


WRONG = {"loss": (_wrong_loss, "loss 1.0e-02"), "gradient": (_wrong_gradient, "gradients 1.0e-02"),
         "count": (_wrong_count, "mask counts masked_an ")}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_kernel_is_caught_falls_back_and_is_logged_once(auto_runs_kernels, monkeypatch, caplog, wrong):
    make_wrong, numbers = WRONG[wrong]
    student, guide = _inputs()
    want = _loss_and_grads(student, guide, "torch")
    right = _loss_and_grads(student, guide, "triton")
    make_wrong(monkeypatch)
    wrong_result = _loss_and_grads(student, guide, "triton")  # backend="triton" is never checked
    assert not _same(wrong_result, right) or wrong == "count"
    assert auto_runs_kernels == []

    with caplog.at_level(logging.WARNING, logger="cgist.function"):
        for _ in range(3):
            assert _same(_loss_and_grads(student, guide, "auto"), want)  # the PyTorch path's, exactly
    assert len(auto_runs_kernels) == 1 and not auto_runs_kernels[0].ok
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    message = warnings[0]
    assert message.startswith("cgist: the Triton kernels disagree with the PyTorch path on cpu simulating NVIDIA H100 "
                              "80GB HBM3 (sm_90) for float32 embeddings (D=12) with a float32 guide (Dg=8), fp32 products at 'highest', 1 dimension, "
                              f"directions query_to_doc, joint partition (first-use check, {ROWS_HERE} rows): ")
    assert numbers in message and "run `cgist doctor`" in message
    assert route.kernel_failures() == {}  # a disagreement is remembered per variant, not as a build failure
    (variant, check), = route.first_use_checks().items()
    assert variant == dense.variant_of(dense_call(student, guide, GistOptions(**OPTIONS)), "cpu@sm_90") and not check.ok


def test_the_count_check_compares_every_field(auto_runs_kernels, monkeypatch):
    """Only the wrong count differs: the loss and gradients agree, and the mismatch is named with both values."""
    _wrong_count(monkeypatch)
    student, guide = _inputs()
    cgist.gist_loss(student, guide, backend="auto", **OPTIONS)
    (check,) = auto_runs_kernels
    assert check.loss_diff <= check.tolerance and check.grad_diff <= check.tolerance
    ((field, (kernels, torch_path)),) = check.count_mismatches.items()
    assert field == "masked_an" and kernels == torch_path + 1 and torch_path > 0


def test_a_right_kernel_is_checked_once_per_variant_and_used(auto_runs_kernels, caplog):
    student, guide = _inputs()
    with caplog.at_level(logging.WARNING, logger="cgist.function"):
        for options in ({}, {"offset": 3}, {}, {"matryoshka_dims": (12, 6)}, {"matryoshka_dims": (12, 4)}):
            got = _loss_and_grads(student, guide, "auto", **options)
            assert _same(got, _loss_and_grads(student, guide, "triton", **options))  # the kernels' result
        _loss_and_grads(student, None, "auto")
        _loss_and_grads([s.double() for s in student], [g.double() for g in guide], "auto")
    # one check each: float32 with a guide, with two Matryoshka dimensions, without a guide, float64
    assert [(c.variant.dtype, c.variant.guide_dtype, c.variant.n_dims) for c in auto_runs_kernels] == [
        (torch.float32, torch.float32, 1), (torch.float32, torch.float32, 2), (torch.float32, None, 1),
        (torch.float64, torch.float64, 1)]
    assert all(c.ok and c.rows == ROWS_HERE for c in auto_runs_kernels)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_check_can_be_turned_off(auto_runs_kernels, monkeypatch):
    _wrong_loss(monkeypatch)
    student, guide = _inputs()
    monkeypatch.setenv(selfcheck.ENV, "0")
    assert _same(_loss_and_grads(student, guide, "auto"), _loss_and_grads(student, guide, "triton"))
    assert auto_runs_kernels == [] and route.first_use_checks() == {}
    monkeypatch.setenv(selfcheck.ENV, "no")
    with pytest.raises(ValueError, match=r"CGIST_SELF_CHECK must be 0 or 1 \(or unset\), got 'no'"):
        cgist.gist_loss(student, guide, backend="auto", **OPTIONS)


def test_a_kernel_failing_in_the_check_falls_back_as_a_build_failure(auto_runs_kernels, monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(triton_dense.BackwardWork, "run", fail)
    student, guide = _inputs()
    want = _loss_and_grads(student, guide, "torch")
    with caplog.at_level(logging.WARNING, logger="cgist.function"):
        assert _same(_loss_and_grads(student, guide, "auto"), want)
        assert _same(_loss_and_grads(student, guide, "auto"), want)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: PassManager::run failed" in warnings[0]
    assert list(route.kernel_failures()) == [("dense", "cpu@sm_90", torch.float32, torch.float32)]


def test_a_warm_call_reads_no_value_on_the_host(auto_runs_kernels):
    """After its check, a variant's call runs the kernels alone: nothing waits for the device."""
    student, guide = make_inputs(13, 26, 40, 24, 1, torch.float32, 0)
    call = dense_call(student, guide, GistOptions(margin=0.1, offset=5, matryoshka_dims=(40, 20)))
    stage = route.select_stage(call, "auto")
    stage.forward(call, True, True)
    assert len(auto_runs_kernels) == 1
    with _HostReads() as probe:
        stage.forward(call, True, True)
    assert probe.ops == [] and len(auto_runs_kernels) == 1


def test_the_check_reports_its_cost():
    """The check times itself: under the interpreter, all of it is running (nothing compiles)."""
    variant = dense.make_variant("cpu", torch.float32, torch.float32, 40, 24, GistOptions())
    start = time.perf_counter()
    check = _check(variant, GistOptions(), 3)
    assert 0 < check.seconds <= time.perf_counter() - start
    assert check.ok, check.numbers()


@pytest.mark.parametrize("pair", [(torch.float64, torch.float64), (torch.float32, None), (torch.float32, torch.bfloat16),
                                  (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                  (torch.bfloat16, torch.float32)], ids=lambda p: "-".join(map(str, p)))
def test_right_kernels_pass_in_every_dtype_pair(pair):
    """No false alarm in any dtype pair the kernels take (under the interpreter, whose half products are exact as
    a GPU's are), with Matryoshka dimensions, duplicates masked and two directions over every rank's anchors."""
    options = GistOptions(matryoshka_dims=(40, 16), mask_duplicates=True, all_anchors=True, contrast_anchors=False,
                          directions=("query_to_doc", "doc_to_query"), hardness_mode="all_negatives",
                          hardness_strength=2.0)
    variant = dense.make_variant("cpu", pair[0], pair[1], 40, 24, options)
    check = _check(variant, options, 4)
    assert check.ok, check.numbers()
    assert check.counts["masked_dq"][1] > 0 and check.counts["masked_an"][1] > 0


def test_a_learned_temperature_is_checked_too(monkeypatch):
    """Where the call learns its temperature, so does the check problem, and the check compares its gradient: a
    PyTorch path whose temperature gradient is doubled disagrees with the kernels."""
    student, guide = _inputs()
    learned = torch.tensor(0.05, requires_grad=True)
    options = GistOptions(temperature=0.05, contrast_anchors=False)
    call = dense_call(student, guide, options, temperature=learned)
    assert route.check_kernels(call, ROWS_HERE).ok
    original = pytorch_dense.forward

    def doubled(*args):
        loss, grads, counters = original(*args)
        return loss, type(grads)(grads.inputs, {name: 2 * g for name, g in grads.parameters.items()}), counters

    monkeypatch.setattr(pytorch_dense, "forward", doubled)
    check = route.check_kernels(call, ROWS_HERE)
    assert not check.ok and check.loss_diff < check.tolerance < check.grad_diff, check.numbers()


def _variant(device: str, student, guide, options: GistOptions) -> dense.DenseVariant:
    return dense.variant_of(dense_call(student, guide, options), device)


def test_the_variant_is_what_selects_the_kernels():
    student, guide = _inputs()
    base = _variant("cuda:0", student, guide, GistOptions())
    same = [GistOptions(offset=5, margin=0.3, temperature=0.1, contrast_anchors=False, mask_self=True)]
    assert all(_variant("cuda:0", student, guide, o) == base for o in same)
    assert _variant("cuda:0", [list(s.split(2)) for s in student], guide, GistOptions()) == base
    assert _variant("cuda:0", student[:2], guide[:2], GistOptions()) == base  # negatives: runtime
    others = [
        _variant("cuda:1", student, guide, GistOptions()),
        _variant("cuda:0", student, None, GistOptions()),
        _variant("cuda:0", student, [g.bfloat16() for g in guide], GistOptions()),
        _variant("cuda:0", student, guide, GistOptions(matryoshka_dims=(12, 6))),
        _variant("cuda:0", student, guide, GistOptions(directions=("query_to_doc", "doc_to_query"),
                                                        contrast_anchors=False)),
        _variant("cuda:0", [s[:, :8] for s in student], guide, GistOptions()),
    ]
    assert len({base, *others}) == 1 + len(others)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert _variant("cuda:0", student, guide, GistOptions()) != base
        assert selfcheck.score_precision(torch.float32) == "tf32"
        half = [s.bfloat16() for s in student], [g.bfloat16() for g in guide]
        assert _variant("cuda:0", *half, GistOptions()).precision == ""
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("dim_g", [1, 3, 16, 384])
@pytest.mark.parametrize("strategy", ["absolute", "relative"])
@pytest.mark.parametrize("guide_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_no_guide_score_of_the_problem_is_near_its_threshold(dim_g, strategy, guide_dtype):
    """Every guide score of the check's problem, AP, AA, PP, AN and every rank's anchors, lies 0.15 or more from its
    row's threshold (after rounding the guide to its dtype), so both paths mask the same entries; and a share of
    every block is masked."""
    options = GistOptions(margin_strategy=strategy, directions=("query_to_doc", "doc_to_query"),
                          contrast_anchors=False, all_anchors=True, mask_duplicates=True)
    variant = dense.make_variant("cpu", torch.float32, guide_dtype, 16, dim_g, options)
    _, guide, checked, text_ids = dense.check_inputs(variant, options, 4, torch.device("cpu"))
    assert checked.margin == dense.MARGIN and checked.offset == 0 and checked.temperature == 0.05
    assert len(guide) == 4 and torch.equal(guide[3], guide[0]) and len(text_ids) == 4
    unit = [torch.nn.functional.normalize(g.double(), dim=1) for g in guide]
    theta = (unit[0] * unit[1]).sum(1, keepdim=True)
    threshold = theta - dense.MARGIN * (theta.abs() if strategy == "relative" else 1.0)
    for rows in (unit[0], unit[1]):  # anchor rows and positive rows (offset 0)
        for column in unit:
            scores = rows @ column.T
            assert float((scores - threshold).abs().min()) >= 0.15
            masked = float((scores > threshold).double().mean())
            assert masked > 0.04 if dim_g > 1 else masked == 1.0
