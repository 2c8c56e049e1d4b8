"""bench/mutants.py, the mutation check: its table stays valid as the code moves (every mutant's source text is in
the tree exactly once, and applying it changes its file in a copy); nothing is installed and no test run starts."""

import filecmp
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mutants():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "bench"))
        import mutants

    return mutants


def _names():
    import ast

    tree = ast.parse((ROOT / "bench" / "mutants.py").read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Mutant"]
    return [call.args[0].value for call in calls]


def test_the_table_is_well_formed(mutants):
    names = [m.name for m in mutants.MUTANTS]
    assert names == _names() and len(set(names)) == len(names) and len(names) >= 8
    for mutant in mutants.MUTANTS:
        assert mutant.old != mutant.new and mutant.bug and "\n" not in mutant.bug, mutant.name
        assert mutant.tests and all((ROOT / t).is_file() for t in mutant.tests), mutant.name


@pytest.mark.parametrize("name", _names())
def test_each_mutant_is_found_once_and_changes_its_file_in_a_copy(mutants, name, tmp_path):
    mutant = mutants.mutant_named(name)
    assert mutants.occurrences(mutant, ROOT) == 1, f"{name}: update its source text in bench/mutants.py"
    copy = tmp_path / mutant.path
    copy.parent.mkdir(parents=True)
    copy.write_bytes((ROOT / mutant.path).read_bytes())
    original = copy.read_text(encoding="utf-8")
    mutants.apply(mutant, tmp_path)
    text = copy.read_text(encoding="utf-8")
    assert text != original and text == original.replace(mutant.old, mutant.new)
    if mutant.path.endswith(".py"):
        compile(text, mutant.path, "exec")  # a mutant is a bug, not a syntax error


def test_a_mutant_not_found_once_fails_loudly(mutants, tmp_path):
    mutant = mutants.MUTANTS[0]
    path = tmp_path / mutant.path
    path.parent.mkdir(parents=True)
    for text in ("", mutant.old * 2):
        path.write_text(text, encoding="utf-8")
        with pytest.raises(mutants.MutantError, match="found"):
            mutants.apply(mutant, tmp_path)
        assert path.read_text(encoding="utf-8") == text


def test_the_copy_holds_the_working_tree_and_only_the_copy_is_mutated(mutants, tmp_path):
    files = mutants.project_files(ROOT)
    assert "bench/mutants.py" in files and "kernels/gist.py" in files and not any(f.startswith(".venv/") for f in files)
    mutants.copy_tree(tmp_path, ROOT)
    mutant = mutants.mutant_named("row-block-offset")
    before = (ROOT / mutant.path).read_bytes()
    mutants.apply(mutant, tmp_path)
    assert (ROOT / mutant.path).read_bytes() == before
    same, changed, errors = filecmp.cmpfiles(ROOT, tmp_path, [mutant.path, "LICENSE"], shallow=False)
    assert same == ["LICENSE"] and changed == [mutant.path] and not errors
