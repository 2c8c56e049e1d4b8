"""A step's embeddings as the loss stage's call, one piece per kind of column (docs/design.md#the-drop-in-protocol):
``DenseColumns`` (embeddings, the dense score: the GIST and ranking families) and ``TokenColumns`` (token embeddings
with their masks, the MaxSim and XTR scores: the multi-vector families). Each gathers its columns across ranks with
``gather_across_devices``, as sentence-transformers does, and builds the call with its score's door
(``cgist.stage.spec.dense.dense_call``; a token score's door, ``Score.door``: MaxSim's or XTR's), which checks it
once.
"""

from __future__ import annotations

import abc
import functools

import torch
import torch.nn.functional as F
from sentence_transformers.base.losses.merged_forward import embed_columns, embed_columns_padded
from sentence_transformers.util import (
    all_gather,
    all_gather_padded,
    all_gather_with_grad,
    cat_padded_token_embeddings,
    get_rank,
    stack_padded_token_embeddings,
)
from torch import Tensor

from ..stage.spec.dense import DenseCall, dense_call
from ..stage.spec.maxsim import MaxSimCall
from ..stage.spec.options import GistOptions
from .base import FusedDropIn, check_equal_batches

__all__ = ["DenseColumns", "TokenColumns"]

_NO_TEXT_IDS = ("mask_duplicates needs the batch's token ids: call the loss on the batch's features (calculate_loss "
                "alone does not see them), or pass mask_duplicates=False")


class DenseColumns(FusedDropIn):
    """The dense score's call over a step's embeddings: the family's guide (``_guide_columns``: the guide's columns,
    ``"self"`` or None) and the texts' ids go with the columns; with gathering the candidates are gathered with
    gradients from every rank, and so are the anchors when a direction scores against them."""

    def _stage_call(self, reps: list[list[Tensor]], reps_guided: object, options: GistOptions,
                    dims: tuple[tuple[int, float], ...] | None, temperature: Tensor | None) -> DenseCall:
        guide = self._guide_columns(reps, reps_guided)
        text_ids = self.step_inputs.text_ids
        if options.mask_duplicates and text_ids is None:
            raise ValueError(_NO_TEXT_IDS)
        anchors, *candidates = (list(r) for r in reps)
        if self.gather_across_devices:
            batch = sum(r.shape[0] for r in anchors)
            check_equal_batches(batch, anchors[0].device)
            everyone = options.reads_anchors
            candidates = [all_gather_with_grad(torch.cat(c)) for c in candidates]
            if everyone:  # every rank's anchors, as one more column
                candidates.append(all_gather_with_grad(torch.cat(anchors)))
            if isinstance(guide, list):  # the guide model's mini-batches, or the label column's whole columns
                whole = [torch.cat(c) if isinstance(c, (list, tuple)) else c for c in guide]
                gathered = [all_gather_with_grad(c) for c in whole[1:]]
                guide = [guide[0], *gathered, *([all_gather_with_grad(whole[0])] if everyone else [])]
            if text_ids is not None:
                text_ids = [text_ids[0], *(all_gather(t) for t in text_ids[1:]),
                            *([all_gather(text_ids[0])] if everyone else [])]
            options = options.replace(offset=get_rank() * batch, all_anchors=everyone)
        if dims is not None:
            # MatryoshkaLoss scores normalised prefixes (its ``shrink``), so even a dot-product loss scores cosines.
            options = options.replace(matryoshka_dims=tuple(d for d, _ in dims),
                                      matryoshka_weights=tuple(w for _, w in dims), similarity="cos")
        return dense_call([anchors, *candidates], guide, options, text_ids=text_ids, temperature=temperature)

    def _guide_columns(self, reps: list[list[Tensor]], reps_guided: object) -> list | str | None:
        """The family: the guide the fused stage takes (``gist_loss``'s ``guide_embeddings``), checked; default
        None (no guide)."""
        return None

    def _embed(self, features: list[dict[str, Tensor]], labels: Tensor | None) -> tuple[list[list[Tensor]], object]:
        """A plain step's embedding (``cgist.losses.steps.PlainStep``): sentence-transformers' ``embed_columns``, and
        the family's ``_plain_reps_guided``."""
        # As sentence-transformers does: a guide reads copies made before the student writes its outputs into the
        # features.
        copies = [dict(feature) for feature in features]
        embeddings = embed_columns(self.model, features)
        return [[e] for e in embeddings], self._plain_reps_guided(features, copies, embeddings, labels)

    def _plain_reps_guided(self, features: list[dict[str, Tensor]], copies: list[dict[str, Tensor]],
                           embeddings: list[Tensor], labels: Tensor | None) -> object:
        """The family: what a plain step's ``calculate_loss`` takes beside the student's embeddings (default: the
        labels)."""
        return labels


