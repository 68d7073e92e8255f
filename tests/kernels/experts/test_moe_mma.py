"""The tensor-core q2_0 decode body (moe_mma.py) through the interpreter: levels, tile order, oracle, dispatch.

The interpreter has no inline assembly, so these run the plain-shift levels (ASM=False); the GPU
check in bench/kernels_experts.py compares the assembly path with the reference.
"""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from server.kernels.experts import moe, qblocks
from server.kernels.experts.moe_mma import _q2_levels, tile_order
from server.kernels.experts.routing import single_pair_blocks
from tests.kernels.experts.test_fused_moe import _problem, oracle


@triton.jit
def _levels_kernel(words_ptr, out_ptr, R: tl.constexpr):
    words = tl.load(words_ptr + tl.arange(0, R)[:, None] * 4 + tl.arange(0, 4)[None, :])
    levels = _q2_levels(words, False, False)
    tl.store(out_ptr + tl.arange(0, R)[:, None] * 64 + tl.arange(0, 64)[None, :], levels)


def test_levels_of_every_byte_pattern_in_every_byte_match_the_gguf_definition():
    """Rows of one q2_0 block; byte p of word w in row r is (4r + w + 64p) % 256: every value in every byte."""
    r, w, p = torch.meshgrid(torch.arange(64), torch.arange(4), torch.arange(4), indexing="ij")
    codes = ((4 * r + w + 64 * p) % 256).to(torch.uint8).reshape(64, 16)
    levels = torch.empty((64, 64), dtype=torch.float16)
    _levels_kernel[(1,)](codes.view(torch.int32).contiguous(), levels, R=64)
    want = qblocks.dequantize(qblocks.Q2_0, torch.ones((64, 1), dtype=torch.float16), codes)
    assert torch.equal(levels.float(), tile_order(want)), "q2_0 levels differ from the GGUF definition"


def test_tile_order_puts_weight_16t_plus_8h_plus_2c_plus_j_at_column_16c_plus_8j_plus_2t_plus_h():
    a = torch.arange(2 * 128, dtype=torch.float32).view(2, 128)
    got = tile_order(a)
    for block in range(2):
        for t, h, c, j in itertools.product(range(4), range(2), range(4), range(2)):
            col = 64 * block + 16 * c + 8 * j + 2 * t + h
            assert got[1, col] == a[1, 64 * block + 16 * t + 8 * h + 2 * c + j], f"column {col}"


# (experts, hidden D, intermediate I, tokens, top_k): K steps of 4, 3 (2 + 1 fallback: 192) and 2 q blocks,
# unused experts, a token routed twice (test_fused_moe._problem), more than 16 pairs on one expert.
CASES = [(5, 256, 192, 3, 2), (3, 128, 64, 1, 2), (2, 64, 128, 20, 2)]


@pytest.mark.parametrize("num_e,d,i,tokens,top_k", CASES)
def test_mma_body_matches_float64_oracle_with_fp16_activations(num_e, d, i, tokens, top_k, monkeypatch):
    monkeypatch.setattr(moe, "MMA_MIN_PAIRS", 1)  # CI-sized problems have few pairs
    x, w, ids, gu, dn = _problem("q2_0", num_e, d, i, tokens=tokens, top_k=top_k, seed=d + i + tokens)
    got = moe.fused_moe_triton(x.half(), w.half(), ids, gu, dn, gemv=True)
    want = oracle(x.half().float(), w.half().float(), ids, gu, dn)
    assert got.dtype == torch.float16
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 3e-3, f"tensor-core body differs from the float64 oracle by {err:.2e}"  # fp16 h between kernels


def test_mma_body_reads_every_code_and_scale_it_is_given(monkeypatch):
    monkeypatch.setattr(moe, "MMA_MIN_PAIRS", 1)
    x, w, ids, gu, dn = _problem("q2_0", 2, 128, 128, tokens=2, top_k=1, seed=4)
    ids[:] = 0
    x = x.half()
    before = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True)
    for proj in (gu, dn):
        for key, flip in (("codes", lambda t: t.view(torch.uint8).reshape(-1)[37].__ixor__(0x10)),
                          ("d", lambda t: t.reshape(-1)[1].mul_(-2))):
            saved = proj.tensors[key].clone()
            flip(proj.tensors[key])
            after = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True)
            assert not torch.equal(before, after), f"a changed q2_0 {key} left the tensor-core output unchanged"
            proj.tensors[key].copy_(saved)


def test_dispatch_takes_the_mma_body_for_half_precision_q2_0_decode_with_enough_pairs(monkeypatch):
    many = moe.MMA_MIN_PAIRS
    assert moe.use_mma("q2_0", torch.bfloat16, many) and moe.use_mma("q2_0", torch.float16, many)
    assert not moe.use_mma("q2_0", torch.bfloat16, many - 1)
    assert not moe.use_mma("q2_0", torch.float32, many) and not moe.use_mma("e8p", torch.float16, many)
    calls = []
    for name in ("launch_expert_mma", "launch_expert_gemv", "launch_expert_gemm"):
        monkeypatch.setattr(moe, name, lambda *a, _n=name, **k: calls.append(_n.split("_")[-1]))
    x, w, ids, gu, dn = _problem("q2_0", 5, 64, 64, tokens=2, top_k=2, seed=3)
    moe.fused_moe_triton(x.half(), w, ids, gu, dn)  # 4 pairs: below MMA_MIN_PAIRS
    monkeypatch.setattr(moe, "MMA_MIN_PAIRS", 4)
    moe.fused_moe_triton(x.half(), w, ids, gu, dn)
    moe.fused_moe_triton(x, w, ids, gu, dn)  # float32 activations
    assert calls == ["gemv", "gemv", "mma", "mma", "gemv", "gemv"]


def test_single_pair_blocks_hold_each_pair_once_in_order():
    ids = torch.tensor([[3, 1], [1, 0]])
    blocks = single_pair_blocks(ids, 4)
    assert blocks.block_expert.tolist() == [3, 1, 1, 0] and blocks.num_pairs == 4
    assert blocks.pair_ids.view(4, 4).tolist() == [[p, 4, 4, 4] for p in range(4)]
