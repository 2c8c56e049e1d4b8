"""The MaxSim score's part of the problem model (``similarity`` ``"maxsim"`` or ``"mean_maxsim"``, over token
embeddings; docs/design.md#late-interaction): its call (``MaxSimCall``), its rules (the empty document's score, the
MeanMaxSim weights) and its door (``maxsim_call``: the arguments of ``cgist.maxsim_loss`` checked once).

Query ``i``'s score against document ``m`` is ``s(i, m) = sum_t w[i, t] * max_{u real} <q[i, t], d[m, u]>`` with the
weights ``w`` of ``query_weights`` (the query's mask, divided under MeanMaxSim by its real token count), or, for a
document without a real token, ``EMPTY_DOCUMENT_SCORE`` divided likewise.

The call's blocks are the column groups of its options (``GistOptions.column_groups``: AP, GIST's AA and PP, AN), as
for the dense score. A query's row holds the scores of the anchors' groups in their order, then the positives' (PP):
each row side is one ``Part`` of the call, its rows (the queries, or the positives: rows ``offset + i`` of the first
column, as views) against its groups' columns. A multi-vector guide is a call of its own over the guide's tokens, laid
out alike. It imports only torch and the spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..budget import maxsim_block_bytes
from ..numerics import compute_dtype, normalize
from .call import StageCall, learned
from .checks import as_chunks, check_finite, check_text_ids, rows
from .options import GistOptions
from .problem import BoundGroup, bind_groups
from .scores import MAXSIM

__all__ = ["CHECK_ROWS", "EMPTY_DOCUMENT_SCORE", "GUIDE_KINDS", "MaxSimCall", "Part", "MaxSimVariant", "check_problem",
           "door", "maxsim_call", "query_weights", "row_views", "sample_calls", "sample_tokens", "variant_of"]

#: sentence-transformers' score of a document without any real token (before MeanMaxSim's division).
EMPTY_DOCUMENT_SCORE = -1e9
#: What a guide scores a query's candidates with: a single-vector guide's cosines (``"vectors"``), a multi-vector
#: guide's MaxSim (``"tokens"``), the student's own scores, detached (``"self"``), or nothing (``"none"``: only
#: ``mask_duplicates`` and ``mask_self`` mask).
GUIDE_KINDS = ("vectors", "tokens", "self", "none")


def query_weights(mask: Tensor, length_normalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Each query token's weight in its query's scores ``(rows, L)`` in ``dtype``, and the score of an empty
    document ``(rows, 1)``: the mask and ``EMPTY_DOCUMENT_SCORE``, each divided under MeanMaxSim
    (``length_normalize``) by the query's real token count, at least 1."""
    weights = mask.to(dtype)
    fill = torch.full((mask.shape[0], 1), EMPTY_DOCUMENT_SCORE, dtype=dtype, device=mask.device)
    if length_normalize:
        counts = mask.sum(1, keepdim=True).clamp(min=1).to(dtype)
        weights, fill = weights / counts, fill / counts
    return weights, fill


def row_views(chunks: Sequence[Tensor], start: int, count: int) -> list[Tensor]:
    """Rows ``start:start + count`` of a column's row chunks (or of their masks, or gradients), as views of them."""
    views, row = [], 0
    for chunk in chunks:
        lo, hi = max(start, row), min(start + count, row + chunk.shape[0])
        if lo < hi:
            views.append(chunk[lo - row:hi - row])
        row += chunk.shape[0]
    return views


@dataclass(frozen=True)
class Part:
    """One row side of a call: its rows (``queries``, with their masks) against its groups' columns (``documents``,
    each a list of row chunks, with their masks), whose scores are ``span`` of a query's row. ``rows_of``: the
    call's column and first row its rows are (``(0, 0)``: the queries; ``(1, offset)``: the positives, PP's rows);
    ``columns_of``: the call's column of each of its columns, so that its gradients land in the call's
    (``MaxSimCall.part_gradients``)."""

    queries: Sequence[Tensor]
    query_masks: Sequence[Tensor]
    documents: Sequence[Sequence[Tensor]]
    document_masks: Sequence[Sequence[Tensor]]
    span: slice
    rows_of: tuple[int, int]
    columns_of: tuple[int, ...]

    @property
    def n_queries(self) -> int:
        return rows(self.queries)

    @property
    def n_documents(self) -> int:
        return sum(rows(column) for column in self.documents)


