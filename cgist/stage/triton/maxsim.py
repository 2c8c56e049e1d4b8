"""Launchers for the MaxSim kernels (``cgist.kernels.maxsim``): the streaming MaxSim loss stage on Triton, tensors in,
tensors out (docs/design.md#late-interaction).

``maxsim_forward_triton`` takes a ``MaxSimCall`` (``cgist.stage.pytorch.maxsim``) and returns the mean loss and each
query's softmax normaliser as ``(peak, total)``; ``maxsim_backward_triton`` takes them back and returns the gradients
of every query chunk and every document chunk, in ``accumulate(dtype)`` (fp32, fp64 for fp64 inputs) and the chunks'
shapes, as the PyTorch stage's ``maxsim_forward`` and ``maxsim_backward`` do. No kernel holds more than one tile of
token products; ``budget_bytes`` bounds the backward's one buffer, the logits' gradients of a slab of queries.

The chunks are packed first (``_pack``): the kernels read one contiguous tensor per side, so the query chunks are
concatenated into ``(B, Lq, D)`` and the document chunks, column after column, into ``(M, Ld, D)``, each chunk's
tokens padded to the widest chunk's with masked tokens. That is a copy of the inputs (the PyTorch stage reads the
chunks in place). The gradients come back as views of the packed gradients, one per chunk.

* forward: ``maxsim_fwd_kernel`` over ``(query, block of BLOCK_M documents)`` writes each block's partial normaliser;
  they are combined here in a fixed order (``_combine``). ``maxsim_label_kernel`` computes the label logits with the
  same code.
* a guided call (GIST's mask, ``maxsim_guided_triton``): for each slab of queries, ``maxsim_scores_kernel`` writes
  the slab's scores, the mask and the softmax run on the host, and the two gradient kernels below take the logits'
  gradients they make; the gradients are made in the forward, as the PyTorch stage's are.
* backward, for each slab of queries (all of them when their ``(rows, M)`` logits' gradients fit ``budget_bytes``):
  ``maxsim_grad_kernel`` writes the slab's logits' gradients, ``maxsim_dq_kernel`` (a program per query and token
  block, over every document) gathers the query gradients, and ``maxsim_dd_kernel`` (a program per document, over the
  slab's queries) adds the slab's document gradients. Each recomputes the maxima it needs.

Each kernel's tiles, warps and pipeline stages are ``launch_configs``'s (bench/aot_compile.py compiles them for every
architecture: none spills). Everything is deterministic (no atomics) and reads no value on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
from cgist.stage.devices import Arch

from .launch import TL_DTYPES, _arch, _device_constant, _launch_device, input_precision

if TYPE_CHECKING:
    from cgist.stage.pytorch.maxsim import MaxSimCall

__all__ = ["BLOCK_M", "EMPTY_DOCUMENT_SCORE", "KERNELS", "MAX_BLOCK_T", "MAX_REGISTERS", "Launch", "launch_configs",
           "maxsim_backward_triton", "maxsim_forward_triton", "maxsim_guided_triton", "shared_memory_estimate"]

#: sentence-transformers' score of a document without any real token (``cgist.stage.pytorch.maxsim``'s).
EMPTY_DOCUMENT_SCORE = -1e9
#: Documents per forward (and logit-gradient) program: enough that a program's loop amortises its launch.
BLOCK_M = 32
#: The largest chunk of document tokens per product (the least is 16, ``tl.dot``'s smallest).
MAX_BLOCK_T = 64
#: The kernels, by name, in launch order.
KERNELS = {k.__name__: k for k in (
    maxsim_fwd_kernel, maxsim_label_kernel, maxsim_scores_kernel, maxsim_grad_kernel, maxsim_dq_kernel,
    maxsim_dd_kernel)}

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
        """As the compile tables write it (``LQ`` aside): ``Q32xT64xK32[xM32]-w4-s2[-r255]``."""
        m = self.meta
        tiles = f"Q{m['BLOCK_Q']}xT{m['BLOCK_T']}xK{m['BLOCK_K']}" + (f"xM{m['BLOCK_M']}" if "BLOCK_M" in m else "")
        return f"{tiles}-w{self.num_warps}-s{self.num_stages}" + (f"-r{self.maxnreg}" if self.maxnreg else "")


def shared_memory_estimate(launch: Launch, dtype: torch.dtype) -> int:
    """An upper bound on the shared memory (bytes) of a kernel compiled with ``launch`` for ``dtype`` inputs: the
    staged slices of the products, ``max(1, num_stages) * (BLOCK_Q + BLOCK_T) * BLOCK_K * e`` (``e`` the inputs'
    element size; Triton keeps ``num_stages - 1`` buffers with mma.sync and FMA loops, ``num_stages`` with wgmma and
    tcgen05), beside the document-gradient kernel's operands in ``ACC``, ``(BLOCK_Q + BLOCK_K) * BLOCK_Q * a``, and
    1 KiB for barriers and alignment. bench/aot_compile.py checks it against every binary it builds."""
    m = launch.meta
    e = torch.empty(0, dtype=dtype).element_size()
    a = torch.empty(0, dtype=torch.promote_types(dtype, torch.float32)).element_size()
    products = max(1, launch.num_stages) * (m["BLOCK_Q"] + m["BLOCK_T"]) * m["BLOCK_K"] * e
    return products + (m["BLOCK_Q"] + m["BLOCK_K"]) * m["BLOCK_Q"] * a + 1024


def launch_configs(dtype: torch.dtype, arch: Arch | None, lq: int, ld: int, dim: int, *,
                   block_tokens: int | None = None, block_query_tokens: int | None = None,
                   block_features: int | None = None, block_docs: int = BLOCK_M) -> dict[str, Launch]:
    """Each kernel's ``Launch`` for inputs of ``dtype`` on ``arch`` (None: the interpreter, taken as tensor cores),
    ``lq`` query tokens, ``ld`` document tokens and ``dim`` features.

    ``LQ`` and ``BLOCK_D`` are ``lq`` and ``dim`` padded to powers of two (at least 16, ``tl.dot``'s smallest);
    ``BLOCK_T`` the widest document's tokens, at most ``MAX_BLOCK_T``. ``block_tokens`` (``BLOCK_T``),
    ``block_query_tokens`` (``BLOCK_Q``), ``block_features`` (``BLOCK_K``) and ``block_docs`` (``BLOCK_M``) override
    the tiles (powers of two of at least 16, but ``block_docs``): tests make them small."""
    precision = input_precision(dtype, arch)
    acc = torch.promote_types(dtype, torch.float32)
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

    @property
    def shape_args(self) -> dict:
        return dict(lq=self.queries.shape[1], ld=self.documents.shape[1], dim=self.queries.shape[2])

    def pointers(self, scalars: Tensor | None = None) -> dict:
        pointers = dict(q_ptr=self.queries, w_ptr=self.weights, d_ptr=self.documents, dmask_ptr=self.doc_mask,
                        width_ptr=self.widths)
        return pointers if scalars is None else dict(pointers, fill_ptr=self.fill, scalars_ptr=scalars)

    def launch(self, kernel, grid: tuple, **args) -> None:
        """``kernel`` on ``grid`` with ``args`` and its ``Launch``."""
        launch = self.launches[kernel.__name__]
        kernel[grid](**args, **launch.meta, num_warps=launch.num_warps, num_stages=launch.num_stages,
                     maxnreg=launch.maxnreg)

    def blocks(self, kernel) -> int:
        """How many token blocks ``kernel``'s ``BLOCK_Q`` cuts the padded queries into."""
        meta = self.launches[kernel.__name__].meta
        return triton.cdiv(max(16, triton.next_power_of_2(self.queries.shape[1])), meta["BLOCK_Q"])


def _padded(chunks: list[Tensor], width: int) -> Tensor:
    """Row chunks ``(r, L, ...)`` padded with zeros (False) to ``width`` tokens and concatenated, contiguous."""
    return torch.cat([F.pad(c, (0, 0) * (c.dim() - 2) + (0, width - c.shape[1])) for c in chunks]).contiguous()


def _pack(call: MaxSimCall, tiles: dict) -> _Packed:
    """Concatenate and pad the chunks (module docstring); the weights, fills and widths; the launches."""
    acc = torch.promote_types(call.queries[0].dtype, torch.float32)
    lq = max(q.shape[1] for q in call.queries)
    doc_chunks = [d for column in call.documents for d in column]
    doc_masks = [m for column in call.document_masks for m in column]
    ld = max(d.shape[1] for d in doc_chunks)
    queries = _padded(list(call.queries), lq)
    query_mask = _padded(list(call.query_masks), lq)
    weights = query_mask.to(acc)
    fill = torch.full((queries.shape[0],), EMPTY_DOCUMENT_SCORE, dtype=acc, device=queries.device)
    if call.length_normalize:
        counts = query_mask.sum(1).clamp(min=1).to(acc)
        weights, fill = weights / counts[:, None], fill / counts
    documents = _padded(doc_chunks, ld)
    doc_mask = _padded(doc_masks, ld)
    positions = torch.arange(1, ld + 1, dtype=torch.int32, device=doc_mask.device)
    widths = torch.where(doc_mask, positions, 0).amax(1).to(torch.int32)
    launches = launch_configs(queries.dtype, _arch(queries.device), lq, ld, queries.shape[2], **tiles)
    return _Packed(queries, weights.contiguous(), fill, documents, doc_mask.to(torch.int8), widths, acc, launches)


def _scalars(scale: float, unit: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(scale, unit)`` on ``device`` in the accumulation dtype (``cgist.kernels.maxsim.SCALE``, ``UNIT``): a Python
    float would reach a kernel as fp32. Made once per value (``launch._device_constant``). Read only."""
    return _device_constant((float(scale), float(unit)), dtype, device)


def _combine(peaks: Tensor, totals: Tensor) -> tuple[Tensor, Tensor]:
    """The blocks' partial normalisers ``(B, n_blocks)`` as one per query: the largest peak, and the totals rescaled to
    it and summed, in a fixed order."""
    peak = peaks.amax(1)
    return peak, (totals * torch.exp(peaks - peak[:, None])).sum(1)


@torch.no_grad()
def maxsim_forward_triton(call: MaxSimCall, *, block_tokens: int | None = None, block_docs: int = BLOCK_M,
                          block_query_tokens: int | None = None,
                          block_features: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The mean loss over the queries, and each query's softmax normaliser as its largest logit ``peak`` and the sum
    of ``exp(logit - peak)`` (for ``maxsim_backward_triton``).

    ``block_tokens`` (document tokens per product), ``block_docs`` (documents per forward program),
    ``block_query_tokens`` (query tokens per product) and ``block_features`` (features per ``tl.dot``) override the
    tiles of ``launch_configs``: tests make them small.
    """
    packed = _pack(call, dict(block_tokens=block_tokens, block_docs=block_docs, block_query_tokens=block_query_tokens,
                              block_features=block_features))
    batch, n_docs = packed.queries.shape[0], packed.documents.shape[0]
    device = packed.queries.device
    scalars = _scalars(call.scale, 0.0, packed.acc, device)
    n_blocks = triton.cdiv(n_docs, block_docs)
    peaks = torch.empty(batch, n_blocks, dtype=packed.acc, device=device)
    totals = torch.empty(batch, n_blocks, dtype=packed.acc, device=device)
    labels = torch.empty(batch, dtype=packed.acc, device=device)
    with _launch_device(device):
        packed.launch(maxsim_fwd_kernel, (batch, n_blocks), **packed.pointers(scalars), peak_ptr=peaks,
                      total_ptr=totals, n_docs=n_docs, **packed.shape_args)
        packed.launch(maxsim_label_kernel, (batch,), **packed.pointers(scalars), label_ptr=labels,
                      offset=call.offset, **packed.shape_args)
    peak, total = _combine(peaks, totals)
    return (peak + torch.log(total) - labels).mean(), peak, total


@torch.no_grad()
def maxsim_backward_triton(call: MaxSimCall, peak: Tensor, total: Tensor, grad_output: float, *,
                           block_tokens: int | None = None, block_docs: int = BLOCK_M,
                           block_query_tokens: int | None = None, block_features: int | None = None,
                           block_queries: int | None = None) -> tuple[list[Tensor], list[list[Tensor]]]:
    """The gradients of ``grad_output`` times the loss, for every query chunk and every document chunk (in
    ``accumulate(dtype)``, the chunks' shapes), from the softmax normaliser of ``maxsim_forward_triton``.

    The queries go in slabs of ``block_queries`` (None: as many as the slab's ``(rows, M)`` logits' gradients fit
    ``call.budget_bytes``, at least one); the other tiles as ``maxsim_forward_triton``'s."""
    packed = _pack(call, dict(block_tokens=block_tokens, block_docs=block_docs, block_query_tokens=block_query_tokens,
                              block_features=block_features))
    batch, n_docs = packed.queries.shape[0], packed.documents.shape[0]
    device = packed.queries.device
    scalars = _scalars(call.scale, grad_output * call.scale / batch, packed.acc, device)
    peak, total = peak.to(packed.acc).contiguous(), total.to(packed.acc).contiguous()
    dq = torch.zeros(packed.queries.shape, dtype=packed.acc, device=device)  # padding rows stay 0
    dd = torch.zeros(packed.documents.shape, dtype=packed.acc, device=device)  # the kernel adds into it
    if block_queries is None:
        block_queries = call.budget_bytes // max(1, n_docs * packed.acc.itemsize)
    rows = max(1, min(batch, block_queries))
    grads = torch.empty(rows, n_docs, dtype=packed.acc, device=device)
    with _launch_device(device):
        for start in range(0, batch, rows):
            n = min(rows, batch - start)
            packed.launch(maxsim_grad_kernel, (n, triton.cdiv(n_docs, block_docs)), **packed.pointers(scalars),
                          peak_ptr=peak, total_ptr=total, g_ptr=grads, n_docs=n_docs, offset=call.offset,
                          q_start=start, **packed.shape_args)
            packed.launch(maxsim_dq_kernel, (n, packed.blocks(maxsim_dq_kernel)), **packed.pointers(), g_ptr=grads,
                          dq_ptr=dq, n_docs=n_docs, q_start=start, **packed.shape_args)
            packed.launch(maxsim_dd_kernel, (n_docs,), **packed.pointers(), g_ptr=grads, dd_ptr=dd, n_docs=n_docs,
                          n_rows=n, q_start=start, **packed.shape_args)
    return _unpacked(call, dq, dd)


#: The gradients of a call's query chunks and of its columns' chunks (the PyTorch stage's ``Gradients``).
Gradients = tuple[list[Tensor], list[list[Tensor]]]


def _unpacked(call: MaxSimCall, dq: Tensor, dd: Tensor) -> Gradients:
    """The packed gradients as views, one per query chunk and per document chunk, column by column."""
    q_grads = [g[:, : q.shape[1]] for g, q in zip(dq.split([q.shape[0] for q in call.queries]), call.queries)]
    d_grads, row = [], 0
    for column in call.documents:
        grads_ = []
        for d in column:
            grads_.append(dd[row : row + d.shape[0], : d.shape[1]])
            row += d.shape[0]
        d_grads.append(grads_)
    return q_grads, d_grads


@torch.no_grad()
def maxsim_guided_triton(call: MaxSimCall, with_grad: bool, softmax: Callable, *, block_tokens: int | None = None,
                         block_docs: int = BLOCK_M, block_query_tokens: int | None = None,
                         block_features: int | None = None,
                         block_queries: int | None = None) -> tuple[Tensor, list[Gradients] | None]:
    """A guided call (``call.guide``, GIST's mask): the mean loss and, ``with_grad``, the gradients of each part of
    the call (``MaxSimCall.parts``), each ``(query chunks, columns)`` in ``accumulate(dtype)``, which the PyTorch
    stage's ``folded`` makes the contract of its ``maxsim_forward`` (``maxsim_backward`` scales them by the loss's
    incoming gradient). ``softmax`` is the PyTorch stage's ``block_softmax`` (the dispatch passes it: this backend
    imports no stage).

    The queries go in slabs of ``block_queries`` (None: as many as the slab's scores, the guide's scores and mask fit
    ``call.budget_bytes``, at least one). As for the unguided launchers, the packed inputs and the gradients are
    outside the budget: each part is packed (the PP part packs the first column again, and has gradients of its own
    until they are folded into the call's), and the mask's comparisons make a few ``(rows, W)`` bool temporaries. For each slab and each part of the call (``MaxSimCall.parts``: its
    documents, and GIST's PP block, whose queries are the positives), ``maxsim_scores_kernel`` writes the part's
    scores into the slab's row ``(rows, W)``; the guide's mask and the softmax are the PyTorch stage's
    (``softmax``: the same counters, ties and exact softmax), and turn the scores into the logits' gradients in
    place, which ``maxsim_dq_kernel`` and ``maxsim_dd_kernel`` send back along the maxima, part by part. The other
    tiles as ``maxsim_forward_triton``'s."""
    tiles = dict(block_tokens=block_tokens, block_docs=block_docs, block_query_tokens=block_query_tokens,
                 block_features=block_features)
    parts = [(part, cols, _pack(part, tiles)) for part, cols in call.parts()]
    batch, width = call.n_queries, call.width
    acc = parts[0][2].acc
    device = parts[0][2].queries.device
    empty = [packed.widths == 0 for *_, packed in parts]  # an empty document's score is a constant: it sends nothing
    scalars = _scalars(1.0, 0.0, acc, device)  # a scale of 1: the scores, which the guide's mask reads
    if block_queries is None:  # the slab's row, and a part's copy of it where there are several parts
        per_query = call.kept_per_query(False) + (len(parts) > 1) * width * acc.itemsize
        block_queries = call.budget_bytes // max(1, per_query)
    rows = max(1, min(batch, block_queries))
    scores = torch.empty(rows, width, dtype=acc, device=device)
    # each part's scores, where there are several parts (else the kernel writes the row itself)
    outs = [torch.empty(rows, part.n_documents, dtype=acc, device=device) for part, *_ in parts] \
        if len(parts) > 1 else [scores]
    losses = torch.empty(batch, dtype=acc, device=device)
    grads = [(torch.zeros(packed.queries.shape, dtype=acc, device=device),
              torch.zeros(packed.documents.shape, dtype=acc, device=device))
             for *_, packed in parts] if with_grad else []
    call.guide.reset()
    with _launch_device(device):
        for start in range(0, batch, rows):
            n = min(rows, batch - start)
            slab = scores[:n]
            for (part, cols, packed), out in zip(parts, outs):
                out = out[:n]
                packed.launch(maxsim_scores_kernel, (n, triton.cdiv(part.n_documents, block_docs)),
                              **packed.pointers(scalars), out_ptr=out, n_docs=part.n_documents, q_start=start,
                              **packed.shape_args)
                if len(parts) > 1:
                    slab[:, cols] = out
            logits_grad = softmax(call, start, slab, losses, with_grad)
            for (part, cols, packed), (dq, dd), part_empty in zip(parts, grads, empty):
                g = logits_grad[:, cols].contiguous()
                g.masked_fill_(part_empty, 0.0)
                packed.launch(maxsim_dq_kernel, (n, packed.blocks(maxsim_dq_kernel)), **packed.pointers(), g_ptr=g,
                              dq_ptr=dq, n_docs=part.n_documents, q_start=start, **packed.shape_args)
                packed.launch(maxsim_dd_kernel, (part.n_documents,), **packed.pointers(), g_ptr=g, dd_ptr=dd,
                              n_docs=part.n_documents, n_rows=n, q_start=start, **packed.shape_args)
    if not with_grad:
        return losses.mean(), None
    return losses.mean(), [_unpacked(part, dq, dd) for (part, *_), (dq, dd) in zip(parts, grads)]
