"""Numerics shared by the oracle, the PyTorch streaming path and the Triton launcher; imports only torch.

Each rule of the loss that more than one path applies lives here once: the normalisation and its
backward, the accumulation dtype, the guide threshold, the guide-mask rule and the tie ids.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["EPS", "STATS_FIELDS", "TieIndex", "available_bytes", "compute_dtype", "default_block_bytes", "guide_mask", "normalize", "normalize_backward_", "row_chunks", "row_dots", "stack_rows", "threshold", "tie_ids"]

#: Norm floor of the normalisation, as in ``torch.nn.CosineSimilarity``.
EPS = 1e-8

#: The counters of one call's guide mask, in the order every backend returns them (``need_stats``), as
#: one float64 vector: entries masked per block (AP without its label; AN over all negative columns),
#: anchors whose candidates are all masked but the label, and the sums over anchors of theta_i and T_i.
STATS_FIELDS = ("masked_ap", "masked_aa", "masked_pp", "masked_an", "positive_only", "theta_sum", "threshold_sum")

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
    """The score-buffer budget when none is given (``block_bytes=None``), shared by both backends.

    At least ``MIN_BLOCK_BYTES``, grown to ``floor_bytes`` (what a backend needs for blocks of an
    efficient shape), but never above an eighth of the memory available on ``device``, nor above
    ``MAX_BLOCK_BYTES`` (a CPU keeps its buffers between calls: ``cgist.streaming.release_workspace``).
    """
    cap = min(available_bytes(device) // MEMORY_SHARE, MAX_BLOCK_BYTES)
    return max(min(max(MIN_BLOCK_BYTES, floor_bytes), cap), 1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_chunks(column: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """A column of embeddings as the list of its row chunks: itself for a tensor."""
    return [column] if isinstance(column, Tensor) else list(column)


def stack_rows(column: Tensor | Sequence[Tensor]) -> Tensor:
    """A column as one tensor: its row chunks concatenated (a copy), or the tensor itself."""
    chunks = row_chunks(column)
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def normalize(x: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(x / max(||x||_2, eps), ||x||_2)`` row-wise, in ``dtype`` (default: x's own); differentiable."""
    x = x if dtype is None else x.to(dtype)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x / norm.clamp_min(EPS), norm


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for rows x dim ``a`` and ``b``, as a batch of 1 x dim by dim x 1 products: no rows x
    dim temporary (``vecdot`` makes one)."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


def normalize_backward_(x_hat: Tensor, norm: Tensor, grad_hat: Tensor) -> Tensor:
    """Gradient through ``x / max(||x||, eps)``, in place of ``grad_hat``: ``(g - x_hat (x_hat . g)) / ||x||``.

    Rows whose norm was clamped get ``g / eps``. Shapes: ``x_hat`` and ``grad_hat`` rows x dim, ``norm`` rows x 1.
    """
    radial = row_dots(x_hat, grad_hat).unsqueeze(-1).masked_fill_(norm < EPS, 0.0)
    return grad_hat.addcmul_(x_hat, radial, value=-1.0).div_(norm.clamp_min(EPS))


def threshold(theta: Tensor, margin: float, relative: bool) -> Tensor:
    """Guide threshold ``T_i`` above which a candidate is masked (strictly greater)."""
    return theta - theta.abs() * margin if relative else theta - margin