class TokenColumns(FusedDropIn):
    """A token score's call (MaxSim's, XTR's) over a step's token embeddings and their masks (``calculate_loss(reps,
    masks_chunks)``, as sentence-transformers' cached multi-vector class calls it): the family's guide
    (``_guide_arguments``) and the texts' ids go with them; with gathering the document columns (and their guide and
    ids) are gathered from every rank, the token axis padded to the ranks' longest, the queries stay local."""

    # Its own dimensions are a loss per dimension (sentence-transformers' decoration), each fused.
    fuses_matryoshka = False

    def _stage_call(self, reps: list[list[Tensor]], masks_chunks: object, options: GistOptions,
                    dims: tuple[tuple[int, float], ...] | None, temperature: Tensor | None) -> MaxSimCall:
        if dims is not None:  # fuses_matryoshka is off: sentence-transformers' decoration calls once per dimension
            raise NotImplementedError("the multi-vector loss stage computes one Matryoshka dimension per call")
        if masks_chunks is None or len(masks_chunks) != len(reps):
            raise TypeError("calculate_loss of a multi-vector drop-in takes the token embeddings' masks beside them, "
                            "one list of mini-batch masks per column (masks_chunks)")
        queries, *documents = (list(r) for r in reps)
        query_masks, *document_masks = (list(m) for m in masks_chunks)
        guide = self._guide_arguments(reps, options)
        if options.mask_duplicates and guide.get("text_ids") is None:
            raise ValueError(_NO_TEXT_IDS)
        if self.gather_across_devices:
            batch = sum(q.shape[0] for q in queries)
            check_equal_batches(batch, queries[0].device)
            gathered = [all_gather_padded(*cat_padded_token_embeddings(c, m), with_grad=True)
                        for c, m in zip(documents, document_masks)]
            documents, document_masks = [[e] for e, _ in gathered], [[m] for _, m in gathered]
            options = options.replace(offset=get_rank() * batch)
            guide = _gathered_guide(guide)
        door = options.score.door()
        return door(queries, query_masks, documents, document_masks, options, temperature=temperature, **guide,
                    **self._score_arguments())

    def _guide_arguments(self, reps: list[list[Tensor]], options: GistOptions) -> dict[str, object]:
        """The family: the door's ``guide``, ``guide_masks`` and ``text_ids`` for a step (default: none)."""
        return {}

    @abc.abstractmethod
    def _score_arguments(self) -> dict[str, object]:
        """The family: the door's arguments of the score itself, such as a learned parameter of its scorer."""

    def _embed(self, features: list[dict[str, Tensor]], labels: Tensor | None) -> tuple[list[list[Tensor]], object]:
        """A plain step's embedding, as sentence-transformers' multi-vector class embeds a batch: the queries (each
        column's ``task`` stamped by the collator, the queries' by default), then the document columns merged, in
        chunks of ``mini_batch_size`` rows; the token embeddings and their masks, one chunk per column."""
        features = [dict(feature) for feature in features]
        query = features[0]
        outputs = self.model(query, task=query.get("task", "query"))
        documents, masks = embed_columns_padded(self.model, features[1:], self.mini_batch_size,
                                                task_default="document")
        return ([[outputs["token_embeddings"]], *([d] for d in documents)],
                [[outputs["attention_mask"].bool()], *([m] for m in masks)])

    def _embeddings_loss(self, reps: list[list[Tensor]], masks_chunks: object) -> Tensor:
        """sentence-transformers' scoring and cross-entropy over given token embeddings (its multi-vector class's
        ``forward`` after the embedding): the plain drop-ins' unfused loss."""
        (queries, query_mask), *columns = (cat_padded_token_embeddings(r, m) for r, m in zip(reps, masks_chunks))
        documents, masks = [e for e, _ in columns], [m for _, m in columns]
        batch = queries.shape[0]
        if self.gather_across_devices:
            gathered = [all_gather_padded(e, m, with_grad=True) for e, m in zip(documents, masks)]
            documents, masks = [e for e, _ in gathered], [m for _, m in gathered]
        stacked, stacked_mask = stack_padded_token_embeddings(documents, masks)
        score = self.similarity_fct or functools.partial(_model_scores, self.model)
        step = self.score_mini_batch_size or batch
        scores = torch.cat([score(queries[i:i + step], stacked, queries_mask=query_mask[i:i + step],
                                  documents_mask=stacked_mask) for i in range(0, batch, step)])
        labels = torch.arange(batch, device=queries.device) * len(documents)
        if self.gather_across_devices:
            labels = labels + get_rank() * batch * len(documents)
        return F.cross_entropy(scores * self.scale, labels)


def _gathered_guide(guide: dict[str, object]) -> dict[str, object]:
    """The door's guide arguments with the document columns' guide and text ids gathered from every rank, as
    the documents are (the queries' stay local); a multi-vector guide's token axis padded to the ranks' longest."""
    out = dict(guide)
    columns = guide.get("guide")
    if isinstance(columns, list):
        if guide.get("guide_masks") is None:
            out["guide"] = [columns[0], *(all_gather(torch.cat(_listed(c))) for c in columns[1:])]
        else:
            gathered = [all_gather_padded(*cat_padded_token_embeddings(_listed(c), _listed(m)))
                        for c, m in zip(columns[1:], guide["guide_masks"][1:])]
            out["guide"] = [columns[0], *(e for e, _ in gathered)]
            out["guide_masks"] = [guide["guide_masks"][0], *(m for _, m in gathered)]
    if guide.get("text_ids") is not None:
        out["text_ids"] = [guide["text_ids"][0], *(all_gather(t) for t in guide["text_ids"][1:])]
    return out


def _model_scores(model: torch.nn.Module, queries: Tensor, documents: Tensor, **masks: Tensor) -> Tensor:
    """sentence-transformers 6.3's default score: the model's similarity over the stacked documents."""
    from sentence_transformers.multi_vector_encoder.scoring.colbert import _colbert_scores

    return _colbert_scores(model.similarity, queries, documents, **masks)


def _listed(value: Tensor | list[Tensor]) -> list[Tensor]:
    """A tensor or a list of row chunks, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
