"""Numerics shared by the oracle, the PyTorch streaming path and the Triton launcher; imports only torch.

Each rule of the loss that more than one path applies lives here once: the normalisation, the accumulation dtype,
the guide threshold, the guide-mask rule, the tie ids, and the half-precision products (``addmm_``, ``half_rows``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BLOCKS", "COUNT_FIELDS", "EPS", "STATS_FIELDS", "SUM_FIELDS", "HalfRows", "TieIndex", "addmm_", "available_bytes", "compute_dtype", "copy_rows", "default_block_bytes", "fingerprint_words", "guide_mask", "half_products", "half_rows", "rank_ids", "normalize", "row_chunks", "row_dots", "stack_rows", "threshold", "tie_ids", "token_fingerprints"]

#: Norm floor of the normalisation, as in ``torch.nn.CosineSimilarity``.
EPS = 1e-8

#: The statistics blocks, in the order of the loss: anchor-positive, anchor-anchor, positive-positive,
#: anchor-negatives, and the directions' query-to-query, document-to-query and document-to-document (every document
#: column). Each column group (``cgist.options.ColumnGroup.name``) counts in one of them.
BLOCKS = ("ap", "aa", "pp", "an", "qq", "dq", "dd")

#: The counters of one call's guide mask, in the order every backend returns them (``need_stats``), as an
#: int64 vector: entries masked per block (AP without its label; AN over all negative columns; the directions'
#: QQ, DQ and DD, DD with DN) and anchors whose candidates are all masked but the label. Exact at any size.
COUNT_FIELDS = (*(f"masked_{name}" for name in BLOCKS), "positive_only")
#: The sums over anchors of theta_i and T_i, returned beside the counts as a vector in the compute dtype.
SUM_FIELDS = ("theta_sum", "threshold_sum")
STATS_FIELDS = COUNT_FIELDS + SUM_FIELDS

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
    ``MAX_BLOCK_BYTES`` (a CPU keeps its buffers between calls: ``cgist.workspace.release_workspace``).
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


def copy_rows(chunks: Sequence[Tensor], out: Tensor) -> Tensor:
    """``out`` (rows x w) filled with the first w components of the row chunks, one after the other."""
    width = out.shape[1]
    return torch.cat([c if c.shape[1] == width else c[:, :width] for c in chunks], out=out)


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for rows x dim ``a`` and ``b``, as a batch of 1 x dim by dim x 1 products: no rows x
    dim temporary (``vecdot`` makes one)."""
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


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


#: Rows fingerprinted at once, at most; fewer when that keeps the float32 temporary (rows x a span of bytes) within
#: the column's own number of elements (``tie_ids``).
_FINGERPRINT_ROWS = 2048
_FINGERPRINT_SEED = 0x5EED
#: Bytes per exact float32 product: 512 signed bytes (magnitude <= 2^7) times coefficients below 2^8 sum to
#: less than 2^24 in magnitude.
_FINGERPRINT_SPAN, _FINGERPRINT_BITS = 512, 8
#: Sums per row: each agrees for two different rows with probability at most 2^-8, all 8 with 2^-64.
_FINGERPRINT_SUMS = 8
#: The prime modulus of the sums and of the two hashes that fold them into one key.
_FINGERPRINT_PRIME = 2**31 - 1