@dataclass(frozen=True)
class MaxSimCall(StageCall):
    """A MaxSim call. ``columns``: the queries, then the document columns (positive, then negatives; with ``offset``
    every rank's rows), each a list of row chunks ``(r, L, D)``; ``masks``: their bool masks, chunk by chunk. Query
    ``i``'s label is the first document column's row ``offset + i``. ``parts``: the row sides, ``groups``: every
    column group bound to the call's columns (``BoundGroup[int]``: a column is its index) with its span of a row.

    The guide (docs/design.md#the-guide-for-late-interaction): ``guide_kind`` (``GUIDE_KINDS``; None where nothing
    masks, without a guide, ``mask_duplicates`` or a contrast block), ``guide_vectors`` (a single-vector guide's
    columns, whole and normalised), ``guide_tokens`` (a multi-vector guide's call, laid out as this one),
    ``text_ids`` (one int32 id per row of each column, equal for equal texts). ``budget_bytes``: the working memory
    of the stage (``cgist.stage.budget``)."""

    masks: Sequence[Sequence[Tensor]] = ()
    parts: tuple[Part, ...] = ()
    groups: tuple[tuple[BoundGroup, slice], ...] = ()
    guide_kind: str | None = None
    guide_vectors: Sequence[Tensor] | None = None
    guide_tokens: MaxSimCall | None = None
    text_ids: Sequence[Tensor] | None = None
    budget_bytes: int = 0

    @staticmethod
    def default_budget(options: GistOptions, first: Tensor, query_tokens: int, document_tokens: int,
                       n_documents: int) -> int:
        """The budget of a call without ``block_bytes``: ``cgist.stage.budget.maxsim_block_bytes``."""
        return maxsim_block_bytes(first.device, query_tokens, document_tokens, first.element_size())

    @property
    def guided(self) -> bool:
        return self.guide_kind in ("vectors", "tokens", "self")

    @property
    def scale(self) -> float:
        return self.options.scale

    @property
    def length_normalize(self) -> bool:
        return self.options.similarity == "mean_maxsim"

    @property
    def offset(self) -> int:
        return self.options.offset

    @property
    def n_queries(self) -> int:
        return rows(self.columns[0])

    @property
    def width(self) -> int:
        """The scores of a query's row: every part's."""
        return self.parts[-1].span.stop

    def part_gradients(self, grads: Sequence[Sequence[Tensor]]) -> list[tuple[list[Tensor], list[list[Tensor]]]]:
        """Each part's gradients as views of the call's (``grads``: one tensor per chunk of each column, ``columns``'
        layout): its rows' and its columns'. GIST's PP rows are rows ``offset + i`` of the first document column, and
        AA's column is the queries, so a part's gradients are added where its inputs are."""
        out = []
        for part in self.parts:
            column, start = part.rows_of
            row_grads = row_views(grads[column], start, part.n_queries)
            out.append((row_grads, [list(grads[c]) for c in part.columns_of]))
        return out


def _bound(options: GistOptions, columns: Sequence[Sequence[Tensor]], masks: Sequence[Sequence[Tensor]]
           ) -> tuple[tuple[Part, ...], tuple[tuple[BoundGroup, slice], ...]]:
    """The parts and the spans of the column groups: the anchors' groups in their order, then the positives'."""
    sizes = [rows(column) for column in columns]
    groups = bind_groups(options, list(range(len(columns))), sizes)[0]
    n_queries, offset = sizes[0], options.offset
    parts, spans, start = [], [], 0
    for side in ("a", "p"):
        side_groups = [g for g in groups if g.spec.row == side]
        if not side_groups:
            continue
        first = start
        for g in side_groups:
            spans.append((g, slice(start, start + g.n_cols)))
            start += g.n_cols
        column, row = (0, 0) if side == "a" else (1, offset)
        parts.append(Part(row_views(columns[column], row, n_queries), row_views(masks[column], row, n_queries),
                          [columns[g.cols] for g in side_groups], [masks[g.cols] for g in side_groups],
                          slice(first, start), (column, row), tuple(g.cols for g in side_groups)))
    spans.sort(key=lambda pair: pair[0].index)
    return tuple(parts), tuple(spans)


# The door: cgist.maxsim_loss's arguments, checked ----------------------------------------------------------------


