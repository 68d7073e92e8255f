"""Triton device functions for the turbo row layout (format.py documents it) and codebook lookups.

Indices are unpacked with shifts and masks in registers (attention reads 32-bit words and
splits them with a tl.join tree, so every field stays in the thread that loaded it).
Centroids come either from a chain of selects against the 2^bits codebook scalars (exact;
the store kernel's norm correction) or from the codebook's odd interpolating polynomial (a
few multiply-adds per value; attention): no per-element gathers from global memory.
"""

import triton
import triton.language as tl


@triton.jit
def pack_fields(fields, ROWS: tl.constexpr, N: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, N] int32 fields of WIDTH bits -> [ROWS, N * WIDTH / 8] bytes (int32), first field lowest."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    f = tl.reshape(fields, (ROWS, N // PER_BYTE, PER_BYTE))
    shifts = (tl.arange(0, PER_BYTE) * WIDTH)[None, None, :]
    return tl.sum(f << shifts, axis=2)


@triton.jit
def split_words(words, WIDTH: tl.constexpr, LEVELS: tl.constexpr, UP: tl.constexpr):
    """[R, C] int32 words -> [R, C * 2^LEVELS]: field k of each word at bit UP (NOT masked).

    A halving tree of tl.join: level l pairs every word with itself shifted right by half of
    its remaining fields, so field k = sum of the level choices ends up at the row-major
    position k. The joined axes stay inside the thread that loaded the word: about one shift
    per value and no shared-memory round trip (a broadcast [R, C, N] shift spreads the fields
    of one word over N threads, each re-reading the word). UP (< half a word) lifts every
    field at the first level, where no bit of the half kept low is lost yet.
    """
    HALF_BITS: tl.constexpr = WIDTH << (LEVELS - 1)
    x = tl.join(words << UP, words >> (HALF_BITS - UP))
    for level in tl.static_range(1, LEVELS):
        x = tl.join(x, x >> (WIDTH << (LEVELS - 1 - level)))
    return tl.reshape(x, (words.shape[0], words.shape[1] << LEVELS))


@triton.jit
def load_indices(row_ptrs, mask, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, UP: tl.constexpr = 0):
    """Indices [ROWS, D] << UP of the rows starting at row_ptrs [ROWS] (uint8 pointers; rows start
    on 4-byte boundaries, as format.py's do), read as 32-bit words.

    turbo3 reads its low plane as 32-bit words (16 values each) and its high plane as 16-bit
    words (16 values each), splits both with the same tree and merges bit 2 with one LOP3.
    """
    words_ptrs = row_ptrs.to(tl.pointer_type(tl.int32))
    if BITS == 3:
        low = tl.load(words_ptrs[:, None] + tl.arange(0, D // 16)[None, :], mask=mask[:, None], other=0)
        high_ptrs = (row_ptrs + D // 4).to(tl.pointer_type(tl.uint16))
        high = tl.load(high_ptrs[:, None] + tl.arange(0, D // 16)[None, :], mask=mask[:, None], other=0)
        low = split_words(low, 2, 4, UP)
        high = split_words(high.to(tl.int32), 1, 4, UP + 2)  # bit j of a half-word -> bit 2 + UP of field j
        return (low & (3 << UP)) | (high & (4 << UP))
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        words = tl.load(words_ptrs[:, None] + tl.arange(0, D // PER_WORD)[None, :], mask=mask[:, None], other=0)
        return split_words(words, BITS, 5 - (BITS // 2), UP) & (((1 << BITS) - 1) << UP)  # 16 or 8 fields per word


@triton.jit
def store_indices(idx, row_ptrs, mask, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack indices [ROWS, D] into the rows starting at row_ptrs [ROWS] (inverse of load_indices)."""
    if BITS == 3:
        low = pack_fields(idx & 3, ROWS, D, 2)
        high = pack_fields(idx >> 2, ROWS, D, 1)
        tl.store(row_ptrs[:, None] + tl.arange(0, D // 4)[None, :], low.to(tl.uint8), mask=mask[:, None])
        tl.store(row_ptrs[:, None] + D // 4 + tl.arange(0, D // 8)[None, :], high.to(tl.uint8), mask=mask[:, None])
    else:
        packed = pack_fields(idx, ROWS, D, BITS)
        tl.store(row_ptrs[:, None] + tl.arange(0, D * BITS // 8)[None, :], packed.to(tl.uint8), mask=mask[:, None])


@triton.jit
def centroid_of(idx, centroids_ptr, BITS: tl.constexpr):
    """centroids[idx] as float32, by selects against the 2^BITS codebook scalars."""
    value = tl.zeros(idx.shape, tl.float32) + tl.load(centroids_ptr)
    for k in tl.static_range(1, 1 << BITS):
        value = tl.where(idx == k, tl.load(centroids_ptr + k), value)
    return value


@triton.jit
def centroid_by_polynomial(idx2, coef_ptr, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """centroids[idx] in DTYPE from Codebook.odd_polynomial (coefficients at coef_ptr), idx2 = 2 idx.

    float32 reproduces the centroids to ~1e-7 relative. float16 stays within 1e-3 relative of
    them (about two fp16 ulps; tests/kernels/turbo/test_codes.py; bf16 K/V storage rounds to
    3.9e-3) and packs two values per instruction (HFMA2). Either way 2 idx + 1 becomes a float
    by OR-ing it into the mantissa of 2^23 (fp32) or 1024 (fp16) and one exact subtraction
    (no int-to-float conversion, a quarter-rate instruction on sm_90); load_indices(UP=1)
    gives 2 idx at no extra cost.
    """
    HALF: tl.constexpr = 1 << (BITS - 1)
    LAST: tl.constexpr = (1 << BITS) - 1
    # odd = 2 idx - LAST (odd integers, exact): 2 idx + 1 sits in the mantissa of 1024 / 2^23.
    if DTYPE == tl.float16:
        odd = (idx2 | 0x6401).to(tl.int16).to(tl.float16, bitcast=True) - (1025.0 + LAST)
    else:
        odd = (idx2 | 0x4B000001).to(tl.float32, bitcast=True) - (8388609.0 + LAST)
    t = odd * (1.0 / LAST)
    t2 = t * t
    acc = tl.zeros(idx2.shape, DTYPE) + tl.load(coef_ptr + HALF - 1).to(DTYPE)
    for j in tl.static_range(HALF - 1):
        acc = acc * t2 + tl.load(coef_ptr + HALF - 2 - j).to(DTYPE)
    return acc * t