@functools.lru_cache(maxsize=32)
def _fingerprint_coefficients(width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Fixed pseudo-random coefficients for rows of ``width`` bytes, the same on every device, rank and run.

    ``(width x 8 integers below 2^8 as float32, 8 x 2 integers below the prime as int64)``. Byte k's coefficients
    do not depend on ``width`` (each span of 512 bytes has its own seed), so a row and the same row padded with
    zero bytes get the same key. Made once per (width, device): a copy from host memory to a GPU waits for its
    stream.
    """
    spans = [torch.randint(0, 2**_FINGERPRINT_BITS, (_FINGERPRINT_SPAN, _FINGERPRINT_SUMS), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(_FINGERPRINT_SEED + 1 + s))
             for s in range(-(-width // _FINGERPRINT_SPAN))]
    fold = torch.randint(0, _FINGERPRINT_PRIME, (_FINGERPRINT_SUMS, 2), dtype=torch.int64,
                         generator=torch.Generator().manual_seed(_FINGERPRINT_SEED))
    return torch.cat(spans)[:width].to(torch.float32).to(device), fold.to(device)


def fingerprint_words(words: Tensor) -> Tensor:
    """A 62-bit key (int64) of each row of 32-bit words: equal rows get equal keys, two different rows equal
    ones with probability about 2^-62.

    Only integer and float32 arithmetic, all of it exact, so a row's key is the same on every device, at every
    position and at every matmul precision. The row's bytes, read as signed integers, times 8 columns of random
    integers below 2^8 are float32 matrix products over spans of 512 bytes: every partial sum is an integer of
    magnitude below 2^24, exact in any order, also when the product rounds its operands to tf32 or bf16 (8
    significant bits fit both). The spans' sums add up exactly in int64 and are reduced modulo the prime
    p = 2^31 - 1. For two different rows, fix every coefficient but one at a byte where they differ (by
    d, 0 < |d| < 2^8): its 2^8 values give 2^8 different sums modulo p (their differences are below 2^16 in
    magnitude), so at most one makes the sums agree, and all 8 agree with probability at most 2^-64. Two
    random linear hashes modulo p then fold the 8 residues into ``h1 * p + h2``, equal for two different
    residue vectors with probability 1/p^2, about 2^-62.
    """
    data = words.contiguous().view(torch.int8)  # rows x bytes
    width = data.shape[1]
    coefficients, fold = _fingerprint_coefficients(width, words.device)
    sums = None
    for lo in range(0, width, _FINGERPRINT_SPAN):
        hi = lo + _FINGERPRINT_SPAN
        part = (data[:, lo:hi].to(torch.float32) @ coefficients[lo:hi]).to(torch.int64)
        sums = part if sums is None else sums.add_(part)
    # Residues below 2^31 times coefficients below 2^31, reduced; 8 of them sum below 2^34: no int64 overflow.
    sums.remainder_(_FINGERPRINT_PRIME)
    h1, h2 = ((sums * fold[:, j]).remainder_(_FINGERPRINT_PRIME).sum(dim=1) % _FINGERPRINT_PRIME for j in (0, 1))
    return h1 * _FINGERPRINT_PRIME + h2


def token_fingerprints(input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """A 62-bit key (int64) per row of token ids: rows with the same tokens get the same key, whatever their padding.

    ``input_ids`` (rows x length) and ``attention_mask`` (1 on the tokens, 0 on the padding; all ones if None).
    Each token enters as ``id + 1`` and padding as 0, and ``fingerprint_words`` gives zero words no weight, so the
    key of a text depends only on its tokens, not on the width its batch was padded to.
    """
    words = input_ids.to(torch.int32) + 1  # token ids are vocabulary indices, far below 2^31 - 1
    if attention_mask is not None:
        words = words * (attention_mask != 0)
    return fingerprint_words(words)


def _fingerprint(rows: Tensor) -> Tensor:
    """``fingerprint_words`` of each row's bits (fp32: one 32-bit word per element, fp64: two)."""
    return fingerprint_words((rows + 0.0).view(torch.int32))  # -0.0 and 0.0 compare equal, so they must hash equal


def tie_ids(columns: Sequence[Tensor], dtype: torch.dtype, *, normalized: bool = False,
            text_ids: Sequence[Tensor] | None = None) -> list[Tensor]:
    """An integer id per row of each guide column: equal ids for rows that tie, the same text or the same vector.

    A candidate ties with theta_i when its guide score is theta_i itself: when it is the same text as theta_i's
    partner. sentence-transformers computes every guide score by one element-wise formula, so there a bitwise equal
    guide vector scores exactly theta_i, and a duplicate embedded with other padding (another mini-batch) differs by
    rounding, on either side. cgist decides the tie by identity instead of by the rounding of two different products:

    * with ``text_ids`` (one id per row of each column, equal for equal texts: the drop-ins pass the fingerprints of
      the token ids), those are the tie ids, so that a duplicate text ties wherever and however it was embedded;
    * without, each row of a column, normalised in ``dtype`` (``normalize``; pass ``normalized=True`` for columns
      that already are, in ``dtype``), gets a 64-bit fingerprint of its bits, computed a few thousand rows at a
      time; the id is the rank of the fingerprint among all of them (sorted on the device, no host sync). Memory is
      O(rows). Two given different rows get equal fingerprints with probability about 2^-62
      (``fingerprint_words``); over the ~10^12 row pairs of a million-row step that is about 2 * 10^-7. A
      collision would make one candidate count as a tie with theta_i: it would be masked exactly when
      theta_i > T_i instead of by its own guide score, in one step.
    """
    if text_ids is not None:
        return list(text_ids)

    def chunk_rows(column: Tensor) -> int:
        span = min(_FINGERPRINT_SPAN, column.shape[1] * torch.finfo(dtype).bits // 8)
        return max(1, min(_FINGERPRINT_ROWS, column.numel() // span))

    return rank_ids([torch.cat([_fingerprint(chunk if normalized else normalize(chunk, dtype)[0])
                                for chunk in column.split(chunk_rows(column))]) for column in columns])


def rank_ids(keys: Sequence[Tensor]) -> list[Tensor]:
    """int32 ids of integer ``keys`` (one tensor per column): equal keys, in any column, get equal ids.

    The id is the rank of the key among all of them, found by one sort on the device (no host sync).
    """
    sizes = [k.numel() for k in keys]
    ordered, order = torch.cat([k.reshape(-1) for k in keys]).sort()
    ids = torch.empty_like(order, dtype=torch.int32)
    ids[order] = torch.searchsorted(ordered, ordered, side="left").to(torch.int32)
    return list(ids.split(sizes))


@functools.cache
def half_accumulation(device_type: str) -> str:
    """How ``out (fp32) += a @ b`` runs for half operands on ``device_type``: one call (``"addmm"``), a product then
    an add (``"mm"``), or the operands widened first (``"upcast"``).

    Recent torch multiplies bf16 and fp16 into fp32 directly on CUDA (``out_dtype``), on the tensor cores; probed
    once on tiny tensors. Elsewhere (CPU) it has no such call.
    """
    if device_type != "cuda":
        return "upcast"
    out = torch.zeros(2, 2, device=device_type)
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
    try:
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
        return "addmm"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return "mm"
    except (RuntimeError, TypeError, NotImplementedError):
        return "upcast"


def addmm_(out: Tensor, a: Tensor, b: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``out = beta * out + alpha * (a @ b)``, accumulated in ``out``'s dtype (float32 for half operands), in place.

    Half operands are multiplied into float32 where torch can (``half_accumulation``); widening them first gives the
    same products, as a product of two half values is exact in float32. With ``beta = 0`` the old ``out`` is not
    read (a NaN there stays out).
    """
    if a.dtype == out.dtype:
        return out.addmm_(a, b, beta=beta, alpha=alpha)
    how = half_accumulation(out.device.type)
    if how == "addmm":
        return torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=out.dtype, out=out)
    if how == "mm":
        product = torch.mm(a, b, out_dtype=out.dtype)
        return out.copy_(product).mul_(alpha) if beta == 0 else out.mul_(beta).add_(product, alpha=alpha)
    return out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta, alpha=alpha)


@dataclass
class HalfRows:
    """A column's rows as half-precision operands of the score products (``half_products``).

    ``y`` holds the rows as given, or, as fp16 for bf16 rows, scaled by a power of two; ``inv`` is the factor that
    normalises them (``x_hat = inv * y``, in fp32), so a product of two ``y`` is exact and the normalisation is
    applied after it. ``x_hat`` (student only) is the normalised rows rounded to the half dtype, the operand of the
    gradient products.
    """

    y: Tensor
    inv: Tensor
    x_hat: Tensor | None = None

    def rows(self, start: int, stop: int) -> HalfRows:
        return HalfRows(*(None if t is None else t[start:stop] for t in (self.y, self.inv, self.x_hat)))


def half_rows(x: Tensor, norm: Tensor, dtype: torch.dtype, x_hat: Tensor | None) -> HalfRows:
    """``x`` (rows x dim, any floating dtype) as a ``HalfRows`` in ``dtype``, with ``norm`` = ||x|| (rows x 1, fp32).

    bf16 rows bound for fp16 are first scaled by a power of two that brings their largest component into
    [0.5, 1): every component within 2^14 of it converts exactly (bf16's 8 significant bits fit in fp16's 11),
    a smaller one with an error below 2^-25 of the largest, so a cosine moves by less than 2^-24 sqrt(dim).
    """
    inv = 1.0 / norm.squeeze(1).clamp_min(EPS)
    if x.dtype == torch.bfloat16 and dtype == torch.float16:
        exponent = torch.frexp(x.abs().amax(dim=1).float())[1]
        y = torch.ldexp(x.float(), -exponent.unsqueeze(1)).to(dtype)
        inv = torch.ldexp(inv, exponent)
    else:
        y = x.to(dtype)
    return HalfRows(y, inv, None if x_hat is None else x_hat.to(dtype))


def half_products(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The half dtype in which rows of ``dtype`` enter the score products on ``device``, or None (compute dtype).

    On CUDA (and ROCm) a bf16 or fp16 column is multiplied on the tensor cores: fp16 as it is, bf16 as it is where
    the GPU has bf16 tensor cores (sm_80 and newer) and as fp16 below (``half_rows``), accumulating in float32.
    This is the path "auto" takes below sm_80, where Triton emits no tensor-core instructions. Elsewhere, and for
    float32 rows, the products run in the compute dtype.

    The streaming path (one dimension) then multiplies the inputs as given (bf16 as fp16 below sm_80, each row
    scaled by a power of two), so that every score product is exact, with the normalisation, the scale and the shift
    applied to the float32 result; its gradient products take the softmax probabilities and the normalised rows
    rounded to the half dtype (a relative error of one half-ulp each).
    """
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return dtype