def _token_side(value: object, mask_value: object, name: str, mask_name: str, like: Tensor | None,
                ) -> tuple[list[Tensor], list[Tensor], list[tuple[str, Tensor, Tensor]]]:
    """One column's chunks checked against their masks and ``like`` (the queries: dim, dtype, device): the chunks
    (a zero-width token axis padded to one masked token, as sentence-transformers scores it), their masks as
    contiguous bool, and each chunk with its name in messages and its mask (for ``check_finite``). One mask may cover
    a column's chunks of one token width (sentence-transformers concatenates both): its row slices are theirs."""
    chunks, masks = as_chunks(value, name), as_chunks(mask_value, mask_name)
    if len(masks) == 1 < len(chunks) and _covers(masks[0], chunks):
        masks = list(masks[0].split([x.shape[0] for x in chunks]))
    if len(masks) != len(chunks):
        raise ValueError(f"{mask_name} must have one mask per chunk of {name}, or one (rows, tokens) mask over chunks "
                         f"of one token width: got {len(masks)} masks for {len(chunks)} chunks")
    out, out_masks, named = [], [], []
    for k, (x, m) in enumerate(zip(chunks, masks)):
        where = name if len(chunks) == 1 else f"{name} chunk {k}"
        where_mask = mask_name if len(masks) == 1 else f"{mask_name} chunk {k}"
        if x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"{where} must be a floating (rows, tokens, dim) tensor of token embeddings, got "
                             f"{x.dtype} of shape {tuple(x.shape)}")
        if x.shape[2] == 0:
            raise ValueError(f"{where} has token embeddings of dim 0")
        if like is not None:
            if x.shape[2] != like.shape[2]:
                raise ValueError(f"{where} has token embeddings of dim {x.shape[2]}, but the queries' have dim "
                                 f"{like.shape[2]}")
            if x.dtype != like.dtype:
                raise ValueError(f"{where} is {x.dtype}, but the queries are {like.dtype}: pass one dtype")
            if x.device != like.device:
                raise ValueError(f"{where} is on {x.device}, but the queries are on {like.device}")
        if not isinstance(m, Tensor) or m.shape != x.shape[:2]:
            raise ValueError(f"{where_mask} must have shape {tuple(x.shape[:2])} (rows, tokens) to match {where}, got "
                             f"{tuple(getattr(m, 'shape', ()))}")
        if m.is_complex():
            raise TypeError(f"{where_mask} must be a bool (or 0/1) tensor, got {m.dtype}")
        if m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any()):
            bad = sorted(float(v) for v in m[(m != 0) & (m != 1)].unique().tolist())[:4]
            raise ValueError(f"{where_mask} must hold 0 and 1 only (True at a real token), got {bad}")
        m = m.to(device=x.device, dtype=torch.bool).contiguous()
        if x.shape[1] == 0:  # no token: one masked token scores as none does, and its gradient goes back as zeros
            x, m = F.pad(x, (0, 0, 0, 1)), F.pad(m, (0, 1))
        out.append(x)
        out_masks.append(m)
        named.append((where, x, m))
    return out, out_masks, named


def _covers(mask: Tensor, chunks: Sequence[Tensor]) -> bool:
    """Whether ``mask`` is one ``(rows, tokens)`` mask over all of ``chunks``, of its token width each."""
    return (mask.dim() == 2 and all(x.dim() == 3 and x.shape[1] == mask.shape[1] for x in chunks)
            and mask.shape[0] == rows(chunks))


def _zero_padded(columns: list[list[Tensor]], named: list[tuple[str, Tensor, Tensor]],
                 padded: set[str]) -> list[list[Tensor]]:
    """``columns`` with zeros at the masked tokens of the chunks ``check_finite`` found non-finite there only (a
    padding token is never scored; zeros keep its NaN out of the products' sums). The gradient flows back to the given
    chunk, 0 at the padding."""
    if not padded:
        return columns
    zeroed = {id(x): torch.where(m.unsqueeze(-1), x, x.new_zeros(())) for where, x, m in named if where in padded}
    return [[zeroed.get(id(x), x) for x in column] for column in columns]


def _token_columns(values: object, mask_values: object, name: str, mask_name: str,
                   like: Tensor) -> tuple[list[list[Tensor]], list[list[Tensor]], list[tuple[str, Tensor, Tensor]]]:
    """A list of token columns (``values``) and their masks, each column checked by ``_token_side``."""
    if isinstance(values, Tensor) or not isinstance(values, Sequence) or not values:
        raise TypeError(f"{name} must be a non-empty list of columns, each a tensor or a list of row chunks; got "
                        f"{type(values).__name__}")
    if isinstance(mask_values, Tensor) or not isinstance(mask_values, Sequence) or len(mask_values) != len(values):
        raise ValueError(f"{mask_name} must be a list of one mask per column of {name} ({len(values)})")
    columns, masks, named = [], [], []
    for n, (value, mask) in enumerate(zip(values, mask_values)):
        chunks, checked, more = _token_side(value, mask, f"{name}[{n}]", f"{mask_name}[{n}]", like)
        columns.append(chunks)
        masks.append(checked)
        named += more
    return columns, masks, named


