"""The workspace budget (``block_bytes``): the bytes of score buffers a loss-stage call may hold at once, and how each
backend cuts its work to fit. This module is its only owner.

* ``default_block_bytes``: the budget when none is given, shared by both backends.
* The PyTorch streaming path: ``row_blocks`` cuts a call into row blocks and column tiles (``RowBlocks``), sized
  by measurement (``ROW_TARGET``, ``ROW_FLOOR``, ``TILE_COLS``).
* The Triton GEMM backward: ``backward_chunks`` cuts it into chunks of rows and columns (``Chunks``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "GEMM_ROW_FLOOR", "MAX_BLOCK_BYTES", "MEMORY_SHARE", "MIN_BLOCK_BYTES", "ROW_FLOOR", "ROW_TARGET", "TILE_COLS", "Chunks",
    "RowBlocks", "available_bytes", "backward_chunks", "default_block_bytes", "row_blocks",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: Smallest default budget, bytes of score buffers held at once.
MIN_BLOCK_BYTES = 16 * 2**20
#: The default budget never exceeds this share of the memory available to the process.
MEMORY_SHARE = 8
#: Nor this many bytes (blocks of 1024 rows fit up to B = 32k at D = 384 with one dimension).
MAX_BLOCK_BYTES = 2**30


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free memory, or the host's MemAvailable (physical memory elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_block_bytes(device: torch.device, floor_bytes: int) -> int:
    """The workspace budget when none is given (``block_bytes=None``), shared by both backends.

    At least ``MIN_BLOCK_BYTES``, grown to ``floor_bytes`` (what a backend needs for blocks of an
    efficient shape), but never above an eighth of the memory available on ``device``, nor above
    ``MAX_BLOCK_BYTES`` (a CPU keeps its buffers between calls: ``cgist.stage.pytorch.workspace.release_workspace``).
    """
    cap = min(available_bytes(device) // MEMORY_SHARE, MAX_BLOCK_BYTES)
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
    tile = max(block_widths) if device.type == "cuda" else min(TILE_COLS, max(block_widths))
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
    cols = bn * max(1, block_bytes // size(bm, bn))
    while cols > bn and size(bm, cols) > block_bytes:  # the partials' ceil makes size slightly superlinear
        cols -= bn
    return Chunks(bm, cols, size(bm, cols))
