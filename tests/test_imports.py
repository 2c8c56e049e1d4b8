"""Import structure: what importing ``cgist`` and ``cgist.kernels`` loads; what kernels/, the backends and the spec
import (docs/design.md#adding-a-score).

``cgist``, ``cgist.kernels`` and ``gist_loss`` need no sentence-transformers (``FusedCachedGISTLoss`` and
``add_guide_embeddings`` load it on first use), and importing ``cgist`` (the public entry points ``gist_loss`` and
``maxsim_loss``) imports no backend: the router imports one on a call's first use of it. kernels/ is device code
only: its modules import torch, triton, the standard library and each other, nothing of cgist, and its package imports
nothing at all (from a checkout it is what ``import kernels`` finds). A backend (cgist/stage/pytorch/,
cgist/stage/triton/) imports its own modules, the spec, the loss stage's leaf modules (``LEAF_MODULES``: none of them
reaches the dispatch or a backend) and, for Triton, the kernels: no backend imports another. The spec imports no
backend, no dispatch.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import cgist.kernels
import pytest

import cgist
import cgist.stage.triton

#: Run in a fresh interpreter: what the light imports load, then the lazy attribute.
PROBE = """
import json, sys
import torch
import cgist.kernels
import cgist
backends = sorted(m for m in sys.modules if m.startswith(("cgist.stage.pytorch", "cgist.stage.triton")))
assert backends == [], backends  # the entry points import no backend

gen = torch.Generator().manual_seed(0)
x = [torch.randn(rows, 4, generator=gen, dtype=torch.float64) for rows in (2, 3)]
loss = cgist.gist_loss(x, [t.flip(1) for t in x], offset=1, backend="torch")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("sentence_transformers", "transformers"))
used = sorted(m for m in sys.modules if m.startswith(("cgist.stage.pytorch.", "cgist.stage.triton.")))
cls = cgist.FusedCachedGISTLoss
after = "sentence_transformers" in sys.modules
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
precompute = cgist.add_guide_embeddings
print(json.dumps({"heavy": heavy, "used": used, "finite": bool(torch.isfinite(loss)), "after": after,
                  "name": cls.__name__, "subclass": issubclass(cls, CachedGISTEmbedLoss),
                  "precompute": f"{precompute.__module__}.{precompute.__name__}"}))
"""


def test_light_imports_leave_sentence_transformers_unloaded(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["heavy"] == [], f"importing cgist loaded {result['heavy']}"
    # a call on the PyTorch path imports its score's module of that backend, on first use
    assert result["used"] == ["cgist.stage.pytorch.dense", "cgist.stage.pytorch.workspace"], result["used"]
    assert result["finite"]
    # The probe sees the import once the class is asked for, so the empty list above means something.
    assert result["after"] and result["name"] == "FusedCachedGISTLoss" and result["subclass"]
    assert result["precompute"] == "cgist.losses.precompute.add_guide_embeddings"


def test_the_kernels_folder_imported_as_kernels_is_the_pypi_package_where_one_is_installed():
    """From a checkout, ``import kernels`` (the PyPI package that transformers requires and imports) finds kernels/
    first: it must hand over to the installed package, and load nothing else where none is installed; transformers'
    models must import from a checkout's root."""
    probe = ("import sys, importlib.util; before = set(sys.modules); import kernels; "
             "print(getattr(kernels, '__file__', None)); print(sorted(set(sys.modules) - before - {'kernels'}) == []); "
             "from transformers import modeling_utils")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=KERNELS.parent, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found, nothing_else = proc.stdout.splitlines()[:2]
    installed = importlib.util.find_spec("kernels") is not None and _has_distribution("kernels")
    if installed:
        assert Path(found).resolve() != (KERNELS / "__init__.py").resolve(), found
    else:
        assert Path(found).resolve() == (KERNELS / "__init__.py").resolve() and nothing_else == "True"


