"""The turbo storage format: packing layout, quantization quality, norms, accounting (specs/turboquant.md)."""

import pytest
import torch

from server.kernels.rotation import SIGNS1, SIGNS2, inv_sqrt_group, sign_words_tensor
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.format import (
    RowLayout,
    bits_per_value,
    dequantize_reference,
    dequantize_rotated,
    dequantize_stored,
    group_size,
    pack_indices,
    quantize_reference,
    stored_order,
    unpack_indices,
)
from server.kernels.turbo.quantize import TurboPages, store_turbo_triton
from server.kernels.turbo.store import TurboKVStore
from turbo_oracle import sylvester

KINDS = {"turbo2": 2, "turbo3": 3, "turbo4": 4}


def mse_times_d(x, kind):
    codes, norms = quantize_reference(x, kind)
    x_hat = dequantize_reference(codes, norms, kind, x.shape[-1])
    return ((x - x_hat).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packing_round_trips_every_value_at_every_position(bits, head_dim):
    """Row v*D + e holds value v at position e and a different background value: exhaustive over a group."""
    values = torch.arange(2**bits)
    background = (values + 1) % 2**bits
    idx = background.repeat_interleave(head_dim)[:, None].repeat(1, head_dim)
    idx[torch.arange(len(idx)), torch.arange(head_dim).repeat(2**bits)] = values.repeat_interleave(head_dim)
    packed = pack_indices(idx.int(), bits)
    assert packed.dtype == torch.uint8 and packed.shape == (len(idx), head_dim * bits // 8)
    assert torch.equal(unpack_indices(packed, bits, head_dim), idx.int())


def test_byte_layout_is_the_documented_one():
    """Little-endian 32-bit words; value 8f + k of a word sits in nibble k, field f (width bits each)."""
    idx = torch.zeros(1, 128, dtype=torch.int32)
    idx[0, 0], idx[0, 1], idx[0, 3] = 1, 2, 3
    assert pack_indices(idx, 4)[0, :2].tolist() == [0x21, 0x30]  # even element in the low nibble
    idx[0, 8] = 3  # turbo2: value 8 of word 0 -> nibble 0, bits 2-3
    assert pack_indices(idx, 2)[0, :2].tolist() == [0b10_11_01, 0b11_0000]
    idx = torch.zeros(1, 128, dtype=torch.int32)
    idx[0, 9] = 5  # low bits 01: word 0, nibble 1, field 1 (bit 6); bit 2: plane two, nibble 1, field 1 (bit 5)
    idx[0, 58] = 4  # bit 2 only: plane two word 1 (bytes 36-39), its value 26 = 8 * 3 + 2 -> bit 4 * 2 + 3
    row = pack_indices(idx, 3)[0]
    assert row.shape == (48,) and row[0].item() == 1 << 6 and row[32].item() == 1 << 5
    assert row[37].item() == 1 << 3
    assert int(row.sum()) == (1 << 6) + (1 << 5) + (1 << 3)


@pytest.mark.parametrize("kind,bound", [("turbo2", 0.120), ("turbo3", 0.0345), ("turbo4", 0.0096)])
def test_mse_on_gaussian_inputs_within_spec(kind, bound):
    torch.manual_seed(1)
    assert mse_times_d(torch.randn(8192, 128), kind) <= bound


def test_turbo3_adversarial_hadamard_rows_within_spec():
    assert mse_times_d(sylvester(128).float(), "turbo3") < 0.045


@pytest.mark.parametrize("kind", KINDS)
def test_reconstruction_keeps_the_input_norm(kind):
    x = torch.randn(500, 256) * torch.rand(500, 1) * 30
    codes, norms = quantize_reference(x, kind)
    x_hat = dequantize_reference(codes, norms, kind, 256)
    for got, want in ((x_hat[:, :128], x[:, :128]), (x_hat[:, 128:], x[:, 128:])):  # each group on its own
        assert torch.allclose(got.norm(dim=-1), want.norm(dim=-1), rtol=1e-3)  # fp16 norm rounding


@pytest.mark.parametrize("kind", KINDS)
def test_zero_vector_decodes_to_exact_zeros(kind):
    codes, norms = quantize_reference(torch.zeros(3, 128), kind)
    assert codes.eq(0).all() and norms.eq(0).all()
    assert dequantize_reference(codes, norms, kind, 128).eq(0).all()


def test_rotated_decode_is_norm_times_centroid():
    x = torch.randn(4, 64)
    codes, norms = quantize_reference(x, "turbo3")
    c = torch.tensor(codebook(3, 64).centroids, dtype=torch.float32)
    expect = c[unpack_indices(codes, 3, 64)] * norms.float()
    assert torch.equal(dequantize_rotated(codes, norms, "turbo3", 64), expect)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_table_decode_matches_the_definition_on_every_byte(kind, head_dim):
    """dequantize_stored's table lookups against norm * c[unpack_indices], exactly: rows whose bytes all hold one
    value (turbo3: every pair of low-plane and high-plane byte, so every key at every position) and random rows."""
    bits, layout = KINDS[kind], RowLayout(kind, head_dim)
    byte = torch.arange(256, dtype=torch.uint8)
    if bits == 3:
        low, high = byte.repeat_interleave(256), byte.repeat(256)
        uniform = torch.cat((low[:, None].expand(-1, head_dim // 4), high[:, None].expand(-1, head_dim // 8)), dim=1)
    else:
        uniform = byte[:, None].expand(-1, layout.row_bytes)
    codes = torch.cat((uniform, torch.randint(0, 256, (64, layout.row_bytes), dtype=torch.uint8)))
    norms = (torch.rand(len(codes), layout.num_groups) * 4).half()
    c = torch.tensor(codebook(bits, layout.group).centroids, dtype=torch.float32)
    want = (c[unpack_indices(codes, bits, head_dim)].view(len(codes), layout.num_groups, -1)
            * norms.float()[..., None]).flatten(1)
    assert torch.equal(dequantize_rotated(codes, norms, kind, head_dim), want)
    order = list(stored_order(bits, head_dim))
    assert sorted(order) == list(range(head_dim))
    assert torch.equal(dequantize_stored(codes, norms, kind, head_dim), want[:, order])


def test_bits_and_bytes_match_the_spec_table():
    assert [bits_per_value(k) for k in KINDS] == [2.125, 3.125, 4.125]
    assert [TurboKVStore.bits_per_value(k) for k in KINDS] == [2.125, 3.125, 4.125]
    assert [RowLayout(k, 128).bytes_per_head for k in KINDS] == [34, 50, 66]
    assert [RowLayout(k, 64).bytes_per_head for k in KINDS] == [18, 26, 34]
    assert TurboKVStore.bytes_per_token(8, 128, "turbo4", "turbo3") == 8 * (66 + 50)
    assert TurboKVStore.bytes_per_token(2, 256, "turbo3", "turbo3") == 2 * 2 * 100


@pytest.mark.parametrize("head_dim", [0, 32, 80, 96, 200])
def test_head_dim_not_a_multiple_of_64_is_refused_with_the_fix(head_dim):
    with pytest.raises(ValueError, match="multiple of 64.*bf16"):
        group_size(head_dim)
    with pytest.raises(ValueError, match="multiple of 64"):
        TurboKVStore(4, 16, 2, head_dim, "turbo3", "turbo3", "cpu", torch.float32)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="turbo5.*turbo2, turbo3, turbo4"):
        TurboKVStore(4, 16, 2, 128, "turbo5", "turbo3", "cpu", torch.float32)


def pages_for(kind, num_pages, page_size, heads, head_dim):
    layout = RowLayout(kind, head_dim)
    book = codebook(layout.bits, layout.group)
    return TurboPages(
        torch.zeros(num_pages, heads, page_size, layout.row_bytes, dtype=torch.uint8),
        torch.zeros(num_pages, heads, page_size, layout.num_groups, dtype=torch.float16),
        layout.bits, book.centroids_tensor(), book.midpoints_tensor(), book.odd_polynomial_tensor(),
    )


@pytest.mark.parametrize("head_dim,k_kind,v_kind", [(64, "turbo2", "turbo3"), (128, "turbo4", "turbo3"), (256, "turbo3", "turbo4")])
def test_store_kernel_matches_the_reference_quantizer(head_dim, k_kind, v_kind):
    """Triton store (interpreter) vs quantize_reference, scattered through a shuffled slot mapping."""
    torch.manual_seed(head_dim)
    heads, page_size, num_pages, tokens = 3, 16, 5, 37
    k = torch.randn(tokens, heads, head_dim) * 3
    v = torch.randn(tokens, heads, head_dim)
    k[5] = 0.0  # zero rows: norm 0, index 0
    slots = torch.randperm(num_pages * page_size)[:tokens]
    kp, vp = (pages_for(kind, num_pages, page_size, heads, head_dim) for kind in (k_kind, v_kind))
    group = group_size(head_dim)
    signs = (sign_words_tensor(SIGNS1, "cpu"), sign_words_tensor(SIGNS2, "cpu"))
    store_turbo_triton(k, v[:, :, :], slots, torch.arange(tokens), kp, vp, signs, inv_sqrt_group(group))
    for pages, kind, x in ((kp, k_kind, k), (vp, v_kind, v)):
        codes, norms = quantize_reference(x, kind)
        got_codes = pages.codes[slots // page_size, :, slots % page_size]
        got_norms = pages.norms[slots // page_size, :, slots % page_size]
        assert torch.allclose(got_norms.float(), norms.float(), rtol=2e-3, atol=0)
        # Float sums in another order can move a value across a midpoint by an ulp; allow only that.
        mismatch = (unpack_indices(got_codes, pages.bits, head_dim) != unpack_indices(codes, pages.bits, head_dim))
        assert mismatch.float().mean() < 1e-3, mismatch.float().mean()
        written = torch.zeros(num_pages * page_size, dtype=torch.bool)
        written[slots] = True
        untouched = pages.codes.transpose(1, 2).reshape(num_pages * page_size, -1)[~written]
        assert untouched.eq(0).all(), "the store wrote outside its slots"
