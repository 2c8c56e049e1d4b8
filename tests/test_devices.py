"""The device seam (``cgist.stage.devices``) and the devices it simulates: every route of docs/devices.md taken under
the device it names, with CPU tensors standing in for it and the kernels under the interpreter.

A simulated device answers every question cgist asks of a device, so what runs here is what runs there: the router,
the tile tables and their pruning, the launchers, the first-use check and the fallback. What a real GPU alone answers
(its properties, its stream, making it current) is read through torch.cuda's functions, here replaced by a GPU's
answers, so that those lines run too.
"""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch
from helpers import make_inputs

import cgist
from cgist.stage import devices
from cgist.stage.dispatch import route, selfcheck
from cgist.stage.numerics import half_products
from cgist.stage.pytorch import dense as pytorch_dense
from cgist.stage.spec.options import GistOptions
from cgist.stage.spec.scores import DENSE, Score

CPU = torch.device("cpu")
#: What docs/devices.md's table says "auto" takes on each device, and why.
ROUTES = {
    "sm_70": ("torch", "below sm_80"), "sm_75": ("torch", "below sm_80"),
    **{arch: ("triton", f"{arch}: Triton kernels") for arch in
       ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "sm_130")},
    "rocm": ("torch", "ROCm: the Triton kernels are untested on AMD GPUs"), "mps": ("torch", "mps tensors"),
}


def test_the_simulated_devices_are_docs_devices_md_rows():
    assert list(devices.SIMULATED) == list(ROUTES)


@pytest.mark.parametrize("arch", list(ROUTES))
def test_a_simulated_device_answers_as_the_device_it_stands_for(simulate, arch):
    sim = simulate(arch)
    assert devices.simulated(CPU) is sim and devices.simulated(torch.device("cuda:0")) is None
    assert devices.device_kind(CPU) == sim.kind and devices.is_gpu(CPU) == (sim.kind != "mps")
    assert devices.device_key(CPU) == f"cpu@{arch}"
    assert devices.device_name(CPU) == sim.name
    shape = {"rocm": "ROCm", "mps": "mps"}.get(arch, arch)
    assert devices.describe(CPU) == f"cpu simulating {sim.name} ({shape})"
    arch_info = devices.gpu_arch(CPU)
    assert (arch_info is None) == (sim.kind != "cuda")
    if arch_info is not None:
        assert arch_info.name == arch and arch_info.known == (arch != "sm_130")
    assert devices.bf16_tensor_cores(CPU) == (arch not in ("sm_70", "sm_75", "mps"))
    assert devices.free_bytes(CPU) > 0  # the host's: the tensors are there
    devices.synchronize(CPU)
    with devices.launch_context(CPU):
        pass


