"""GGUF q1_0/q2_0 expert stacks are used unrotated: both bodies of the fused MoE multiply x as it is."""

import struct

import pytest
import torch

from server.kernels.experts import moe
from server.kernels.experts.moe_reference import fused_moe_reference
from server.kernels.experts.weights import from_gguf

BLOCK = {"q1_0": 128, "q2_0": 64}


def _random_blocks(gen: torch.Generator, rows: int, k: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF bytes [rows * K/block * 18] and the float64 weights [rows, K] they stand for, decoded
    here by ggml's rule (d, then 16 code bytes LSB first; q1_0 ±d, q2_0 (code - 1)·d)."""
    nb = k // BLOCK[fmt]
    d = (torch.randn(rows, nb, generator=gen) * 0.1).half()
    codes = torch.randint(0, 256, (rows, nb, 16), generator=gen, dtype=torch.uint8)
    raw = torch.cat([d.view(torch.uint8).reshape(rows, nb, 2), codes], -1).reshape(-1)
    w = torch.empty(rows, k, dtype=torch.float64)
    for r in range(rows):
        for b in range(nb):
            scale = struct.unpack("<e", bytes(raw[(r * nb + b) * 18:][:2].tolist()))[0]
            for j in range(BLOCK[fmt]):
                byte = int(codes[r, b, j * (1 if fmt == "q1_0" else 2) // 8])
                if fmt == "q1_0":
                    v = scale if (byte >> (j % 8)) & 1 else -scale
                else:
                    v = (((byte >> (2 * (j % 4))) & 3) - 1) * scale
                w[r, b * BLOCK[fmt] + j] = v
    return raw, w


@pytest.mark.parametrize("fmt_gate_up,fmt_down", [("q2_0", "q1_0"), ("q1_0", "q2_0")])
def test_unrotated_gguf_experts_match_float64_oracle(fmt_gate_up, fmt_down):
    num_e, d, i, tokens, top_k = 3, 128, 128, 5, 2
    gen = torch.Generator().manual_seed(11)
    raw_gu, w_gu = _random_blocks(gen, num_e * 2 * i, d, fmt_gate_up)
    raw_dn, w_dn = _random_blocks(gen, num_e * d, i, fmt_down)
    gate_up, down = from_gguf(fmt_gate_up, raw_gu, 2 * i, d), from_gguf(fmt_down, raw_dn, d, i)
    assert gate_up.signs is None and down.signs is None
    w_gu, w_dn = w_gu.reshape(num_e, 2 * i, d), w_dn.reshape(num_e, d, i)
    x = torch.randn(tokens, d, generator=gen)
    ids = torch.randint(0, num_e - 1, (tokens, top_k), generator=gen)  # the last expert gets no tokens
    ids[0, 1] = ids[0, 0]  # one token routed twice to one expert
    topk_w = torch.rand(tokens, top_k, generator=gen)
    want = torch.zeros(tokens, d, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            g = w_gu[ids[t, j]] @ x[t].double()
            h = torch.nn.functional.silu(g[:i]) * g[i:]
            want[t] += float(topk_w[t, j]) * (w_dn[ids[t, j]] @ h)
    scale = want.abs().max()
    for block_m in (moe.DECODE_BLOCK_M, moe.PREFILL_BLOCK_M):
        got = moe.fused_moe_triton(x, topk_w, ids, gate_up, down, block_m=block_m).double()
        assert (got - want).abs().max() < 1e-5 * scale, f"Triton body (block_m {block_m}) differs from the oracle"
    ref = fused_moe_reference(x, topk_w, ids, gate_up, down).double()
    assert (ref - want).abs().max() < 1e-5 * scale, "reference differs from the oracle"
