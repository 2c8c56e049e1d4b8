"""cgist.cli.data: the pair file formats, the split and retrieval task, and the standard-library pair builder.

``write_jsonl`` and ``write_csv`` are shared with the command-line tests (``pairs`` is a conftest fixture).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from cgist.cli.data import DataError, load_pairs, retrieval_task, split_pairs, stdlib_files, stdlib_pairs


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    return path


# ---------------------------------------------------------------------------------------------- file formats


def test_load_pairs_formats(pairs, tmp_path):
    """The same pairs from JSONL (key order free; blank lines skipped), CSV (blank lines skipped), a saved dataset and
    the train split of a saved DatasetDict, in training column order."""
    rows = [{"anchor": p["anchor"], "positive": p["positive"], "negative": q["positive"]}
            for p, q in zip(pairs[:5], pairs[5:10])]
    reordered = [{"negative": r["negative"], "anchor": r["anchor"], "positive": r["positive"]} for r in rows]
    jsonl = load_pairs(write_jsonl(tmp_path / "pairs.jsonl", reordered[:1] + rows[1:]))  # key order may vary
    blank_lines = tmp_path / "blank-lines.jsonl"
    blank_lines.write_text("\n" + "\n  \n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    table = load_pairs(write_csv(tmp_path / "pairs.csv", list(reordered[0]), [list(r.values()) for r in reordered]))
    blank_rows = write_csv(tmp_path / "blank-rows.csv", list(reordered[0]),
                           [row for r in reordered for row in ([], list(r.values()))])
    Dataset.from_list(reordered).save_to_disk(str(tmp_path / "saved"))
    saved = load_pairs(tmp_path / "saved")
    splits = DatasetDict({"test": Dataset.from_list(reordered[:2]), "train": Dataset.from_list(reordered)})
    splits.save_to_disk(str(tmp_path / "splits"))
    train_split = load_pairs(tmp_path / "splits")
    for dataset in (jsonl, load_pairs(blank_lines), table, load_pairs(blank_rows), saved, train_split):
        assert dataset.column_names == ["anchor", "positive", "negative"]
        assert dataset.to_list() == rows


def test_load_pairs_rejects_unknown_suffix(tmp_path):
    path = tmp_path / "pairs.parquet"
    path.write_text("x")
    with pytest.raises(DataError, match="must be a .jsonl"):
        load_pairs(path)


def test_split_and_retrieval_task(pairs):
    dataset = Dataset.from_list(pairs[:30])
    train, held_out = split_pairs(dataset, 0.1, seed=3)
    assert (len(train), len(held_out)) == (27, 3)
    anchors, positives = list(held_out["anchor"]), list(held_out["positive"])
    assert sorted(list(train["anchor"]) + anchors) == sorted(dataset["anchor"])
    queries, corpus, relevant = retrieval_task(held_out)
    assert sorted(queries.values()) == sorted(anchors)
    assert sorted(corpus.values()) == sorted(positives)
    for qid, query in queries.items():
        (doc,) = relevant[qid]
        assert corpus[doc] == positives[anchors.index(query)]


# ---------------------------------------------------------------------------------------------- stdlib builder


def test_stdlib_pairs_real_and_deterministic():
    first = stdlib_pairs(300, seed=0)
    assert first == stdlib_pairs(300, seed=0)
    assert first != stdlib_pairs(300, seed=1)
    assert len(first) == 300
    assert len({p["anchor"].casefold() for p in first}) == len(first)
    for pair in first:
        assert len(pair["anchor"].split()) >= 3 and "\n" not in pair["anchor"]
        head = pair["positive"].split("(", 1)[0].split(":", 1)[0].split()
        assert head[0] in ("def", "class", "async") and not head[-1].startswith("_"), pair["positive"][:80]
        assert pair["anchor"] not in pair["positive"]  # the docstring is cut out of the code


def test_stdlib_files_skip_private_and_tests():
    files = list(stdlib_files())
    assert len(files) > 100
    for name, path in files:
        parts = name.split(".")
        assert not any(p.startswith("_") for p in parts), name
        assert not {"test", "tests", "idlelib", "tkinter"} & set(parts), name
        assert path.suffix == ".py"


def test_stdlib_pairs_on_a_fake_library(tmp_path):
    """Only public top-level functions and classes with a docstring, from non-test, non-private modules;
    a summary seen before (zipapp.other repeats textwrap.public's) is dropped, and so is a module that does not
    parse (shlex: a syntax error, colorsys: not UTF-8, sched: a null byte, a ValueError before Python 3.12), without
    stopping the others."""
    module = '''
import os

def public(x):
    """Add one to the given number.

    More detail that is not part of the summary.
    """
    return x + 1

def _private(x):
    """Private helper that must be skipped."""
    return x

def undocumented(x):
    return x

@functools.total_ordering
class Widget:
    """A small widget with a name
    that spans two lines."""

    def method(self):
        """Methods are not top-level."""
        return 1
'''
    (tmp_path / "textwrap.py").write_text(module)
    (tmp_path / "_collections_abc.py").write_text(module.replace("Add one", "Private module"))
    (tmp_path / "email").mkdir()
    (tmp_path / "email" / "__init__.py").write_text(
        module.replace("Add one", "Add two").replace("x + 1", "x + 2").replace("Widget", "Gadget").replace("widget", "gadget")
    )
    (tmp_path / "zipapp.py").write_text("def other(y):\n    \"\"\"Add one to the given number.\"\"\"\n    return y - 1\n")
    (tmp_path / "email" / "_parseaddr.py").write_text(module.replace("Add one", "Add three"))
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "__init__.py").write_text(module.replace("Add one", "Test package"))
    (tmp_path / "shlex.py").write_text(module.replace("Add one", "Does not parse") + "\ndef broken(:\n")
    (tmp_path / "colorsys.py").write_bytes(module.replace("Add one", "Not UTF-8").encode("utf-16"))
    (tmp_path / "sched.py").write_text(module.replace("Add one", "Null byte") + "\x00\n")
    found = sorted(stdlib_pairs(stdlib=tmp_path), key=lambda p: p["anchor"])
    assert [p["anchor"] for p in found] == [
        "A small gadget with a name that spans two lines.",
        "A small widget with a name that spans two lines.",
        "Add one to the given number.",
        "Add two to the given number.",
    ]
    assert found[2]["positive"] == "def public(x):\n    return x + 1"
    assert found[1]["positive"].startswith("class Widget:\n\n    def method(self):")
