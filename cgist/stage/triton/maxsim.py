"""The MaxSim score on the Triton backend: the launchers of its kernels (``cgist.kernels.maxsim``), tensors in, tensors
out (docs/design.md#late-interaction), and the backend contract, ``forward`` and ``backward``
(docs/design.md#dispatch).

A call (``cgist.stage.spec.maxsim.MaxSimCall``) is launched part by part (its row sides: the queries against their
columns, and GIST's PP block, whose rows are the positives). Each part is packed first (``_pack``): the kernels read
one contiguous tensor per side, so its query chunks are concatenated into ``(B, Lq, D)`` and its columns' chunks,
column after column, into ``(M, Ld, D)``, each chunk's tokens padded to the widest chunk's with masked tokens. That is a
copy of the inputs (the PyTorch backend reads the chunks in place). The gradients come back as views of the packed
gradients, one per chunk, added into the call's where parts share an input.

* Unguided (no mask; one part): ``maxsim_forward_triton``, a program per ``(query, block of BLOCK_M documents)``
  writing each block's partial normaliser, combined here in a fixed order (``_combine``), and
  ``maxsim_label_kernel`` for the label logits; ``maxsim_backward_triton`` then, per slab of queries whose
  ``(rows, M)`` logits' gradients fit the budget, ``maxsim_grad_kernel`` writes them, ``maxsim_dq_kernel`` (a
  program per query and token block) gathers the query gradients and ``maxsim_dd_kernel`` (a program per document)
  adds the slab's document gradients. Each recomputes the maxima it needs.
* Held (a guide's mask, GIST's contrast blocks, a learned temperature, or XTR: ``maxsim_held_triton``): per slab of
  queries, ``maxsim_scores_kernel`` writes the slab's scores with the forward's code, the mask and the exact softmax
  are the stage's (``cgist.stage.block``, written once for every backend), and the two gradient kernels send the
  logits' gradients back; the gradients are made in the forward, as the PyTorch backend's are.

Each kernel's tiles, warps and pipeline stages are ``launch_configs``'s (bench/aot_compile.py compiles them for every
architecture: none spills). Everything is deterministic (no atomics). It imports only torch, triton, the kernels, the
backend's shared modules and the spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

from cgist.kernels.maxsim import (
    maxsim_dd_kernel,
    maxsim_dq_kernel,
    maxsim_fwd_kernel,
    maxsim_grad_kernel,
    maxsim_label_kernel,
    maxsim_scores_kernel,
)
from cgist.stage.block import BlockMasks, block_softmax
from cgist.stage.budget import kept_bytes, slab_rows
from cgist.stage.devices import Arch, launch_context
from cgist.stage.numerics import compute_dtype
from cgist.stage.spec.call import Grads
from cgist.stage.spec.maxsim import MaxSimCall, Part, query_weights

from .common import TL_DTYPES, arch_of, device_constant, input_precision
from .tiles import SHARED_OVERHEAD, pipelined_loads

__all__ = ["BLOCK_M", "KERNELS", "MAX_BLOCK_T", "MAX_REGISTERS", "XTR_KERNELS", "Launch", "backward", "forward",
           "launch_configs", "maxsim_backward_triton", "maxsim_forward_triton", "maxsim_held_triton",
           "shared_memory_estimate"]

#: Documents per forward (and logit-gradient) program: enough that a program's loop amortises its launch.
BLOCK_M = 32
#: The largest chunk of document tokens per product (the least is 16, ``tl.dot``'s smallest).
MAX_BLOCK_T = 64
#: The kernels, by name, in launch order.
KERNELS = {k.__name__: k for k in (
    maxsim_fwd_kernel, maxsim_label_kernel, maxsim_scores_kernel, maxsim_grad_kernel, maxsim_dq_kernel,
    maxsim_dd_kernel)}
#: The kernels that also score XTR (their ``XTR`` constexpr): the held path's.
XTR_KERNELS = ("maxsim_scores_kernel", "maxsim_dq_kernel", "maxsim_dd_kernel")

# Tiles per operand kind (``_kind``) and kernel: (BLOCK_Q query tokens, BLOCK_K features, warps, stages), with
# BLOCK_T = MAX_BLOCK_T document tokens at most. Measured with bench/aot_compile.py (sm_70 to sm_120, 32 and 128 query
# tokens, 128 features): every kernel holds one (32, 64) product tile and a slice of each side, so one config serves
# every architecture of a kind. tf32x3 splits its operands in registers and takes 16 features a slice (the query
# gradient at 32 spills 56 B at 255 registers on sm_80 to sm_120). Below sm_80 (FMA loops, no asynchronous copies)
# one stage. The document-gradient kernel takes one stage everywhere: no load of its rows of ``dd`` is issued ahead
# of the barrier that orders it after the previous update's writes.
_ALL = tuple(KERNELS)
_TILES: dict[str, dict[str, tuple[int, int, int, int]]] = {
    kind: {name: (32, block_k, 4, 1 if name == "maxsim_dd_kernel" or kind.startswith("fma") else 2) for name in _ALL}
    for kind, block_k in (("half", 32), ("tf32", 32), ("tf32x3", 16), ("fma-half", 16), ("fma", 16))
}
#: ``.maxnreg`` of every kernel: the register limit per thread, stated. Without it ptxas settles some of them on 96,
#: 128 or 168 registers (more programs per SM) and spills 4 to 40 B (the bf16 forward at 128 query tokens on sm_90, the
#: fp32 query gradient on sm_75); with it none spills, the largest taking 225 registers (Triton 3.9).
MAX_REGISTERS = 255


def _kind(dtype: torch.dtype, precision: str, arch: Arch | None) -> str:
    """The operands as the tile tables part them: half (bf16, fp16), tf32 or tf32x3 on the tensor cores, "fma-half"
    and "fma" (fp32, fp64) on FMA loops (below sm_80, and fp64)."""
    tensor_cores = (arch is None or arch.mma) and dtype != torch.float64
    half = dtype in (torch.bfloat16, torch.float16)
    if not tensor_cores:
        return "fma-half" if half else "fma"
    return "half" if half else precision


@dataclass(frozen=True)
class Launch:
    """One kernel's launch: its constexprs (beyond the pointers and sizes), warps and pipeline stages."""

    meta: dict
    num_warps: int
    num_stages: int
    maxnreg: int | None = MAX_REGISTERS

    @property
    def tiles(self) -> str:
        """As the compile tables write it (``LQ`` aside): ``Q32xT64xK32[xM32]-w4-s2[-r255][-xtr]``."""
        m = self.meta
        tiles = f"Q{m['BLOCK_Q']}xT{m['BLOCK_T']}xK{m['BLOCK_K']}" + (f"xM{m['BLOCK_M']}" if "BLOCK_M" in m else "")
        return f"{tiles}-w{self.num_warps}-s{self.num_stages}" + (f"-r{self.maxnreg}" if self.maxnreg else "") \
            + ("-xtr" if m.get("XTR") else "")