@pytest.mark.parametrize("arch", list(ROUTES))
def test_auto_routes_every_pair_as_docs_devices_md_says(simulate, arch):
    """The route per dtype pair, and the half products of the PyTorch path where it is taken (7.x: bf16 as fp16)."""
    simulate(arch)
    backend, why = ROUTES[arch]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        chosen, reason = route.auto_route(CPU, dtype, dtype)
        assert chosen == backend and why in reason
    products = {dtype: half_products(CPU, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    expected = {"sm_70": torch.float16, "sm_75": torch.float16, "mps": None}.get(arch, torch.bfloat16)
    assert products == {torch.float32: None, torch.bfloat16: expected,
                        torch.float16: None if arch == "mps" else torch.float16}


def test_a_bad_simulated_device_is_refused(monkeypatch):
    monkeypatch.setenv(devices.SIMULATE_ENV, "sm_91")
    with pytest.raises(ValueError, match=r"CGIST_SIMULATE_DEVICE must be one of sm_70, .*, mps \(or unset\), got "
                                         r"'sm_91'"):
        devices.device_kind(CPU)
    monkeypatch.setenv(devices.SIMULATE_ENV, "sm_90")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="CGIST_SIMULATE_DEVICE=sm_90 runs the kernels under the Triton "
                                           "interpreter: set TRITON_INTERPRET=1"):
        devices.gpu_arch(CPU)
    monkeypatch.setenv(devices.SIMULATE_ENV, "rocm")  # no kernels there: no interpreter needed
    assert devices.device_kind(CPU) == "rocm"


@pytest.mark.parametrize("arch, products", [("sm_75", torch.float16), ("rocm", torch.bfloat16), ("mps", None)])
def test_the_pytorch_path_multiplies_bf16_as_the_device_does(simulate, monkeypatch, arch, products):
    """On 7.x the streaming path multiplies bf16 rows as exactly scaled fp16 (no bf16 tensor cores), on ROCm as
    they are, on MPS in float32; the result is the CPU's within bf16's rounding of the rows."""
    student, guide = make_inputs(6, 9, 16, 8, 1, torch.bfloat16, seed=2)
    options = dict(temperature=0.05, margin=0.1)
    want = cgist.gist_loss(student, guide, backend="torch", **options)
    simulate(arch)
    taken = []
    half_rows = pytorch_dense.half_rows
    monkeypatch.setattr(pytorch_dense, "half_rows", lambda x, *args: taken.append(args[1]) or half_rows(x, *args))
    got = cgist.gist_loss(student, guide, **options)
    assert set(taken) == ({products} if products else set())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_an_unknown_newer_gpu_takes_the_newest_tiles_pruned(simulate):
    """sm_130 (64 KiB of shared memory): the kernels run with sm_120's tiles that fit, the autotuner's pick among them
    (a simulated device takes the first), and the doctor shows the same list."""
    from cgist.stage.triton import tiles
    from cgist.stage.triton.common import arch_of, input_precision

    sim = simulate("sm_130")
    newest = devices.arch_for(max(devices.KNOWN_ARCHS))
    student, guide = make_inputs(20, 20, 16, 8, 1, torch.bfloat16, seed=4)
    precision = input_precision(torch.bfloat16, sim.arch)
    full = tiles.tile_configs(torch.bfloat16, precision, torch.bfloat16, precision, arch=newest)
    pruned = tiles.tile_configs(torch.bfloat16, precision, torch.bfloat16, precision, arch=sim.arch)
    assert 0 < len(pruned) < len(full) and {str(c) for c in pruned} < {str(c) for c in full}
    assert all(tiles.shared_memory_estimate(c, "half") <= 64 * 1024 for c in pruned)
    cgist.gist_loss(student, guide, temperature=0.05)
    assert str(tiles.tuned_fwd_kernel(arch_of(CPU)).best_config) == str(pruned[0])
    listed = route.kernel_tiles(CPU, torch.bfloat16, torch.bfloat16)
    assert listed.startswith("dense " + ", ".join(
        "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f"-w{c.num_warps}-s{c.num_stages}" for c in pruned) + ";")


def test_kernel_tiles_reads_the_launchers_precision():
    """``cgist doctor``'s tiles (it crashed on every GPU that takes the kernels: ``route.kernel_tiles`` imported a
    module the restructure had removed)."""
    listed = route.kernel_tiles(CPU, torch.float32, torch.float32)
    assert listed.startswith("dense 128x64x16-w8-s3, 64x64x16-w4-s3; token scores Q32xT64xK16")  # sm_90's tf32x3


def test_a_score_without_triton_kernels_takes_the_pytorch_path(simulate, monkeypatch):
    """A score that registers no Triton backend: "auto" takes the PyTorch path on a GPU the kernels serve (no
    notice: there is nothing to install), and backend="triton" says why it cannot run."""
    simulate("sm_90")
    torch_only = Score("dense", DENSE.similarities, tokens=False, options=DENSE.options, spec=DENSE.spec,
                       backends={"torch": DENSE.backend("torch")})
    monkeypatch.setattr(GistOptions, "score", property(lambda self: torch_only))
    call = types.SimpleNamespace(options=GistOptions(), device=CPU, dtype=torch.float32, guide_dtype=torch.float32)
    assert route.auto_route(CPU, torch.float32, torch.float32, torch_only) == (
        "torch", "the dense score has no Triton kernels")
    assert route.select_stage(call, "auto") is pytorch_dense
    with pytest.raises(RuntimeError, match="backend='triton' is unavailable: the dense score has no Triton kernels"):
        route.select_stage(call, "triton")


def test_a_kernel_failing_after_its_check_falls_back_once(simulate, monkeypatch, caplog):
    """Under a simulated sm_90 with the first-use check on: the kernels pass it, then fail at a launch; "auto" trains
    on the PyTorch path from then on, with one warning naming the device."""
    from cgist.stage.triton import dense as triton_dense

    simulate("sm_90")
    monkeypatch.setenv(selfcheck.ENV, "1")
    monkeypatch.setattr(selfcheck, "ROWS", 6)
    student, guide = make_inputs(5, 10, 12, 8, 1, torch.float32, seed=3, requires_grad=True)
    options = dict(temperature=0.05, margin=0.1, offset=5)
    checked = cgist.gist_loss(student, guide, **options)
    assert [c.ok for c in route.first_use_checks().values()] == [True]
    want = cgist.gist_loss(student, guide, backend="torch", **options)
    torch.testing.assert_close(checked, want, rtol=1e-5, atol=1e-6)

    def broken(*args, **kwargs):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(triton_dense, "forward_group", broken)
    with caplog.at_level(logging.WARNING, logger="cgist"):
        for _ in range(2):
            assert torch.equal(cgist.gist_loss(student, guide, **options), want)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cpu simulating NVIDIA H100 80GB HBM3 (sm_90)" in warnings[0]
    assert list(route.kernel_failures()) == [("dense", "cpu@sm_90", torch.float32, torch.float32)]


# A real GPU's answers, through torch.cuda -----------------------------------------------------------------------


def test_a_real_gpu_is_read_through_torch_cuda(monkeypatch):
    """The lines only a real GPU reaches, with torch.cuda's functions answering as an H100 does (and Triton's driver
    failing, so that torch's shared-memory figure is read)."""
    calls = []

    class CurrentDevice:
        def __init__(self, device) -> None:
            self.device = device

        def __enter__(self):
            calls.append(f"enter {self.device}")

        def __exit__(self, *exc):
            calls.append("exit")

    props = types.SimpleNamespace(shared_memory_per_block_optin=232448)
    answers = dict(current_device=lambda: 3, get_device_capability=lambda index: (9, 0),
                   get_device_properties=lambda index: props, get_device_name=lambda device=None: "NVIDIA H100",
                   mem_get_info=lambda device=None: (7 * 2**30, 80 * 2**30),
                   is_bf16_supported=lambda including_emulation=True: True,
                   synchronize=lambda device=None: calls.append("synchronize"), device=CurrentDevice)
    for name, answer in answers.items():
        monkeypatch.setattr(torch.cuda, name, answer)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv(devices.SIMULATE_ENV, raising=False)
    devices.reset_devices()
    try:
        gpu = torch.device("cuda")
        arch = devices.gpu_arch(gpu)
        assert (arch.name, arch.shared_bytes, arch.known) == ("sm_90", 232448, True)
        assert devices.device_key(gpu) == "cuda:3" and devices.describe(gpu) == "cuda:3 (NVIDIA H100, sm_90)"
        assert devices.free_bytes(gpu) == 7 * 2**30 and devices.bf16_tensor_cores(gpu)
        devices.synchronize(gpu)
        with devices.launch_context(gpu):
            calls.append("launch")
        assert calls == ["enter cuda", "exit", "synchronize", "enter cuda", "launch", "exit"]
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert devices.device_kind(gpu) == "rocm" and devices.gpu_arch(gpu) is None
    finally:
        devices.reset_devices()


# The seam's other answers -------------------------------------------------------------------------------------------


def test_a_capability_older_than_every_known_one_has_no_tiles(simulate, monkeypatch):
    """sm_60 has no ``Arch``; a launch on such a GPU (a simulated sm_90 made to read none) is refused by name."""
    from cgist.stage.triton import common

    assert devices.arch_for((6, 0)) is None
    simulate("sm_90")
    monkeypatch.setattr(common, "gpu_arch", lambda device: None)
    with pytest.raises(RuntimeError, match=r"cpu simulating NVIDIA H100 80GB HBM3 \(sm_90\) is older than every "
                                           r"architecture the Triton tile configs know \(sm_70 and newer\)"):
        common.arch_of(CPU)


def test_free_memory_without_proc_meminfo_is_the_physical_memory(monkeypatch):
    def no_meminfo(path, *args, **kwargs):
        raise OSError(f"no {path}")

    monkeypatch.setattr(devices, "open", no_meminfo, raising=False)
    assert devices.free_bytes(CPU) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_triton_version_that_cannot_be_read_is_not_trusted(monkeypatch, caplog):
    import triton

    monkeypatch.setattr(triton, "__version__", "unknown")
    devices.reset_notices()
    with caplog.at_level(logging.WARNING, logger="cgist"):
        why = devices.unchecked_triton()
    devices.reset_notices()
    assert why.startswith("Triton unknown is older than every release the kernels' compile check covers")
    assert [r.getMessage() for r in caplog.records] == [f"cgist: {why}"]


def test_a_pytorch_backend_that_cannot_be_imported_is_raised():
    """Only the Triton backend's ImportError becomes "unavailable": a score's PyTorch module must import."""
    broken = Score("broken", ("cos",), tokens=False, options=(), spec=DENSE.spec,
                   backends={"torch": "cgist.stage.pytorch.no_such_module"})
    with pytest.raises(ModuleNotFoundError, match="cgist.stage.pytorch.no_such_module"):
        route.backend_module(broken, "torch")


def test_the_check_names_a_dtype_without_kernels():
    with pytest.raises(TypeError, match="the kernels take float64, float32, bfloat16 or float16 embeddings, got "
                                        "torch.int32"):
        selfcheck.score_precision(torch.int32)


def test_a_device_other_than_the_cpu_gets_its_scratch_fresh():
    """The kept workspace is the CPU's (a GPU's caching allocator reuses its blocks): elsewhere each call allocates."""
    from cgist.stage.pytorch.workspace import _thread_buffer

    scratch = _thread_buffer(12, torch.float32, torch.device("meta"))
    assert scratch.device.type == "meta" and scratch.numel() == 12