class TieIndex:
    """The tie ids of a block's columns, sorted, to find where a column ties with a row's partner.

    Row i ties with column j when ``col_ids[j] == partner_ids[i]``: the column's normalised guide vector
    equals that of theta_i's partner. Ties are few (the label itself, and duplicate texts), so they are
    found by binary search instead of comparing every row with every column.
    """

    def __init__(self, col_ids: Tensor) -> None:
        self.sorted, self.order = col_ids.sort()

    def pairs(self, partner_ids: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """``(rows, cols)`` of the ties among columns ``lo:hi``, with ``cols`` counted from ``lo``."""
        first = torch.searchsorted(self.sorted, partner_ids, side="left")
        counts = torch.searchsorted(self.sorted, partner_ids, side="right") - first
        rows = torch.repeat_interleave(torch.arange(partner_ids.shape[0], device=counts.device), counts)
        within = torch.arange(rows.shape[0], device=counts.device) - (torch.cumsum(counts, 0) - counts)[rows]
        cols = self.order[first[rows] + within]
        keep = (cols >= lo) & (cols < hi)
        return rows[keep], cols[keep] - lo


def guide_mask(guide: Tensor, limit: Tensor, theta_masked: Tensor, ties: tuple[Tensor, Tensor],
               out: Tensor | None = None) -> Tensor:
    """True where a score is masked: its guide score is strictly above the row's threshold ``limit``.

    Row i's scores pair a row vector with each column; theta_i pairs the same row vector with a partner
    (the positive for anchor rows, the anchor for positive rows). A column equal to that partner is a tie
    with theta_i and is masked exactly when ``theta_masked[i]`` (theta_i > T_i), whatever the rounding of
    its guide score; ``ties`` holds the ``(rows, cols)`` of those entries (``TieIndex.pairs``).
    Shapes: ``guide`` rows x cols, ``limit`` and ``theta_masked`` rows x 1. The mask is written into
    ``out`` if given, in its dtype (bool, or 0.0 / 1.0 in a floating one).
    """
    mask = torch.gt(guide, limit) if out is None else torch.gt(guide, limit, out=out)
    rows, cols = ties
    mask[rows, cols] = theta_masked[rows, 0].to(mask.dtype)
    return mask


#: Rows fingerprinted at once; bounds the float64 temporaries to this many rows x dim.
_FINGERPRINT_ROWS = 2048
_FINGERPRINT_SEED = 0x5EED
#: Each fingerprint sum of two different rows collides with probability 2^-b (b bits per coefficient);
#: there are enough sums for 2^-80 together.
_FINGERPRINT_BITS = 80


@functools.lru_cache(maxsize=32)
def _fingerprint_coefficients(width: int, device: torch.device) -> Tensor:
    """``width x m`` fixed pseudo-random integers below 2^b, as float64: the same on every device, rank and run.

    A row of ``width`` 32-bit integers times them sums to less than 2^53 in magnitude, so every partial sum
    of a float64 matrix product is an exact integer, in any order; b = 52 - 31 - ceil(log2(width)) and
    m = ceil(80 / b). Made once per (width, device): a copy from host memory to a GPU waits for its stream.
    """
    bits = 52 - 31 - max(1, (width - 1).bit_length())
    if bits < 1:
        raise ValueError(f"guide rows of {width} 32-bit words are too wide to fingerprint exactly")
    gen = torch.Generator().manual_seed(_FINGERPRINT_SEED + width)
    count = -(-_FINGERPRINT_BITS // bits)
    return torch.randint(0, 2**bits, (width, count), generator=gen, dtype=torch.int64).to(torch.float64).to(device)


@functools.lru_cache(maxsize=32)
def _mix_constants(count: int, device: torch.device) -> Tensor:
    """``count`` fixed odd pseudo-random 64-bit integers that mix the fingerprint sums into one value."""
    gen = torch.Generator().manual_seed(_FINGERPRINT_SEED)
    return (torch.randint(-(2**63), 2**63 - 1, (count,), generator=gen, dtype=torch.int64) | 1).to(device)


def _fingerprint(rows: Tensor) -> Tensor:
    """A 64-bit hash of each row's bits: equal rows hash equal, different rows collide with odds ~2^-64.

    The row's bits are read as 32-bit integers (one per fp32 element, two per fp64 one) and multiplied by
    m vectors of random b-bit integers (``_fingerprint_coefficients``) in one float64 matrix product, exact
    because every partial sum is an integer below 2^53. For two different rows each sum collides with
    probability at most 2^-b (fix every coefficient but one where the rows differ: at most one value of
    it makes the sums equal), all m of them with at most 2^-80. The m sums are then mixed into one value
    (about 2^-64 more).
    """
    words = (rows + 0.0).view(torch.int32)  # -0.0 and 0.0 compare equal, so they must hash equal
    coefficients = _fingerprint_coefficients(words.shape[1], rows.device)
    # Word by word of each element (fp64: 2), so that the float64 temporary is rows x dim.
    planes = words.shape[1] // rows.shape[1]
    sums = sum(words[:, p::planes].to(torch.float64) @ coefficients[p::planes] for p in range(planes))
    sums = sums.to(torch.int64)
    return (sums * _mix_constants(sums.shape[1], rows.device)).sum(dim=1)  # modulo 2^64


def tie_ids(columns: Sequence[Tensor], dtype: torch.dtype, *, normalized: bool = False) -> list[Tensor]:
    """An int32 id per row of each guide column: equal ids for rows whose normalised vectors are equal.

    sentence-transformers computes every guide score by one element-wise formula, so a candidate whose
    guide vector equals theta's partner scores exactly theta. Matrix products give no such promise (BLAS
    kernels differ with shape and position), so the tie is decided by identity instead of by the rounding
    of two different products.

    Each row of a column, normalised in ``dtype`` (``normalize``; pass ``normalized=True`` for columns that
    already are, in ``dtype``), gets a 64-bit fingerprint of its bits,
    computed a few thousand rows at a time; the id is the rank of the fingerprint among all of them
    (sorted on the device, no host sync). Memory is O(rows). The fingerprint's sums all collide for two
    given different rows with probability at most 2^-80 (``_fingerprint``), and mixing them into 64 bits
    adds about 2^-64; over the ~10^12 row pairs of a million-row step that is about 10^-7. A collision
    would make one candidate count as a tie with theta_i: it would be masked exactly when theta_i > T_i
    instead of by its own guide score, in one step.
    """
    prints = torch.cat([
        _fingerprint(chunk if normalized else normalize(chunk, dtype)[0])
        for column in columns for chunk in column.split(_FINGERPRINT_ROWS)
    ])
    ordered, order = prints.sort()
    ids = torch.empty_like(order, dtype=torch.int32)
    ids[order] = torch.searchsorted(ordered, ordered, side="left").to(torch.int32)
    return list(ids.split([c.shape[0] for c in columns]))