def _vector_guide(guide: Sequence, heights: list[int], device: torch.device) -> list[Tensor]:
    """A single-vector guide's columns, checked (floating ``(rows, Dg)``, finite), whole and normalised in the
    compute dtype."""
    whole = []
    for n, (value, height) in enumerate(zip(guide, heights)):
        chunks = as_chunks(value, f"guide[{n}]")
        if any(c.dim() != 2 or not c.is_floating_point() for c in chunks):
            raise ValueError(f"guide[{n}] must be floating (rows, dim) embeddings like guide[0], got "
                             f"{[tuple(c.shape) for c in chunks]}")
        column = torch.cat(chunks).detach().to(device)
        dim = as_chunks(guide[0], "guide[0]")[0].shape[1]
        if column.shape[0] != height or column.shape[1] != dim or dim == 0:
            raise ValueError(f"guide[{n}] must have shape ({height}, {dim}) with a dim of at least 1, got "
                             f"{tuple(column.shape)}")
        whole.append(column)
    check_finite([(f"guide[{n}]", c) for n, c in enumerate(whole)])
    return [normalize(c, compute_dtype(whole[0].dtype))[0] for c in whole]


def _text_name(i: int) -> str:
    return "text_ids[0] (queries)" if i == 0 else f"text_ids[{i}] (documents[{i - 1}])"


def maxsim_call(queries: object, query_mask: object, documents: object, document_masks: object,
                options: GistOptions, *, guide: object = None, guide_masks: object = None,
                text_ids: object = None, temperature: Tensor | None = None,
                call_class: type[MaxSimCall] | None = None,
                parameters: Mapping[str, Tensor] | None = None) -> MaxSimCall:
    """The call of ``cgist.maxsim_loss``'s arguments, checked once (each error names the argument): shapes, masks
    (bool, or 0/1 values; any layout), dtypes, devices, finiteness, the offset's range, the text ids and the
    guide. ``options`` carries the score (``"maxsim"``, ``"mean_maxsim"``; another score over token embeddings
    passes its ``call_class``, and its own learned ``parameters`` by name), the scale (``1 / temperature``), GIST's
    rule and blocks, the offset and the budget (None: ``cgist.stage.budget.maxsim_block_bytes``)."""
    if not options.score.tokens or (call_class is None and options.score is not MAXSIM):
        raise ValueError(f"similarity={options.similarity!r} is not a MaxSim score; maxsim_call takes "
                         f"{MAXSIM.similarities}")
    q_chunks, q_masks, named = _token_side(queries, query_mask, "queries", "query_mask", None)
    first = q_chunks[0]
    n_queries = rows(q_chunks)
    if n_queries == 0:
        raise ValueError("queries must hold at least one query, got 0 rows")
    d_chunks, d_masks, more = _token_columns(documents, document_masks, "documents", "document_masks", first)
    named += more
    heights = [rows(c) for c in d_chunks]
    if len(set(heights)) > 1:
        raise ValueError(f"every document column must have the same number of rows, got {heights}")
    offset = options.offset
    if not 0 <= offset <= heights[0] - n_queries:
        raise ValueError(f"offset must be an int in [0, {heights[0] - n_queries}] (the first document column has "
                         f"{heights[0]} rows for {n_queries} queries), got {offset!r}")
    columns = _zero_padded([q_chunks, *d_chunks], named, check_finite(named))
    masks = [q_masks, *d_masks]
    ids = None
    if text_ids is not None:
        ids = check_text_ids(text_ids, [n_queries, *heights], _text_name, first.device)
    elif options.mask_duplicates:
        raise ValueError("mask_duplicates needs text_ids: one id per text of each column, equal for equal texts")
    call_class = call_class or MaxSimCall
    if options.block_bytes is None:
        lq = max(x.shape[1] for x in q_chunks)
        ld = max(x.shape[1] for column in d_chunks for x in column)
        options = options.replace(block_bytes=call_class.default_budget(options, first, lq, ld, sum(heights)))
    parts, groups = _bound(options, columns, masks)
    call = call_class(options, columns, None, learned(temperature, **(parameters or {})), masks, parts, groups, text_ids=ids,
                      budget_bytes=options.block_bytes)
    return _with_guide(call, guide, guide_masks)


