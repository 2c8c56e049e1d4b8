"""The output directory of ``cgist train``: the atomic publication of the model, and the checkpoints.

Layout of ``OUTPUT_DIR``::

    modules.json, model.safetensors, README.md, ...   the published model (only after a finished run)
    cgist_train.json                                  its summary
    checkpoints/checkpoint-N/                         the Trainer's checkpoint after step N, with RECORD_NAME

Whatever a reader finds under a final name is complete: the model appears by renaming a staging directory
into place, and a checkpoint by renaming ``checkpoints/.staging-*/checkpoint-N`` to ``checkpoints/checkpoint-N``.
Checkpoints are deleted by renaming them to ``.trash-*`` first. A run killed midway leaves at most a
hidden ``.staging-*`` or ``.trash-*`` entry, which the next run removes; one killed before its first checkpoint
leaves no more than those and the ``checkpoints`` folder (:func:`holds_only_leftovers`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = [
    "CHECKPOINTS_DIR",
    "RECORD_NAME",
    "checkpoint_step",
    "commit_checkpoint",
    "discard",
    "fingerprint",
    "holds_only_leftovers",
    "is_final",
    "latest_checkpoint",
    "list_checkpoints",
    "new_staging",
    "publish",
    "read_record",
    "remove_stale",
    "write_record",
]

#: Subdirectory of the output directory that holds the checkpoints.
CHECKPOINTS_DIR = "checkpoints"
#: Written into every checkpoint beside the Trainer's files: the options that shaped training and the scores
#: before training.
RECORD_NAME = "cgist_checkpoint.json"

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")
_STAGING, _TRASH = ".staging-", ".trash-"


def checkpoint_step(path: Path) -> int | None:
    """N for a directory named ``checkpoint-N``, else None."""
    match = _CHECKPOINT.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in ``directory`` (those with a record), oldest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if checkpoint_step(p) is not None and (p / RECORD_NAME).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint of the highest step in ``directory``, or None."""
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


def is_final(checkpoint: Path) -> bool:
    """Whether the Trainer had reached its last step when it wrote ``checkpoint``."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return state["global_step"] >= state["max_steps"]


def read_record(checkpoint: Path) -> dict:
    """The record ``write_record`` left in ``checkpoint``."""
    return json.loads((checkpoint / RECORD_NAME).read_text())


def write_record(checkpoint: Path, record: dict) -> None:
    """Store ``record`` (JSON) in the checkpoint directory being written."""
    (checkpoint / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")


def new_staging(directory: Path) -> Path:
    """A fresh hidden directory in ``directory`` where the next checkpoint is written."""
    return Path(tempfile.mkdtemp(prefix=_STAGING, dir=directory))


def discard(path: Path) -> None:
    """Delete a directory: first renamed to a hidden name, so that it never lies half-deleted under its own."""
    if not path.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=_TRASH, dir=path.parent))
    path.rename(trash / path.name)
    shutil.rmtree(trash, ignore_errors=True)


def commit_checkpoint(staged: Path, directory: Path, keep: int) -> Path:
    """Rename the finished ``staged`` checkpoint into ``directory``, then delete all but the ``keep`` newest."""
    final = directory / staged.name
    staged.rename(final)
    shutil.rmtree(staged.parent, ignore_errors=True)
    for old in list_checkpoints(directory)[:-keep]:
        discard(old)
    return final


def holds_only_leftovers(output: Path) -> bool:
    """Whether the output directory ``output`` holds nothing but what a run leaves before its first checkpoint.

    That is: the ``checkpoints`` folder (made when training starts) with at most hidden entries of an unfinished
    save or deletion in it, and the hidden entry of an unfinished deletion of an earlier run's checkpoints.
    ``cgist train --resume auto`` starts a new run in such a directory; a model or any other file stops it.
    """
    for path in output.iterdir():
        if path.name.startswith(_TRASH) and path.is_dir():
            continue
        if path.name == CHECKPOINTS_DIR and path.is_dir() and all(
            entry.name.startswith((_STAGING, _TRASH)) and entry.is_dir() for entry in path.iterdir()
        ):
            continue
        return False
    return True


def remove_stale(directory: Path) -> None:
    """Delete what an interrupted save or deletion left behind in ``directory``."""
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith((_STAGING, _TRASH)):
                shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _deferred_signals() -> Iterator[None]:
    """Hold back SIGINT and SIGTERM for the body, then act on the first one that came (if any) as before."""
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


def publish(staging: Path, output: Path) -> None:
    """Put the finished ``staging`` directory in the place of ``output`` by renames, keeping its checkpoints.

    Both lie in one parent directory, so ``output`` always holds either the previous run or the whole new one;
    ``output/checkpoints`` moves into the new one first (and back, should a rename fail). SIGINT and SIGTERM
    wait until the renames are done.
    """
    with _deferred_signals():
        if not output.exists():
            staging.rename(output)
            return
        checkpoints, moved = output / CHECKPOINTS_DIR, staging / CHECKPOINTS_DIR
        trash = Path(tempfile.mkdtemp(prefix=f".{output.name}-old-", dir=output.parent))
        try:
            if checkpoints.exists():
                checkpoints.rename(moved)
            output.rename(trash / output.name)
            staging.rename(output)
        except BaseException:
            if not output.exists() and (trash / output.name).exists():
                (trash / output.name).rename(output)
            if moved.exists() and not checkpoints.exists():
                moved.rename(checkpoints)
            with suppress(OSError):
                trash.rmdir()  # only if empty: it may still hold the previous run
            raise
    shutil.rmtree(trash, ignore_errors=True)


def fingerprint(path: Path) -> str:
    """SHA-256 of a data file's bytes, or of a directory's file names and bytes, as ``sha256:<hex>``."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return f"sha256:{digest.hexdigest()}"