def shared_memory_estimate(launch: Launch, dtype: torch.dtype) -> int:
    """An upper bound on the shared memory (bytes) of a kernel compiled with ``launch`` for ``dtype`` inputs: the
    staged slices of the products, ``max(1, num_stages) * (BLOCK_Q + BLOCK_T) * BLOCK_K * e`` (``e`` the inputs'
    element size; Triton keeps ``num_stages - 1`` buffers with mma.sync and FMA loops, ``num_stages`` with wgmma and
    tcgen05), beside the document-gradient kernel's operands in ``ACC``, ``(BLOCK_Q + BLOCK_K) * BLOCK_Q * a``, and
    1 KiB for barriers and alignment. bench/aot_compile.py checks it against every binary it builds."""
    m = launch.meta
    e = torch.empty(0, dtype=dtype).element_size()
    a = torch.empty(0, dtype=compute_dtype(dtype)).element_size()
    return pipelined_loads(max(1, launch.num_stages), m["BLOCK_Q"], m["BLOCK_T"], m["BLOCK_K"], e) \
        + (m["BLOCK_Q"] + m["BLOCK_K"]) * m["BLOCK_Q"] * a + SHARED_OVERHEAD


def launch_configs(dtype: torch.dtype, arch: Arch | None, lq: int, ld: int, dim: int, *,
                   block_tokens: int | None = None, block_query_tokens: int | None = None,
                   block_features: int | None = None, block_docs: int = BLOCK_M, xtr: bool = False
                   ) -> dict[str, Launch]:
    """Each kernel's ``Launch`` for inputs of ``dtype`` on ``arch`` (None: the interpreter, taken as tensor cores),
    ``lq`` query tokens, ``ld`` document tokens and ``dim`` features; ``xtr``: the slab kernels (``XTR_KERNELS``)
    score XTR.

    ``LQ`` and ``BLOCK_D`` are ``lq`` and ``dim`` padded to powers of two (at least 16, ``tl.dot``'s smallest);
    ``BLOCK_T`` the widest document's tokens, at most ``MAX_BLOCK_T``. ``block_tokens`` (``BLOCK_T``),
    ``block_query_tokens`` (``BLOCK_Q``), ``block_features`` (``BLOCK_K``) and ``block_docs`` (``BLOCK_M``) override
    the tiles (powers of two of at least 16, but ``block_docs``): tests make them small."""
    precision = input_precision(dtype, arch)
    acc = compute_dtype(dtype)
    big_lq = max(16, triton.next_power_of_2(lq))
    block_d = max(16, triton.next_power_of_2(dim))
    block_t = max(16, block_tokens or min(MAX_BLOCK_T, triton.next_power_of_2(ld)))
    launches = {}
    for name, (block_q, block_k, warps, stages) in _TILES[_kind(dtype, precision, arch)].items():
        meta = dict(ACC=TL_DTYPES[acc], PRECISION=precision, LQ=big_lq,
                    BLOCK_Q=min(big_lq, block_query_tokens or block_q), BLOCK_D=block_d,
                    BLOCK_K=min(block_d, block_features or block_k), BLOCK_T=block_t)
        if name in ("maxsim_fwd_kernel", "maxsim_scores_kernel", "maxsim_grad_kernel"):
            meta["BLOCK_M"] = block_docs
        if name == "maxsim_dq_kernel":  # its grid spans the token blocks
            del meta["LQ"]
        if name in XTR_KERNELS:
            meta["XTR"] = xtr
        launches[name] = Launch(meta, warps, stages)
    return launches


