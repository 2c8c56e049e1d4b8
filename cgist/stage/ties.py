"""Identity, where rounding must not decide: the tie ids of the guide's columns and the texts' fingerprints.

A candidate ties with theta_i when it is the same text as theta_i's partner (``tie_ids``): the drop-ins key texts by
fingerprints of their token ids (``token_fingerprints``), and without text ids equal normalised guide vectors tie,
keyed by fingerprints of their bits. Every key is exact integer arithmetic (``fingerprint_words``), the same on every
device and at every matmul precision; ``rank_ids`` turns keys into dense int32 ids with one sort on the device, and
``TieIndex`` finds a block's ties by binary search. Imports only torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from .numerics import normalize

__all__ = ["TieIndex", "fingerprint_words", "rank_ids", "tie_ids", "token_fingerprints"]


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
