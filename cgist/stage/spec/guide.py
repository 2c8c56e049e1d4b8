"""Where the guide comes from: the four guide sources as one small type, with one vocabulary for the loss, the
functional form and the command line. It imports only the standard library.

===========  ==================  ===============  ======================================================
source       ``guide=`` of the   ``--guide-mode``  what the loss stage scores the guide with
             drop-in             of cgist train
===========  ==================  ===============  ======================================================
``model``    a SentenceTransformer  ``model``     the guide model's embeddings of each batch
``labels``   ``"labels"``        ``precomputed``  the guide's embeddings read off the batch's label column
``self``     ``"self"``          ``self``         the student's own first-pass embeddings, detached
``none``     None                ``none``         nothing: no guide mask
===========  ==================  ===============  ======================================================

The loss stage (``gist_loss``) sees only the ``kind`` of a source: the guide's columns (``"embeddings"``), the
student's own (``"self"``), or none (None).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LABELS", "MODEL", "NONE", "SELF", "SOURCES", "GuideSource", "by_cli", "kind_of", "masks"]


@dataclass(frozen=True)
class GuideSource:
    """One guide source: its name (``FusedCachedGISTLoss.guide_mode`` and the config's ``guide_mode``), its name on
    the command line, and the ``kind`` of guide the loss stage takes from it."""

    name: str
    cli: str
    kind: str | None

    @property
    def runs_model(self) -> bool:
        """A guide model embeds every batch (sentence-transformers' own loss)."""
        return self is MODEL

    @property
    def argument(self) -> str | None:
        """The drop-in's ``guide=`` for a source that is no model: ``"labels"``, ``"self"`` or None."""
        return self.name if self in (LABELS, SELF) else None

    @property
    def reads_labels(self) -> bool:
        """The guide's embeddings are the batch's label column."""
        return self is LABELS

    def masks(self, mask_self: bool | None, mask_duplicates: bool | None, have_text_ids: bool, *,
              self_pairs_excluded: bool) -> tuple[bool, bool]:
        """``mask_self`` and ``mask_duplicates`` with this source's defaults for those left None (see ``masks``)."""
        return masks(self.kind, mask_self, mask_duplicates, have_text_ids, self_pairs_excluded=self_pairs_excluded)


MODEL = GuideSource("model", "model", "embeddings")
LABELS = GuideSource("labels", "precomputed", "embeddings")
SELF = GuideSource("self", "self", "self")
NONE = GuideSource("none", "none", None)
SOURCES = (MODEL, LABELS, SELF, NONE)


def by_cli(name: str) -> GuideSource:
    """The source of a ``--guide-mode`` value."""
    for source in SOURCES:
        if source.cli == name:
            return source
    raise ValueError(f"--guide-mode must be one of {', '.join(s.cli for s in SOURCES)}, got {name!r}")


def kind_of(guide_embeddings: object) -> str | None:
    """The kind of a ``guide_embeddings`` argument of ``gist_loss``: ``"embeddings"`` (the guide's columns),
    ``"self"`` or None; any other string is an error."""
    if guide_embeddings is None:
        return None
    if isinstance(guide_embeddings, str):
        if guide_embeddings != "self":
            raise ValueError(f"guide_embeddings must be the guide's columns, 'self' or None, got {guide_embeddings!r}")
        return "self"
    return "embeddings"


def masks(kind: str | None, mask_self: bool | None, mask_duplicates: bool | None, have_text_ids: bool, *,
          self_pairs_excluded: bool) -> tuple[bool, bool]:
    """``mask_self`` and ``mask_duplicates`` with their defaults for a guide of ``kind`` (None: the default): the one
    place the defaults are decided (docs/design.md#rules-by-release).

    With the guide's own embeddings, ``mask_self`` defaults to ``self_pairs_excluded``, the self-pair rule of a
    sentence-transformers release (``cgist.compat.ReleaseRules``: on from 6.3, where the self-pairs are always
    excluded; off before, where they drop out only when the guide scores them above the threshold): the drop-ins pass
    the installed release's, ``gist_loss`` the newest release's. ``mask_duplicates`` is then off (sentence-transformers' rule: duplicates drop
    out by their guide scores). With the student as its own guide, or no guide, nothing masks them otherwise: both
    default to on, ``mask_duplicates`` when text ids are given.
    """
    unguided = kind != "embeddings"
    mask_self = (unguided or self_pairs_excluded) if mask_self is None else mask_self
    mask_duplicates = (unguided and have_text_ids) if mask_duplicates is None else mask_duplicates
    return mask_self, mask_duplicates
