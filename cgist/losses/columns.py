"""A step's embeddings as the loss stage's call, one component per kind of column, which a family holds
(``FusedDropIn.columns``; docs/design.md#the-drop-in-protocol): ``DenseColumns`` (embeddings, the dense score: the GIST
and ranking families) and ``TokenColumns`` (token embeddings with their masks, the MaxSim and XTR scores: the
multi-vector families). Each reads only the ``StageBatch`` it is handed: it gathers the columns across ranks where
``batch.gather`` says so, as sentence-transformers does, and builds the call with its score's door
(``cgist.stage.spec.dense.dense_call``; a token score's door, ``Score.door``: MaxSim's or XTR's), which checks it
once. Each also embeds a plain step's batch (``embed``), as sentence-transformers' plain class of its kind does.
"""

from __future__ import annotations

import torch
from sentence_transformers.base.losses.merged_forward import embed_columns, embed_columns_padded
from sentence_transformers.util import (
    all_gather,
    all_gather_padded,
    all_gather_with_grad,
    cat_padded_token_embeddings,
    get_rank,
)
from torch import Tensor

from ..stage.spec.dense import DenseCall, dense_call
from ..stage.spec.maxsim import MaxSimCall
from .base import StageBatch, check_equal_batches

__all__ = ["DenseColumns", "TokenColumns"]


class DenseColumns:
    """The dense score's call over a step's embeddings: the family's guide (the guide's columns, ``"self"`` or None)
    and the texts' ids go with the columns; with gathering the candidates are gathered with gradients from every rank,
    and so are the anchors when a direction scores against them."""

    def call(self, batch: StageBatch) -> DenseCall:
        """The loss stage's call over ``batch`` (``StageBatch``), checked by the dense score's door."""
        options, guide, text_ids = batch.options, batch.guide, batch.text_ids
        anchors, *candidates = batch.reps
        if batch.gather:
            rows = sum(r.shape[0] for r in anchors)
            check_equal_batches(rows, anchors[0].device)
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
            options = options.replace(offset=get_rank() * rows, all_anchors=everyone)
        if batch.dims is not None:
            # MatryoshkaLoss scores normalised prefixes (its ``shrink``), so even a dot-product loss scores cosines.
            options = options.replace(matryoshka_dims=tuple(d for d, _ in batch.dims),
                                      matryoshka_weights=tuple(w for _, w in batch.dims), similarity="cos")
        return dense_call([anchors, *candidates], guide, options, text_ids=text_ids, temperature=batch.temperature)

    def embed(self, model: torch.nn.Module, features: list[dict[str, Tensor]],
              mini_batch_size: int | None) -> tuple[list[list[Tensor]], None]:
        """A plain step's embedding (``cgist.losses.steps.PlainStep``): sentence-transformers' ``embed_columns``, one
        chunk per column; no masks."""
        return [[e] for e in embed_columns(model, features)], None


class TokenColumns:
    """A token score's call (MaxSim's, XTR's) over a step's token embeddings and their masks (``batch.beside``, as
    sentence-transformers' cached multi-vector class calls ``calculate_loss(reps, masks_chunks)``): the family's
    guide (the door's ``guide`` and ``guide_masks``) and the texts' ids go with them; with gathering the document
    columns (and their guide and ids) are gathered from every rank, the token axis padded to the ranks' longest, the
    queries stay local."""

    def call(self, batch: StageBatch) -> MaxSimCall:
        """The loss stage's call over ``batch`` (``StageBatch``), checked by its score's door (``Score.door``)."""
        if batch.dims is not None:  # the multi-vector families leave Matryoshka to sentence-transformers' decoration
            raise NotImplementedError("the multi-vector loss stage computes one Matryoshka dimension per call")
        masks_chunks, options = batch.beside, batch.options
        if masks_chunks is None or len(masks_chunks) != len(batch.reps):
            raise TypeError("calculate_loss of a multi-vector drop-in takes the token embeddings' masks beside them, "
                            "one list of mini-batch masks per column (masks_chunks)")
        queries, *documents = batch.reps
        query_masks, *document_masks = (list(m) for m in masks_chunks)
        guide, text_ids = dict(batch.guide or {}), batch.text_ids
        if batch.gather:
            rows = sum(q.shape[0] for q in queries)
            check_equal_batches(rows, queries[0].device)
            gathered = [all_gather_padded(*cat_padded_token_embeddings(c, m), with_grad=True)
                        for c, m in zip(documents, document_masks)]
            documents, document_masks = [[e] for e, _ in gathered], [[m] for _, m in gathered]
            options = options.replace(offset=get_rank() * rows)
            guide = _gathered_guide(guide)
            if text_ids is not None:
                text_ids = [text_ids[0], *(all_gather(t) for t in text_ids[1:])]
        door = options.score.door()
        return door(queries, query_masks, documents, document_masks, options, temperature=batch.temperature,
                    text_ids=text_ids, **guide, **batch.score_arguments)

    def embed(self, model: torch.nn.Module, features: list[dict[str, Tensor]],
              mini_batch_size: int | None) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        """A plain step's embedding, as sentence-transformers' multi-vector class embeds a batch: the queries (each
        column's ``task`` stamped by the collator, the queries' by default), then the document columns merged, in
        chunks of ``mini_batch_size`` rows; the token embeddings and their masks, one chunk per column."""
        features = [dict(feature) for feature in features]
        query = features[0]
        outputs = model(query, task=query.get("task", "query"))
        documents, masks = embed_columns_padded(model, features[1:], mini_batch_size, task_default="document")
        return ([[outputs["token_embeddings"]], *([d] for d in documents)],
                [[outputs["attention_mask"].bool()], *([m] for m in masks)])


def _gathered_guide(guide: dict[str, object]) -> dict[str, object]:
    """The door's guide arguments with the document columns' guide gathered from every rank, as the documents are
    (the queries' stay local); a multi-vector guide's token axis padded to the ranks' longest."""
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
    return out


def _listed(value: Tensor | list[Tensor]) -> list[Tensor]:
    """A tensor or a list of row chunks, as a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
