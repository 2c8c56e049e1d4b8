"""Training data for ``cgist train``: the standard-library docstring pairs and user files.

Every pair dataset has the columns ``anchor``, ``positive`` and optionally ``negative``/``negative_N``,
all non-empty strings, in that order (sentence-transformers reads the columns by position).
"""

from __future__ import annotations

import ast
import csv
import functools
import json
import math
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from datasets import Dataset

__all__ = ["DataError", "load_pairs", "retrieval_task", "split_pairs", "stdlib_files", "stdlib_pairs"]

# Packages whose code is tests, demos, GUI or vendored tooling rather than library API.
SKIPPED_PACKAGES = frozenset(
    {"test", "tests", "idlelib", "idle_test", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
     "pydoc_data", "antigravity", "this", "__phello__", "site-packages", "dist-packages"}
)
NEGATIVE_COLUMN = re.compile(r"negative(_\d+)?")


class DataError(ValueError):
    """A dataset that cannot be trained on; the message says which file, column or row and why."""


def summary_line(docstring: str) -> str:
    """First paragraph of a docstring, joined into one line (``""`` if it has none)."""
    paragraph = docstring.strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def node_code(lines: list[str], node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Source of ``node`` (from its ``def``/``class`` line, whole lines) with the docstring statement cut out."""
    doc = node.body[0]
    return textwrap.dedent("".join(lines[node.lineno - 1 : doc.lineno - 1] + lines[doc.end_lineno : node.end_lineno]))


def stdlib_files(stdlib: Path | None = None) -> Iterator[tuple[str, Path]]:
    """``(dotted module name, path)`` of every public, non-test source file of the standard library, sorted."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIPPED_PACKAGES:
            continue
        if (root / f"{top}.py").is_file():
            yield top, root / f"{top}.py"
        elif (root / top / "__init__.py").is_file():
            for path in sorted((root / top).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if any(p.startswith("_") or p in SKIPPED_PACKAGES or p.startswith("test") for p in parts[1:]):
                    continue
                yield ".".join(parts), path


def module_pairs(source: str, max_source_chars: int) -> Iterator[tuple[str, str]]:
    """``(summary line, code without its docstring)`` of each public top-level function or class of a module."""
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        docstring = ast.get_docstring(node)
        if not docstring:
            continue
        summary = summary_line(docstring)
        code = node_code(lines, node).strip()
        if len(summary.split()) >= 3 and code.count("\n") >= 1:
            yield summary, code[:max_source_chars]


@functools.lru_cache(maxsize=4)
def all_stdlib_pairs(stdlib: Path | None, max_source_chars: int) -> tuple[tuple[str, str], ...]:
    """Every ``(summary, code)`` pair in sorted module order, first occurrence of each summary and code only."""
    pairs, seen = [], set()
    for _, path in stdlib_files(stdlib):
        try:
            source = path.read_text(encoding="utf-8")
            found = list(module_pairs(source, max_source_chars))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for summary, code in found:
            keys = (summary.casefold(), code)
            if keys[0] in seen or keys[1] in seen:
                continue
            seen.update(keys)
            pairs.append((summary, code))
    return tuple(pairs)


def stdlib_pairs(
    max_pairs: int | None = None, *, seed: int = 0, max_source_chars: int = 2000, stdlib: Path | None = None
) -> list[dict[str, str]]:
    """Docstring-summary / source-code pairs from the installed standard library, parsed (never imported).

    Each public top-level function or class with a docstring gives one pair: ``anchor`` is the docstring's
    summary line and ``positive`` its source code without the docstring. Pairs whose summary or code repeats
    an earlier one are dropped. The list is built in sorted module order, then shuffled with ``seed`` and cut
    to ``max_pairs``, so the result depends only on the Python installation and the arguments.
    """
    pairs = [{"anchor": a, "positive": p} for a, p in all_stdlib_pairs(stdlib, max_source_chars)]
    random.Random(seed).shuffle(pairs)
    return pairs if max_pairs is None else pairs[:max_pairs]


def check_columns(columns: list[str], where: str) -> list[str]:
    """The columns in training order (anchor, positive, negatives); DataError on missing or unknown ones."""
    missing = [c for c in ("anchor", "positive") if c not in columns]
    unknown = [c for c in columns if c not in ("anchor", "positive") and not NEGATIVE_COLUMN.fullmatch(c)]
    if missing or unknown:
        problems = ([f"missing column(s) {missing}"] if missing else []) + (
            [f"unknown column(s) {unknown}"] if unknown else []
        )
        raise DataError(
            f"{where}: {'; '.join(problems)}; expected columns 'anchor', 'positive' and optionally "
            f"'negative' or 'negative_1', 'negative_2', ... (found {columns})"
        )
    return ["anchor", "positive", *(c for c in columns if c not in ("anchor", "positive"))]


def check_pairs(dataset: Dataset, where: str) -> Dataset:
    """Columns in training order, every cell a non-empty string; DataError otherwise."""
    columns = check_columns(list(dataset.column_names), where)
    if len(dataset) == 0:
        raise DataError(f"{where}: the dataset is empty; it needs at least 2 rows")
    for column in columns:
        for row, value in enumerate(dataset[column]):
            if not isinstance(value, str) or not value.strip():
                raise DataError(
                    f"{where}: row {row + 1}, column {column!r} must be a non-empty string, got {value!r}"
                )
    return dataset.select_columns(columns)


def load_pairs(path: str | Path) -> Dataset:
    """Pairs from a JSONL file, a CSV file, or a directory written by ``Dataset.save_to_disk``."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--data: {path} does not exist")
    if path.is_dir():
        from datasets import DatasetDict, load_from_disk

        try:
            dataset = load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as err:
            raise DataError(f"--data: {path} is not a saved `datasets` directory ({err})") from None
        if isinstance(dataset, DatasetDict):
            if "train" not in dataset:
                raise DataError(f"--data: {path} holds splits {list(dataset)}, but no 'train' split")
            dataset = dataset["train"]
        return check_pairs(dataset, str(path))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = read_jsonl(path)
        return check_pairs(Dataset.from_list(rows) if rows else Dataset.from_dict({}), str(path))
    if suffix == ".csv":
        return check_pairs(read_csv(path), str(path))
    raise DataError(f"--data: {path} must be a .jsonl, .json (one object a line) or .csv file, or a dataset directory")


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object per non-blank line; every line must have the first line's keys."""
    rows: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {number} must be a JSON object, got {type(row).__name__}")
            if rows and set(row) != set(rows[0]):
                raise DataError(f"{path}: line {number} has keys {list(row)}, but the first row has {list(rows[0])}")
            check_columns(list(row), f"{path}: line {number}")
            rows.append(row)
    return rows


def read_csv(path: Path) -> Dataset:
    """A CSV file with a header row; every cell read as a string."""
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: the file is empty; it needs a header row (anchor,positive,...) and data rows")
        check_columns(header, str(path))
        columns: dict[str, list[str]] = {name: [] for name in header}
        for number, row in enumerate(reader, 2):
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(f"{path}: line {number} has {len(row)} fields, but the header has {len(header)}")
            for name, value in zip(header, row):
                columns[name].append(value)
    return Dataset.from_dict(columns)


def split_pairs(dataset: Dataset, eval_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Seeded shuffle, then ``(train, held_out)`` with ``ceil(eval_fraction * n)`` held-out rows (at least 1 of each)."""
    n = len(dataset)
    if n < 2:
        raise DataError(f"the dataset has {n} row(s); it needs at least 2 (one to train on, one to evaluate)")
    n_eval = min(max(1, math.ceil(eval_fraction * n)), n - 1)
    shuffled = dataset.shuffle(seed=seed)
    return shuffled.select(range(n_eval, n)), shuffled.select(range(n_eval))


def retrieval_task(held_out: Dataset) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """``(queries, corpus, relevant_docs)`` for an InformationRetrievalEvaluator.

    The anchors are the queries; the corpus is every distinct positive and negative text of the split, so the
    negatives act as distractors; a query's relevant document is its own positive.
    """
    corpus_ids: dict[str, str] = {}
    for column in held_out.column_names[1:]:
        for text in held_out[column]:
            corpus_ids.setdefault(text, f"d{len(corpus_ids)}")
    queries = {f"q{i}": anchor for i, anchor in enumerate(held_out["anchor"])}
    relevant = {f"q{i}": {corpus_ids[positive]} for i, positive in enumerate(held_out["positive"])}
    corpus = {cid: text for text, cid in corpus_ids.items()}
    return queries, corpus, relevant
