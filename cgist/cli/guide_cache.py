"""The guide-embedding cache of ``cgist train --guide-mode precomputed``: the training split with its ``label`` column.

Layout of ``--guide-cache`` (default ``$XDG_CACHE_HOME/cgist``, else ``~/.cache/cgist``)::

    guide-embeddings/<name>/entry.json   the key the entry was built for, and the SHA-256 of each file of dataset/
    guide-embeddings/<name>/dataset/     the training split and its guide embeddings (datasets' save_to_disk)

``<name>`` is a digest of the key: the guide (its path or Hub id and the SHA-256 of its files), the training split's
texts, the student's tokenizer and --max-seq-length, so any change to what the guide sees or is builds a new entry.
An entry is written in a hidden ``.building-*`` directory and renamed into place, so one under its final name is
complete. Before use, every file is checked against its recorded SHA-256 and the dataset against the split; an entry
that fails (cut short, edited, left by another version) is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .output import discard, fingerprint

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

__all__ = ["ENTRY_NAME", "cache_key", "default_cache_dir", "entry_path", "guide_directory", "load_entry",
           "store_entry", "texts_digest", "tokenizer_digest"]

#: Bumped when the layout or the meaning of the stored embeddings changes, so older entries are not read.
FORMAT = 1
ENTRY_NAME = "entry.json"
_DATASET, _BUILDING = "dataset", ".building-"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cgist``, or ``~/.cache/cgist`` without it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cgist"


def guide_directory(path: str) -> Path | None:
    """The directory that holds a guide's files: ``path`` itself, or the snapshot of the Hub id ``path`` in the
    local Hugging Face cache; None when neither exists (a Hub id that has not been downloaded yet)."""
    if Path(path).exists():
        return Path(path).resolve()
    from huggingface_hub import snapshot_download

    for repo_id in (path, f"sentence-transformers/{path}"):
        try:
            return Path(snapshot_download(repo_id, local_files_only=True))
        except Exception:  # not in the cache, or not a valid repository id: the loader reports it
            continue
    return None


def texts_digest(dataset: Dataset) -> str:
    """``sha256:<hex>`` of a dataset's column names and texts, row by row in order."""
    digest = hashlib.sha256(json.dumps(dataset.column_names).encode())
    for batch in dataset.iter(batch_size=1024):
        digest.update(json.dumps([batch[name] for name in dataset.column_names]).encode())
    return f"sha256:{digest.hexdigest()}"


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """``sha256:<hex>`` of how a tokenizer splits text: its class and vocabulary, and for a fast tokenizer its whole
    pipeline (normaliser, pre-tokeniser, model, post-processor) without the per-call truncation and padding."""
    described: dict[str, object] = {"class": type(tokenizer).__name__}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pipeline = json.loads(backend.to_str())
        described["pipeline"] = {k: v for k, v in pipeline.items() if k not in ("truncation", "padding")}
    else:
        described["vocab"] = sorted(tokenizer.get_vocab().items())
    return "sha256:" + hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def cache_key(guide: str, guide_files: Path, train_set: Dataset, tokenizer: PreTrainedTokenizerBase,
              max_seq_length: int) -> dict[str, object]:
    """What the guide embeddings of ``train_set`` depend on, as a JSON-able dict."""
    return {
        "format": FORMAT,
        "guide": guide,
        "guide_files": fingerprint(guide_files),
        "train_texts": texts_digest(train_set),
        "student_tokenizer": tokenizer_digest(tokenizer),
        "max_seq_length": max_seq_length,
    }


def entry_path(cache_dir: Path, key: dict[str, object]) -> Path:
    """Where the entry of ``key`` lives under ``cache_dir``."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / "guide-embeddings" / name


def _file_digests(directory: Path) -> dict[str, str]:
    return {path.relative_to(directory).as_posix(): fingerprint(path)
            for path in sorted(directory.rglob("*")) if path.is_file()}


def load_entry(entry: Path, key: dict[str, object], train_set: Dataset) -> tuple[Dataset | None, str]:
    """The cached training split of ``key`` and ``""``, or None and why it cannot be used ("" when there is none).

    The entry must record ``key``, its files must have their recorded SHA-256, and its dataset must hold
    ``train_set``'s columns and texts plus ``label``.
    """
    from datasets import load_from_disk

    if not entry.exists():
        return None, ""
    try:
        record = json.loads((entry / ENTRY_NAME).read_text())
    except (OSError, ValueError) as err:
        return None, f"its {ENTRY_NAME} cannot be read ({type(err).__name__})"
    if not isinstance(record, dict) or record.get("key") != key:
        return None, f"its {ENTRY_NAME} records another key"
    if _file_digests(entry / _DATASET) != record.get("files"):
        return None, "its files differ from those it recorded"
    try:
        dataset = load_from_disk(str(entry / _DATASET))
    except Exception as err:  # datasets and pyarrow raise many types for a damaged directory
        return None, f"its dataset cannot be loaded ({type(err).__name__})"
    if dataset.column_names != [*train_set.column_names, "label"] or len(dataset) != len(train_set):
        return None, "its dataset does not hold the training split"
    if texts_digest(dataset.select_columns(train_set.column_names)) != key["train_texts"]:
        return None, "its texts differ from the training split's"
    return dataset, ""


def store_entry(entry: Path, key: dict[str, object], dataset: Dataset) -> None:
    """Write ``dataset`` as the entry of ``key``: built in a hidden directory beside it, then renamed into place
    (replacing an unusable entry of the same name)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_BUILDING, dir=entry.parent))
    try:
        dataset.save_to_disk(str(staging / _DATASET))
        record = {"key": key, "files": _file_digests(staging / _DATASET)}
        (staging / ENTRY_NAME).write_text(json.dumps(record, indent=2) + "\n")
        if entry.exists():
            discard(entry)
        try:
            staging.rename(entry)
        except OSError:  # another run put its entry in place meanwhile; the two hold the same embeddings
            if not entry.exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
