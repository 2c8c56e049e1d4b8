"""``GistOptions``: the options of one loss-stage call, for every score and every family, validated once and passed
as one object.

Every drop-in, ``gist_loss`` and ``maxsim_loss`` build it; the autograd node and every backend read it. The score is
its ``similarity`` (``cgist.stage.spec.scores``: ``"cos"``, ``"dot"``, ``"maxsim"``, ``"mean_maxsim"``, ``"xtr"``, or
a registered score's); a field that only some scores take (``Score.options``) stays at its default under the others,
and a score's own options (``Score.score_options``, such as XTR's ``top_k``) are ``score_options``, by name. It imports
only the standard library and the registry of scores.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .scores import SCORES, Score, guide_similarities, score_of

__all__ = [
    "ANCHOR_DIRECTIONS", "DIRECTIONS", "HARDNESS_MODES", "MARGIN_STRATEGIES", "PARTITION_MODES",
    "ColumnGroup", "GistOptions", "ScoreOptions", "check_bools", "check_margin", "check_scale", "real_number",
]

MARGIN_STRATEGIES = ("absolute", "relative")
#: sentence-transformers' ``MultipleNegativesRankingLoss`` directions: each row's softmax over these columns.
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
#: The directions that score rows against the anchors: under gathering, every rank's anchors are one more column.
ANCHOR_DIRECTIONS = ("query_to_query", "doc_to_query")
PARTITION_MODES = ("joint", "per_direction")
HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")


@dataclass(frozen=True)
class ColumnGroup:
    """One column group of the loss (docs/design.md#column-groups): every local row, anchor i (``row="a"``) or its
    positive ``offset + i`` (``"p"``), against the rows of one column, with the group's rules.

    A rule's column is given by its offset: row i meets it at column ``i + offset``. Both backends build their
    blocks from these; the dense oracle states the same rules on its own.
    """

    name: str  # the statistics block it counts in: "ap", "aa", "pp", "an", "qq", "dq" or "dd"
    part: int  # its partition: the log-sum-exp it adds to (0: query-to-document)
    row: str  # "a" (anchor rows) or "p" (their positives)
    column: int  # the call's column it scores against
    label: bool = False  # AP: column offset + i is the label, carried apart from the other terms
    unmasked_offset: int | None = None  # row i's column i + this is never masked (DQ's pair)
    excluded_offset: int | None = None  # row i's column i + this is always masked (self-pairs, own documents)
    hard_own: bool = False  # the hardness penalty at each row's own column, offset + i
    hard_others: bool = False  # ... at every other column


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


def real_number(name: str, value: object) -> float:
    """``value`` as a float: a real number (not a bool), or a 0-dim floating tensor such as a learned
    ``nn.Parameter`` (its value now); else a TypeError naming ``name``. It reads a tensor's value without importing
    torch (``.item()``)."""
    if _is_scalar_tensor(value):
        return float(value.detach().item())
    _check_real(name, value)
    return float(value)


def check_scale(scale: object) -> float:
    """A ``scale`` (the logits' factor, ``1 / temperature``; a number or a learned 0-dim tensor) as a float: positive
    (sentence-transformers' message) and finite (an infinite scale makes the scaled scores infinite)."""
    value = real_number("scale", scale)
    if not value > 0:
        raise ValueError("Scale must be a positive value.")
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value!r}: the scaled scores would be infinite")
    return value


def _is_scalar_tensor(value: object) -> bool:
    """A 0-dim (or one-element) floating tensor: what a learned temperature or scale is."""
    return (type(value).__module__.startswith("torch") and hasattr(value, "is_floating_point")
            and value.is_floating_point() and value.numel() == 1)


def _owners(name: str, kind: str) -> str:
    """The registered scores whose ``kind`` (``"options"`` or ``"score_options"``) name ``name``, by name."""
    return " and the ".join(s.name for s in SCORES if name in getattr(s, kind))


def check_bools(**flags: object) -> None:
    """Each flag a bool, else a TypeError naming it."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_margin(margin: object, margin_strategy: object) -> None:
    """GIST's margin, as every guided loss checks it: a real, finite number (a NaN margin would mask nothing and an
    infinite one everything or nothing), with a ``margin_strategy`` of ``MARGIN_STRATEGIES``."""
    _check_real("margin", margin)
    if not math.isfinite(margin):
        raise ValueError(f"margin must be a finite number, got {margin!r}")
    if not isinstance(margin_strategy, str) or margin_strategy not in MARGIN_STRATEGIES:
        raise ValueError(f"margin_strategy must be one of {MARGIN_STRATEGIES}, got {margin_strategy!r}")


class ScoreOptions(Mapping[str, object]):
    """A score's own options by name (``GistOptions.score_options``): read-only, and hashable as the options are."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, object] | None = None) -> None:
        self._values = dict(values or {})

    def __getitem__(self, name: str) -> object:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __repr__(self) -> str:
        return repr(self._values)


@dataclass(frozen=True)
class GistOptions:
    """The options of one loss-stage call, for every family and score: the score (``similarity``, and what only some
    scores take), GIST's guide rule and blocks, sentence-transformers' directions, partitions and hardness, the
    Matryoshka dimensions, the offset of this rank's labels and the budget.

    Args:
        temperature: divides the scores before the softmax (``1 / scale`` of the ranking losses); positive and
            finite.
        margin: finite; with ``margin_strategy`` it sets the guide threshold ``T_i`` of anchor i.
        margin_strategy: ``"absolute"`` (``T_i = theta_i - margin``) or ``"relative"``
            (``T_i = theta_i - |theta_i| * margin``).
        contrast_anchors: add the anchor-anchor block.
        contrast_positives: add the positive-positive block.
        mask_self: always exclude the self-pairs AA[i, i] and PP[i, offset + i], as sentence-transformers 6.3 and
            later do (False: they drop out only when the guide scores them above the threshold, the rule of 6.2).
        mask_duplicates: exclude every candidate whose text is anchor i's or its positive's, whatever the scores
            (the call then needs a text id per row); the label stays.
        directions: the blocks of sentence-transformers' ``MultipleNegativesRankingLoss``, each masked by the guide
            as the GIST blocks are: ``"query_to_doc"`` (required: anchor i against the positives and every
            negative set, the GIST blocks AP and AN), ``"query_to_query"`` (anchor i against all anchors, its own
            left out), ``"doc_to_query"`` (its positive against all anchors, the pair (positive, anchor i) never
            masked) and ``"doc_to_doc"`` (its positive against the positives and every negative set, anchor i's
            own documents left out). ``"query_to_query"`` is the anchor-anchor block over all ranks' anchors and
            ``"doc_to_doc"`` contains the positive-positive block, so they exclude ``contrast_anchors`` and
            ``contrast_positives`` (GIST's blocks over this rank's anchors and over the positives).
        partition_mode: ``"joint"``, one softmax over every block, or ``"per_direction"``, the mean over
            directions of each direction's log-sum-exp, minus the positive score (sentence-transformers' rule; it
            needs every direction to contain the positive pair, so neither ``"query_to_query"``,
            ``"doc_to_doc"`` nor the GIST contrast blocks).
        hardness_mode, hardness_strength: ``hardness_strength * stop_grad(cos)`` is added, after the guide's mask and
            not divided by the temperature, to the query-to-document logits of ``"in_batch_negatives"`` (all but
            anchor i's own documents), ``"hard_negatives"`` (its own negatives) or ``"all_negatives"`` (all but its
            positive); None adds nothing.
        similarity: the student's score, and with it the score of the stage (``cgist.stage.spec.scores``): ``"cos"``
            (cosine, as ``cos_sim``) or ``"dot"`` (dot product, as ``dot_score``: the student's embeddings are not
            normalised) over embeddings; ``"maxsim"`` or ``"mean_maxsim"`` (MaxSim, MeanMaxSim) or ``"xtr"`` (XTR)
            over token embeddings; or a similarity of a score added with ``cgist.register_score``. The options of
            another score (``Score.options``) must stay at their defaults.
        score_options: the score's own options, by name (its ``Score.score_options``; those not given take the
            defaults there, and its spec module's ``check_options`` checks them): XTR's ``top_k``, its retrieval
            depth, which it needs (each query token keeps its ``top_k`` largest similarities among every real
            document token of the call, ``cgist.stage.spec.xtr``). A mapping; read back as a ``ScoreOptions``.
        guide_similarity: the guide's score: ``"cos"`` (the cosine of its embeddings, for every score), or under a
            token score a multi-vector guide's ``"maxsim"`` or ``"mean_maxsim"``.
        all_anchors: the call's last column holds the anchors of every rank (N rows, this rank's at ``offset``),
            which ``"query_to_query"`` and ``"doc_to_query"`` score against; without it they take this rank's.
        offset: anchor i's positive is candidate ``offset + i`` (``rank * B`` when candidates are gathered).
            Its range, ``[0, N - B]``, depends on the shapes and is checked with them.
        matryoshka_dims: if given, the loss is ``sum_d w_d * L_d`` over these student dimensions, where
            ``L_d`` scores the student embeddings truncated to their first d components (each renormalised)
            and the guide is untouched. Distinct positive ints, in any order; at most the student dimension
            (checked with the shapes).
        matryoshka_weights: the weights ``w_d``, one finite number per dimension (default: all 1).
        block_bytes: the workspace budget: bytes of score buffers the loss stage may hold at once, a positive int
            (the streaming path's row-block tiles, ``cgist.stage.budget.row_blocks``; the Triton backward's chunk operands,
            ``cgist.stage.budget.backward_chunks``); None picks a default for the device.

    Raises:
        TypeError, ValueError: naming the first bad option.
    """

    temperature: float = 0.01
    margin: float = 0.0
    margin_strategy: Literal["absolute", "relative"] = "absolute"
    contrast_anchors: bool = True
    contrast_positives: bool = True
    mask_self: bool = True
    mask_duplicates: bool = False
    directions: tuple[str, ...] = ("query_to_doc",)
    partition_mode: Literal["joint", "per_direction"] = "joint"
    hardness_mode: str | None = None
    hardness_strength: float = 0.0
    similarity: str = "cos"
    score_options: Mapping[str, object] = ScoreOptions()
    guide_similarity: str = "cos"
    all_anchors: bool = False
    offset: int = 0
    matryoshka_dims: tuple[int, ...] | None = None
    matryoshka_weights: tuple[float, ...] | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        check_margin(self.margin, self.margin_strategy)
        check_bools(**{name: getattr(self, name) for name in ("contrast_anchors", "contrast_positives", "mask_self",
                                                               "mask_duplicates", "all_anchors")})
        if isinstance(self.offset, bool) or not isinstance(self.offset, numbers.Integral):
            raise TypeError(f"offset must be an int, got {type(self.offset).__name__}")
        if self.block_bytes is not None:
            if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, numbers.Integral):
                raise TypeError(f"block_bytes must be an int or None, got {type(self.block_bytes).__name__}")
            if self.block_bytes < 1:
                raise ValueError(f"block_bytes must be at least 1, got {self.block_bytes}")
            object.__setattr__(self, "block_bytes", int(self.block_bytes))
        self._check_matryoshka()
        self._check_directions()
        self._check_score()
        # Plain Python numbers from here on (numpy scalars and the like are accepted above).
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "margin", float(self.margin))
        object.__setattr__(self, "offset", int(self.offset))

    def _check_matryoshka(self) -> None:
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if dims is None:
            if weights is not None:
                raise ValueError("matryoshka_weights needs matryoshka_dims")
            return
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or not dims:
            raise TypeError(f"matryoshka_dims must be a non-empty sequence of ints, got {dims!r}")
        for d in dims:
            if isinstance(d, bool) or not isinstance(d, numbers.Integral):
                raise TypeError(f"matryoshka_dims must hold ints, got {type(d).__name__} {d!r}")
            if d < 1:
                raise ValueError(f"matryoshka_dims must be positive, got {d}")
        if len(set(dims)) != len(dims):
            repeated = sorted({d for d in dims if list(dims).count(d) > 1})
            raise ValueError(f"matryoshka_dims must be distinct, got {list(dims)} (repeated: {repeated})")
        if weights is None:
            weights = [1.0] * len(dims)
        if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != len(dims):
            raise ValueError(f"matryoshka_weights must have one weight per dimension ({len(dims)}), got {weights!r}")
        for w in weights:
            _check_real("matryoshka_weights", w)
            if not math.isfinite(w):
                raise ValueError(f"matryoshka_weights must be finite, got {w!r}")
        object.__setattr__(self, "matryoshka_dims", tuple(int(d) for d in dims))
        object.__setattr__(self, "matryoshka_weights", tuple(float(w) for w in weights))

    def _check_directions(self) -> None:
        directions = self.directions
        if isinstance(directions, (str, bytes)) or not isinstance(directions, Sequence) or not directions:
            raise TypeError(f"directions must be a non-empty sequence of {DIRECTIONS}, got {directions!r}")
        unknown = [d for d in directions if d not in DIRECTIONS]
        if unknown:
            raise ValueError(f"directions must be among {DIRECTIONS}, got {unknown}")
        if len(set(directions)) != len(directions):
            raise ValueError(f"directions must be distinct, got {list(directions)}")
        if "query_to_doc" not in directions:
            raise ValueError("directions must include 'query_to_doc' (it holds the positive pair), got "
                             f"{list(directions)}")
        for flag, direction, block in (("contrast_anchors", "query_to_query", "anchor-anchor"),
                                       ("contrast_positives", "doc_to_doc", "positive-positive")):
            if getattr(self, flag) and direction in directions:
                raise ValueError(f"{flag}=True adds the {block} block, which the direction {direction!r} contains; "
                                 f"set {flag}=False to use {direction!r}, or leave {direction!r} out")
        if self.partition_mode not in PARTITION_MODES:
            raise ValueError(f"partition_mode must be one of {PARTITION_MODES}, got {self.partition_mode!r}")
        same_type = [d for d in directions if d in ("query_to_query", "doc_to_doc")]
        same_type += [f for f in ("contrast_anchors", "contrast_positives") if getattr(self, f)]
        if self.partition_mode == "per_direction" and same_type:
            raise ValueError(
                "partition_mode='per_direction' requires every direction's candidate pool to include the positive "
                f"pair; {', '.join(same_type)} only hold same-type similarities and never the positive, which makes "
                "the per-direction loss ill-defined. Use partition_mode='joint' instead"
            )
        if self.hardness_mode not in HARDNESS_MODES:
            raise ValueError(f"hardness_mode must be one of {HARDNESS_MODES}, got {self.hardness_mode!r}")
        _check_real("hardness_strength", self.hardness_strength)
        if not (math.isfinite(self.hardness_strength) and self.hardness_strength >= 0):
            raise ValueError(f"hardness_strength must be a finite number >= 0, got {self.hardness_strength!r}")
        object.__setattr__(self, "directions", tuple(directions))
        object.__setattr__(self, "hardness_strength", float(self.hardness_strength))

    def _check_score(self) -> None:
        """The score's options: the fields of another score at their defaults, its own ``score_options`` by its
        checks (``Score.check_options``), the defaults filled in."""
        score = score_of(self.similarity)
        if self.guide_similarity not in guide_similarities():
            raise ValueError(f"guide_similarity must be one of {guide_similarities()}, got {self.guide_similarity!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in sorted({name for s in SCORES for name in s.options}):
            value = getattr(self, name)
            if name not in score.options and value != defaults[name]:
                raise ValueError(f"{name}={value!r} is an option of the {_owners(name, 'options')} score; "
                                 f"similarity={self.similarity!r} (the {score.name} score) takes it only at its default")
        given = self.score_options
        if not isinstance(given, Mapping):
            raise TypeError(f"score_options must be a mapping of option names to values, got {type(given).__name__}")
        for name, value in given.items():
            if name not in score.score_options:
                owners = _owners(name, "score_options")
                owner = f"an option of the {owners} score" if owners else "no registered score's option"
                raise ValueError(f"{name}={value!r} is {owner}; similarity={self.similarity!r} (the {score.name} "
                                 f"score) takes {sorted(score.score_options) or 'no option of its own'}")
        object.__setattr__(self, "score_options", ScoreOptions({**score.score_options, **given}))
        checked = score.check_options(self)  # its own checks, and the values they normalise
        object.__setattr__(self, "score_options", ScoreOptions({**self.score_options, **checked}))

    def column_groups(self, n_columns: int) -> tuple[tuple[ColumnGroup, ...], int, dict[str, int]]:
        """The column groups of a call of ``n_columns`` columns, in their order (GIST's AP, AA, PP, AN_1..AN_k,
        then QQ, DQ, DD, DN_1..DN_k), the number of partitions, and the partition of each row side.

        The columns are ``[anchor, positive, *negatives]`` and, with ``all_anchors``, every rank's anchors. Each row
        side lies in one partition: the anchors' groups belong to query-to-document, or jointly with it; under
        ``per_direction`` (which allows only query-to-document and document-to-query) the positives' to
        document-to-query.
        """
        n_neg = n_columns - 2 - self.all_anchors
        negatives = range(2, 2 + n_neg)
        everyone = n_columns - 1 if self.all_anchors else 0  # the anchors the anchor-column directions score
        own_anchor = self.offset if self.all_anchors else 0  # anchor i among them
        p_part = 1 if self.partition_mode == "per_direction" and "doc_to_query" in self.directions else 0
        mode = self.hardness_mode if self.hardness else None
        others, own = mode in ("in_batch_negatives", "all_negatives"), mode in ("hard_negatives", "all_negatives")
        groups = [ColumnGroup("ap", 0, "a", 1, label=True, hard_others=others)]
        if self.contrast_anchors:
            groups.append(ColumnGroup("aa", 0, "a", 0, excluded_offset=0 if self.mask_self else None))
        if self.contrast_positives:
            groups.append(ColumnGroup("pp", 0, "p", 1, excluded_offset=self.offset if self.mask_self else None))
        groups += [ColumnGroup("an", 0, "a", c, hard_own=own, hard_others=others) for c in negatives]
        if "query_to_query" in self.directions:
            groups.append(ColumnGroup("qq", 0, "a", everyone, excluded_offset=own_anchor))
        if "doc_to_query" in self.directions:
            groups.append(ColumnGroup("dq", p_part, "p", everyone, unmasked_offset=own_anchor))
        if "doc_to_doc" in self.directions:
            groups += [ColumnGroup("dd", 0, "p", c, excluded_offset=self.offset) for c in (1, *negatives)]
        return tuple(groups), 1 + p_part, {"a": 0, "p": p_part}

    @property
    def score(self) -> Score:
        """The score of the stage (``cgist.stage.spec.scores``), by ``similarity``."""
        return score_of(self.similarity)

    @property
    def scale(self) -> float:
        """The factor of the logits, ``1 / temperature`` (sentence-transformers' ``scale``)."""
        return 1.0 / self.temperature

    @property
    def reads_anchors(self) -> bool:
        """Whether a direction scores against the anchors (``ANCHOR_DIRECTIONS``): with gathering, a call then takes
        every rank's anchors as its last column (``all_anchors``)."""
        return any(direction in ANCHOR_DIRECTIONS for direction in self.directions)

    @property
    def hardness(self) -> float:
        """The hardness strength in effect: 0 without a hardness mode."""
        return self.hardness_strength if self.hardness_mode is not None else 0.0

    def dims(self, full_dim: int) -> tuple[tuple[int, float], ...]:
        """``(d, w_d)`` pairs in decreasing d: ``((full_dim, 1.0),)`` without Matryoshka."""
        if self.matryoshka_dims is None:
            return ((full_dim, 1.0),)
        return tuple(sorted(zip(self.matryoshka_dims, self.matryoshka_weights), reverse=True))

    @property
    def relative(self) -> bool:
        """True for the relative margin strategy."""
        return self.margin_strategy == "relative"

    def replace(self, **changes: object) -> GistOptions:
        """A validated copy with ``changes`` applied (``options.replace(offset=rank * B)``)."""
        return dataclasses.replace(self, **changes)
