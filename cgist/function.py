"""The public functional form of the dense score, ``gist_loss`` (and ``gist_loss_with_options``): a thin entry point
over the loss stage.

A call reads downward: its arguments become one validated call (``cgist.stage.spec.dense.dense_call``), and the
stage runs it (``cgist.stage.node.run``: the router picks the backend, the one autograd node computes the loss and,
when a student embedding needs a gradient, the embedding gradients in the same pass). It imports no backend.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .compat import NEWEST_RULES
from .stage.node import run
from .stage.spec.dense import dense_call
from .stage.spec.guide import kind_of, masks
from .stage.spec.options import ANCHOR_DIRECTIONS, GistOptions, real_number
from .stage.stats import GistStats

__all__ = ["gist_loss", "gist_loss_with_options"]


def gist_loss_with_options(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]] | str | None,
    options: GistOptions,
    *,
    backend: str = "auto",
    return_stats: bool = False,
    text_ids: Sequence[Tensor] | None = None,
    temperature: Tensor | None = None,
) -> Tensor | tuple[Tensor, GistStats]:
    """``gist_loss`` with its loss options given as one validated ``GistOptions`` (the masks already decided);
    ``temperature``: a learned temperature (a 0-dim tensor whose value ``options.temperature`` is), which gets the
    loss's derivative."""
    call = dense_call(embeddings, guide_embeddings, options, text_ids=text_ids, temperature=temperature)
    return run(call, backend, return_stats)


def gist_loss(
    embeddings: Sequence[Tensor | Sequence[Tensor]],
    guide_embeddings: Sequence[Tensor | Sequence[Tensor]] | str | None,
    *,
    temperature: float | Tensor = 0.01,
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
        temperature: divides the cosine similarities before the softmax; a 0-dim tensor that requires a gradient (a
            learned temperature, an ``nn.Parameter``) gets the loss's derivative.
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
    learned = temperature if isinstance(temperature, Tensor) and temperature.requires_grad else None
    options = GistOptions(
        temperature=real_number("temperature", temperature), margin=margin, margin_strategy=margin_strategy, contrast_anchors=contrast_anchors,
        contrast_positives=contrast_positives, mask_self=mask_self, mask_duplicates=mask_duplicates,
        directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
        hardness_strength=hardness_strength, similarity=similarity, all_anchors=all_anchors is not None,
        offset=offset, matryoshka_dims=matryoshka_dims, matryoshka_weights=matryoshka_weights, block_bytes=block_bytes,
    )
    return gist_loss_with_options(embeddings, guide_embeddings, options, backend=backend, return_stats=return_stats,
                                  text_ids=text_ids, temperature=learned)


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