@dataclass
class _Packed:
    """A call's inputs as the kernels read them (``cgist.kernels.maxsim``: Layout), with the launches."""

    queries: Tensor  # (B, Lq, D), contiguous, the inputs' dtype
    weights: Tensor  # (B, Lq) acc: the mask, divided by the real token count under MeanMaxSim
    fill: Tensor  # (B,) acc: the score of an empty document
    documents: Tensor  # (M, Ld, D), contiguous: every column's chunks, column after column
    doc_mask: Tensor  # (M, Ld) int8
    widths: Tensor  # (M,) int32: the last real token + 1, 0 for a document without one
    acc: torch.dtype
    launches: dict[str, Launch]
    tau: Tensor | None = None  # (B, Lq) acc: XTR's thresholds (None: MaxSim)

    @property
    def shape_args(self) -> dict:
        return dict(lq=self.queries.shape[1], ld=self.documents.shape[1], dim=self.queries.shape[2])

    def pointers(self, scalars: Tensor | None = None) -> dict:
        pointers = dict(q_ptr=self.queries, w_ptr=self.weights, d_ptr=self.documents, dmask_ptr=self.doc_mask,
                        width_ptr=self.widths)
        return pointers if scalars is None else dict(pointers, fill_ptr=self.fill, scalars_ptr=scalars)

    def launch(self, kernel, grid: tuple, **args) -> None:
        """``kernel`` on ``grid`` with ``args`` and its ``Launch``; a slab kernel also reads the thresholds (the
        weights stand in for MaxSim's, which reads none)."""
        launch = self.launches[kernel.__name__]
        if kernel.__name__ in XTR_KERNELS:
            args["tau_ptr"] = self.weights if self.tau is None else self.tau
        kernel[grid](**args, **launch.meta, num_warps=launch.num_warps, num_stages=launch.num_stages,
                     maxnreg=launch.maxnreg)

    def blocks(self, kernel) -> int:
        """How many token blocks ``kernel``'s ``BLOCK_Q`` cuts the padded queries into."""
        meta = self.launches[kernel.__name__].meta
        return triton.cdiv(max(16, triton.next_power_of_2(self.queries.shape[1])), meta["BLOCK_Q"])


