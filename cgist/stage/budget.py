"""The workspace budget (``block_bytes``): the bytes of score buffers a loss-stage call may hold at once, and how each
backend cuts its work to fit. This module is its only owner.

* ``default_block_bytes``: the budget when none is given, shared by both backends.
* The PyTorch streaming path: ``row_blocks`` cuts a call into row blocks and column tiles (``RowBlocks``), sized
  by measurement (``ROW_TARGET``, ``ROW_FLOOR``, ``TILE_COLS``).
* The Triton GEMM backward: ``backward_chunks`` cuts it into chunks of rows and columns (``Chunks``).
* The MaxSim score: its default (``maxsim_block_bytes``), the PyTorch stage's tiles and row blocks (``split_budget``,
  ``tile_rows``, ``kept_bytes``) and the Triton stage's slabs of queries (``slab_rows``); XTR's default
  (``xtr_block_bytes``) and thresholds' sweep (``threshold_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .devices import free_bytes, is_gpu

__all__ = [
    "BACKWARD_BYTES", "DOC_ROWS", "GEMM_ROW_FLOOR", "MAX_BLOCK_BYTES", "MEMORY_SHARE", "MIN_BLOCK_BYTES", "ROW_FLOOR",
    "ROW_TARGET", "TILE_COLS", "TILE_FLOOR_BYTES", "XTR_ROW_QUERIES", "Chunks", "RowBlocks", "argmax_dtype",
    "backward_chunks", "default_block_bytes", "kept_bytes", "maxsim_block_bytes", "row_blocks",
    "slab_rows", "split_budget", "threshold_rows", "tile_rows", "topk_bytes", "xtr_block_bytes", "xtr_kept_bytes",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: Smallest default budget, bytes of score buffers held at once.
MIN_BLOCK_BYTES = 16 * 2**20
#: The default budget never exceeds this share of the memory available to the process.
MEMORY_SHARE = 8
#: Nor this many bytes (blocks of 1024 rows fit up to B = 32k at D = 384 with one dimension).
MAX_BLOCK_BYTES = 2**30


def default_block_bytes(device: torch.device, floor_bytes: int) -> int:
    """The workspace budget when none is given (``block_bytes=None``), shared by both backends.

    At least ``MIN_BLOCK_BYTES``, grown to ``floor_bytes`` (what a backend needs for blocks of an
    efficient shape), but never above an eighth of the memory available on ``device``, nor above
    ``MAX_BLOCK_BYTES`` (a CPU keeps its buffers between calls: ``cgist.stage.pytorch.workspace.release_workspace``).
    """
    cap = min(free_bytes(device) // MEMORY_SHARE, MAX_BLOCK_BYTES)
    return max(min(max(MIN_BLOCK_BYTES, floor_bytes), cap), 1)


#: Rows per block that the default budget grows to reach (measured, see ``row_blocks``).
ROW_TARGET = 1024


#: Fewer rows per block than this in one pass, and the call runs in two passes of this many (see ``row_blocks``).
ROW_FLOOR = 256


#: Columns per tile on a CPU (measured, see ``row_blocks``): wide enough that the per-tile overhead is small.
TILE_COLS = 4096


@dataclass(frozen=True)
class RowBlocks:
    """How the streaming path cuts a call: ``rows`` per row block, ``cols`` per column tile, and whether in one pass.

    In one pass a row block keeps the tiles of all its columns from the softmax sums to the gradients; in two
    passes it recomputes them.
    """

    rows: int
    cols: int
    one_pass: bool


def row_blocks(batch: int, block_widths: Sequence[int], top: int, n_dims: int, itemsize: int,
               block_bytes: int | None, device: torch.device = torch.device("cpu"), half: bool = False) -> RowBlocks:
    """The streaming path's row blocks for B = ``batch`` anchor rows against groups of ``block_widths`` columns.

    The budget bounds the workspace (``cgist.stage.pytorch.workspace.Workspace``), per row: the softmax terms of
    every kept column for each of the ``n_dims`` dimensions, one tile's guide scores (and with ``half`` products its
    score gradients as a half operand), and the row block's operands and product (a few R x ``top``). One pass keeps
    all ``sum(block_widths)`` columns. The rows per block are the budget divided by that; with the default budget
    (``block_bytes=None``) it first grows so that ``ROW_TARGET`` rows fit, unless that exceeds an eighth of the
    available memory or 1 GiB. When fewer than ``min(ROW_FLOOR, B)`` rows fit, the call runs in two passes with
    ``min(ROW_FLOOR, B)`` rows per block and as many columns per tile as the budget allows (at least one, at most
    ``TILE_COLS`` on a CPU).

    Larger blocks read and write the columns' gradients fewer times and keep the products' inner dimension wide;
    ``ROW_TARGET`` and ``TILE_COLS`` are where the measured time stopped falling (docs/performance.md#memory).
    ``ROW_FLOOR`` is the smallest one-pass block: a budget too small for it gets two passes of blocks that stay
    GEMM-efficient at any B, for one more set of score products.
    """
    # On a GPU one launch per block is better than cache-sized tiles.
    tile = max(block_widths) if is_gpu(device) else min(TILE_COLS, max(block_widths))
    # guide scores per tile column (the mask goes where the logits will), and with half products the tile's
    # score gradients as a half operand
    scratch = itemsize + (2 if half else 0)
    kept = (2 * n_dims - 1) * itemsize  # per kept column: the terms per dim, term x logit but for the top dim
    operands = (top + 2 * (top + 1) + (2 * top if n_dims == 1 else 0)) * itemsize  # per row: see Workspace
    one_pass_row = sum(block_widths) * kept + tile * scratch + operands
    floor = min(ROW_FLOOR, batch)
    if block_bytes is None:
        block_bytes = default_block_bytes(device, min(ROW_TARGET, batch) * one_pass_row)
    rows = min(batch, block_bytes // one_pass_row)
    if rows >= floor:
        return RowBlocks(rows, tile, True)
    cols = (block_bytes // floor - operands) // (kept + scratch)
    return RowBlocks(floor, max(1, min(tile, cols)), False)


#: Rows per chunk of the Triton GEMM backward that the default budget grows to reach, so that the chunk GEMMs run near
#: their peak.
GEMM_ROW_FLOOR = 1024


@dataclass(frozen=True)
class Chunks:
    """Rows and columns of one chunk of the Triton GEMM backward (multiples of the tile, or a whole group), and the
    bytes of its buffers."""

    rows: int
    cols: int
    bytes: int


def backward_chunks(batch: int, widest: int, tiles: dict, n_dims: int, entry_bytes: int, acc_bytes: int,
                    block_bytes: int | None, device: torch.device, max_entries: int = 2**31 - 1) -> Chunks:
    """The chunk shape of the Triton GEMM backward, and the bytes its buffers take.

    A chunk of R rows and C columns holds one GEMM operand of ``entry_bytes`` per entry and segment
    (``n_dims`` segments), and with several dimensions the per-tile partial sums of the radial terms:
    ``R * C * n_dims * entry_bytes + n_dims * (R * ceil(C / BLOCK_N) + C * R / BLOCK_M) * acc_bytes``.
    Rows are the largest multiple of BLOCK_M that fits ``block_bytes`` against whole blocks (``widest``
    columns); if not even BLOCK_M rows fit, BLOCK_M rows against the most columns (a multiple of
    BLOCK_N, at least one tile) that fit. With ``block_bytes=None`` the budget is
    ``default_block_bytes``, grown to reach ``GEMM_ROW_FLOOR`` rows. A chunk holds at most
    ``max_entries`` entries per segment (the kernel addresses its buffer with int32 offsets).
    """
    bm, bn = tiles["BLOCK_M"], tiles["BLOCK_N"]

    def size(rows: int, cols: int) -> int:
        partials = n_dims * (rows * _cdiv(cols, bn) + cols * _cdiv(rows, bm)) * acc_bytes if n_dims > 1 else 0
        return rows * cols * n_dims * entry_bytes + partials

    all_rows = _cdiv(batch, bm) * bm
    if block_bytes is None:
        block_bytes = default_block_bytes(device, size(min(all_rows, GEMM_ROW_FLOOR), widest))
    if size(bm, widest) <= block_bytes:
        rows = min(all_rows, bm * max(1, block_bytes // size(bm, widest)), bm * max(1, max_entries // (bm * widest)))
        return Chunks(rows, widest, size(rows, widest))
    cols = bn * max(1, block_bytes // size(bm, bn))  # size(BLOCK_M, k * BLOCK_N) is k * size(BLOCK_M, BLOCK_N)
    return Chunks(bm, cols, size(bm, cols))


# The MaxSim score (docs/design.md#late-interaction) ------------------------------------------------------------------

#: Documents per tile of the PyTorch MaxSim stage: enough columns that the product is efficient, few enough that a
#: tile of queries is tall.
DOC_ROWS = 16
#: The default budget of one tile's token products (more where one document tile of one query needs more); the
#: default budget is twice it, the other half for what a row block of queries keeps between its sweeps. Measured:
#: half of it costs 16% more time at ColBERT's shapes, for 4% less memory (docs/design.md#late-interaction).
TILE_FLOOR_BYTES = 8 * 2**20
#: Bytes per (query token, document) of a document tile's backward in the PyTorch MaxSim stage: the weight, the
#: argmax as int64, the token row it reads, the gradient row it adds into, and ``embedding_bag``'s bag of each index.
BACKWARD_BYTES = 4 + 8 + 8 + 8 + 8


def maxsim_block_bytes(device: torch.device, query_tokens: int, document_tokens: int, itemsize: int) -> int:
    """The MaxSim stage's budget when none is given: twice one tile's token products (``TILE_FLOOR_BYTES``, or what
    one document tile of one query needs), below the dense stage's least default where the device has room."""
    tile = max(TILE_FLOOR_BYTES, query_tokens * document_tokens * DOC_ROWS * itemsize)
    return min(2 * tile, default_block_bytes(device, 2 * tile))


def split_budget(block_bytes: int) -> tuple[int, int]:
    """The MaxSim stage's budget in two halves: one tile's token products, and what a row block keeps."""
    return block_bytes - block_bytes // 2, block_bytes // 2


def tile_rows(query_tokens: int, document_tokens: int, itemsize: int, product_bytes: int, keep_bytes: int,
              keep_per_query: int) -> tuple[int, int]:
    """Rows per document tile and per query tile of the PyTorch MaxSim stage: one tile's product
    ``(bd * Ld, bq * Lq)`` fits ``product_bytes``, and one query tile's kept scores and argmax
    (``keep_per_query`` bytes a query) fit ``keep_bytes``."""
    lq, ld = query_tokens, document_tokens
    doc_rows = max(1, min(DOC_ROWS, product_bytes // max(1, lq * ld * itemsize)))
    query_rows = max(1, product_bytes // max(1, lq * doc_rows * ld * itemsize))
    return doc_rows, max(1, min(query_rows, keep_bytes // max(1, keep_per_query)))


def argmax_dtype(width: int) -> torch.dtype:
    """The narrowest integer dtype that holds a token position below ``width`` (the PyTorch MaxSim stage's argmax)."""
    return torch.uint8 if width <= 256 else torch.int16 if width <= 2**15 else torch.int32


def kept_bytes(n_queries: int, n_documents: int, query_tokens: int, document_tokens: int, dim: int,
               acc_bytes: int, with_grad: bool, guide: str | None = None) -> int:
    """The bytes that the PyTorch MaxSim stage holds for a row block of ``n_queries`` queries: a score per document
    (which becomes its gradient), and with a guide of kind ``guide`` its mask and (but for ``"self"``) its scores;
    ``with_grad`` also an argmax per query token and document, the block's query tokens and their gradient in the
    compute dtype (``acc_bytes`` an element), and a document tile's backward temporaries (``BACKWARD_BYTES`` per
    query token and document of the tile, and the gathered rows)."""
    guided = 0 if guide is None else n_queries * n_documents * (1 + (0 if guide == "self" else acc_bytes))
    if not with_grad:
        return n_queries * n_documents * acc_bytes + guided
    index = torch.empty(0, dtype=argmax_dtype(document_tokens)).element_size()
    tile = query_tokens * (DOC_ROWS * BACKWARD_BYTES + dim * acc_bytes)
    return n_queries * (n_documents * (query_tokens * index + acc_bytes) + 2 * query_tokens * dim * acc_bytes + tile) \
        + guided


def slab_rows(n_queries: int, per_query: int, block_bytes: int) -> int:
    """Queries per slab of the Triton MaxSim stage: as many as keep ``per_query`` bytes each within ``block_bytes``,
    at least one."""
    return max(1, min(n_queries, block_bytes // max(1, per_query)))


def topk_bytes(query_tokens: int, top_k: int, acc_bytes: int) -> int:
    """What ``cgist.stage.xtr_thresholds.TopK`` holds for ``query_tokens`` query tokens: ``top_k`` values each, and the
    candidates it lists (at most a quarter as many) and merges (their values and rows, their order and place, a
    merge's rows): ``4 * acc_bytes + 24`` bytes per value kept, an upper bound."""
    return query_tokens * top_k * (4 * acc_bytes + 24)


def xtr_kept_bytes(query_tokens: int, n_documents: int, top_k: int, acc_bytes: int) -> int:
    """What the PyTorch XTR stage keeps for a query beyond MaxSim's ``kept_bytes``: each query token's maximum per
    document, each score's ``Z``, and its query tokens' ``TopK`` (``topk_bytes``)."""
    return n_documents * (query_tokens + 1) * acc_bytes + topk_bytes(query_tokens, top_k, acc_bytes)


def threshold_rows(top_k: int, tile_tokens: int, acc_bytes: int, product_bytes: int) -> int:
    """Query tokens per block of XTR's thresholds' sweep (``cgist.stage.xtr_thresholds.thresholds``): a block's
    similarities with a tile of ``tile_tokens`` document tokens (in ``acc_bytes`` elements, with a bool each: which
    pass) and its ``TopK`` (``topk_bytes``) fit ``product_bytes``; at least one."""
    per_token = tile_tokens * (acc_bytes + 1) + topk_bytes(1, top_k, acc_bytes)
    return max(1, product_bytes // per_token)


#: The queries an XTR row block holds by default, where the device has room: a GradCache mini-batch of 32 in one
#: block, so that each mini-batch sweeps the documents once (a row block reads every document token). The stage's
#: time and memory at this default: docs/performance.md#xtr.
XTR_ROW_QUERIES = 32


def xtr_block_bytes(device: torch.device, query_tokens: int, document_tokens: int, dim: int, n_documents: int,
                    top_k: int, itemsize: int, acc_bytes: int) -> int:
    """XTR's budget when none is given: MaxSim's (``maxsim_block_bytes``), grown so that the half a row block keeps
    holds ``XTR_ROW_QUERIES`` queries of the PyTorch stage with gradients and a guide (``kept_bytes``,
    ``xtr_kept_bytes``), within ``default_block_bytes``' cap."""
    per_query = kept_bytes(1, n_documents, query_tokens, document_tokens, dim, acc_bytes, True, "vectors") \
        + xtr_kept_bytes(query_tokens, n_documents, top_k, acc_bytes)
    floor = max(maxsim_block_bytes(device, query_tokens, document_tokens, itemsize), 2 * XTR_ROW_QUERIES * per_query)
    return default_block_bytes(device, floor)
