"""Fused quantized MoE (Triton via the interpreter, and the reference) against a float64 oracle."""

import math

import pytest
import torch

from server.kernels.experts import moe, weights
from server.kernels.experts.moe_reference import fused_moe_reference
from server.kernels.rotation import sign_bits


def _rotation_matrix(signs, group: int) -> torch.Tensor:
    """Independent float64 R = D2 · H · D1 / sqrt(G) with H built by Sylvester's construction."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < group:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    d1, d2 = (1 - 2 * sign_bits(words, group).double() for words in signs)
    return d2[:, None] * h * d1[None, :] / math.sqrt(group)


def _rotate64(w: weights.ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    if w.signs is None:
        return x
    r = _rotation_matrix(w.signs, w.group)
    return (x.reshape(*x.shape[:-1], -1, w.group) @ r.T).reshape(x.shape)


def oracle(x, topk_w, topk_ids, gate_up, down) -> torch.Tensor:
    """Dequantize in float64, rotate with an explicit matrix, matmul in float64."""
    gu = gate_up.dequantize(dtype=torch.float64)
    dn = down.dequantize(dtype=torch.float64)
    i = gu.shape[1] // 2
    xr = _rotate64(gate_up, x.double())
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            g = gu[e] @ xr[t]
            h = g[:i] * torch.sigmoid(g[:i]) * g[i:]
            y[t] += float(topk_w[t, j]) * (dn[e] @ _rotate64(down, h))
    return y


# (format, experts, hidden D, intermediate I): odd expert counts and widths the formats can hold.
CASES = [("e8p", 5, 40, 24), ("e8p3", 3, 24, 56), ("q2_0", 5, 64, 192), ("q1_0", 3, 128, 128), ("bf16", 3, 36, 20)]


def _problem(fmt, num_e, d, i, tokens, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    gu = weights.quantize(torch.randn(num_e, 2 * i, d, generator=gen) / math.sqrt(d), fmt, seed=seed)
    dn = weights.quantize(torch.randn(num_e, d, i, generator=gen) / math.sqrt(i), fmt, seed=seed + 1)
    x = torch.randn(tokens, d, generator=gen)
    ids = torch.randint(0, num_e - 1, (tokens, top_k), generator=gen)  # the last expert gets no tokens
    ids[0, -1] = ids[0, 0]  # token 0 routed twice to one expert
    w = torch.rand(tokens, top_k, generator=gen)
    return x, w, ids, gu, dn


@pytest.mark.parametrize("fmt,num_e,d,i", CASES)
@pytest.mark.parametrize("block_m", [moe.DECODE_BLOCK_M, moe.PREFILL_BLOCK_M])
def test_triton_moe_matches_float64_oracle(fmt, num_e, d, i, block_m):
    x, w, ids, gu, dn = _problem(fmt, num_e, d, i, tokens=7 if block_m == 16 else 19, top_k=2, seed=len(fmt) + d)
    want = oracle(x, w, ids, gu, dn)
    got = moe.fused_moe_triton(x, w, ids, gu, dn, block_m=block_m).double()
    ref = fused_moe_reference(x, w, ids, gu, dn).double()
    scale = want.abs().max()
    assert (got - want).abs().max() < 1e-5 * scale, "Triton body differs from the float64 oracle"
    assert (ref - want).abs().max() < 1e-5 * scale, "reference differs from the float64 oracle"


def test_single_token_with_half_precision_activations():
    x, w, ids, gu, dn = _problem("e8p", 4, 32, 40, tokens=1, top_k=3, seed=9)
    got = moe.fused_moe_triton(x.half(), w.half(), ids, gu, dn)
    want = oracle(x.half().float(), w.half().float(), ids, gu, dn)
    assert got.dtype == torch.float16
    assert ((got.double() - want).norm() / want.norm()) < 5e-3  # h is stored in fp16 between the kernels


@pytest.mark.parametrize("fmt", ["e8p", "e8p3", "q2_0", "q1_0"])
def test_changing_one_packed_code_changes_the_output(fmt):
    num_e, d, i = 2, 128, 128
    x, w, ids, gu, dn = _problem(fmt, num_e, d, i, tokens=3, top_k=1, seed=4)
    ids[:] = 0
    before = moe.fused_moe_triton(x, w, ids, gu, dn)
    for proj in (gu, dn):
        key = "residual" if fmt == "e8p3" and proj is dn else "codes"
        saved = proj.tensors[key].clone()
        proj.tensors[key].view(torch.uint8).reshape(-1)[5] ^= 0x10  # one code of expert 0, row 0
        after = moe.fused_moe_triton(x, w, ids, gu, dn)
        assert not torch.equal(before, after), f"{fmt}: flipping a {key} bit of the {'gate_up' if proj is gu else 'down'} weights left the output unchanged"
        proj.tensors[key].copy_(saved)
    assert torch.equal(moe.fused_moe_triton(x, w, ids, gu, dn), before)


def test_dispatch_on_cpu_takes_the_reference_and_rejects_bad_shapes():
    x, w, ids, gu, dn = _problem("e8p", 3, 16, 16, tokens=2, top_k=2, seed=5)
    assert torch.equal(moe.fused_moe(x, w, ids, gu, dn), fused_moe_reference(x, w, ids, gu, dn))
    with pytest.raises(ValueError, match=r"x must be \[tokens, 16\]"):
        moe.fused_moe(x[:, :8], w, ids, gu, dn)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        moe.fused_moe(x, w, ids + 3, gu, dn)
    with pytest.raises(ValueError, match="down must be"):
        moe.fused_moe(x, w, ids, gu, gu)


def test_quantize_refuses_unknown_formats_and_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="unknown expert weight format 'q3_0'"):
        weights.quantize(torch.randn(4, 64), "q3_0")
    with pytest.raises(ValueError, match="units of 64 weights; input width 96"):
        weights.quantize(torch.randn(4, 96), "q2_0")
    with pytest.raises(ValueError, match="units of 8 weights; input width 12"):
        weights.quantize(torch.randn(4, 12), "e8p")


@pytest.mark.parametrize("fmt,expected", [("e8p", 0.0916), ("e8p3", 0.0296), ("q2_0", 0.1175), ("q1_0", 0.3634)])
def test_quantized_weights_error_follows_format_distortion(fmt, expected):
    """Rotated, quantized and rotated back, Gaussian rows keep the format's distortion (q: ≈ scalar figures)."""
    w = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(6))
    q = weights.quantize(w, fmt, seed=1)
    r = _rotate64(q, torch.eye(256, dtype=torch.float64)).T  # stored rows are W·Rᵀ; times R gives W back
    w_hat = q.dequantize(dtype=torch.float64)[0] @ r
    rel = ((w_hat - w[0].double()) ** 2).mean().item() / w.var().item()
    assert rel < 1.1 * expected, f"{fmt}: relative MSE {rel:.4f}, expected about {expected}"
    assert rel > 0.6 * expected


def test_a_kernel_that_does_not_fit_falls_back_to_the_reference_and_says_so(monkeypatch, caplog):
    from triton.runtime.errors import OutOfResources

    def too_big(*args, **kwargs):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(moe, "use_triton", lambda t: True)
    monkeypatch.setattr(moe, "fused_moe_triton", too_big)
    x, w, ids, gu, dn = _problem("q2_0", 2, 64, 64, tokens=2, top_k=1, seed=8)
    with caplog.at_level("WARNING"):
        y = moe.fused_moe(x, w, ids, gu, dn)
    assert torch.equal(y, fused_moe_reference(x, w, ids, gu, dn))
    assert "q2_0 kernel does not fit this GPU" in caplog.text
