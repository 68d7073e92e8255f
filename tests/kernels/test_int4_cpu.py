"""4-bit ggml blocks multiplied through torch's CPU int4 kernel (server/kernels/int4_cpu.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from server.kernels.int4_cpu import (
    GROUP, INT4_ROWS, Int4Codes, Int4Weight, int4_linear, int4_linear_reference, supported,
)  # fmt: skip

needs_kernel = pytest.mark.skipif(not supported(), reason="this torch has no _weight_int4pack_mm_for_cpu")


def ggml_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of random Q4_0 / Q4_1 blocks, every nibble value at every position of every block somewhere."""
    g = np.random.default_rng(seed)
    nb = cols // GROUP
    d = g.uniform(0.001, 0.05, (rows, nb, 1)).astype(np.float16)
    nibbles = (np.arange(rows * nb * 32).reshape(rows, nb, 32) + g.integers(0, 16, (rows, nb, 1))) % 16
    qs = (nibbles[..., :16] | (nibbles[..., 16:] << 4)).astype(np.uint8)  # byte j: value j low, j + 16 high
    parts = [d.view(np.uint8)]
    if kind == "Q4_1":
        parts.append(g.uniform(-0.4, 0.0, (rows, nb, 1)).astype(np.float16).view(np.uint8))
    return np.concatenate(parts + [qs], axis=-1).reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_codes_from_ggml_blocks_mean_what_gguf_decodes(kind):
    blocks = ggml_blocks(kind, rows=16, cols=4 * GROUP, seed=1)
    codes = Int4Codes.from_ggml(torch.from_numpy(blocks), kind)
    assert codes.q.shape == (16, 128) and sorted(codes.q.unique().tolist()) == list(range(16))
    want = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).reshape(16, 128)
    got = (codes.q.double() - 8) * codes.scale.double().repeat_interleave(GROUP, 1) + codes.zero.double(
    ).repeat_interleave(GROUP, 1)  # fmt: skip
    assert torch.equal(got, torch.from_numpy(want).double())  # exact in float64: fp16 scales, small integers


def test_an_unknown_block_type_is_refused():
    with pytest.raises(ValueError, match="not a 4-bit ggml block type"):
        Int4Codes.from_ggml(torch.zeros(1, 34, dtype=torch.uint8), "Q8_0")


@needs_kernel
@pytest.mark.parametrize("rows, cols, tokens", [(1, 32, 1), (17, 96, 3), (64, 576, 1), (40, 160, INT4_ROWS)])
def test_int4_linear_matches_its_float64_meaning(rows, cols, tokens):
    blocks = ggml_blocks("Q4_1", rows, cols, seed=rows + cols)
    codes = Int4Codes.from_ggml(torch.from_numpy(blocks), "Q4_1")
    weight = Int4Weight.pack(codes)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    got = int4_linear(x, weight)
    rounded = weight.rounded_codes(codes.q)
    oracle = x.to(torch.bfloat16).double() @ rounded.dequantize().double().t()
    scale = oracle.abs().max().item()
    assert got.dtype == x.dtype and got.shape == (tokens, rows)
    assert (got.double() - oracle).abs().max().item() <= 1e-2 * scale  # the kernel's output is bfloat16
    assert (int4_linear_reference(x, rounded).double() - oracle).abs().max().item() <= 1e-5 * scale
    # bfloat16 scales and zeros are close to the file's: a few percent of a quantization step
    assert (rounded.dequantize() - codes.dequantize()).abs().max() <= 0.05 * codes.scale.max()


@needs_kernel
def test_many_rows_multiply_the_files_exact_weights_in_float32():
    """A prompt chunk's product dequantizes the codes with their fp16 scales (not the kernel's bfloat16 ones)."""
    codes = Int4Codes.from_ggml(torch.from_numpy(ggml_blocks("Q4_1", 40, 160, seed=5)), "Q4_1")
    x = torch.randn(INT4_ROWS + 1, 160, generator=torch.Generator().manual_seed(1))
    oracle = x.double() @ codes.dequantize().double().t()
    got = int4_linear(x, Int4Weight.pack(codes))
    assert (got.double() - oracle).abs().max().item() <= 1e-5 * oracle.abs().max().item()


@needs_kernel
def test_one_changed_code_changes_the_output():
    codes = Int4Codes.from_ggml(torch.from_numpy(ggml_blocks("Q4_0", 8, 64, seed=3)), "Q4_0")
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    base = int4_linear(x, Int4Weight.pack(codes))
    codes.q[5, 37] = (codes.q[5, 37] + 7) % 16
    changed = int4_linear(x, Int4Weight.pack(codes))
    differs = (changed != base).squeeze(0)
    assert differs[5] and not differs[torch.arange(8) != 5].any()


@needs_kernel
def test_many_rows_multiply_a_bfloat16_copy_when_asked():
    """bf16_prompts (a CPU with AMX): a prompt chunk's product takes x and the exact weight each rounded once to
    bfloat16, with float32 sums; up to INT4_ROWS rows still take the int4 kernel."""
    codes = Int4Codes.from_ggml(torch.from_numpy(ggml_blocks("Q4_1", 40, 160, seed=6)), "Q4_1")
    weight = Int4Weight.pack(codes, bf16_prompts=True)
    assert weight.dense.dtype == torch.bfloat16 and torch.equal(weight.dense, codes.dequantize().bfloat16())
    x = torch.randn(INT4_ROWS + 1, 160, generator=torch.Generator().manual_seed(2))
    got = int4_linear(x, weight)
    rounded = x.bfloat16().double() @ codes.dequantize().bfloat16().double().t()
    # the output itself is rounded to bfloat16 (half an ulp: 2^-9 relative) before it returns as float32
    assert got.dtype == x.dtype and ((got.double() - rounded).abs() <= 2**-8 * rounded.abs() + 1e-6).all()
    exact = x.double() @ codes.dequantize().double().t()
    assert (got.double() - exact).abs().max() > 1e-5 * exact.abs().max()  # the rounding is there to see
    few = x[:INT4_ROWS]
    assert torch.equal(int4_linear(few, weight), int4_linear(few, Int4Weight.pack(codes)))
