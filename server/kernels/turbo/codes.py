"""Triton device functions for the turbo row layout (format.py documents it) and codebook lookups.

Indices are unpacked with shifts and masks in registers. Centroids come either from a
chain of selects against the 2^bits codebook scalars (exact; the store kernel's norm
correction) or from the codebook's odd interpolating polynomial (a few multiply-adds per
value; attention): no per-element gathers from global memory.
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
def unpack_fields(packed, ROWS: tl.constexpr, NBYTES: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, NBYTES] bytes (int32) -> [ROWS, NBYTES * 8 / WIDTH] fields, in element order."""
    PER_BYTE: tl.constexpr = 8 // WIDTH
    shifts = (tl.arange(0, PER_BYTE) * WIDTH)[None, None, :]
    f = (packed[:, :, None] >> shifts) & ((1 << WIDTH) - 1)
    return tl.reshape(f, (ROWS, NBYTES * PER_BYTE))


@triton.jit
def load_indices(row_ptrs, mask, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Indices [ROWS, D] of the rows starting at row_ptrs [ROWS] (uint8 pointers)."""
    if BITS == 3:
        low = tl.load(row_ptrs[:, None] + tl.arange(0, D // 4)[None, :], mask=mask[:, None], other=0)
        high = tl.load(row_ptrs[:, None] + D // 4 + tl.arange(0, D // 8)[None, :], mask=mask[:, None], other=0)
        return unpack_fields(low.to(tl.int32), ROWS, D // 4, 2) | (unpack_fields(high.to(tl.int32), ROWS, D // 8, 1) << 2)
    else:
        packed = tl.load(row_ptrs[:, None] + tl.arange(0, D * BITS // 8)[None, :], mask=mask[:, None], other=0)
        return unpack_fields(packed.to(tl.int32), ROWS, D * BITS // 8, BITS)


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
def centroid_by_polynomial(idx, coef_ptr, BITS: tl.constexpr):
    """centroids[idx] to ~1e-7 relative, from Codebook.odd_polynomial (coefficients at coef_ptr)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    t = idx.to(tl.float32) * (2.0 / ((1 << BITS) - 1)) - 1.0
    t2 = t * t
    acc = tl.zeros(idx.shape, tl.float32) + tl.load(coef_ptr + HALF - 1)
    for j in tl.static_range(HALF - 1):
        acc = acc * t2 + tl.load(coef_ptr + HALF - 2 - j)
    return acc * t
