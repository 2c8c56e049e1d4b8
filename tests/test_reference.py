"""cgist.stage.reference: the dense oracle against sentence-transformers' ``CachedGISTEmbedLoss.calculate_loss``.

The streaming path, ``gist_loss`` and ``FusedCachedGISTLoss.calculate_loss`` are compared on the same
inputs, all in float64, with the installed release's rule for the self-pairs (``cgist.compat.release_rules``).

Embeddings are random, with positives and negatives drawn near their anchors so that the guide masks
some candidates and keeps others. They are passed as uneven mini-batches of leaf tensors, as the
GradCache loop does, and the loss and the gradient of every leaf are compared. Other ranks of a
``gather_across_devices`` run are simulated by patching ``all_gather_with_grad`` and ``get_rank``.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch
from helpers import assert_close, loss_kwargs, one_thread, tolerance  # noqa: F401  (one_thread: autouse)
from helpers_models import computed_on
from sentence_transformers.sentence_transformer.losses import CachedGISTEmbedLoss
from sentence_transformers.sentence_transformer.losses import cached_gist_embed as st_module

import cgist.losses.columns
from cgist import FusedCachedGISTLoss, GistOptions, gist_loss
from cgist.compat import release_rules
from cgist.stage.dispatch.direct import loss_and_grads
from cgist.stage.reference import gist_loss_reference

D, DG = 24, 16
MINI_BATCH = 5


@dataclass(frozen=True)
class Case:
    options: GistOptions = GistOptions()
    batch: int = 13
    negatives: int = 1
    rank: int = 0
    world: int = 1
    gather: bool = False
    duplicates: bool = False

    @property
    def id(self) -> str:
        o = self.options
        flags = f"aa{int(o.contrast_anchors)}-pp{int(o.contrast_positives)}"
        where = f"r{self.rank}of{self.world}" if self.gather else "local"
        dup = "-dup" if self.duplicates else ""
        return (
            f"B{self.batch}-N{self.batch * self.world}-D{D}-k{self.negatives}-m{o.margin:+g}-{o.margin_strategy[:3]}"
            f"-{flags}-t{o.temperature:g}-{where}{dup}-fp64"
        )


# (rank, world, gather): single device, rank 0 of 2, and two ranks > 0 of 3.
PLACEMENTS = [(0, 1, False), (0, 2, True), (1, 3, True), (2, 3, True)]
TEMPERATURES = [0.01, 0.05, 1.0]


def _cases() -> list[Case]:
    """Every margin x strategy x contrast combination; k, placement and temperature cycle through theirs."""
    grid = itertools.product([0.0, 0.1, -0.1], ["absolute", "relative"], [True, False], [True, False])
    cases = []
    for n, (margin, strategy, aa, pp) in enumerate(grid):
        rank, world, gather = PLACEMENTS[n % len(PLACEMENTS)]
        options = GistOptions(
            temperature=TEMPERATURES[n % len(TEMPERATURES)], margin=margin, margin_strategy=strategy,
            contrast_anchors=aa, contrast_positives=pp,
        )
        cases.append(Case(options, negatives=n % 4, rank=rank, world=world, gather=gather))
    for rank, world, gather in PLACEMENTS:
        for margin in (0.0, 0.1):
            cases.append(Case(GistOptions(margin=margin), negatives=2, rank=rank, world=world, gather=gather, duplicates=True))
    cases += [Case(GistOptions(margin=0.1), batch=1, negatives=3, rank=1, world=2, gather=True), Case(batch=7, negatives=0)]
    return cases


CASES = _cases()


def _near(base: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Rows of ``base`` plus noise of a random per-row scale, so guide scores spread around the thresholds."""
    scale = torch.empty(base.shape[0], 1, dtype=base.dtype).uniform_(0.2, 2.0, generator=gen)
    return base + scale * torch.randn(base.shape, dtype=base.dtype, generator=gen)


