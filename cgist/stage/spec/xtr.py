"""The XTR score's part of the problem model (``similarity`` ``"xtr"``, over token embeddings;
docs/design.md#xtr): its call (``XTRCall``), its rule, its option's check, its door (``xtr_call``) and its first-use
check; the thresholds' sweep, which both backends run as it is, is ``cgist.stage.xtr_thresholds``'.

sentence-transformers' XTR (``multi_vector_encoder.scoring.xtr_scores``): each query token keeps its ``top_k``
similarities among every real document token of the call (every column, gathered across ranks where the columns
are); document ``j``'s score is the sum over query ``i``'s real tokens of its retrieved per-token maxima, divided by
``Z``, how many of those tokens retrieved at least one of its tokens (at least 1); a similarity not retrieved counts 0;
a document without a real token scores ``EMPTY_DOCUMENT_SCORE``. With ``m_tj`` the maximum over document ``j``'s
real tokens of ``q_t . d`` and ``tau_t`` the ``top_k``-th largest similarity of query token ``t`` over the pool, a
token of ``j`` is retrieved for ``t`` exactly when ``m_tj >= tau_t`` (``cgist.stage.xtr_thresholds.retrieved``), so

    score_ij = sum_t m_tj [m_tj >= tau_t] / max(1, sum_t [m_tj >= tau_t])      over query i's real tokens t.

So XTR is MaxSim's tiles and kernels with another reduction of the maxima, after one sweep that finds ``tau``. Ties at
``tau_t``: every token whose similarity equals ``tau_t`` is retrieved, and so is one within the products' rounding
bound below it (``cgist.stage.xtr_thresholds.tie_slack``); sentence-transformers' ``torch.topk`` keeps ``top_k`` of the tied tokens, which ones
unspecified. The backward is MaxSim's through the retrieved maxima only: ``tau`` and
``Z`` are constant almost everywhere. It imports only torch and the spec.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..budget import xtr_block_bytes
from ..numerics import compute_dtype
from .maxsim import MaxSimCall, maxsim_call, sample_tokens
from .options import GistOptions
from .scores import XTR

__all__ = ["CHECK_TOP_K", "XTRVariant", "XTRCall", "check_options", "check_problem", "door", "sample_calls", "variant_of",
           "xtr_call"]

@dataclass(frozen=True)
class XTRCall(MaxSimCall):
    """A call of the XTR score: a MaxSim call (one part: the queries against the document columns; GIST's contrast
    blocks are not defined for XTR) whose tiles reduce the maxima by XTR's rule, with its ``top_k``
    (``options.score_options``)."""

    @property
    def top_k(self) -> int:
        return self.options.score_options["top_k"]

    @staticmethod
    def default_budget(options: GistOptions, first: Tensor, query_tokens: int, document_tokens: int,
                       n_documents: int) -> int:
        """The budget of a call without ``block_bytes``: ``cgist.stage.budget.xtr_block_bytes``."""
        acc = torch.empty(0, dtype=compute_dtype(first.dtype)).element_size()
        return xtr_block_bytes(first.device, query_tokens, document_tokens, first.shape[2], n_documents,
                               options.score_options["top_k"], first.element_size(), acc)


def check_options(options: GistOptions) -> dict[str, object]:
    """XTR's own option (``Score.check_options``): ``top_k``, a positive int, which XTR needs."""
    top_k = options.score_options["top_k"]
    if top_k is None:
        raise ValueError(f"similarity={options.similarity!r} needs top_k, the number of document tokens each query "
                         "token retrieves")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    return {"top_k": int(top_k)}


def xtr_call(queries: object, query_mask: object, documents: object, document_masks: object, options: GistOptions,
             *, guide: object = None, guide_masks: object = None, text_ids: object = None,
             temperature: Tensor | None = None) -> XTRCall:
    """The call of ``cgist.maxsim_loss``'s arguments with ``top_k`` (XTR), checked once as ``maxsim_call`` checks
    MaxSim's: GIST's contrast blocks are refused (XTR retrieves from the documents' tokens; a block of queries or of
    positives has no pool defined)."""
    if options.score is not XTR:
        raise ValueError(f"similarity={options.similarity!r} is not XTR")
    if options.contrast_anchors or options.contrast_positives:
        raise ValueError("contrast_anchors and contrast_positives are not defined for XTR scoring (a query token "
                         "retrieves from the documents' tokens only): pass them False, or score with MaxSim")
    return maxsim_call(queries, query_mask, documents, document_masks, options, guide=guide, guide_masks=guide_masks,
                       text_ids=text_ids, temperature=temperature, call_class=XTRCall)