def test_the_kernels_folder_imported_as_kernels_stays_where_no_package_is_installed():
    """With nothing but the checkout on ``sys.path`` (no PyPI package ``kernels`` to hand over to), ``import kernels``
    is the kernels/ folder itself, and loads nothing else."""
    probe = ("import sys; sys.path[:] = ['']; before = set(sys.modules); import kernels; print(kernels.__file__); "
             "print(sorted(set(sys.modules) - before - {'kernels'}) == [])")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=KERNELS.parent, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found, nothing_else = proc.stdout.splitlines()[:2]
    assert Path(found).resolve() == (KERNELS / "__init__.py").resolve() and nothing_else == "True"


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_unknown_attribute_raises_attribute_error():
    for module in (cgist, cgist.kernels):
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            module.no_such_name  # noqa: B018


def test_a_dense_backends_one_entry_is_the_contracts_forward():
    """Each dense backend module has one entry, the backend contract's ``forward`` (its other public names are the
    Triton launchers that benchmarks time); raw columns reach it through the door, by
    ``cgist.stage.dispatch.direct.loss_and_grads``. ``cgist.stage.triton`` re-exports nothing of its modules, and
    ``cgist.kernels`` holds the kernels only."""
    import inspect

    from cgist.stage.dispatch.direct import loss_and_grads
    from cgist.stage.spec.scores import DENSE

    modules = [importlib.import_module(DENSE.backend(name)) for name in ("torch", "triton")]
    for module in modules:
        assert "forward" in module.__all__ and not [name for name in module.__all__ if "loss" in name], module.__name__
        assert list(inspect.signature(module.forward).parameters)[:3] == ["call", "with_grad", "need_stats"]
    assert modules[0].__all__ == ["forward"]
    for module in (*modules, cgist.stage.triton, cgist.kernels):
        assert not hasattr(module, "gist_loss_and_grads"), module.__name__
    assert all(inspect.ismodule(value) for name, value in vars(cgist.stage.triton).items() if not name.startswith("_"))
    assert list(inspect.signature(loss_and_grads).parameters)[:4] == ["backend", "columns", "guide", "options"]


# What kernels/, the backends and the spec import -------------------------------------------------------------------

KERNELS = Path(cgist.kernels.__file__).parent
BACKEND = Path(cgist.stage.triton.__file__).parent
PYTORCH = BACKEND.parent / "pytorch"
SPEC = BACKEND.parent / "spec"
ALLOWED_PACKAGES = {"torch", "triton"} | set(sys.stdlib_module_names)
#: The loss stage's leaf modules, which every layer may import: none reaches the dispatch or a backend.
LEAF_MODULES = {"cgist.stage.numerics", "cgist.stage.ties", "cgist.stage.budget", "cgist.stage.devices",
                "cgist.stage.stats"}
