"""cgist.cli.output's publication of a finished run (``publish``): the output directory holds the previous run or
the whole new one, whatever happens while the renames are under way (a rename that fails, SIGINT or SIGTERM). The
runs that publish through the command line are in test_cli.py and test_cli_resume.py."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from cgist.cli.output import CHECKPOINTS_DIR, publish


def make_run(directory: Path, model: str, checkpoints: bool = True) -> Path:
    """A run's output directory: a model file holding ``model``, and a checkpoint of it unless ``checkpoints`` is
    False (as in the staging directory of a run about to be published)."""
    directory.mkdir()
    (directory / "model.safetensors").write_text(model)
    if checkpoints:
        (directory / CHECKPOINTS_DIR / "checkpoint-2").mkdir(parents=True)
        (directory / CHECKPOINTS_DIR / "checkpoint-2" / "model.safetensors").write_text(f"{model} at step 2")
    return directory


def contents(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` by its relative path, with its text."""
    return {p.relative_to(directory).as_posix(): p.read_text() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_publish_into_a_new_output_dir(tmp_path):
    """Where there is no output directory yet, the staging directory becomes it."""
    staging = make_run(tmp_path / ".out-new", "new", checkpoints=False)
    publish(staging, tmp_path / "out")
    assert contents(tmp_path / "out") == {"model.safetensors": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_publish_replaces_the_previous_run_and_keeps_its_checkpoints(tmp_path):
    out = make_run(tmp_path / "out", "old")
    publish(make_run(tmp_path / ".out-new", "new", checkpoints=False), out)
    assert contents(out) == {"model.safetensors": "new", "checkpoints/checkpoint-2/model.safetensors": "old at step 2"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("failing", [1, 2, 3], ids=["checkpoints-out", "previous-run-out", "new-run-in"])
def test_a_failed_rename_leaves_the_previous_run_in_place(failing, tmp_path, monkeypatch):
    """Whichever of the three renames fails (the checkpoints into the new run, the previous run out of the way, the
    new run into place; simulated: a rename fails for want of space or permission only on a real disk), the error
    propagates, the output directory holds the previous run with its checkpoints, the staging directory the new
    model, and no hidden folder of the previous run is left."""
    out = make_run(tmp_path / "out", "old")
    staging = make_run(tmp_path / ".out-new", "new", checkpoints=False)
    rename, renames = Path.rename, []

    def rename_failing_once(self: Path, target):
        renames.append((self.name, Path(target).name))
        if len(renames) == failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_failing_once)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        publish(staging, out)
    assert renames[:failing] == [(CHECKPOINTS_DIR, CHECKPOINTS_DIR), ("out", "out"), (".out-new", "out")][:failing]
    assert contents(out) == {"model.safetensors": "old", "checkpoints/checkpoint-2/model.safetensors": "old at step 2"}
    assert contents(staging) == {"model.safetensors": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out-new", "out"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_publish_waits_for_the_renames(signum, tmp_path, monkeypatch):
    """SIGINT or SIGTERM that comes while the renames are under way (sent by the first one) acts once they are done:
    its handler (SIGINT's raises KeyboardInterrupt) sees the new run published with the previous run's checkpoints."""
    out = make_run(tmp_path / "out", "old")
    staging = make_run(tmp_path / ".out-new", "new", checkpoints=False)
    rename, seen = Path.rename, []

    def rename_sending_the_signal(self: Path, target):
        if not seen:
            seen.append("sent")
            signal.raise_signal(signum)
        return rename(self, target)

    def handler(signum, frame):
        seen.append(contents(out))
        if signum == signal.SIGINT:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "rename", rename_sending_the_signal)
    previous = signal.signal(signum, handler)
    try:
        if signum == signal.SIGINT:
            with pytest.raises(KeyboardInterrupt):
                publish(staging, out)
        else:
            publish(staging, out)
    finally:
        signal.signal(signum, previous)
    assert seen == ["sent", {"model.safetensors": "new", "checkpoints/checkpoint-2/model.safetensors": "old at step 2"}]
