"""The one-pair-per-program decode body (moe_gemv.py) against the float64 oracle, and its dispatch rule."""

import pytest
import torch
import triton
import triton.language as tl

from server.kernels.experts import moe, qblocks
from server.kernels.experts.moe_gemv import _q_levels
from server.kernels.experts.moe_reference import fused_moe_reference
from server.kernels.experts.moe_triton import FORMAT_IDS
from tests.kernels.experts.test_fused_moe import _problem, oracle


@triton.jit
def _q_levels_kernel(words_ptr, out_ptr, R: tl.constexpr, FORMAT: tl.constexpr, OUT: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, R)[:, None] * 4 + tl.arange(0, 4)[None, :])
    tl.store(out_ptr + tl.arange(0, R)[:, None] * OUT + tl.arange(0, OUT)[None, :], _q_levels(words, FORMAT, False))


@pytest.mark.parametrize("fmt", ["q1_0", "q2_0"])
def test_q_levels_of_every_byte_pattern_in_every_byte_match_the_gguf_definition_in_natural_order(fmt):
    """Rows of 16 code bytes; byte p of word w in row r is (4r + w + 64p) % 256: every value in every byte.
    (The interpreter runs the plain-shift levels; the GPU check runs the assembly.)"""
    fmt_def = qblocks.BLOCK_FORMATS[fmt]
    r, w, p = torch.meshgrid(torch.arange(64), torch.arange(4), torch.arange(4), indexing="ij")
    codes = ((4 * r + w + 64 * p) % 256).to(torch.uint8).reshape(64, 16)
    levels = torch.empty((64, fmt_def.block), dtype=torch.float32)
    _q_levels_kernel[(1,)](codes.view(torch.int32).contiguous(), levels, R=64, FORMAT=FORMAT_IDS[fmt],
                           OUT=fmt_def.block)
    want = qblocks.dequantize(fmt_def, torch.ones((64, 1), dtype=torch.float16), codes)
    assert torch.equal(levels, want), f"GEMV {fmt} levels differ from the GGUF definition"


# Odd widths: K not a multiple of the K step (40, 24, 56, 264; q: 192, 384, 640), odd expert counts, unused experts;
# several K steps (264, 384, 640), so the loads issued a step ahead are carried across iterations and past K.
CASES = [("e8p", 5, 40, 24), ("e8p3", 3, 24, 56), ("q2_0", 5, 64, 192), ("q1_0", 3, 128, 128), ("e8p", 2, 264, 16),
         ("q1_0", 2, 384, 128), ("q2_0", 3, 640, 64)]


@pytest.mark.parametrize("fmt,num_e,d,i", CASES)
def test_gemv_body_matches_float64_oracle(fmt, num_e, d, i):
    x, w, ids, gu, dn = _problem(fmt, num_e, d, i, tokens=3, top_k=2, seed=len(fmt) + d + i)
    want = oracle(x, w, ids, gu, dn)
    got = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True).double()
    assert (got - want).abs().max() < 1e-5 * want.abs().max(), "GEMV body differs from the float64 oracle"


def test_gemv_body_with_half_precision_activations_and_one_token():
    x, w, ids, gu, dn = _problem("e8p3", 4, 32, 40, tokens=1, top_k=3, seed=11)
    got = moe.fused_moe_triton(x.half(), w.half(), ids, gu, dn, gemv=True)
    want = oracle(x.half().float(), w.half().float(), ids, gu, dn)
    assert got.dtype == torch.float16
    assert ((got.double() - want).norm() / want.norm()) < 5e-3  # h is stored in fp16 between the kernels


@pytest.mark.parametrize("fmt", ["e8p", "e8p3", "q2_0", "q1_0"])
def test_gemv_body_reads_every_code_it_is_given(fmt):
    """Flipping one code bit of expert 0's gate_up, then down (residual for e8p3), changes the output."""
    x, w, ids, gu, dn = _problem(fmt, 2, 128, 128, tokens=2, top_k=1, seed=4)
    ids[:] = 0
    before = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True)
    for proj in (gu, dn):
        key = "residual" if fmt == "e8p3" and proj is dn else "codes"
        saved = proj.tensors[key].clone()
        proj.tensors[key].view(torch.uint8).reshape(-1)[5] ^= 0x10
        after = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True)
        assert not torch.equal(before, after), f"{fmt}: a flipped {key} bit left the GEMV output unchanged"
        proj.tensors[key].copy_(saved)


def test_dispatch_takes_the_gemv_body_only_while_pairs_rarely_share_an_expert(monkeypatch):
    assert moe.use_gemv("e8p", num_pairs=8, num_experts=64)
    assert moe.use_gemv("q2_0", num_pairs=64, num_experts=64)
    assert not moe.use_gemv("e8p", num_pairs=65, num_experts=64)
    assert not moe.use_gemv("bf16", num_pairs=1, num_experts=64)
    calls = []
    monkeypatch.setattr(moe, "launch_expert_gemv", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(moe, "launch_expert_gemm", lambda *a, **k: calls.append("gemm"))
    x, w, ids, gu, dn = _problem("e8p", 5, 16, 16, tokens=2, top_k=2, seed=3)
    moe.fused_moe_triton(x, w, ids, gu, dn)
    moe.fused_moe_triton(x, w, ids, gu, dn, block_m=moe.DECODE_BLOCK_M)
    x, w, ids, gu, dn = _problem("e8p", 5, 16, 16, tokens=3, top_k=2, seed=3)
    moe.fused_moe_triton(x, w, ids, gu, dn)
    assert calls == ["gemv", "gemv", "gemm", "gemm", "gemm", "gemm"]


def test_gemv_and_gemm_bodies_agree_with_the_reference_on_one_problem():
    x, w, ids, gu, dn = _problem("q2_0", 3, 64, 64, tokens=2, top_k=1, seed=12)
    ref = fused_moe_reference(x, w, ids, gu, dn)
    for gemv in (True, False):
        got = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=gemv)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_q_codes_that_are_not_word_aligned_take_the_gemm_body(monkeypatch):
    """The GEMV body reads q codes as int32 words; an unaligned view must not reach it."""
    x, w, ids, gu, dn = _problem("q2_0", 2, 64, 64, tokens=1, top_k=1, seed=13)
    codes = gu.tensors["codes"]
    shifted = torch.zeros(codes.numel() + 1, dtype=torch.uint8)[1:].view(codes.shape)
    shifted.copy_(codes)
    gu.tensors["codes"] = shifted
    calls = []
    monkeypatch.setattr(moe, "launch_expert_gemv", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(moe, "launch_expert_gemm", lambda *a, **k: calls.append("gemm"))
    moe.fused_moe_triton(x, w, ids, gu, dn)
    assert calls == ["gemm", "gemm"]
