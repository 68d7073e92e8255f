"""Skinny matmul with a fused epilogue (server/kernels/gemv.py: SiLU * up for gate_up, RoPE for qkv) vs the
unfused composition (F.linear, then the model's torch reference op) vs a float64 oracle, through the Triton
interpreter on CPU (fp16/fp32 only), at odd widths, ragged K, both bodies (1 row; 2..16 rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.kernels import gemv
from server.runtime.models.rope import RotaryEmbedding
from tests.kernels.test_gemv import TOLERANCE, assert_close

SHAPES = [(1, 37, 70), (3, 37, 2100), (16, 45, 40), (1, 19, 2100)]  # (rows, output width, K)


def silu_and_mul_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("rows,width,k", SHAPES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_gate_up_with_silu_and_mul_matches_composition_and_oracle(rows, width, k, dtype):
    g = torch.Generator().manual_seed(rows * width + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(2 * width, k, generator=g) * k**-0.5 * 3).to(dtype)  # gates over [-6, 6]: SiLU's bend
    fused = gemv.skinny_matmul_silu_and_mul(x, w)
    assert fused.shape == (rows, width) and fused.dtype == dtype
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    atol, rtol = TOLERANCE[dtype]
    # The fused op rounds the projection to dtype, then one more rounding: a few ulps of the result.
    assert_close(fused, silu_and_mul_oracle(x, w), 4 * atol, 4 * rtol, "fused gate_up vs float64 oracle")
    assert_close(fused, F.silu(gate) * up, 4 * atol, 4 * rtol, "fused gate_up vs F.linear + F.silu * up")


def rope_oracle(x, w, bias, positions, rotary: RotaryEmbedding, rotated_heads: int, head_dim: int):
    """float64: project, then rotate each pair (i, i + D/2) of the first heads by position * inv_freq[i]."""
    qkv = x.double() @ w.double().T + (0.0 if bias is None else bias.double())
    heads = qkv[:, : rotated_heads * head_dim].view(len(x), rotated_heads, head_dim)
    angle = positions[:, None, None].double() * rotary.inv_freq.double()
    cos, sin = torch.cos(angle) * rotary.attention_scaling, torch.sin(angle) * rotary.attention_scaling
    x1, x2 = heads.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)
    return torch.cat((rotated, qkv[:, rotated_heads * head_dim :]), dim=1)


# (rows, q heads, kv heads, head_dim, K): GQA ratios 1..8, one token and a 16-row batch, ragged K.
ROPE_CASES = [(1, 4, 4, 16, 70), (3, 6, 2, 8, 2100), (16, 8, 1, 16, 40), (1, 9, 3, 64, 33), (5, 5, 1, 32, 64)]


@pytest.mark.parametrize("rows,q_heads,kv_heads,head_dim,k", ROPE_CASES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_qkv_with_rope_matches_composition_and_oracle(rows, q_heads, kv_heads, head_dim, k, dtype):
    g = torch.Generator().manual_seed(rows + q_heads * kv_heads + k)
    n = (q_heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if q_heads % 2 else None  # Qwen2 has a qkv bias
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024} if rows == 5 else None
    rotary = RotaryEmbedding(head_dim, 10000.0, scaling, 4096)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    positions[0] = 0 if rows > 1 else 4095
    fused = gemv.skinny_matmul_rope(x, w, bias, positions, rotary.inv_freq, rotary.attention_scaling,
                                    q_heads + kv_heads, head_dim)  # fmt: skip
    assert fused.shape == (rows, n) and fused.dtype == dtype

    qkv = F.linear(x, w, bias)
    q, k_, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    ref_q, ref_k = rotary(positions, q.reshape(rows, q_heads, head_dim), k_.reshape(rows, kv_heads, head_dim))
    composed = torch.cat((ref_q.flatten(1), ref_k.flatten(1), v), dim=1)
    oracle = rope_oracle(x, w, bias, positions, rotary, q_heads + kv_heads, head_dim)
    atol, rtol = TOLERANCE[dtype]
    # float32 angles at position 4095 are good to ~4e-4 rad (the reference's own error, see test_fused_layer_ops);
    # fp16: the reference rotates in fp16 arithmetic, a few ulps from either.
    slack = 1e-3 if dtype == torch.float32 else 4 * atol
    assert_close(fused, oracle, slack, 4 * rtol, "fused qkv + RoPE vs float64 oracle")
    assert_close(fused, composed, slack, 8 * rtol, "fused qkv + RoPE vs F.linear + RotaryEmbedding")
    v_cols = slice((q_heads + kv_heads) * head_dim, n)
    assert_close(fused[:, v_cols], F.linear(x, w, bias)[:, v_cols], atol, rtol, "v rows are not rotated")


@pytest.mark.parametrize("rows,page_dtype", [(1, torch.float16), (5, torch.float32), (16, torch.float16)])
def test_qkv_with_rope_stores_k_and_v_into_their_slots(rows, page_dtype):
    """The decode cache write fused into the qkv epilogue: every k and v row lands in its token's slot,
    as write_kv_pages would store the returned k and v; padding tokens (slot -1) and other slots untouched."""
    g = torch.Generator().manual_seed(rows)
    q_heads, kv_heads, head_dim, k = 6, 2, 16, 70
    n = (q_heads + 2 * kv_heads) * head_dim
    x = torch.randn(rows, k, generator=g).to(torch.float16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.float16)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, 4096)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    pages = [torch.full((6, 4, kv_heads, head_dim), 7.0, dtype=page_dtype) for _ in range(2)]
    slots = torch.randperm(24, generator=g)[:rows]
    if rows > 1:
        slots[1] = -1  # a padding row of a CUDA-graph batch
    args = (x, w, None, positions, rotary.inv_freq, rotary.attention_scaling, q_heads + kv_heads, head_dim)
    fused = gemv.skinny_matmul_rope(*args, kv_cache=(*pages, slots))
    assert torch.equal(fused, gemv.skinny_matmul_rope(*args)), "the cache write changed the projection"
    k_rows, v_rows = fused[:, q_heads * head_dim:].view(rows, 2, kv_heads, head_dim).unbind(1)
    for cache, new in zip(pages, (k_rows, v_rows)):
        flat = cache.view(-1, kv_heads, head_dim)
        written = slots >= 0
        assert torch.equal(flat[slots[written]], new[written].to(page_dtype))
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[written]] = False
        assert bool((flat[untouched] == 7.0).all())


def test_linear_rope_stores_the_cache_on_both_paths(monkeypatch):
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)  # the CPU interpreter stands in for CUDA
    g = torch.Generator().manual_seed(4)
    rotary = RotaryEmbedding(8, 10000.0, None, 4096)
    qkv_w = torch.randn(4 * 8, 40, generator=g).to(torch.float16)  # 2 q heads, 1 kv head of dim 8
    for rows in (1, 17):  # the fused epilogue, then F.linear + rotary + write_kv_pages
        x = torch.randn(rows, 40, generator=g).to(torch.float16)
        pages = [torch.zeros(5, 4, 1, 8, dtype=torch.float16) for _ in range(2)]
        slots = torch.randperm(20, generator=g)[:rows]
        q, k, v = gemv.linear_rope(x, qkv_w, None, torch.arange(rows), rotary.inv_freq, 1.0, 2, 1, 8, (*pages, slots))
        assert torch.equal(pages[0].view(-1, 1, 8)[slots], k), f"{rows} rows: k not in its slots"
        assert torch.equal(pages[1].view(-1, 1, 8)[slots], v), f"{rows} rows: v not in its slots"


def test_fused_launchers_refuse_bad_shapes_with_a_clear_message():
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match="2 \\* width"):
        gemv.skinny_matmul_silu_and_mul(x, torch.randn(7, 32))
    with pytest.raises(ValueError, match="even head_dim"):
        gemv.skinny_matmul_rope(x, torch.randn(30, 32), None, torch.zeros(1, dtype=torch.int64), torch.rand(3), 1.0, 4, 7)
    with pytest.raises(ValueError, match="one per row"):
        gemv.skinny_matmul_rope(x, torch.randn(48, 32), None, torch.zeros(2, dtype=torch.int64), torch.rand(4), 1.0, 4, 8)
    with pytest.raises(ValueError, match="1..16 rows"):
        gemv.skinny_matmul_silu_and_mul(torch.randn(17, 32), torch.randn(8, 32))
    wrong_heads = [torch.zeros(2, 4, 3, 8) for _ in range(2)]  # 3 kv heads of 8 != the 16 v rows
    with pytest.raises(ValueError, match="v rows"):
        gemv.skinny_matmul_rope(x, torch.randn(48, 32), None, torch.zeros(1, dtype=torch.int64), torch.rand(4), 1.0,
                                4, 8, kv_cache=(*wrong_heads, torch.zeros(1, dtype=torch.int64)))


def test_fused_linears_take_the_kernel_up_to_16_rows_and_fall_back_to_the_separate_ops_above(monkeypatch):
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)  # the CPU interpreter stands in for CUDA
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2 * 24, 40, generator=g).to(torch.float16)
    rotary = RotaryEmbedding(8, 10000.0, None, 4096)
    qkv_w = torch.randn(4 * 8, 40, generator=g).to(torch.float16)  # 2 q heads, 1 kv head of dim 8
    launched = []
    for name in ("skinny_matmul_silu_and_mul", "skinny_matmul_rope"):
        real = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, real=real, name=name: launched.append((name, len(a[0]))) or real(*a))
    for rows in (1, 16, 17):
        x = torch.randn(rows, 40, generator=g).to(torch.float16)
        positions = torch.arange(rows) * 7
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        assert_close(gemv.linear_silu_and_mul(x, w), F.silu(gate) * up, 4e-3, 2**-8, f"linear_silu_and_mul {rows} rows")
        q, k, v = gemv.linear_rope(x, qkv_w, None, positions, rotary.inv_freq, 1.0, 2, 1, 8)
        assert q.shape == (rows, 2, 8) and k.shape == (rows, 1, 8) and v.shape == (rows, 1, 8)
        q_ref, k_ref = rotary(positions, *(t.view(rows, -1, 8) for t in F.linear(x, qkv_w)[:, :24].split([16, 8], 1)))
        assert_close(q, q_ref, 1e-2, 2**-7, f"linear_rope q, {rows} rows")
        assert_close(k, k_ref, 1e-2, 2**-7, f"linear_rope k, {rows} rows")
        assert_close(v.flatten(1), F.linear(x, qkv_w)[:, 24:], 1e-3, 2**-10, f"linear_rope v, {rows} rows")
    assert launched == [(n, r) for r in (1, 16) for n in ("skinny_matmul_silu_and_mul", "skinny_matmul_rope")]


def test_measured_one_row_configs_replace_the_rule_and_keep_results(monkeypatch):
    monkeypatch.setattr(gemv, "MEASURED_M1", {(2 * 19, 70, True): (2, 32, 2), (19, 70, False): (4, 64, 2)})
    assert gemv._config(1, 2 * 19, 70, paired=True) == (1, 2, 32, 2)
    assert gemv._config(1, 19, 70) == (1, 4, 64, 2)
    assert gemv._config(3, 19, 70)[0] == 16, "2..16 rows keep the tensor-core rule"
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, 70, generator=g).to(torch.float16), (torch.randn(2 * 19, 70, generator=g) * 0.3).to(torch.float16)
    assert_close(gemv.skinny_matmul_silu_and_mul(x, w), silu_and_mul_oracle(x, w), 4e-3, 2**-8, "measured paired config")
    assert_close(gemv.skinny_matmul(x, w[:19]), x.double() @ w[:19].double().T, 1e-3, 2**-10, "measured plain config")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_row_programs_that_load_several_k_tiles_before_the_wait_keep_results(monkeypatch, dtype):
    # BLOCK_K 1024 lets a one-row program take its first K tiles as one wide tile (gemv._pre_tiles); K not a
    # multiple of it leaves the last tile ragged, the wide one full (plain) or partly past the end (paired).
    monkeypatch.setattr(gemv, "MEASURED_M1", {(2 * 19, 3000, True): (2, 1024, 2), (19, 4100, False): (4, 1024, 2)})
    size = torch.tensor([], dtype=dtype).element_size()
    assert gemv._pre_tiles(1, 2, 1024, 3000, size, True) == 2
    assert gemv._pre_tiles(1, 4, 1024, 4100, size, False) == (4 if dtype == torch.float16 else 2)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 4100, generator=g).to(dtype)
    w = (torch.randn(2 * 19, 4100, generator=g) * 0.05).to(dtype)
    atol, rtol = (2e-3, 2**-9) if dtype == torch.float16 else (1e-4, 1e-5)
    assert_close(gemv.skinny_matmul(x, w[:19]), x.double() @ w[:19].double().T, atol, rtol, "wide first tile, plain")
    xs, ws = x[:, :3000].contiguous(), w[:, :3000].contiguous()
    assert_close(gemv.skinny_matmul_silu_and_mul(xs, ws), silu_and_mul_oracle(xs, ws), atol, rtol, "wide first tile, paired")