#: The registry's door of the MaxSim score (``Score.door``).
door = maxsim_call


def _with_guide(call: MaxSimCall, guide: object, guide_masks: object) -> MaxSimCall:
    """``call`` with its guide (``maxsim_call``'s ``guide`` and ``guide_masks``, checked); no guide state where
    nothing masks."""
    options = call.options
    contrast = options.contrast_anchors or options.contrast_positives
    if guide is None or isinstance(guide, str):
        if guide not in (None, "self"):
            raise ValueError(f"guide must be 'self', the guide's columns or None, got {guide!r}")
        if guide_masks is not None:
            raise ValueError("guide_masks are for a multi-vector guide's (rows, tokens, dim) columns")
        kind = guide or ("none" if options.mask_duplicates or contrast else None)
        return dataclasses.replace(call, guide_kind=kind)
    heights = call.sizes
    if isinstance(guide, Tensor) or not isinstance(guide, Sequence) or len(guide) != len(heights):
        raise ValueError(f"guide must be 'self', None, or a list of the guide's columns: the queries', then the "
                         f"{len(heights) - 1} document columns' (each a tensor or a list of row chunks)")
    if as_chunks(guide[0], "guide[0]")[0].dim() == 2:  # a single-vector guide: the cosine of its embeddings
        if guide_masks is not None:
            raise ValueError("guide_masks are for a multi-vector guide's (rows, tokens, dim) columns; this guide's "
                             "columns are (rows, dim) embeddings")
        if options.guide_similarity != "cos":
            raise ValueError(f"guide_similarity={options.guide_similarity!r} scores a multi-vector guide; this "
                             "guide's columns are (rows, dim) embeddings, scored by their cosine")
        vectors = _vector_guide(guide, heights, call.device)
        return dataclasses.replace(call, guide_kind="vectors", guide_vectors=vectors, guide_dtype=vectors[0].dtype)
    tokens = _token_guide(call, guide, guide_masks)
    return dataclasses.replace(call, guide_kind="tokens", guide_tokens=tokens, guide_dtype=tokens.dtype)


def _token_guide(call: MaxSimCall, guide: Sequence, guide_masks: object) -> MaxSimCall:
    """A multi-vector guide's columns and masks, checked as the student's are, as a call over the same rows laid out
    as the student's (its scale 1, its score ``options.guide_similarity``; GIST's contrast blocks alike)."""
    options = call.options
    if isinstance(guide_masks, Tensor) or not isinstance(guide_masks, Sequence) or len(guide_masks) != len(guide):
        raise ValueError(f"a multi-vector guide needs guide_masks: one mask per guide column ({len(guide)}), each "
                         "a tensor or a list of row chunks as the column")
    if options.guide_similarity not in MAXSIM.guide_similarities:
        raise ValueError("a multi-vector guide's (rows, tokens, dim) columns are scored by MaxSim: guide_similarity "
                         f"must be one of {MAXSIM.guide_similarities}, got {options.guide_similarity!r}")
    detached = [[c.detach() for c in as_chunks(g, f"guide[{n}]")] for n, g in enumerate(guide)]
    q_chunks, q_masks, named = _token_side(detached[0], guide_masks[0], "guide[0]", "guide_masks[0]", None)
    if q_chunks[0].device != call.device:
        raise ValueError(f"guide[0] is on {q_chunks[0].device}, but the queries are on {call.device}")
    d_chunks, d_masks, more = _token_columns(detached[1:], list(guide_masks[1:]), "guide", "guide_masks", q_chunks[0])
    for n, (column, height) in enumerate(zip([q_chunks, *d_chunks], call.sizes)):
        if rows(column) != height:
            what = "the queries" if n == 0 else f"documents[{n - 1}]"
            raise ValueError(f"guide[{n}] has {rows(column)} rows, but {what} has {height}")
    named += more
    guide_options = options.replace(similarity=options.guide_similarity, guide_similarity="cos", temperature=1.0)
    columns, masks = _zero_padded([q_chunks, *d_chunks], named, check_finite(named)), [q_masks, *d_masks]
    parts, groups = _bound(guide_options, columns, masks)
    return MaxSimCall(guide_options, columns, None, {}, masks, parts, groups, budget_bytes=call.budget_bytes)


# The first-use check of the kernels (cgist.stage.dispatch.selfcheck) ---------------------------------------------

