"""The streaming path's schedule and memory: how a call is cut into row blocks and column tiles (``plan``), and the
buffers every row block reuses (``Workspace``).

Block shape. Fewer rows per block make the products thin (and the gradient of the columns is read and written once
per row block), so the default budget grows until ``ROW_TARGET`` rows fit, up to an eighth of the memory available
and 1 GiB. Tiles of ``TILE_COLS`` columns bound the guide scratch. Both were chosen by measurement (``plan``). The
workspace is kept between calls on a CPU (``_thread_buffer``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .numerics import default_block_bytes

__all__ = ["ROW_FLOOR", "ROW_TARGET", "TILE_COLS", "Plan", "Workspace", "plan", "release_workspace"]

#: Rows per block that the default budget grows to reach (measured, see ``plan``).
ROW_TARGET = 1024
#: Fewer rows per block than this in one pass, and the call runs in two passes of this many (see ``plan``).
ROW_FLOOR = 256
#: Columns per tile on a CPU (measured, see ``plan``): wide enough that the per-tile overhead is small.
TILE_COLS = 4096


@dataclass(frozen=True)
class Plan:
    """How a call is tiled: ``rows`` per row block, ``cols`` per column tile, and whether in one pass.

    In one pass a row block keeps the tiles of all its columns from the softmax sums to the gradients; in two
    passes it recomputes them.
    """

    rows: int
    cols: int
    one_pass: bool


def plan(batch: int, block_widths: Sequence[int], top: int, n_dims: int, itemsize: int, block_bytes: int | None,
         device: torch.device = torch.device("cpu"), half: bool = False) -> Plan:
    """Choose the schedule for B = ``batch`` anchor rows against score blocks of ``block_widths`` columns.

    The budget bounds the workspace (``Workspace``), per row: the softmax terms of every kept column for
    each of the ``n_dims`` dimensions, one tile's guide scores (and with ``half`` products its score gradients
    as a half operand), and the row block's operands and product (a few R x ``top``). One pass keeps all ``sum(block_widths)`` columns. The rows per block are the budget
    divided by that; with the default budget (``block_bytes=None``) it first grows so that ``ROW_TARGET``
    rows fit, unless that exceeds an eighth of the available memory or 1 GiB. When fewer than
    ``min(ROW_FLOOR, B)`` rows fit, the call runs in two passes with ``min(ROW_FLOOR, B)`` rows per block and
    as many columns per tile as the budget allows (at least one, at most ``TILE_COLS`` on a CPU).

    Measured (``gist_loss_and_grads`` with gradients and statistics, fp32, D = Dg = 384, k = 1, 2 threads,
    one-pass schedules forced by the budget; median of 5 calls). B = N = 4096: 256 rows per block 981 ms,
    512 rows 892 ms, 1024 rows 870 ms, 2048 rows 881 ms (the bare GEMMs of the same shapes in blocks of
    those rows: 748, 726, 704, 697 ms); with 256 rows, tiles of 1024 columns 1067 ms, 2048 1018 ms, 4096
    988 ms, 8192 or 16384 within 1% of 4096. B = N = 1024: 762 rows 71.0 ms, one block of 1024 rows 66.3 ms.
    Larger blocks read and write the columns' gradients fewer times and keep the products' inner
    dimension wide. Hence ``ROW_TARGET`` = 1024 and ``TILE_COLS`` = 4096. ``ROW_FLOOR`` = 256 is the
    smallest one-pass block: a budget too small for it gets two passes of 256 rows instead, blocks that
    stay GEMM-efficient at any B for one more set of score products.
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
        return Plan(rows, tile, True)
    cols = (block_bytes // floor - operands) // (kept + scratch)
    return Plan(floor, max(1, min(tile, cols)), False)


_THREAD = threading.local()


def _thread_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``numel`` elements of scratch; on a CPU, carved from a buffer that this thread keeps between calls.

    A fresh buffer of many megabytes is paged in by the kernel at its first write, one page fault per 4 KiB
    (measured at B = 1024: ~7,500 faults per call, about a tenth of the loss stage's time). The kept buffer
    is the largest workspace this thread has used in ``dtype`` (at most the byte budget of that call),
    replaced when a call needs more; ``release_workspace`` frees it. CUDA's caching allocator already
    reuses its blocks.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buffers = _THREAD.__dict__.setdefault("buffers", {})
    kept = buffers.get(dtype)
    if kept is None or kept.numel() < numel:
        buffers[dtype] = kept = None  # freed before the larger one is allocated
        buffers[dtype] = kept = torch.empty(numel, dtype=dtype)
    return kept[:numel]


def release_workspace() -> None:
    """Free the workspace buffers that the calling thread keeps between CPU calls (``_thread_buffer``)."""
    _THREAD.__dict__.pop("buffers", None)


class Workspace:
    """Buffers that every row block reuses, so that its large tiles are neither allocated nor paged in again.

    ``terms``: the softmax terms of every dimension and block of a row block (one pass), or of one column chunk
    (two passes); ``products``: with several dimensions, each term times its shifted logit, laid out alike,
    for every dimension but the top one;
    ``guide``: one tile's guide scores; ``rows``: a row block's R x top product; ``shifted`` and ``weighted``:
    the anchor and positive rows as the score products and (one dimension) the columns' gradient products
    take them. All are views of one buffer (``_thread_buffer``).
    """

    def __init__(self, schedule: Plan, widths: Sequence[int], n_dims: int, top: int, dtype: torch.dtype,
                 device: torch.device, half: bool) -> None:
        rows, self.one_pass = schedule.rows, schedule.one_pass
        self.starts = [0, *torch.tensor(widths).cumsum(0).tolist()[:-1]]  # each group's first column
        self.rows = rows
        self.stride = rows * (sum(widths) if self.one_pass else schedule.cols)
        widest = rows * min(schedule.cols, max(widths))
        sizes = {"terms": n_dims * self.stride, "guide": widest, "rows": rows * top, "shifted": 2 * rows * (top + 1)}
        if n_dims == 1:
            sizes["weighted"] = 2 * rows * top
        if half:  # a tile's score gradients as a half operand: 2 per element
            sizes["half_tile"] = (widest + 1) // 2
        if n_dims > 1:  # each term times its logit, for the smaller dimensions' radial sums
            sizes["products"] = (n_dims - 1) * self.stride
        flat = _thread_buffer(sum(sizes.values()), dtype, device)
        self.flat, start = {}, 0
        for name, n in sizes.items():
            self.flat[name] = flat[start : start + n]
            start += n

    def view(self, name: str, shape: tuple[int, int], start: int = 0) -> Tensor:
        """A contiguous ``shape`` view of buffer ``name`` from element ``start``."""
        return self.flat[name][start : start + shape[0] * shape[1]].view(shape)

    def half_tile(self, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
        """A ``shape`` view in the half ``dtype`` of the buffer ``half_tile``."""
        return self.flat["half_tile"].view(dtype)[: shape[0] * shape[1]].view(shape)

    def terms(self, dim: int, group: int, lo: int, shape: tuple[int, int], name: str = "terms") -> Tensor:
        """The buffer ``name`` ("terms" or "products") of dimension ``dim`` for the tile of group number ``group``
        (``BoundGroup.index``) from column ``lo``.

        In one pass every tile of a row block has its own place; in two passes they all share one.
        """
        start = self.rows * (self.starts[group] + lo) if self.one_pass else 0
        return self.view(name, shape, dim * self.stride + start)
