"""E8P / residual codebooks: construction, exhaustive decode (reference and Triton), encoder, distortion."""

import pytest
import torch
import triton
import triton.language as tl

from server.kernels.experts import e8p
from server.kernels.experts.moe_gemv import _lookup, _lookup2
from server.kernels.experts.moe_triton import _e8p_code_nibbles, _e8p_nibbles, _fields8, _residual_nibbles


def test_abs_table_row_counts_by_norm_match_spec():
    norms = (e8p.abs_table() ** 2).sum(1)
    counts = {int(n): int(c) for n, c in zip(*torch.unique(norms, return_counts=True))}
    assert counts == {2: 1, 4: 8, 6: 28, 8: 64, 10: 126, 12: 29}


def _in_shifted_e8(points: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Independent membership test: x - shift has all half-odd coordinates (x2 odd) and an even sum."""
    y = points - shift[:, None]
    twice = y * 2
    half_odd = (twice == twice.round()).all(1) & (twice.round().long() % 2 == 1).all(1)
    return half_odd & (y.sum(1).round().long() % 2 == 0) & ((y.sum(1) - y.sum(1).round()).abs() < 1e-6)


def test_all_65536_codes_decode_to_distinct_points_of_e8_shifted_by_a_quarter():
    points = e8p.decode(torch.arange(1 << 16))
    assert torch.unique(points, dim=0).shape[0] == 1 << 16
    # h + 1/4 with h half-odd is 3 mod 4 in quarters, h - 1/4 is 1 mod 4: every coordinate agrees.
    quarters = (points * 4).round().long() % 4
    assert ((quarters == 1) | (quarters == 3)).all() and (quarters == quarters[:, :1]).all()
    shift = torch.where(quarters[:, 0] == 3, 0.25, -0.25)
    assert _in_shifted_e8(points, shift).all()
    assert (shift > 0).sum() == 1 << 15
    assert (points.abs() - 0.25 <= 3.5 + 1e-6).all()


def test_residual_table_is_256_distinct_e8_points():
    t = e8p.residual_table()
    assert torch.unique(t, dim=0).shape[0] == 256
    integer = (t == t.round()).all(1)
    half = ((t * 2).round().long() % 2 == 1).all(1)
    assert (integer | half).all() and (t.sum(1).round().long() % 2 == 0).all()
    assert ((t**2).sum(1) <= 4).all()


@triton.jit
def _decode_tile_kernel(codes_ptr, res_ptr, table_ptr, rtable_ptr, out_ptr, rout_ptr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHERED: tl.constexpr):
    """4·w and 2·r of every code of a tile: through L1 loads (GEMM body) or, GATHERED, from tables held
    in registers and looked up with tl.gather (GEMV body)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_K // 8)
    ptrs = rows[:, None] * (BLOCK_K // 8) + g[None, :]
    if GATHERED:
        c = tl.load(codes_ptr + ptrs).to(tl.int32) & 0xFFFF
        abs_word, sign_word = _lookup2(tl.load(table_ptr + tl.arange(0, 512)), c >> 8, (c & 0xFF) + 256)
        w4 = _fields8(_e8p_code_nibbles(abs_word, sign_word), 4) * 2 - 15
        r = tl.load(res_ptr + ptrs).to(tl.int32) & 0xFF
        r2 = _fields8(_lookup(tl.load(rtable_ptr + tl.arange(0, 256)), r), 4) - 4
    else:
        w4 = _e8p_nibbles(codes_ptr + ptrs, None, table_ptr, BLOCK_N, BLOCK_K, True) * 2 - 15
        r2 = _residual_nibbles(res_ptr + ptrs, None, rtable_ptr, BLOCK_N, BLOCK_K, True) - 4
    offs = rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    tl.store(out_ptr + offs, w4)
    tl.store(rout_ptr + offs, r2)


@pytest.mark.parametrize("gathered", [False, True], ids=["l1_loads", "gathered_tables"])
def test_triton_decode_of_every_e8p_and_residual_code_matches_reference(gathered):
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).reshape(256, 256)
    res = (torch.arange(1 << 16) % 256).to(torch.uint8).reshape(256, 256)
    out = torch.empty((256, 256 * 8), dtype=torch.int32)
    rout = torch.empty_like(out)
    _decode_tile_kernel[(16,)](codes, res, e8p.kernel_table(), e8p.residual_table_packed(), out, rout,
                               BLOCK_N=16, BLOCK_K=2048, GATHERED=gathered)
    assert torch.equal(out.reshape(-1, 8).float() / 4, e8p.decode(torch.arange(1 << 16)))
    want_r = e8p.residual_table()[torch.arange(1 << 16) % 256]
    assert torch.equal(rout.reshape(-1, 8).float() / 2, want_r)


def test_sign_table_word_holds_parity_and_negative_nibbles():
    """Independent of the kernels: bit 0 of every nibble is popcount(s) & 1, bits 1..3 are set exactly
    where the spec's f = s ^ p has bit k (negative coordinate k)."""
    for s, word in enumerate(e8p.sign_table_packed().tolist()):
        p = bin(s).count("1") & 1
        f = s ^ p
        nibbles = [(word >> (4 * k)) & 0xF for k in range(8)]
        assert nibbles == [(0xE if (f >> k) & 1 else 0) | p for k in range(8)], f"sign byte {s}"


def test_encoder_agrees_with_brute_force_over_all_codewords():
    grid = e8p.decode(torch.arange(1 << 16))
    gen = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 2.5):
        x = torch.randn(150, 8, generator=gen) * scale
        brute = torch.cdist(x.double(), grid.double()).argmin(1)
        assert torch.equal(e8p.decode(e8p.encode(x)), grid[brute]), f"encoder missed the nearest codeword at scale {scale}"


def test_residual_encoder_agrees_with_brute_force():
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(500, 8, generator=gen) * 0.4
    pts = e8p.residual_table() / e8p.RESIDUAL_SCALE
    brute = torch.cdist(r.double(), pts.double()).argmin(1)
    assert torch.equal(e8p.encode_residual(r).long(), brute)


def _best_scale_mse(quantize, x: torch.Tensor) -> float:
    return min(((quantize(x * s) / s - x) ** 2).mean().item() for s in (0.94, 0.97, 1.0, 1.03, 1.06))


def test_distortion_on_gaussian_within_two_percent_of_spec():
    x = torch.randn(12000, 8, generator=torch.Generator().manual_seed(2))
    mse2 = _best_scale_mse(lambda v: e8p.decode(e8p.encode(v)), x)

    def e8p3_roundtrip(v):  # the two stages of weights._quantize_e8: E8P point, then residual point
        main = e8p.decode(e8p.encode(v))
        return main + e8p.decode_residual(e8p.encode_residual(v - main))

    mse3 = _best_scale_mse(e8p3_roundtrip, x)
    assert abs(mse2 / 0.0916 - 1) < 0.02, f"e8p distortion {mse2:.4f}, spec 0.0916"
    assert abs(mse3 / 0.0296 - 1) < 0.02, f"e8p3 distortion {mse3:.4f}, spec 0.0296"