#: Queries of the check's problem: a ragged batch of a few queries covers every kernel's masking and tiles.
CHECK_ROWS = 8


@dataclass(frozen=True)
class MaxSimVariant:
    """What selects the MaxSim kernels a call compiles and the launches it runs: the device, the dtype, the fp32
    matmul precision (an fp32 call's), the token dimension, and whether its slabs are held (a guide's mask, GIST's
    contrast blocks or a learned temperature: the scores kernel and the host's softmax) or not (the forward and
    logit-gradient kernels)."""

    device: str
    dtype: torch.dtype
    precision: str
    dim: int
    held: bool

    def describe(self) -> str:
        """``float32 token embeddings (D=128), fp32 products at 'highest', held slabs``."""
        precision = f", fp32 products at {self.precision!r}" if self.precision else ""
        held = "held slabs (a guide's mask)" if self.held else "streamed softmax"
        return f"{str(self.dtype).removeprefix('torch.')} token embeddings (D={self.dim}){precision}, {held}"


def variant_of(call: MaxSimCall, device: str) -> MaxSimVariant:
    """The variant of a call on ``device`` (a device key, ``cuda:0``); reads only shapes and dtypes."""
    precision = torch.get_float32_matmul_precision() if call.dtype == torch.float32 else ""
    return MaxSimVariant(device, call.dtype, precision, call.first.shape[2],
                   call.guide_kind is not None or call.temperature is not None)


def check_problem(call: MaxSimCall, variant: MaxSimVariant, rows: int) -> MaxSimCall:
    """The first-use check's call for ``variant``: ``min(rows, CHECK_ROWS)`` ragged queries of 8 tokens against two
    columns of documents of up to 40, in the call's score and dtype, on its device. A held variant's call has a
    single-vector guide, whose scores the host computes on either path (so the two masks are one, whatever the
    rounding of the student's scores), and GIST's AA and PP blocks (the PP part's own launches)."""
    gen = torch.Generator().manual_seed(0)
    rows, lq, ld = min(rows, CHECK_ROWS), 8, 40
    device, dtype = call.device, variant.dtype

    def tokens(n: int, length: int) -> Tensor:
        return F.normalize(torch.randn(n, length, variant.dim, generator=gen), dim=-1).to(device, dtype)

    queries = tokens(rows, lq)
    documents = [tokens(rows, ld) for _ in range(2)]
    lengths = torch.randint(1, ld + 1, (2, rows), generator=gen)
    masks = [(torch.arange(ld) < lengths[n, :, None]).to(device) for n in range(2)]
    query_mask = torch.ones(rows, lq, dtype=torch.bool, device=device)
    options = GistOptions(similarity=call.options.similarity, temperature=0.25, margin=0.1, contrast_anchors=False,
                          contrast_positives=False, block_bytes=2**20)
    guide = None
    if variant.held:
        vectors = F.normalize(torch.randn(3 * rows, 16, generator=gen), dim=-1).to(device)
        guide = [vectors[:rows], vectors[rows:2 * rows], vectors[2 * rows:]]
        options = options.replace(contrast_anchors=True, contrast_positives=True)
    return maxsim_call(queries, query_mask, documents, masks, options, guide=guide)


def sample_tokens(device: torch.device, dtype: torch.dtype, dim: int, seed: int = 0
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """Two queries and two documents of three tokens, their masks and a single-vector guide of both columns: the
    arguments of a small call of a token score (``sample_calls``)."""
    gen = torch.Generator().manual_seed(seed)
    queries, documents = (torch.randn(2, 3, dim, generator=gen).to(device, dtype) for _ in range(2))
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    guide = [F.normalize(torch.randn(2, 16, generator=gen), dim=-1).to(device) for _ in range(2)]
    return queries, mask, documents, mask, guide


def sample_calls(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype, dim: int,
                 guide_dim: int) -> dict[str, MaxSimCall]:
    """A small call of each kernel variant of the score for ``dtype`` and ``dim`` (the guide's are the check
    problem's own), on ``device``, by name: streamed and held (a guide's mask). ``cgist doctor`` runs the first-use
    check of each."""
    queries, query_mask, documents, document_mask, guide = sample_tokens(device, dtype, dim)
    options = GistOptions(similarity="maxsim", contrast_anchors=False, contrast_positives=False)
    return {"maxsim": maxsim_call(queries, query_mask, [documents], [document_mask], options),
            "maxsim, guided": maxsim_call(queries, query_mask, [documents], [document_mask], options, guide=guide)}
