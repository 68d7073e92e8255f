"""Device functions of server/kernels/turbo/codes.py the decode kernel uses, run in small test kernels.

Indices come back exactly as format.unpack_indices (the format's definition) gives them, for every
value at every position; centroids match the float64 codebook within each dtype's stated bound.
"""

import pytest
import torch
import triton
import triton.language as tl

from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.codes import centroid_by_polynomial, load_indices
from server.kernels.turbo.format import pack_indices, unpack_indices


@triton.jit
def _indices_kernel(codes_ptr, out_ptr, num_rows, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                    UP: tl.constexpr):
    rows = tl.arange(0, ROWS)
    valid = rows < num_rows
    idx = load_indices(codes_ptr + rows * (D * BITS // 8), valid, ROWS, D, BITS, UP)
    tl.store(out_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], idx, mask=valid[:, None])


@triton.jit
def _centroid_kernel(idx_ptr, coef_ptr, out_ptr, N: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr):
    offs = tl.arange(0, N)
    value = centroid_by_polynomial(tl.load(idx_ptr + offs), coef_ptr, BITS, DTYPE)
    tl.store(out_ptr + offs, value.to(tl.float32))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("up", [0, 1])
def test_indices_from_words_are_the_format_indices_for_every_value_at_every_position(bits, head_dim, up):
    """Row v*D + e holds value v at position e over a different background value; last rows masked off."""
    values = torch.arange(2**bits)
    idx = ((values + 1) % 2**bits).repeat_interleave(head_dim)[:, None].repeat(1, head_dim)
    idx[torch.arange(len(idx)), torch.arange(head_dim).repeat(2**bits)] = values.repeat_interleave(head_dim)
    idx = torch.cat([idx, torch.randint(0, 2**bits, (5, head_dim))]).int()
    codes = pack_indices(idx, bits)
    rows = triton.next_power_of_2(len(idx))
    out = torch.full((rows, head_dim), -1, dtype=torch.int32)
    _indices_kernel[(1,)](codes, out, len(idx), ROWS=rows, D=head_dim, BITS=bits, UP=up)
    assert torch.equal(out[: len(idx)], unpack_indices(codes, bits, head_dim) << up)
    assert out[len(idx):].eq(-1).all(), "masked rows must not be written"


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("dtype,bound", [(tl.float32, 2e-6), (tl.float16, 1e-3)])
def test_centroid_polynomial_in_each_dtype_is_within_its_bound_for_every_index(bits, group, dtype, bound):
    """float16 is the fused decode's operand dtype on GPU: about two fp16 ulps (bf16 K/V storage rounds to 3.9e-3)."""
    book = codebook(bits, group)
    n = 2**bits
    out = torch.empty(n, dtype=torch.float32)
    idx2 = 2 * torch.arange(n, dtype=torch.int32)  # the kernel takes 2 idx (load_indices with UP=1)
    _centroid_kernel[(1,)](idx2, book.odd_polynomial_tensor(), out, N=n, BITS=bits, DTYPE=dtype)
    want = torch.tensor(book.centroids, dtype=torch.float64)
    assert ((out.double() - want).abs() / want.abs()).max() < bound
