"""The sentence-transformers version gate (``cgist.compat``): an older release is one ImportError naming the version
found and the range needed, at ``import cgist``; the installed release passes; pyproject.toml, the code and the README
state the same range."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cgist import compat

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
RANGE = compat.SENTENCE_TRANSFORMERS


def _pyproject_requirement(name: str) -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = [Requirement(line) for line in project["dependencies"] if Requirement(line).name == name]
    assert len(found) == 1, f"pyproject.toml lists {name} {len(found)} times among the dependencies"
    return found[0]


@pytest.mark.parametrize("found", ["5.7.0", "6.0.1", "6.1.0", "6.2.0rc1", "2.2.2"])
def test_an_older_release_is_one_clear_import_error(found):
    with pytest.raises(ImportError) as caught:
        compat.check_sentence_transformers(found)
    assert isinstance(caught.value, compat.IncompatibleVersionError)
    message = str(caught.value)
    assert f"sentence-transformers {found} is installed" in message
    assert f"needs sentence-transformers{RANGE}" in message
    assert f'pip install "sentence-transformers[train]{RANGE}"' in message
    assert "\n" not in message


def test_the_version_is_read_from_the_installed_metadata(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda distribution: "5.7.0")
    with pytest.raises(compat.IncompatibleVersionError, match=r"sentence-transformers 5\.7\.0 is installed"):
        compat.check_sentence_transformers()


def test_without_sentence_transformers_nothing_is_checked(monkeypatch):
    """gist_loss needs only torch; the drop-ins' own import names a missing sentence-transformers."""
    monkeypatch.setattr(compat, "installed_version", lambda distribution: None)
    compat.check_sentence_transformers()


def test_a_malformed_version_is_named():
    with pytest.raises(compat.IncompatibleVersionError, match=r"the version 'six', which is not a version number"):
        compat.check_sentence_transformers("six")


@pytest.mark.parametrize("found", ["6.2.0", "6.2.1", "6.9.0", "6.3.0.dev0", "6.2.0+local"])
def test_releases_in_the_range_pass_silently(found):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_sentence_transformers(found)


def test_a_release_past_the_range_warns():
    with pytest.warns(UserWarning, match=r"tested with sentence-transformers>=6\.2\.0,<7; sentence-transformers 7\.0"):
        compat.check_sentence_transformers("7.0.0")


def test_the_installed_release_is_supported():
    installed = compat.installed_version("sentence-transformers")
    assert installed is not None and SpecifierSet(RANGE).contains(installed, prereleases=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_sentence_transformers()


def test_pyproject_the_code_and_the_readme_state_the_same_range():
    requirement = _pyproject_requirement("sentence-transformers")
    assert requirement.specifier == SpecifierSet(RANGE)
    assert Version(compat.SENTENCE_TRANSFORMERS_OLDEST) in requirement.specifier
    assert min(Version(s.version) for s in requirement.specifier if s.operator == ">=") == Version(
        compat.SENTENCE_TRANSFORMERS_OLDEST)
    assert f"sentence-transformers{RANGE}" in (REPO / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("statement", ["import cgist", "from cgist import FusedCachedGISTLoss"])
def test_importing_cgist_with_an_older_release_fails_with_the_message(tmp_path, statement):
    """A sentence-transformers 5.7.0 distribution first on the path: its metadata is what cgist reads."""
    info = tmp_path / "sentence_transformers-5.7.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sentence-transformers\nVersion: 5.7.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"cgist.compat.IncompatibleVersionError: cgist needs sentence-transformers{RANGE}, but "
                    f"sentence-transformers 5.7.0 is installed; upgrade it with: "
                    f'pip install "sentence-transformers[train]{RANGE}"')
    assert "get_rank" not in proc.stderr and f"{os.sep}sentence_transformers{os.sep}" not in proc.stderr


@pytest.mark.parametrize("version, excluded", [("6.2.0", False), ("6.2.9", False), ("6.3.0", True), ("6.3.1", True),
                                               ("6.9.0", True)])
def test_each_release_has_its_rules(version, excluded):
    """A release takes the rules of the newest entry of RELEASE_RULES at or below it."""
    rules = compat.release_rules(version)
    assert rules.self_pairs_excluded is excluded
    assert rules.matryoshka_upcasts_half is excluded and rules.matryoshka_follows_wrappers is excluded


def test_the_rules_table_starts_at_the_oldest_supported_release():
    releases = [Version(since) for since, _ in compat.RELEASE_RULES]
    assert releases == sorted(releases) and str(releases[0]) == compat.SENTENCE_TRANSFORMERS_OLDEST
    assert Version(compat.RELEASE_RULES[-1][0]) <= Version(compat.NEWEST_TESTED)


@pytest.mark.parametrize("version, logged", [("6.3.0", False), ("6.2.0", False), ("6.4.0", True), ("6.3.1", True)])
def test_a_release_newer_than_tested_is_named_once(version, logged, monkeypatch, caplog):
    monkeypatch.setattr(compat, "NEWEST_TESTED", "6.3.0")
    monkeypatch.setattr(compat, "installed_version", lambda distribution: version)
    monkeypatch.setattr(compat, "_noted", [])
    with caplog.at_level("WARNING", logger="cgist.compat"):
        compat.note_untested_release()
        compat.note_untested_release()
    records = [r.getMessage() for r in caplog.records if r.name == "cgist.compat"]
    assert len(records) == int(logged)
    if logged:
        assert records[0].startswith(f"sentence-transformers {version} is installed, newer than 6.3.0")


def test_the_first_drop_in_names_a_newer_release(monkeypatch, caplog, student):
    import cgist

    monkeypatch.setattr(compat, "installed_version", lambda distribution: "6.99.0")
    monkeypatch.setattr(compat, "_noted", [])
    with caplog.at_level("WARNING", logger="cgist.compat"):
        cgist.FusedCachedMultipleNegativesRankingLoss(student)
        cgist.FusedCachedGISTLoss(student, None)
    assert [r.getMessage().split(",")[0] for r in caplog.records if r.name == "cgist.compat"] == [
        "sentence-transformers 6.99.0 is installed"]