#: What runs beside the backends, shared by a score's backends (the spec imports none of it).
SHARED_MODULES = {"cgist.stage.block", "cgist.stage.xtr_thresholds"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` that can run: anywhere (in functions too) but in the body of
    ``if TYPE_CHECKING:``."""
    children = node.orelse if isinstance(node, ast.If) and _is_type_checking(node.test) else ast.iter_child_nodes(node)
    for child in children:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from import_nodes(child)


def runtime_imports(node: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) of every import under ``node`` that can run (``import_nodes``).

    A relative import is its module with its leading dots (``from . import x`` is ".").
    """
    for child in import_nodes(node):
        if isinstance(child, ast.Import):
            yield from ((child.lineno, alias.name) for alias in child.names)
        else:
            yield child.lineno, "." * child.level + (child.module or "")


def kernels_allowed(module: str) -> bool:
    """What a module of kernels/ may import: torch, triton, the standard library, or a module of kernels/ itself
    (one leading dot). Nothing of cgist."""
    if module.startswith("."):
        return not module.startswith("..")
    return module.split(".")[0] in ALLOWED_PACKAGES


def _spec_or_leaf(module: str) -> bool:
    return module in LEAF_MODULES or module.startswith("cgist.stage.spec.") or module.startswith("..spec")


def backend_allowed(module: str) -> bool:
    """What a module of the Triton backend may import: what kernels/ may, the kernels (``cgist.kernels``), the spec
    and the leaf modules (``LEAF_MODULES``), its own modules. No other backend."""
    return (kernels_allowed(module) or _spec_or_leaf(module) or module in SHARED_MODULES
            or module in ("..block", "..xtr_thresholds") or module == "cgist.kernels"
            or module.startswith(("cgist.kernels.", "cgist.stage.triton.")))


def pytorch_allowed(module: str) -> bool:
    """What a module of the PyTorch backend may import: torch and the standard library, its own modules (one leading
    dot), the spec, the leaf modules (relative or absolute) and the shared ones. No triton, no other backend, no
    dispatch."""
    if module in ("..numerics", "..ties", "..budget", "..devices", "..stats", "..block", "..xtr_thresholds"):
        return True
    return (module.split(".")[0] != "triton" and kernels_allowed(module)) or _spec_or_leaf(module) \
        or module.startswith("cgist.stage.pytorch.")


def spec_allowed(module: str) -> bool:
    """What a module of the spec may import: torch, the standard library, its own modules, the leaf modules. No
    backend, no dispatch, no node."""
    if module in ("..numerics", "..ties", "..budget", "..devices", "..stats"):
        return True
    return (module.split(".")[0] != "triton" and kernels_allowed(module)) or _spec_or_leaf(module)


def forbidden_imports(source: str, allowed=kernels_allowed) -> list[tuple[int, str]]:
    return [(line, module) for line, module in runtime_imports(ast.parse(source)) if not allowed(module)]


SAMPLE = """
from __future__ import annotations
import os, numpy
from typing import TYPE_CHECKING
from . import gist
from .launch import gist_forward
from .. import options
from cgist.stage.numerics import EPS
from cgist.stage.dispatch.route import select_stage
if TYPE_CHECKING:
    from cgist.function import Backend
else:
    import sentence_transformers
def f():
    import transformers
    import cgist
from cgist.kernels.gist import gist_fwd_kernel
from cgist.stage.pytorch.dense import forward
"""


def test_the_import_checks_find_what_they_must():
    """numpy, a module above the package, the dispatch, an else branch, a function body and another backend are all
    caught; the Triton backend may import the leaf modules and the kernels, kernels/ neither, the PyTorch backend no
    kernel."""
    assert forbidden_imports(SAMPLE, backend_allowed) == [
        (3, "numpy"), (7, ".."), (9, "cgist.stage.dispatch.route"), (13, "sentence_transformers"),
        (15, "transformers"), (16, "cgist"), (18, "cgist.stage.pytorch.dense"),
    ]
    assert forbidden_imports(SAMPLE, kernels_allowed) == [
        (3, "numpy"), (7, ".."), (8, "cgist.stage.numerics"), (9, "cgist.stage.dispatch.route"),
        (13, "sentence_transformers"), (15, "transformers"), (16, "cgist"), (17, "cgist.kernels.gist"),
        (18, "cgist.stage.pytorch.dense"),
    ]
    assert forbidden_imports(SAMPLE, pytorch_allowed) == [
        (3, "numpy"), (7, ".."), (9, "cgist.stage.dispatch.route"), (13, "sentence_transformers"),
        (15, "transformers"), (16, "cgist"), (17, "cgist.kernels.gist"),
    ]


def _checked(root: Path, allowed) -> set[str]:
    """Check every module under ``root`` against ``allowed``; the modules they import."""
    seen = set()
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        forbidden = forbidden_imports(source, allowed)
        assert forbidden == [], f"{path.relative_to(root.parent)}: (line, module) not allowed: {forbidden}"
        seen |= {module for _, module in runtime_imports(ast.parse(source))}
    return seen


def test_kernels_import_nothing_of_cgist():
    """kernels/ is device code: torch, triton, the standard library and its own modules only."""
    assert {"__init__.py", "gist.py", "gemm.py", "maxsim.py"} <= {f.name for f in KERNELS.rglob("*.py")}
    assert "triton" in _checked(KERNELS, kernels_allowed)  # the parse sees the real imports
    # The package itself imports only the standard library (its hand-over to the PyPI package of its name).
    names = {name.split(".")[0] for _, name in runtime_imports(ast.parse((KERNELS / "__init__.py").read_text("utf-8")))}
    assert names <= set(sys.stdlib_module_names), names


def test_no_backend_imports_another_and_the_spec_imports_none():
    """Each backend's modules import what ``backend_allowed`` / ``pytorch_allowed`` allow, the spec what
    ``spec_allowed`` does: a score is one module per layer, and the layers meet only in the spec."""
    assert {"__init__.py", "common.py", "dense.py", "maxsim.py", "tiles.py"} <= {f.name for f in BACKEND.rglob("*.py")}
    seen = _checked(BACKEND, backend_allowed)
    assert {"torch", "triton", "cgist.kernels.gist", "cgist.kernels.maxsim", "cgist.stage.spec.problem",
            "cgist.stage.block"} <= seen
    assert {"__init__.py", "dense.py", "maxsim.py", "workspace.py"} <= {f.name for f in PYTORCH.rglob("*.py")}
    assert {"..block", "..xtr_thresholds", "..spec.maxsim", "..budget"} <= _checked(PYTORCH, pytorch_allowed)
    assert {".scores", ".problem", "..numerics"} <= _checked(SPEC, spec_allowed)
    for name in SHARED_MODULES:  # what runs beside the backends: the spec and the leaf modules, no backend
        source = (BACKEND.parent / f"{name.rpartition('.')[2]}.py").read_text(encoding="utf-8")
        imported = {module for _, module in runtime_imports(ast.parse(source))}
        assert {".spec.maxsim", ".numerics"} & imported and not {
            m for m in imported if m.startswith((".pytorch", ".triton", ".dispatch", ".node", "triton", "cgist"))}, name


# No import circle among cgist's modules -------------------------------------------------------------------------

PACKAGE = Path(cgist.__file__).parent


def _module_files() -> dict[str, Path]:
    """cgist's modules by dotted name (kernels/ is installed as cgist.kernels)."""
    files = {}
    for root, prefix in ((PACKAGE, "cgist"), (KERNELS, "cgist.kernels")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            files[".".join((prefix, *parts))] = path
    return files


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the cgist modules it can import when it runs, inside functions too (``import_nodes``); a
    ``from PKG import name`` counts as an import of the submodule ``PKG.name`` where there is one, else of PKG."""
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in import_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module
                           for alias in node.names]
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph``, each once, as the modules around it."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                circle = path[path.index(nxt):]
                if frozenset(circle) not in done:
                    done.add(frozenset(circle))
                    found.append(circle + [nxt])
            elif len(path) < len(graph):
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def test_the_cycle_check_finds_a_circle_hidden_inside_a_function():
    graph = {"cgist.a": {"cgist.b"}, "cgist.b": {"cgist.a"}, "cgist.c": {"cgist.a"}}
    assert cycles(graph) == [["cgist.a", "cgist.b", "cgist.a"]]
    source = "def f():\n    from . import b\nif TYPE_CHECKING:\n    from . import c\n"
    assert [m for _, m in runtime_imports(ast.parse(source))] == ["."]


def test_no_import_circle_among_the_package_modules():
    """Also through imports inside functions (what hides a circle from a plain import at start-up). A module's
    import of its own package's ``__init__`` (the lazy names) is an edge like any other."""
    files = _module_files()
    graph = import_graph(files)
    assert {"cgist.stage.spec.problem", "cgist.stage.triton.dense", "cgist.kernels.gist", "cgist.cli.run"} <= graph.keys()
    assert {"cgist.stage.spec.problem", "cgist.kernels.gist"} <= graph["cgist.stage.triton.dense"]
    assert {"cgist.losses.base"} <= graph["cgist.losses.columns"] and not graph["cgist.losses.matryoshka"]
    assert "cgist.stage.numerics" in graph["cgist.stage.spec.problem"]
    assert cycles(graph) == []
