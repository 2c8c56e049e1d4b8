"""What a compile table (``bench/aot_compile.py``'s output, ``bench/results/aot_compile*.txt``) was built from.

A table's first line records the Triton release it was compiled with and a hash of the sources that decide its
binaries: the parsed code (comments, layout and docstrings aside) of

- every module of ``kernels/``, all of it: the kernels and their helpers;
- ``cgist/stage/triton/tiles.py``, all of it: the tile tables, ``tile_configs``, ``operand_kind``,
  ``shared_memory_estimate``, the autotuned forward and the tf32x3 GEMM's configs;
- the launchers' choice of a config's inputs: ``input_precision`` and ``TL_DTYPES`` (``cgist/stage/triton/common.py``),
  ``compute_dtype`` (``cgist/stage/numerics.py``), and the architecture each GPU maps to (``KNOWN_ARCHS``, ``Arch`` and
  ``arch_for`` in ``cgist/stage/devices.py``);
- the MaxSim launcher's choice of each kernel's launch (``cgist/stage/triton/maxsim.py``: ``launch_configs``, its
  tile table and register limit, ``Launch`` and the shared-memory estimate);
- what ``bench/aot_compile.py`` builds from them: its dtype pairs, kernels, Matryoshka configuration, the MaxSim
  kernels' dtypes and shapes, the argument values it specialises the kernels with and the options it compiles them
  with;

and the Triton release. ``check_table`` recomputes it; a table whose hash differs is stale. This module reads
files only (no torch, no Triton), so tests can import it.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The kernel modules that bench/aot_compile.py builds: their kernels are the tables' rows. (kernels/__init__.py holds
#: no kernel.)
KERNEL_FILES = ("gemm.py", "gist.py", "maxsim.py")
#: File -> the top-level names whose definitions are hashed (None: the whole module).
SOURCES: dict[str, tuple[str, ...] | None] = {
    **{f"kernels/{name}": None for name in KERNEL_FILES},
    "cgist/stage/triton/tiles.py": None,
    "cgist/stage/triton/common.py": ("TL_DTYPES", "input_precision"),
    "cgist/stage/numerics.py": ("compute_dtype",),
    "cgist/stage/devices.py": ("KNOWN_ARCHS", "Arch", "arch_for"),
    "cgist/stage/triton/maxsim.py": ("BLOCK_M", "MAX_BLOCK_T", "KERNELS", "_ALL", "_TILES", "MAX_REGISTERS", "_kind",
                                     "Launch", "launch_configs", "shared_memory_estimate"),
    "bench/aot_compile.py": ("PAIRS", "MATRYOSHKA_DIMS", "MATRYOSHKA_PAIRS", "KERNELS", "MATRYOSHKA_KERNELS",
                             "GEMM_KERNEL", "GEMM_USES", "RULES_ALL", "MAXSIM_KERNELS", "MAXSIM_DTYPES", "MAXSIM_LQ",
                             "MAXSIM_LD", "MAXSIM_D", "operands", "launch_values", "gemm_values", "maxsim_values",
                             "maxsim_launches", "specialise", "compile_one", "build_jobs"),
}
#: A table's first line: ``# python bench/aot_compile.py ARGS  (Triton 3.9.0, sources 1a2b...)``.
HEADER = re.compile(
    r"^# python bench/aot_compile\.py(?P<args>.*?)\s+\(Triton (?P<triton>\S+), sources (?P<hash>[0-9a-f]{64})\)")
STALE = "kernels changed: rerun python bench/aot_compile.py and commit its output"


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _defines(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}


def source_parts(root: Path = ROOT) -> dict[str, str]:
    """``"file"`` or ``"file:name"`` -> the ``ast.dump`` of that module or definition, without docstrings."""
    parts = {}
    for file, names in SOURCES.items():
        tree = _strip_docstrings(ast.parse((root / file).read_text(), filename=file))
        if names is None:
            parts[file] = ast.dump(tree)
            continue
        for name in names:
            found = [ast.dump(node) for node in tree.body if name in _defines(node)]
            if not found:
                raise LookupError(f"{file} defines no {name}")
            parts[f"{file}:{name}"] = "\n".join(found)
    return parts


def source_hash(triton_version: str, root: Path = ROOT) -> str:
    """The sha256 of the sources (``source_parts``) and the Triton release that a table is built from."""
    digest = hashlib.sha256(f"triton {triton_version}\n".encode())
    for key, dump in sorted(source_parts(root).items()):
        digest.update(f"{key}\n{dump}\n".encode())
    return digest.hexdigest()


def header(args: list[str], triton_version: str, root: Path = ROOT) -> str:
    """A table's first line, for ``bench/aot_compile.py`` run with ``args`` under ``triton_version``."""
    return f"# python bench/aot_compile.py{''.join(' ' + a for a in args)}  (Triton {triton_version}, sources " \
           f"{source_hash(triton_version, root)})"


def read_header(table: Path) -> dict[str, str]:
    """``args`` (as typed, stripped), ``triton`` and ``hash`` from a table's first line."""
    first = table.read_text().split("\n", 1)[0]
    match = HEADER.match(first)
    if match is None:
        raise ValueError(f"{table}: its first line is not a bench/aot_compile.py header: {first!r}")
    return {key: value.strip() for key, value in match.groupdict().items()}


def check_table(table: Path, root: Path = ROOT) -> None:
    """Raise ``AssertionError(STALE ...)`` when ``table`` was built from other sources than ``root``'s now."""
    recorded = read_header(table)
    if source_hash(recorded["triton"], root) != recorded["hash"]:
        raise AssertionError(f"{STALE} ({table.name}, Triton {recorded['triton']})")
