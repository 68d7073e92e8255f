"""q1_0 / q2_0: every bit pattern against the llama.cpp rule, GGUF byte layout, quantizer quality."""

import struct

import pytest
import torch
import triton
import triton.language as tl

from server.kernels.experts import qblocks
from server.kernels.experts.moe_triton import _qblock_codes


def _ggml_dequantize_block(raw: bytes, fmt: str) -> list[float]:
    """Scalar transcription of ggml's dequantize_row_q1_0 / q2_0 for one 18-byte block."""
    d = struct.unpack("<e", raw[:2])[0]
    qs = raw[2:]
    if fmt == "q1_0":
        return [d if (qs[j // 8] >> (j % 8)) & 1 else -d for j in range(128)]
    return [(((qs[j // 4] >> ((j % 4) * 2)) & 3) - 1) * d for j in range(64)]


def _every_byte_at_every_position() -> torch.Tensor:
    """[256, 16] code bytes: block b holds byte (b + 37 j) % 256 at position j, so each byte value
    appears at each of the 16 positions (every bit pattern of every code slot)."""
    b = torch.arange(256)[:, None]
    j = torch.arange(16)[None, :]
    return ((b + 37 * j) % 256).to(torch.uint8)


@pytest.mark.parametrize("fmt", ["q1_0", "q2_0"])
def test_every_bit_pattern_decodes_like_ggml(fmt):
    f = qblocks.BLOCK_FORMATS[fmt]
    codes = _every_byte_at_every_position()
    d = (torch.rand(256, 1, generator=torch.Generator().manual_seed(0)) * 2 - 1).half()
    raw = qblocks.to_gguf_blocks(f, d, codes)
    assert raw.shape == (256, 18)
    ours = qblocks.dequantize(f, d, codes)
    for b in range(256):
        assert ours[b].tolist() == _ggml_dequantize_block(bytes(raw[b].tolist()), fmt), f"block {b}"


@pytest.mark.parametrize("fmt", ["q1_0", "q2_0"])
def test_gguf_blocks_round_trip_losslessly(fmt):
    f = qblocks.BLOCK_FORMATS[fmt]
    w = torch.randn(3, 5, 2 * f.block)
    d, codes = qblocks.quantize(f, w)
    raw = qblocks.to_gguf_blocks(f, d, codes)
    d2, codes2 = qblocks.from_gguf_blocks(f, raw, 2 * f.block)
    assert torch.equal(d, d2) and torch.equal(codes, codes2)
    with pytest.raises(ValueError, match="blocks of 18 bytes"):
        qblocks.from_gguf_blocks(f, raw[..., :-1], 2 * f.block)


@triton.jit
def _levels_kernel(codes_ptr, out_ptr, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)
    nbytes: tl.constexpr = BLOCK_K * BITS // 8
    c = _qblock_codes(codes_ptr + rows[:, None] * nbytes + tl.arange(0, nbytes)[None, :], BITS, 16, BLOCK_K)
    lv = c * (3 - BITS) - 1  # the kernel's level map: q1_0 2c - 1, q2_0 c - 1
    tl.store(out_ptr + rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], lv)


@pytest.mark.parametrize("fmt", ["q1_0", "q2_0"])
def test_triton_levels_of_every_bit_pattern_match_reference(fmt):
    f = qblocks.BLOCK_FORMATS[fmt]
    codes = _every_byte_at_every_position()
    out = torch.empty((256, f.block), dtype=torch.int32)
    _levels_kernel[(16,)](codes, out, BITS=f.bits, BLOCK_K=f.block)
    ones = torch.ones(256, 1, dtype=torch.float16)
    assert torch.equal(out.float(), qblocks.dequantize(f, ones, codes))


def test_q2_quantizer_beats_ggml_ternary_reference_rule():
    """llama.cpp's reference quantizer uses d = max|w| and round(w/d)+1; ours searches d and its sign."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    d, codes = qblocks.quantize(qblocks.Q2_0, w)
    ours = ((qblocks.dequantize(qblocks.Q2_0, d, codes) - w) ** 2).mean()
    amax = w.abs().amax(1, keepdim=True)
    ggml = ((torch.round(w / amax).clamp(-1, 2) * amax.half().float() - w) ** 2).mean()
    assert ours < 0.8 * ggml
    assert ours < 0.14  # N(0,1) with per-64 blocks; scalar 2-bit Lloyd-Max is 0.1175


def test_q1_quantizer_uses_mean_magnitude():
    w = torch.randn(4, 128)
    d, codes = qblocks.quantize(qblocks.Q1_0, w)
    assert torch.allclose(d.float()[:, 0], w.abs().mean(1), rtol=1e-3)
    assert torch.equal(qblocks.dequantize(qblocks.Q1_0, d, codes).sign(), torch.where(w >= 0, 1.0, -1.0))


@pytest.mark.parametrize("fmt", ["q1_0", "q2_0"])
def test_gguf_expert_tensor_is_used_without_requantizing(fmt):
    """Raw GGUF bytes of an [E, N, K] expert stack -> ExpertWeights decoding to exactly the same weights."""
    from server.kernels.experts import weights

    f = qblocks.BLOCK_FORMATS[fmt]
    q = weights.quantize(torch.randn(3, 5, 2 * f.block), fmt, rotate=False)
    raw = qblocks.to_gguf_blocks(f, q.tensors["d"], q.tensors["codes"])  # what a GGUF file holds
    w = weights.from_gguf(fmt, raw.reshape(-1), 5, 2 * f.block)
    assert w.shape == (3, 5, 2 * f.block) and w.signs is None
    assert torch.equal(w.dequantize(), q.dequantize())
    with pytest.raises(ValueError, match="not whole"):
        weights.from_gguf(fmt, raw.reshape(-1)[:-3], 5, 2 * f.block)
