"""Import structure: what importing ``cgist`` and ``cgist.kernels`` loads, and what kernels/ may import.

``cgist``, ``cgist.kernels`` and ``gist_loss`` need no sentence-transformers (``FusedCachedGISTLoss`` and
``add_guide_embeddings`` load it on first use); the modules under kernels/ import only torch, triton, the standard
library and the loss stage's leaf modules (``ALLOWED_MODULES``: none of them reaches the dispatch or the kernels).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import cgist
import cgist.kernels

#: Run in a fresh interpreter: what the light imports load, then the lazy attribute.
PROBE = """
import json, sys
import torch
import cgist.kernels
import cgist

gen = torch.Generator().manual_seed(0)
x = [torch.randn(rows, 4, generator=gen, dtype=torch.float64) for rows in (2, 3)]
loss = cgist.gist_loss(x, [t.flip(1) for t in x], offset=1, backend="torch")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("sentence_transformers", "transformers"))
cls = cgist.FusedCachedGISTLoss
after = "sentence_transformers" in sys.modules
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
precompute = cgist.add_guide_embeddings
print(json.dumps({"heavy": heavy, "finite": bool(torch.isfinite(loss)), "after": after,
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
    assert result["finite"]
    # The probe sees the import once the class is asked for, so the empty list above means something.
    assert result["after"] and result["name"] == "FusedCachedGISTLoss" and result["subclass"]
    assert result["precompute"] == "cgist.losses.precompute.add_guide_embeddings"


def test_unknown_attribute_raises_attribute_error():
    for module in (cgist, cgist.kernels):
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            module.no_such_name  # noqa: B018


# What kernels/ imports ------------------------------------------------------------------------------------------

KERNELS = Path(cgist.kernels.__file__).parent
ALLOWED_PACKAGES = {"torch", "triton"} | set(sys.stdlib_module_names)
ALLOWED_MODULES = {"cgist.stage.numerics", "cgist.stage.ties", "cgist.stage.budget", "cgist.stage.devices",
                   "cgist.stage.stats", "cgist.stage.spec.problem"}


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


def allowed(module: str) -> bool:
    """torch, triton, the standard library, the leaf modules (``ALLOWED_MODULES``), or a module of kernels/ itself
    (one leading dot)."""
    if module.startswith("."):
        return not module.startswith("..")
    return module.split(".")[0] in ALLOWED_PACKAGES or module in ALLOWED_MODULES


def forbidden_imports(source: str) -> list[tuple[int, str]]:
    return [(line, module) for line, module in runtime_imports(ast.parse(source)) if not allowed(module)]


SAMPLE = """
from __future__ import annotations
import os, numpy
from typing import TYPE_CHECKING
from . import gist
from .launch import gist_forward
from .. import options
from cgist.stage.numerics import EPS
from cgist.stage.spec.options import GistOptions
if TYPE_CHECKING:
    from cgist.function import Backend
else:
    import sentence_transformers
def f():
    import transformers
"""


def test_the_import_check_finds_what_it_must():
    """numpy, a module above kernels/, another cgist module, an else branch and a function body are all caught."""
    assert forbidden_imports(SAMPLE) == [
        (3, "numpy"), (7, ".."), (9, "cgist.stage.spec.options"), (13, "sentence_transformers"), (15, "transformers")
    ]


def test_kernels_import_only_torch_triton_stdlib_and_leaf_modules():
    files = sorted(KERNELS.rglob("*.py"))
    assert {"__init__.py", "gist.py", "launch.py"} <= {f.name for f in files}
    seen = set()
    for path in files:
        source = path.read_text(encoding="utf-8")
        assert forbidden_imports(source) == [], f"{path.name} imports more than torch, triton, stdlib and cgist's leaf modules"
        seen |= {module for _, module in runtime_imports(ast.parse(source))}
    assert {"torch", "triton"} <= seen  # the parse sees the real imports


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
    assert {"cgist.stage.spec.problem", "cgist.kernels.launch", "cgist.cli.run"} <= set(graph)
    assert "cgist.stage.spec.problem" in graph["cgist.kernels.launch"] and "cgist.stage.numerics" in graph["cgist.stage.spec.problem"]
    assert cycles(graph) == []
