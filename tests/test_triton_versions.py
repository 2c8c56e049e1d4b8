"""The Triton releases the kernels are checked under, and the compile tables that show it.

- "auto" runs the kernels only under a Triton release the compile check covers (``OLDEST_CHECKED_TRITON`` and newer);
  under an older one it takes the PyTorch path, with one notice naming the version found and the oldest checked.
- Every compile table in bench/results records a hash of the sources it was built from (``bench/compile_table.py``);
  a table whose hash no longer matches the sources fails here, and a changed tile table changes the hash.
- There is one summary per Triton release from the oldest checked to that of the full table, each built with exactly
  the configs that the launcher picks under that release, without a spill and within the shared memory.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import types
from pathlib import Path

import pytest
import torch

from cgist import GistOptions
from cgist.stage.devices import OLDEST_CHECKED_TRITON, triton_release
from cgist.stage.dispatch import route
from cgist.stage.pytorch import dense as pytorch_dense

triton = pytest.importorskip("triton")

from test_aot_compile import ARCH, CHECKED_PAIRS, parse_table, tiles_seen, tiles_wanted  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
_spec = importlib.util.spec_from_file_location("compile_table", ROOT / "bench" / "compile_table.py")
compile_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_table)

CPU = torch.device("cpu")
#: What the per-release summaries compile: the arguments of bench/aot_compile.py and the architectures they name.
SUMMARY_ARGS = "--arch 80 86 89 90 --dtypes bf16 fp32"
SUMMARY_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def _release_name(release: tuple[int, int]) -> str:
    return ".".join(map(str, release))


# The version gate of "auto" -----------------------------------------------------------------------------------------


@pytest.fixture
def hopper(simulate, monkeypatch):
    """``auto`` on a simulated H100 (sm_90) with Triton importable; returns a setter of the Triton version it finds."""
    simulate("sm_90")
    return lambda version: monkeypatch.setattr(triton, "__version__", version)


def test_auto_takes_the_pytorch_path_under_an_older_triton_with_one_notice(hopper, caplog):
    older = f"{OLDEST_CHECKED_TRITON[0]}.{OLDEST_CHECKED_TRITON[1] - 1}.1"
    hopper(older)
    with caplog.at_level(logging.WARNING, logger="cgist"):
        for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
            call = types.SimpleNamespace(options=GistOptions(), device=CPU, dtype=dtype, guide_dtype=dtype)
            assert route.select_stage(call, "auto") is pytorch_dense
        chosen, why = route.auto_route(CPU, torch.bfloat16, torch.bfloat16)
    assert chosen == "torch"
    notices = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(notices) == 1, notices
    oldest = _release_name(OLDEST_CHECKED_TRITON)
    for text in (notices[0], why):
        assert f"Triton {older} " in text and f"the oldest is {oldest})" in text


@pytest.mark.parametrize("version", ["oldest", "3.9.0", "3.10.0+git1a2b3c4"])
def test_auto_runs_the_kernels_under_a_checked_triton(hopper, caplog, version):
    hopper(f"{_release_name(OLDEST_CHECKED_TRITON)}.0" if version == "oldest" else version)
    with caplog.at_level(logging.WARNING, logger="cgist"):
        assert route.auto_route(CPU, torch.bfloat16, torch.bfloat16) == ("triton", "sm_90: Triton kernels")
    assert not caplog.records


def test_an_explicit_triton_backend_is_not_gated(hopper):
    from cgist.stage.triton import dense as triton_dense

    hopper("3.0.0")
    call = types.SimpleNamespace(options=GistOptions(), device=CPU, dtype=torch.float32, guide_dtype=torch.float32)
    assert route.select_stage(call, "triton") is triton_dense


def test_triton_release():
    assert triton_release("3.4.0") == (3, 4)
    assert triton_release("3.5.0+git1a2b3c4") == (3, 5)
    assert triton_release("3.10.1") > triton_release("3.9.0")
    with pytest.raises(ValueError, match="not a Triton version"):
        triton_release("unknown")


# Compile tables that cannot go stale --------------------------------------------------------------------------------


def _tables() -> list[Path]:
    return sorted(RESULTS.glob("aot_compile*.txt"))


@pytest.mark.parametrize("table", _tables(), ids=lambda p: p.name)
def test_compile_table_matches_the_sources(table):
    compile_table.check_table(table)


def _copy_sources(root: Path) -> None:
    for file in compile_table.SOURCES:
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / file, root / file)


def test_a_changed_tile_table_fails_the_hash_test(tmp_path):
    table = RESULTS / "aot_compile.txt"
    _copy_sources(tmp_path)
    compile_table.check_table(table, tmp_path)  # the copy is what the table was built from

    tiles = tmp_path / "cgist" / "stage" / "triton" / "tiles.py"
    source = tiles.read_text()
    # the second config of sm_80's tf32x3 tiles: a smaller tile
    changed = source.replace("_MMA_TF32X3 = [(128, 64, 16, 8, 3), (64, 64, 16, 4, 3)]",
                             "_MMA_TF32X3 = [(128, 64, 16, 8, 3), (64, 32, 16, 4, 3)]")
    assert changed != source
    tiles.write_text(changed)
    with pytest.raises(AssertionError,
                       match="kernels changed: rerun python bench/aot_compile.py and commit its output"):
        compile_table.check_table(table, tmp_path)

    # a comment or a docstring does not change what compiles
    tiles.write_text(source.replace("_MMA_TF32X3 = [", "# a note\n_MMA_TF32X3 = [").replace(
        '"""The tile configs of the GIST kernels', '"""The GIST kernels\' tile configs'))
    gist = tmp_path / "kernels" / "gist.py"
    gist.write_text(gist.read_text().replace('"""Triton kernels for the GIST loss', '"""The Triton kernels of the GIST loss'))
    compile_table.check_table(table, tmp_path)


@pytest.mark.parametrize(("file", "old", "new"), [
    ("cgist/stage/triton/common.py", '"tf32x3" if', '"tf32" if'),  # the launcher's input precision of fp32
    ("cgist/stage/devices.py", "(8, 6): (86, 99)", "(8, 6): (80, 99)"),  # the tile family of sm_86
    # which release takes which tables
    ("cgist/stage/triton/tiles.py", "_OLDER_TRITON.get(release, {})", "_OLDER_TRITON.get((3, 8), {})"),
    ("cgist/stage/triton/tiles.py", "90: [(128, 128, 16, 8, 3)]", "90: [(128, 64, 16, 8, 3)]"),  # the GEMM's config
    ("kernels/gemm.py", "acc = tl.dot(a_lo, b_hi, acc", "acc = tl.dot(a_hi, b_hi, acc"),  # the GEMM's products
    # the MaxSim launcher's tiles and register limit, and its kernels
    ("cgist/stage/triton/maxsim.py", '("tf32x3", 16)', '("tf32x3", 32)'),
    ("cgist/stage/triton/maxsim.py", "MAX_REGISTERS = 255", "MAX_REGISTERS = 168"),
    ("kernels/maxsim.py", "where = tl.where(chunk_best > best,", "where = tl.where(chunk_best >= best,"),
])
def test_the_hash_covers_the_config_choice(tmp_path, file, old, new):
    _copy_sources(tmp_path)
    path = tmp_path / file
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(AssertionError, match="kernels changed"):
        compile_table.check_table(RESULTS / "aot_compile.txt", tmp_path)


def test_the_hash_covers_the_triton_version(tmp_path):
    table = tmp_path / "aot_compile.txt"
    text = (RESULTS / "aot_compile.txt").read_text()
    recorded = compile_table.read_header(RESULTS / "aot_compile.txt")["triton"]
    table.write_text(text.replace(f"(Triton {recorded},", "(Triton 3.0.0,", 1))
    with pytest.raises(AssertionError, match="kernels changed"):
        compile_table.check_table(table)


# One summary per release --------------------------------------------------------------------------------------------


def test_one_compile_summary_per_triton_release():
    full = compile_table.read_header(RESULTS / "aot_compile.txt")
    assert full["args"] == "", "the full table is bench/aot_compile.py's default one"
    newest = triton_release(full["triton"])
    want = [(newest[0], minor) for minor in range(OLDEST_CHECKED_TRITON[1], newest[1])]
    assert OLDEST_CHECKED_TRITON[0] == newest[0]
    found = {triton_release(compile_table.read_header(p)["triton"]): p.name
             for p in RESULTS.glob("aot_compile_triton-*.txt")}
    assert sorted(found) == want, found
    for release, name in found.items():
        assert name == f"aot_compile_triton-{compile_table.read_header(RESULTS / name)['triton']}.txt"


@pytest.mark.parametrize("table", sorted(RESULTS.glob("aot_compile_triton-*.txt")), ids=lambda p: p.name)
def test_each_release_builds_the_launchers_configs_spill_free(table):
    header = compile_table.read_header(table)
    assert header["args"] == SUMMARY_ARGS
    lines = table.read_text().splitlines()
    rows = parse_table(lines)
    release = triton_release(header["triton"])
    assert tiles_seen(rows) == tiles_wanted(SUMMARY_ARCHS, CHECKED_PAIRS, release)
    for r in rows:
        assert r["spill"] == "0", r
        assert int(r["smem"]) <= min(ARCH[r["arch"]].shared_bytes, int(r["est"])), r
    summaries = [line for line in lines if line.startswith("sm_")]
    assert [line.split(":")[0] for line in summaries] == list(SUMMARY_ARCHS)
    assert all(", max spill 0 B," in line for line in summaries)
    assert not any(line.startswith("FAIL") for line in lines)
