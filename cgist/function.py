"""The public functional form, ``gist_loss`` (and ``gist_loss_with_options``), and its ``torch.autograd.Function``.

A call reads downward: its arguments are checked once (``cgist.stage.spec.checks``), the backend is chosen
(``cgist.stage.dispatch``), and the autograd Function runs it. The forward computes the loss and, when any student
embedding needs a gradient, the embedding gradients in the same pass (GradCache needs them at once anyway); the
backward only scales those stored gradients by ``grad_output``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .compat import NEWEST_RULES
from .stage.dispatch.route import Backend, select_backend
from .stage.spec.checks import check_embeddings, check_text_ids, rows
from .stage.spec.guide import kind_of, masks
from .stage.spec.options import ANCHOR_DIRECTIONS, GistOptions
from .stage.stats import GistStats

__all__ = ["GistLossFunction", "gist_loss", "gist_loss_with_options"]


@dataclass(frozen=True)
class _Call:
    """What ``GistLossFunction`` takes beside the tensors: the backend, the options, each column's number of row
    chunks (``layout``, student columns first, ``n_cols`` of them), and whether to compute the embedding gradients
    and the statistics."""

    backend: Backend
    options: GistOptions
    layout: tuple[int, ...]
    n_cols: int
    need_grads: bool
    need_stats: bool


class GistLossFunction(torch.autograd.Function):
    """Autograd node: forward returns the loss and the mask counters (counts, sums); backward scales the kept
    gradients (docs/design.md#the-drop-in-protocol: the Function's contract).

    ``tensors`` are the row chunks of the student columns, then of the guide columns, as ``call.layout`` counts them.
    The backends take the columns as lists of chunks, and each chunk gets its rows of its column's gradient.
    """

    @staticmethod
    def forward(ctx, call: _Call, *tensors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        columns, start = [], 0
        for n in call.layout:
            columns.append(list(tensors[start : start + n]))
            start += n
        guide = columns[call.n_cols:] or None  # no guide columns: no guide masking
        loss, grads, counters = call.backend(columns[:call.n_cols], guide, call.options, need_grads=call.need_grads,
                                             need_stats=call.need_stats)
        ctx.chunk_rows = [[t.shape[0] for t in column] for column in columns[:call.n_cols]]
        ctx.n_guide_chunks = sum(call.layout[call.n_cols:])
        if grads is not None:
            ctx.save_for_backward(*grads)
        counts, sums = counters if counters is not None else (loss.new_zeros(0, dtype=torch.int64), loss.new_zeros(0))
        ctx.mark_non_differentiable(counts, sums)
        return loss, counts, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor, _grad_counts: Tensor, _grad_sums: Tensor) -> tuple[Tensor | None, ...]:
        grads = [chunk for g, sizes in zip(ctx.saved_tensors, ctx.chunk_rows)
                 for chunk in (g * grad_output.to(g.dtype)).split(sizes)]
        return (None, *grads, *([None] * ctx.n_guide_chunks))  # no gradient for the call, nor for the guide


def gist_loss_with_options(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]] | str | None,
    options: GistOptions,
    *,
    backend: str = "auto",
    return_stats: bool = False,
    text_ids: Sequence[Tensor] | None = None,
) -> Tensor | tuple[Tensor, GistStats]:
    """``gist_loss`` with its loss options given as one validated ``GistOptions`` (the masks already decided)."""
    source = kind_of(guide_embeddings)
    student, guide = check_embeddings(embeddings, guide_embeddings if source == "embeddings" else None, options)
    if options.mask_duplicates and text_ids is None:
        raise ValueError("mask_duplicates=True needs text_ids: one id per row of each column, equal for equal texts")
    # Text ids decide the guide's ties (cgist.stage.ties.tie_ids) as well as the duplicates that mask_duplicates masks.
    ids = check_text_ids(text_ids, student, options.all_anchors) if text_ids is not None else None
    if source == "self":  # the student's own vectors, detached, are the guide
        guide = student
    guide_dtype = guide[0][0].dtype if guide is not None else student[0][0].dtype
    run = select_backend(backend, student[0][0].device, student[0][0].dtype, guide_dtype)
    if ids is not None:
        run = functools.partial(run, text_ids=ids)
    need_grads = torch.is_grad_enabled() and any(t.requires_grad for column in student for t in column)
    guide = [[g.detach() for g in column] for column in guide or []]
    layout = tuple(len(column) for column in student + guide)
    flat = [t for column in student + guide for t in column]
    call = _Call(run, options, layout, len(student), need_grads, return_stats)
    loss, counts, sums = GistLossFunction.apply(call, *flat)
    if not return_stats:
        return loss
    stats = GistStats.from_counters(counts, sums, batch=rows(student[0]), n_cand=rows(student[1]),
                                    n_negatives=len(student) - 2 - options.all_anchors, options=options,
                                    guided=bool(guide), n_anchors=rows(student[-1] if options.all_anchors else student[0]))
    return loss, stats


def gist_loss(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]] | str | None,
    *,
    temperature: float = 0.01,
    margin: float = 0.0, margin_strategy: str = "absolute",
    contrast_anchors: bool = True, contrast_positives: bool = True,
    mask_self: bool | None = None, mask_duplicates: bool | None = None, text_ids: Sequence[Tensor] | None = None,
    directions: Sequence[str] = ("query_to_doc",), partition_mode: str = "joint",
    hardness_mode: str | None = None, hardness_strength: float = 0.0,
    similarity: str = "cos",
    all_anchors: Tensor | Sequence[Tensor] | None = None, all_anchors_guide: Tensor | Sequence[Tensor] | None = None,
    all_anchors_text_ids: Tensor | None = None,
    offset: int = 0,
    matryoshka_dims: Sequence[int] | None = None, matryoshka_weights: Sequence[float] | None = None,
    block_bytes: int | None = None,
    backend: str = "auto",
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, GistStats]:
    """GIST loss of sentence-transformers' ``CachedGISTEmbedLoss``, over embeddings.

    Args:
        embeddings: ``[anchor (B x D), positive (N x D), *negatives (N x D)]`` from the student. A column
            may also be a list of tensors stacked by rows (GradCache's mini-batches): it is never
            concatenated into a copy on the PyTorch path, and each chunk gets its rows of the gradient.
        guide_embeddings: what masks false negatives: the same columns embedded by the guide, in any dimension
            Dg (never differentiated); ``"self"``, the student's own embeddings, detached; or None, no guide
            masking (InfoNCE over the chosen blocks).
        temperature: divides the cosine similarities before the softmax.
        margin, margin_strategy: candidate j of anchor i is masked when its guide score is strictly greater
            than ``theta_i - margin`` ("absolute") or ``theta_i - |theta_i| * margin`` ("relative"), where
            ``theta_i`` is the guide score of anchor i with its positive.
        contrast_anchors, contrast_positives: add the anchor-anchor and positive-positive blocks.
        mask_self: always exclude the self-pairs AA[i, i] and PP[i, offset + i] (default: on, the rule of
            sentence-transformers 6.3 and later; False leaves them to the guide, as 6.2 does).
        mask_duplicates: exclude every candidate whose text is that of anchor i or of its positive, whatever the
            scores (the label stays); needs ``text_ids``. Default: on for ``"self"`` and None when ``text_ids``
            are given, else off.
        text_ids: one integer tensor per column, one id per row, equal exactly for equal texts (e.g.
            ``cgist.stage.ties.token_fingerprints`` of the token ids); gathered like the candidates. When given, they
            also decide the guide's ties: a candidate with the text of theta_i's partner scores theta_i exactly,
            however its guide vector was rounded (``cgist.stage.ties.tie_ids``); without them, equal guide vectors do.
        directions, partition_mode, hardness_mode, hardness_strength: sentence-transformers'
            ``MultipleNegativesRankingLoss`` options, with the guide's mask on every block: see
            ``cgist.GistOptions``. ``"query_to_query"`` and ``"doc_to_query"`` score against every rank's
            anchors, ``all_anchors`` (N rows, this rank's at ``offset``; with a guide also ``all_anchors_guide``,
            with duplicates masked ``all_anchors_text_ids``), or, without them, against this rank's.
        similarity: ``"cos"`` (cosine) or ``"dot"`` (dot product) for the student; the guide always uses cosines.
        offset: global row of this rank's first anchor among the candidates; anchor i's positive is
            candidate ``offset + i`` (``rank * B`` when candidates are gathered across ranks).
        matryoshka_dims, matryoshka_weights: the loss ``sum_d w_d * L_d`` of sentence-transformers'
            ``MatryoshkaLoss`` over these dimensions (student truncated to d and renormalised, guide as is),
            computed in one pass: the guide's scores and mask once, the student's from prefixes.
        block_bytes: bytes of score buffers held at once (None: a default for the device).
        backend: "auto" (Triton on NVIDIA GPUs of sm_80 and newer, the PyTorch streaming path elsewhere, and
            in place of a kernel that fails to build or launch; the environment variable ``CGIST_BACKEND``
            overrides it), "torch" or "triton" (which raises where the kernels cannot run).
        return_stats: also return a ``GistStats`` of what was masked (one more host sync).

    Returns:
        The mean loss over anchors as a 0-dim tensor (float64 for float64 inputs, else float32),
        differentiable with respect to ``embeddings``; with ``return_stats``, ``(loss, stats)``.
    """
    source = kind_of(guide_embeddings)
    mask_self, mask_duplicates = masks(source, mask_self, mask_duplicates, text_ids is not None,
                                       self_pairs_excluded=NEWEST_RULES.self_pairs_excluded)
    if all_anchors is not None:
        embeddings, guide_embeddings, text_ids = _with_all_anchors(
            embeddings, guide_embeddings, text_ids, all_anchors, all_anchors_guide, all_anchors_text_ids,
            source=source, directions=directions)
    options = GistOptions(
        temperature=temperature, margin=margin, margin_strategy=margin_strategy, contrast_anchors=contrast_anchors,
        contrast_positives=contrast_positives, mask_self=mask_self, mask_duplicates=mask_duplicates,
        directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
        hardness_strength=hardness_strength, similarity=similarity, all_anchors=all_anchors is not None,
        offset=offset, matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights, block_bytes=block_bytes,
    )
    return gist_loss_with_options(embeddings, guide_embeddings, options, backend=backend, return_stats=return_stats,
                                  text_ids=text_ids)


def _with_all_anchors(embeddings: Sequence, guide_embeddings: object, text_ids: Sequence[Tensor] | None,
                      all_anchors: object, all_anchors_guide: object, all_anchors_text_ids: Tensor | None, *,
                      source: str | None, directions: Sequence[str]) -> tuple:
    """``gist_loss``'s columns with every rank's anchors appended as the last column, checked: ``all_anchors`` to the
    student's, ``all_anchors_guide`` to the guide's when they are embeddings, ``all_anchors_text_ids`` to the text
    ids when they are given."""
    if not any(direction in ANCHOR_DIRECTIONS for direction in directions):
        raise ValueError(f"all_anchors is only read by the directions {ANCHOR_DIRECTIONS}")
    if source == "embeddings" and all_anchors_guide is None:
        raise ValueError("all_anchors needs all_anchors_guide: the guide's embeddings of the same anchors")
    if text_ids is not None and all_anchors_text_ids is None:
        raise ValueError("all_anchors with text_ids needs all_anchors_text_ids: the text ids of the same anchors")
    embeddings = [*embeddings, all_anchors]
    if source == "embeddings":
        guide_embeddings = [*guide_embeddings, all_anchors_guide]
    if text_ids is not None:
        text_ids = [*text_ids, all_anchors_text_ids]
    return embeddings, guide_embeddings, text_ids
