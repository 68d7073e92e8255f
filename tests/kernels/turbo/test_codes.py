"""Device functions of server/kernels/turbo/codes.py the decode kernel uses, run in small test kernels.

Indices come back exactly as format.unpack_indices (the format's definition) gives them, for every
value at every position; the fp16 lookup (here its Triton model of the PTX, which the GPU check in
bench/kernels_turbo.py compares with the PTX itself) gives exactly the fp16-rounded centroids.
"""

import pytest
import torch
import triton
import triton.language as tl

from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.codes import centroid_by_polynomial, decode_rows, lookup_table
from server.kernels.turbo.format import pack_indices, unpack_indices


@triton.jit
def _decode_kernel(codes_ptr, table_ptr, out_ptr, num_rows, ROWS: tl.constexpr, D: tl.constexpr,
                   BITS: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr):
    rows = tl.arange(0, ROWS)
    valid = rows < num_rows
    x = decode_rows(codes_ptr + rows * (D * BITS // 8), valid, table_ptr, ROWS, D, BITS, LOOKUP, ASM)
    tl.store(out_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], x, mask=valid[:, None])


@triton.jit
def _centroid_kernel(idx_ptr, coef_ptr, out_ptr, N: tl.constexpr, BITS: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, centroid_by_polynomial(tl.load(idx_ptr + offs), coef_ptr, BITS))


def every_value_at_every_position(bits, head_dim):
    """Row v*D + e holds value v at position e over a different background value, then 5 random rows."""
    values = torch.arange(2**bits)
    idx = ((values + 1) % 2**bits).repeat_interleave(head_dim)[:, None].repeat(1, head_dim)
    idx[torch.arange(len(idx)), torch.arange(head_dim).repeat(2**bits)] = values.repeat_interleave(head_dim)
    return torch.cat([idx, torch.randint(0, 2**bits, (5, head_dim))]).int()


def decode(codes, bits, head_dim, lookup, asm=False):
    rows = triton.next_power_of_2(len(codes))
    out = torch.full((rows, head_dim), -1, dtype=torch.float16 if lookup else torch.int32, device=codes.device)
    table = lookup_table(bits, 128 if head_dim % 128 == 0 else 64, codes.device)
    _decode_kernel[(1,)](codes, table, out, len(codes), ROWS=rows, D=head_dim, BITS=bits, LOOKUP=lookup, ASM=asm)
    assert out[len(codes):].eq(-1).all(), "masked rows must not be written"
    return out[: len(codes)]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_indices_from_words_are_the_format_indices_for_every_value_at_every_position(bits, head_dim):
    codes = pack_indices(every_value_at_every_position(bits, head_dim), bits)
    assert torch.equal(decode(codes, bits, head_dim, lookup=False), unpack_indices(codes, bits, head_dim))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp16_lookup_gives_the_rounded_centroid_of_every_value_at_every_position(bits, head_dim):
    codes = pack_indices(every_value_at_every_position(bits, head_dim), bits)
    want = torch.tensor(codebook(bits, head_dim).centroids, dtype=torch.float16)[unpack_indices(codes, bits, head_dim).long()]
    got = decode(codes, bits, head_dim, lookup=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got - want).abs().max()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [64, 128])
def test_centroid_polynomial_in_float32_is_within_2e_6_for_every_index(bits, group):
    book = codebook(bits, group)
    n = 2**bits
    out = torch.empty(n, dtype=torch.float32)
    _centroid_kernel[(1,)](torch.arange(n, dtype=torch.int32), book.odd_polynomial_tensor(), out, N=n, BITS=bits)
    want = torch.tensor(book.centroids, dtype=torch.float64)
    assert ((out.double() - want).abs() / want.abs()).max() < 2e-6


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_ptx_lookup_gives_the_rounded_centroid_of_every_value_at_every_position(bits, head_dim):
    codes = pack_indices(every_value_at_every_position(bits, head_dim), bits).cuda()
    want = torch.tensor(codebook(bits, head_dim).centroids, dtype=torch.float16)[unpack_indices(codes.cpu(), bits, head_dim).long()]
    got = decode(codes, bits, head_dim, lookup=True, asm=True).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got - want).abs().max()