def _padded(chunks: Sequence[Tensor], width: int) -> Tensor:
    """Row chunks ``(r, L, ...)`` padded with zeros (False) to ``width`` tokens and concatenated, contiguous."""
    return torch.cat([F.pad(c, (0, 0) * (c.dim() - 2) + (0, width - c.shape[1])) for c in chunks]).contiguous()


def _pack(part: Part, length_normalize: bool, tiles: dict, tau: Tensor | None = None) -> _Packed:
    """Concatenate and pad a part's chunks (module docstring); the weights and fills
    (``cgist.stage.spec.maxsim.query_weights``), the widths; the launches; XTR's thresholds ``tau``
    (``(B, Lq)``, None for MaxSim)."""
    acc = compute_dtype(part.queries[0].dtype)
    lq = max(q.shape[1] for q in part.queries)
    doc_chunks = [d for column in part.documents for d in column]
    doc_masks = [m for column in part.document_masks for m in column]
    ld = max(d.shape[1] for d in doc_chunks)
    queries = _padded(part.queries, lq)
    weights, fill = query_weights(_padded(part.query_masks, lq), length_normalize, acc)
    documents = _padded(doc_chunks, ld)
    doc_mask = _padded(doc_masks, ld)
    positions = torch.arange(1, ld + 1, dtype=torch.int32, device=doc_mask.device)
    widths = torch.where(doc_mask, positions, 0).amax(1).to(torch.int32)
    launches = launch_configs(queries.dtype, arch_of(queries.device), lq, ld, queries.shape[2], xtr=tau is not None,
                              **tiles)
    return _Packed(queries, weights.contiguous(), fill.squeeze(1).contiguous(), documents, doc_mask.to(torch.int8),
                   widths, acc, launches, None if tau is None else tau.contiguous())