def _embeddings(case: Case, dim: int, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Local columns [anchor, positive, *negatives] (B x dim each) and the gathered candidates (BW x dim)."""
    anchors = torch.randn(case.batch, dim, dtype=torch.float64, generator=gen)
    local = [anchors] + [_near(anchors, gen) for _ in range(1 + case.negatives)]
    if case.duplicates:
        # Duplicate texts: anchor 2 repeats anchor 0, positive 1 repeats positive 0, a negative repeats it too.
        local[0][2 % case.batch] = local[0][0]
        local[1][1 % case.batch] = local[1][0]
        local[-1][3 % case.batch] = local[1][0]
    gathered = []
    for column in local[1:]:
        others = [_near(torch.randn_like(column), gen) for _ in range(case.world - 1)]
        gathered.append(torch.cat([*others[: case.rank], column, *others[case.rank :]]))
    return local, gathered


def _leaves(columns: list[torch.Tensor], requires_grad: bool) -> list[list[torch.Tensor]]:
    """Each column as mini-batches of MINI_BATCH rows (the last one shorter), as fresh leaf tensors."""
    return [[mb.clone().requires_grad_(requires_grad) for mb in c.split(MINI_BATCH)] for c in columns]


def _insert(full: torch.Tensor, local: torch.Tensor, case: Case) -> torch.Tensor:
    """``full`` (BW rows) with rows rank * B ... (rank + 1) * B replaced by ``local``, keeping its autograd graph."""
    lo, hi = case.rank * case.batch, (case.rank + 1) * case.batch
    return torch.cat([full[:lo], local, full[hi:]])


def _patch_gather(monkeypatch, module, case: Case, gathered: list[torch.Tensor]) -> None:
    """Make ``module``'s gather put the local rows at rank * B among the other ranks' rows, in call order."""
    calls = iter(gathered)

    def all_gather_with_grad(local: torch.Tensor) -> torch.Tensor:
        full = next(calls)
        assert full.shape[1] == local.shape[1]
        return _insert(full, local, case)

    monkeypatch.setattr(module, "all_gather_with_grad", all_gather_with_grad)
    monkeypatch.setattr(module, "get_rank", lambda: case.rank)


def _run_loss_object(loss_obj, module, monkeypatch, case, local, local_guide, gathered, gathered_guide):
    """``loss_obj.calculate_loss(..., with_backward=True)``: (loss, gradient of every leaf, column-wise)."""
    _patch_gather(monkeypatch, module, case, gathered + gathered_guide)
    reps = _leaves(local, True)
    with computed_on(loss_obj):
        loss = loss_obj.calculate_loss(reps, _leaves(local_guide, False), with_backward=True)
    assert not loss.requires_grad
    return loss, [torch.cat([leaf.grad for leaf in column]) for column in reps]


def _check(case: Case, models, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    local, gathered = _embeddings(case, D, gen)
    local_guide, gathered_guide = _embeddings(case, DG, gen)
    tol = tolerance("embeddings", "fp64")
    names = ["anchor", "positive", *[f"negative {n + 1}" for n in range(case.negatives)]]

    st_loss, st_grads = _run_loss_object(
        CachedGISTEmbedLoss(*models, mini_batch_size=MINI_BATCH, gather_across_devices=case.gather, **loss_kwargs(case.options)),
        st_module, monkeypatch, case, local, local_guide, gathered, gathered_guide,
    )
    assert torch.isfinite(st_loss)

    # Dense oracle through autograd, on the gathered candidates.
    student = [c.clone().requires_grad_() for c in local]
    candidates = [_insert(g, s, case) for g, s in zip(gathered, student[1:])] if case.gather else student[1:]
    guide = [local_guide[0], *(gathered_guide if case.gather else local_guide[1:])]
    offset = case.rank * case.batch if case.gather else 0
    # The installed release's rule for the self-pairs (cgist.compat.RELEASE_RULES), which the drop-in follows by default.
    mask_self = release_rules().self_pairs_excluded
    options = case.options.replace(offset=offset, mask_self=mask_self)
    ref_loss = gist_loss_reference([student[0], *candidates], guide, options)
    ref_loss.backward()
    assert_close("oracle vs ST", (st_loss, dict(zip(names, st_grads))),
                 (ref_loss, {name: ref.grad for name, ref in zip(names, student)}), tol)

    fused_loss, fused_grads = _run_loss_object(
        FusedCachedGISTLoss(*models, mini_batch_size=MINI_BATCH, gather_across_devices=case.gather, **loss_kwargs(case.options)),
        cgist.losses.columns, monkeypatch, case, local, local_guide, gathered, gathered_guide,
    )
    assert all(torch.isfinite(fused).all() for fused in fused_grads)
    assert_close("fused vs ST", (st_loss, dict(zip(names, st_grads))), (fused_loss, dict(zip(names, fused_grads))),
                 tol)

    # The functional form, and the streaming path on a 1-byte budget (two passes over one-column tiles; the batch,
    # below ROW_FLOOR rows, is one row block), on the already gathered inputs.
    candidates = [c.detach() for c in candidates]
    functional = gist_loss([local[0], *candidates], guide, offset=offset, backend="torch", mask_self=mask_self,
                           **loss_kwargs(case.options))
    assert_close("functional vs ST", st_loss, functional, tol[0])
    stream_loss, stream_grads, _ = loss_and_grads(
        "torch", [local[0], *candidates], guide, options.replace(block_bytes=1), need_grads=True
    )
    lo, hi = offset, offset + case.batch
    local_rows = {name: stream if name == "anchor" else stream[lo:hi] for name, stream in zip(names, stream_grads)}
    assert_close("streaming vs ST", (st_loss, dict(zip(names, st_grads))), (stream_loss, local_rows), tol)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_sentence_transformers(case, student, tiny_guide, monkeypatch):
    """The tiny models only construct the loss objects: every loss here is computed on the case's embeddings."""
    _check(case, (student, tiny_guide), monkeypatch)
