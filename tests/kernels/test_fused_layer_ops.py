"""Fused RMSNorm, rotary embedding and SwiGLU (server/kernels/{rmsnorm,rotary,swiglu}.py) vs the model's
torch reference modules vs float64 oracles, through the Triton interpreter on CPU (fp16/fp32 only)."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from server.kernels.rmsnorm import add_rms_norm, rms_norm
from server.kernels.rotary import apply_rotary
from server.kernels.swiglu import silu_and_mul
from server.runtime.models.llama import RMSNorm
from server.runtime.models.rope import RotaryEmbedding


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("dim", [64, 576, 100])  # 100: not a power of two
def test_rms_norm_matches_reference_and_oracle(dtype, tol, dim):
    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(5, dim, generator=g) * 3).to(dtype)
    ref = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(dim, generator=g))
        expected = ref.weight.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
        reference = ref(x)
    fast = rms_norm(x, ref.weight, 1e-5)
    assert fast.dtype == dtype and fast.shape == x.shape
    assert max_diff(reference, expected) <= tol * 4, "reference vs float64 oracle"
    assert max_diff(fast, expected) <= tol * 4, f"Triton rms_norm vs float64 oracle: {max_diff(fast, expected):.3g}"
    assert max_diff(fast, reference) <= tol * 4, "Triton rms_norm vs reference"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 100)])
def test_add_rms_norm_matches_reference_and_oracle(dtype, tol, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x, residual = (torch.randn(rows, dim, generator=g) * 3).to(dtype), (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    ref = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(dim, generator=g))
        reference, reference_sum = ref.add_and_norm(x, residual)  # the torch path (CPU tensors)
    fast, fast_sum = add_rms_norm(x, residual, ref.weight, 1e-5)
    assert torch.equal(fast_sum, x + residual), "the new residual is the sum rounded to the dtype, as a separate add"
    assert torch.equal(reference_sum, x + residual)
    s = (x + residual).double()
    expected = ref.weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert max_diff(reference, expected) <= tol * 4, "reference vs float64 oracle"
    assert max_diff(fast, expected) <= tol * 4, f"Triton add_rms_norm vs float64 oracle: {max_diff(fast, expected):.3g}"
    assert max_diff(fast, reference) <= tol * 4, "Triton add_rms_norm vs reference"


def test_rms_norm_over_heads_of_a_strided_view():
    # Qwen3's q_norm: RMSNorm over head_dim of q heads split out of a fused qkv projection.
    qkv = torch.randn(3, 4 * 16 + 16)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    w = torch.randn(16)
    expected = w * q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert max_diff(rms_norm(q, w, 1e-6), expected) <= 1e-5


@pytest.mark.parametrize("head_dim,scaling", [(64, None), (128, {"rope_type": "linear", "factor": 4.0})])
def test_rotary_matches_reference_and_oracle(head_dim, scaling):
    g = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 10000.0, scaling, 4096)
    tokens, q_heads, kv_heads = 7, 6, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)  # strided, as the model passes them
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 15, 16, 1000, 4095])
    ref_q, ref_k = rotary(positions, q, k)
    fast_q, fast_k = apply_rotary(positions, q, k, rotary.inv_freq, rotary.attention_scaling)

    # Oracle: rotate each pair (i, i + D/2) by angle position * inv_freq[i], in float64.
    angle = positions[:, None].double() * rotary.inv_freq.double()[None, :]  # [T, D/2]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]

    def rotate(x):
        x1, x2 = x.double().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    for name, fast, ref, x in (("q", fast_q, ref_q, q), ("k", fast_k, ref_k, k)):
        assert max_diff(ref, rotate(x)) <= 1e-3, f"reference {name} vs float64 oracle"  # float32 angles at pos 4095
        assert max_diff(fast, rotate(x)) <= 1e-3, f"Triton {name} vs float64 oracle"
        assert max_diff(fast, ref) <= 1e-3, f"Triton {name} vs reference"


def test_rotary_at_position_zero_is_identity_times_scaling():
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    inv_freq = torch.rand(4)
    fast_q, fast_k = apply_rotary(torch.zeros(1, dtype=torch.int64), q, k, inv_freq, 0.5)
    assert torch.allclose(fast_q, 0.5 * q) and torch.allclose(fast_k, 0.5 * k)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_silu_and_mul_matches_reference_and_oracle(dtype, tol):
    g = torch.Generator().manual_seed(1)
    width = 1536 + 7  # more than one block, ragged tail
    gate_up = (torch.randn(3, 2 * width, generator=g) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate / (1 + torch.exp(-gate)) * up
    reference = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    fast = silu_and_mul(gate_up)
    scale = expected.abs().max().item()
    assert max_diff(fast, expected) <= tol * scale, "Triton silu_and_mul vs float64 oracle"
    assert max_diff(reference, expected) <= tol * scale, "reference vs float64 oracle"


def test_bad_shapes_are_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="2 \\* width"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="even head_dim"):
        apply_rotary(torch.zeros(1, dtype=torch.int64), torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.rand(3), 1.0)


def test_llama_forward_on_the_fast_path_matches_the_reference_path(monkeypatch):
    # The whole dispatch (fused norm, rotary, SwiGLU, KV write, paged prefill and decode) wired into the
    # model: a mixed prefill step then a decode step give the reference path's logits.
    from server.kernels import paged_kv
    from server.runtime.models import llama, rope
    from tests.models.paged_batch import PagedBatch
    from tests.models.tiny_llama import tiny_llama

    model = tiny_llama()
    steps = [{"a": list(range(1, 12)), "b": [5, 6, 7]}, {"a": [40], "b": [41]}]
    logits = {}
    for fast in (False, True):
        for module in (paged_kv, llama, rope):
            monkeypatch.setattr(module, "use_triton", lambda t, fast=fast: fast)
        batch = PagedBatch(model, num_pages=16, page_size=4)
        logits[fast] = [batch.step(step) for step in steps]
    for i, (ref, fast) in enumerate(zip(logits[False], logits[True])):
        for seq in ref:
            assert max_diff(fast[seq], ref[seq]) <= 1e-4, f"step {i}, sequence {seq}: fast path logits differ"


def test_llama_decode_through_the_fused_matmuls_matches_the_reference_path(monkeypatch):
    # fp16, so the decode rows (<= 16) take the skinny matmuls with SiLU*up and RoPE in their epilogues, and
    # every norm after the first takes the residual add; the 20-row prefill step takes F.linear + separate ops.
    from server.kernels import gemv, paged_kv
    from server.runtime.models import llama, rope
    from tests.models.paged_batch import PagedBatch
    from tests.models.tiny_llama import tiny_llama

    model = tiny_llama(num_heads=6, attention_bias=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.half()
    steps = [{"a": list(range(1, 13)), "b": [5, 6, 7, 8, 9, 10, 11, 12]}, {"a": [40], "b": [41]}, {"a": [3], "b": [4]}]
    logits = {}
    calls = []
    real = gemv.skinny_matmul_rope
    for fast in (False, True):
        for module in (paged_kv, llama, rope, gemv):
            monkeypatch.setattr(module, "use_triton", lambda t, fast=fast: fast)
        monkeypatch.setattr(gemv, "skinny_matmul_rope", lambda *a: calls.append(len(a[0])) or real(*a))
        batch = PagedBatch(model, num_pages=16, page_size=4, kv_dtype=torch.float16)
        logits[fast] = [batch.step(step) for step in steps]
    assert calls == [2, 2] * 2, "each decode step's qkv takes the fused kernel in both layers"
    for i, (ref, fast) in enumerate(zip(logits[False], logits[True])):
        for seq in ref:
            scale = ref[seq].abs().max().item()
            assert max_diff(fast[seq], ref[seq]) <= 2e-2 * scale, f"step {i}, sequence {seq}: fast path logits differ"