def _scalars(scale: float, unit: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(scale, unit)`` on ``device`` in the accumulation dtype (``cgist.kernels.maxsim.SCALE``, ``UNIT``): a Python
    float would reach a kernel as fp32. Made once per value (``common.device_constant``). Read only."""
    return device_constant((float(scale), float(unit)), dtype, device)


def _combine(peaks: Tensor, totals: Tensor) -> tuple[Tensor, Tensor]:
    """The blocks' partial normalisers ``(B, n_blocks)`` as one per query: the largest peak, and the totals rescaled to
    it and summed, in a fixed order."""
    peak = peaks.amax(1)
    return peak, (totals * torch.exp(peaks - peak[:, None])).sum(1)


def _one_part(call: MaxSimCall, block_tokens: int | None, block_docs: int, block_query_tokens: int | None,
              block_features: int | None) -> tuple[Part, _Packed]:
    """An unguided call's one part, packed with these tiles."""
    (part,) = call.parts
    return part, _pack(part, call.length_normalize, dict(block_tokens=block_tokens, block_docs=block_docs,
                                                         block_query_tokens=block_query_tokens,
                                                         block_features=block_features))


@torch.no_grad()
def maxsim_forward_triton(call: MaxSimCall, *, block_tokens: int | None = None, block_docs: int = BLOCK_M,
                          block_query_tokens: int | None = None,
                          block_features: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """An unguided call's mean loss over the queries, and each query's softmax normaliser as its largest logit
    ``peak`` and the sum of ``exp(logit - peak)`` (for ``maxsim_backward_triton``).

    ``block_tokens`` (document tokens per product), ``block_docs`` (documents per forward program),
    ``block_query_tokens`` (query tokens per product) and ``block_features`` (features per ``tl.dot``) override the
    tiles of ``launch_configs``: tests make them small.
    """
    part, packed = _one_part(call, block_tokens, block_docs, block_query_tokens, block_features)
    batch, n_docs, device = packed.queries.shape[0], packed.documents.shape[0], packed.queries.device
    scalars = _scalars(call.scale, 0.0, packed.acc, device)
    n_blocks = triton.cdiv(n_docs, block_docs)
    peaks = torch.empty(batch, n_blocks, dtype=packed.acc, device=device)
    totals = torch.empty(batch, n_blocks, dtype=packed.acc, device=device)
    labels = torch.empty(batch, dtype=packed.acc, device=device)
    with launch_context(device):
        packed.launch(maxsim_fwd_kernel, (batch, n_blocks), **packed.pointers(scalars), peak_ptr=peaks,
                      total_ptr=totals, n_docs=n_docs, **packed.shape_args)
        packed.launch(maxsim_label_kernel, (batch,), **packed.pointers(scalars), label_ptr=labels,
                      offset=call.offset, **packed.shape_args)
    peak, total = _combine(peaks, totals)
    return ((peak - labels) + torch.log(total)).mean(), peak, total


@torch.no_grad()
def maxsim_backward_triton(call: MaxSimCall, peak: Tensor, total: Tensor, grad_output: float, *,
                           block_tokens: int | None = None, block_docs: int = BLOCK_M,
                           block_query_tokens: int | None = None, block_features: int | None = None,
                           block_queries: int | None = None) -> list[list[Tensor]]:
    """An unguided call's gradients of ``grad_output`` times the loss, for every chunk of its columns (in the compute
    dtype, the chunks' shapes), from the softmax normaliser of ``maxsim_forward_triton``.

    The queries go in slabs of ``block_queries`` (None: as many as the slab's ``(rows, M)`` logits' gradients fit
    ``call.budget_bytes``, at least one); the other tiles as ``maxsim_forward_triton``'s."""
    part, packed = _one_part(call, block_tokens, block_docs, block_query_tokens, block_features)
    batch, n_docs, device = packed.queries.shape[0], packed.documents.shape[0], packed.queries.device
    scalars = _scalars(call.scale, grad_output * call.scale / batch, packed.acc, device)
    peak, total = peak.to(packed.acc).contiguous(), total.to(packed.acc).contiguous()
    dq = torch.zeros(packed.queries.shape, dtype=packed.acc, device=device)  # padding rows stay 0
    dd = torch.zeros(packed.documents.shape, dtype=packed.acc, device=device)  # the kernel adds into it
    rows = slab_rows(batch, n_docs * packed.acc.itemsize, call.budget_bytes) if block_queries is None \
        else max(1, min(batch, block_queries))
    grads = torch.empty(rows, n_docs, dtype=packed.acc, device=device)
    with launch_context(device):
        for start in range(0, batch, rows):
            n = min(rows, batch - start)
            packed.launch(maxsim_grad_kernel, (n, triton.cdiv(n_docs, block_docs)), **packed.pointers(scalars),
                          peak_ptr=peak, total_ptr=total, g_ptr=grads, n_docs=n_docs, offset=call.offset,
                          q_start=start, **packed.shape_args)
            packed.launch(maxsim_dq_kernel, (n, packed.blocks(maxsim_dq_kernel)), **packed.pointers(), g_ptr=grads,
                          dq_ptr=dq, n_docs=n_docs, q_start=start, **packed.shape_args)
            packed.launch(maxsim_dd_kernel, (n_docs,), **packed.pointers(), g_ptr=grads, dd_ptr=dd, n_docs=n_docs,
                          n_rows=n, q_start=start, **packed.shape_args)
    return _folded(call, [_unpacked(part, dq, dd)])


def _unpacked(part: Part, dq: Tensor, dd: Tensor) -> tuple[list[Tensor], list[list[Tensor]]]:
    """A part's packed gradients as views, one per query chunk and per document chunk, column by column."""
    q_grads = [g[:, : q.shape[1]] for g, q in zip(dq.split([q.shape[0] for q in part.queries]), part.queries)]
    d_grads, row = [], 0
    for column in part.documents:
        grads_ = []
        for d in column:
            grads_.append(dd[row : row + d.shape[0], : d.shape[1]])
            row += d.shape[0]
        d_grads.append(grads_)
    return q_grads, d_grads


def _folded(call: MaxSimCall, parts: list[tuple[list[Tensor], list[list[Tensor]]]]) -> list[list[Tensor]]:
    """The parts' gradients as the call's, one per chunk of each column: a single part that reads each column once
    is the call's as it is (views); otherwise each part's are added where its inputs are
    (``MaxSimCall.part_gradients``: PP's rows are the first column's, AA's column the queries)."""
    if len(call.parts) == 1 and call.parts[0].columns_of == tuple(range(1, len(call.columns))):
        q_grads, d_grads = parts[0]
        return [q_grads, *d_grads]
    dtype = parts[0][0][0].dtype
    grads = [[torch.zeros(t.shape, dtype=dtype, device=t.device) for t in column] for column in call.columns]
    for (rows_, columns), (into_rows, into_columns) in zip(parts, call.part_gradients(grads)):
        for total, part in zip(into_rows, rows_):
            total += part
        for into, column in zip(into_columns, columns):
            for total, part in zip(into, column):
                total += part
    return grads


def _held_per_query(call: MaxSimCall, acc_bytes: int) -> int:
    """The bytes a slab of the held path keeps per query: its scores and the guide's (``kept_bytes`` without the
    gradients), and a part's copy of them where there are several parts."""
    per_query = 0
    for part in call.parts:
        lq = max(q.shape[1] for q in part.queries)
        ld = max(d.shape[1] for column in part.documents for d in column)
        per_query += kept_bytes(1, part.n_documents, lq, ld, call.first.shape[2], acc_bytes, False, call.guide_kind)
    return per_query + (len(call.parts) > 1) * call.width * acc_bytes


@torch.no_grad()
def maxsim_held_triton(call: MaxSimCall, with_grad: bool, share: Tensor | None = None, *,
                       tau: Tensor | None = None, block_tokens: int | None = None, block_docs: int = BLOCK_M,
                       block_query_tokens: int | None = None, block_features: int | None = None,
                       block_queries: int | None = None
                       ) -> tuple[Tensor, list[list[Tensor]] | None, BlockMasks | None]:
    """A call whose slabs of queries are held whole (a guide's mask, GIST's contrast blocks, a learned temperature,
    XTR): the mean loss and, ``with_grad``, the gradients of every chunk of its columns, in the compute dtype; the
    temperature's share added into ``share``; the guide's mask with its counters. With ``tau`` (XTR's thresholds,
    ``(n_queries, Lq)``; one part) the scores are XTR's: the kernels also write each score's count of retrieved
    maxima, by which its gradient is divided.

    The queries go in slabs of ``block_queries`` (None: as many as the slab's scores, the guide's scores and mask
    fit ``call.budget_bytes``, at least one). As for the unguided launchers, the packed inputs and the gradients are
    outside the budget: each part is packed (the PP part packs the first column again, and has gradients of its own
    until they are added into the call's), and the mask's comparisons make a few ``(rows, W)`` bool temporaries. For
    each slab and each part, ``maxsim_scores_kernel`` writes the part's scores into the slab's row ``(rows, W)``
    (and, for a multi-vector guide, the guide's scores likewise); the mask and the softmax are
    ``cgist.stage.block``'s and turn the scores into the logits' gradients in place, which
    ``maxsim_dq_kernel`` and ``maxsim_dd_kernel`` send back along the maxima, part by part. The other tiles as
    ``maxsim_forward_triton``'s."""
    tiles = dict(block_tokens=block_tokens, block_docs=block_docs, block_query_tokens=block_query_tokens,
                 block_features=block_features)
    parts = [(part, _pack(part, call.length_normalize, tiles, tau)) for part in call.parts]
    guide = call.guide_tokens
    guide_parts = [] if guide is None else [(part, _pack(part, guide.length_normalize, tiles)) for part in guide.parts]
    batch, width = call.n_queries, call.width
    acc, device = parts[0][1].acc, call.device
    empty = [packed.widths == 0 for _, packed in parts]  # an empty document's score is a constant: it sends nothing
    per_query = _held_per_query(call, acc.itemsize) + (tau is not None) * width * acc.itemsize
    rows = slab_rows(batch, per_query, call.budget_bytes) if block_queries is None else max(1, min(batch, block_queries))
    scores = torch.empty(rows, width, dtype=acc, device=device)
    counts = None if tau is None else torch.empty(rows, width, dtype=acc, device=device)
    guide_scores = None if guide is None else torch.empty(rows, width, dtype=guide_parts[0][1].acc, device=device)
    losses = torch.empty(batch, dtype=acc, device=device)
    grads = [(torch.zeros(packed.queries.shape, dtype=acc, device=device),
              torch.zeros(packed.documents.shape, dtype=acc, device=device)) for _, packed in parts] \
        if with_grad else []
    masks = None if call.guide_kind is None else BlockMasks(call)
    with launch_context(device):
        for start in range(0, batch, rows):
            n = min(rows, batch - start)
            _slab_scores(parts, start, scores[:n], None if counts is None else counts[:n])
            if guide is not None:
                _slab_scores(guide_parts, start, guide_scores[:n])
            mask = None if masks is None else masks(start, scores[:n], None if guide is None else guide_scores[:n])
            logits_grad = block_softmax(call, start, scores[:n], losses, with_grad, mask, share)
            if counts is not None and with_grad:
                logits_grad /= counts[:n].clamp_(min=1.0)
            for (part, packed), (dq, dd), part_empty in zip(parts, grads, empty):
                g = logits_grad[:, part.span].contiguous()
                g.masked_fill_(part_empty, 0.0)
                packed.launch(maxsim_dq_kernel, (n, packed.blocks(maxsim_dq_kernel)), **packed.pointers(), g_ptr=g,
                              dq_ptr=dq, n_docs=part.n_documents, q_start=start, **packed.shape_args)
                packed.launch(maxsim_dd_kernel, (part.n_documents,), **packed.pointers(), g_ptr=g, dd_ptr=dd,
                              n_docs=part.n_documents, n_rows=n, q_start=start, **packed.shape_args)
    if not with_grad:
        return losses.mean(), None, masks
    return losses.mean(), _folded(call, [_unpacked(part, dq, dd) for (part, _), (dq, dd) in zip(parts, grads)]), masks


def _slab_scores(parts: list[tuple[Part, _Packed]], start: int, slab: Tensor, counts: Tensor | None = None) -> None:
    """The scores of queries ``start:start + len(slab)`` over their whole row (a scale of 1: the scores, which the
    guide's mask reads), part by part, into ``slab`` (XTR's with its counts into ``counts``: one part); the kernel
    writes a part's contiguous ``(rows, n_documents)``, so where there are several parts each is written apart and
    copied into its span."""
    n = slab.shape[0]
    for part, packed in parts:
        out = slab if len(parts) == 1 else torch.empty(n, part.n_documents, dtype=slab.dtype, device=slab.device)
        block_docs = packed.launches[maxsim_scores_kernel.__name__].meta["BLOCK_M"]
        packed.launch(maxsim_scores_kernel, (n, triton.cdiv(part.n_documents, block_docs)),
                      **packed.pointers(_scalars(1.0, 0.0, packed.acc, slab.device)), out_ptr=out,
                      z_ptr=out if counts is None else counts, n_docs=part.n_documents, q_start=start,
                      **packed.shape_args)
        if len(parts) > 1:
            slab[:, part.span] = out


# The backend contract (docs/design.md#dispatch) ------------------------------------------------------------------


@dataclass(frozen=True)
class Normaliser:
    """The saved state of an unguided call: each query's softmax normaliser (``maxsim_forward_triton``), from which
    ``backward`` recomputes the rest."""

    peak: Tensor
    total: Tensor


def forward(call: MaxSimCall, with_grad: bool, need_stats: bool = False, tau: Tensor | None = None
            ) -> tuple[Tensor, Normaliser | Grads | None, object]:
    """The loss, the backward's state, and the guide's counters (``need_stats``). An unguided call keeps each
    query's softmax normaliser (``Normaliser``: the backward recomputes the rest); a held one
    (``maxsim_held_triton``: a guide, a learned temperature, or XTR's thresholds ``tau``) the gradients, made here
    ``with_grad``, the learned temperature's included."""
    if tau is None and call.guide_kind is None and call.temperature is None:
        loss, peak, total = maxsim_forward_triton(call)
        return loss, Normaliser(peak, total), None
    share = torch.zeros((), dtype=compute_dtype(call.dtype), device=call.device) \
        if with_grad and call.temperature is not None else None
    loss, grads, masks = maxsim_held_triton(call, with_grad, share, tau=tau)
    grads = call.grads((g for column in grads for g in column), share) if with_grad else None
    return loss, grads, None if masks is None or not need_stats else masks.counters


def backward(call: MaxSimCall, state: Normaliser, grad_output: Tensor) -> Grads:
    """The gradients of ``grad_output`` times the loss from an unguided call's normalisers: the kernels make them
    now, scaled as they go."""
    grads = maxsim_backward_triton(call, state.peak, state.total, float(grad_output))
    return call.grads(g for column in grads for g in column)
