"""The streaming path's memory: the buffers every row block reuses (``Workspace``), cut to the row blocks that
``cgist.stage.budget.row_blocks`` chose, and kept between calls on a CPU (``_thread_buffer``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import Tensor

from ..budget import RowBlocks

__all__ = ["Workspace", "release_workspace"]


_THREAD = threading.local()


def _thread_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``numel`` elements of scratch; on a CPU, carved from a buffer that this thread keeps between calls.

    A fresh buffer of many megabytes is paged in by the kernel at its first write, one page fault per 4 KiB (a
    tenth of the loss stage's time at B = 1024: docs/performance.md#memory). The kept buffer
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

    def __init__(self, schedule: RowBlocks, widths: Sequence[int], n_dims: int, top: int, dtype: torch.dtype,
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