#: The registry's door of the XTR score (``Score.door``).
door = xtr_call


# The first-use check of the kernels (cgist.stage.dispatch.selfcheck) ---------------------------------------------

#: The check problem's ``top_k``: a few of its documents' tokens, so that the thresholds cut.
CHECK_TOP_K = 5


@dataclass(frozen=True)
class XTRVariant:
    """What selects the XTR launches: those of MaxSim's held slabs (its scores and gradient kernels) with XTR's
    thresholds, by device, dtype, fp32 matmul precision and dimension."""

    device: str
    dtype: torch.dtype
    precision: str
    dim: int

    def describe(self) -> str:
        """``float32 token embeddings (D=128), XTR, fp32 products at 'highest'``."""
        precision = f", fp32 products at {self.precision!r}" if self.precision else ""
        return f"{str(self.dtype).removeprefix('torch.')} token embeddings (D={self.dim}), XTR{precision}"


def variant_of(call: XTRCall, device: str) -> XTRVariant:
    """The variant of a call on ``device`` (a device key, ``cuda:0``); reads only shapes and dtypes."""
    precision = torch.get_float32_matmul_precision() if call.dtype == torch.float32 else ""
    return XTRVariant(device, call.dtype, precision, call.first.shape[2])


def check_problem(call: XTRCall, variant: XTRVariant, rows: int) -> XTRCall:
    """The first-use check's call for ``variant``: eight ragged queries of 8 tokens against two columns of documents
    of up to 40, ``CHECK_TOP_K`` retrieved per query token, with a single-vector guide (its scores the host's on
    either path, so both masks are one), in the call's dtype, on its device.

    The tokens' entries are -1, 0 or 1 (a quarter of them non-zero), so every product is a small integer, exact in
    every dtype and on every path: the thresholds' sweep and either backend's tiles retrieve the same tokens, ties
    (which are many) included, whatever their summation order. Each document's last real token is twice the longest
    token of the query of its row, its largest product by far (``2 |q|^2`` against at most ``|q|^2``, retrieved), so
    that a kernel that stops a document one token short moves the scores; and the temperature, 0.25, spreads the
    logits over several units, so that a scale off by 0.2% moves the loss and its gradients beyond the tolerance."""
    gen = torch.Generator().manual_seed(1)
    rows, lq, ld = min(rows, 8), 8, 40
    device, dtype = call.device, variant.dtype

    def tokens(n: int, length: int) -> Tensor:
        signs = torch.randint(-1, 2, (n, length, variant.dim), generator=gen)
        return (signs * (torch.rand(signs.shape, generator=gen) < 0.25)).float()

    queries = tokens(rows, lq)
    documents = [tokens(rows, ld) for _ in range(2)]
    lengths = torch.randint(1, ld + 1, (2, rows), generator=gen)
    longest = queries[torch.arange(rows), queries.norm(dim=2).argmax(1)]
    for column, length in zip(documents, lengths):
        column[torch.arange(rows), length - 1] = 2 * longest
    masks = [(torch.arange(ld) < lengths[n, :, None]).to(device) for n in range(2)]
    vectors = F.normalize(torch.randn(3 * rows, 16, generator=gen), dim=-1).to(device)
    options = GistOptions(similarity="xtr", score_options={"top_k": CHECK_TOP_K}, temperature=0.25, margin=0.1,
                          contrast_anchors=False, contrast_positives=False, block_bytes=2**20)
    return xtr_call(queries.to(device, dtype), torch.ones(rows, lq, dtype=torch.bool, device=device),
                    [d.to(device, dtype) for d in documents], masks, options,
                    guide=[vectors[:rows], vectors[rows:2 * rows], vectors[2 * rows:]])


def sample_calls(device: torch.device, dtype: torch.dtype, guide_dtype: torch.dtype, dim: int,
                 guide_dim: int) -> dict[str, XTRCall]:
    """A small call of the score's one kernel variant for ``dtype`` and ``dim`` (MaxSim's held slabs; the guide's are
    the check problem's own), on ``device``: ``cgist doctor`` runs its first-use check."""
    queries, query_mask, documents, document_mask, guide = sample_tokens(device, dtype, dim)
    options = GistOptions(similarity="xtr", score_options={"top_k": 2}, contrast_anchors=False, contrast_positives=False)
    return {"xtr": xtr_call(queries, query_mask, [documents], [document_mask], options, guide=guide)}
