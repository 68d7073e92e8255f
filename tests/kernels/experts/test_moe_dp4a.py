"""8-bit activations (int8_activations.py) and the integer-dot decode body (moe_dp4a.py) of q1_0/q2_0 experts.

The body is checked against the reference with the same activation rounding (fused_moe_reference(...,
int8_activations=True)) at float32 tolerance, and against the float64 oracle on unquantized activations at a
tolerance derived from the int8 step (INT8_BOUND below). The interpreter runs `_dp4a`'s plain-integer form; the
GPU check (bench/kernels_experts.check_dp4a) runs the assembly.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from server.kernels import rotation
from server.kernels.experts import int8_activations as act8
from server.kernels.experts import moe, qblocks, weights
from server.kernels.experts.moe_dp4a import _dp4a, _dp4a_step, sum_top_k_slots
from server.kernels.experts.moe_reference import fused_moe_reference
from server.kernels.experts.moe_triton import FORMAT_IDS
from tests.kernels.experts.test_fused_moe import _problem, oracle
from tests.kernels.experts.test_qblocks import _every_byte_at_every_position

# Rounding to int8 moves each value of a 32-group by at most s/2 = max|a|/254, so a group's error has norm at most
# sqrt(32)/254 · max|a| <= sqrt(32)/254 · ||a_group||: activations move by at most 2.2 % (relative L2). For random
# weights a matmul keeps that ratio; y sees three such errors (x's through gate and through up, which the SiLU·up
# product adds, and h's through down), so it may differ from the unquantized op by up to 3 x 2.2 %.
INT8_BOUND = 3 * math.sqrt(32) / 254


def test_group_rounding_is_within_half_a_step_and_uses_the_full_int8_range():
    a = torch.randn(3, 96, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 1e-3, 50.0])[:, None]
    a[1, 32:64] = 0  # an all-zero group: q = 0, s = 0
    q, s = act8.group_scales(a)
    groups = a.reshape(3, 3, 32)
    amax = groups.abs().amax(-1).double()
    assert ((s.double() - amax / 127).abs() <= amax / 127 * 2**-22).all()  # max|a|/127 to float32 rounding
    assert (q.abs() <= 127).all() and torch.equal(q, q.round())
    assert torch.equal(q.abs().amax(-1), torch.where(s > 0, 127.0, 0.0))  # the largest value maps to ±127
    assert ((q * s[..., None] - groups).abs() <= s[..., None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(act8.fake_quantize(a), (q * s[..., None]).reshape(a.shape))


@pytest.mark.parametrize("fmt", ["q2_0", "q1_0"])
def test_planes_hold_each_q_in_the_byte_the_weight_codes_unpack_to(fmt):
    """Planes as the docstring lays them out, checked position by position; the Triton kernel bit for bit, at
    22 groups (three programs, the last partial) with an all-zero group."""
    a = torch.randn(2, 22 * 32, generator=torch.Generator().manual_seed(1))
    a[0, 64:96] = 0
    q, s = act8.group_scales(a)
    planes = act8.quantize_reference(a, fmt)
    assert planes.shape == (2, act8.PLANES, 22) and planes.dtype == torch.int32
    as_bytes = planes[:, :8].contiguous().view(torch.int8).reshape(2, 8, 22, 4)  # [t, plane, group, byte]
    for k in range(32):
        if fmt == "q2_0":  # weight k = 16h + 4b + j: field j of byte b of the group's code word h
            plane, byte = 4 * (k // 16) + k % 4, (k % 16) // 4
        else:  # weight k = 8b + j: bit j of byte b of the group's code word
            plane, byte = k % 8, k // 8
        assert torch.equal(as_bytes[:, plane, :, byte].float(), q[:, :, k]), f"position {k}"
    assert torch.equal(planes[:, 8], -q.sum(-1).int())
    assert torch.equal(planes[:, 9].view(torch.float32), s)
    assert torch.equal(act8.quantize_triton(a, fmt), planes)
    with pytest.raises(ValueError, match="groups of 32"):
        act8.quantize_triton(a[:, :40], fmt)


# (format, rotation group, dtype): the deep shape's group (256: 8 int8 groups), a small one (64: 2 per program
# row), one below an int8 group (16: two rotation groups make one int8 group), in float32 and fp16 (the two-step
# chain stores the rotation in a's dtype; bf16 arithmetic is not exact in the interpreter).
ROTATIONS = [("q2_0", 256, torch.float32), ("q1_0", 64, torch.float16), ("q2_0", 16, torch.float16),
             ("q1_0", 256, torch.float16)]


@pytest.mark.parametrize("fmt,group,dtype", ROTATIONS)
def test_rotation_and_rounding_in_one_launch_give_the_planes_of_the_two_step_chain(fmt, group, dtype):
    """quantize_triton given a rotation, bit for bit against its torch definition (rotate, store in a's dtype,
    quantize) and against the two launches it replaces (rotation.rotate_triton, then quantize_triton): 40 int8
    groups a row at group 256, else 42 (6 programs, the last partial), 3 rows of different magnitudes, an
    all-zero rotation group."""
    gen = torch.Generator().manual_seed(group)
    groups = 40 if group == 256 else 42
    a = (torch.randn(3, groups * 32, generator=gen) * torch.tensor([1.0, 1e-2, 30.0])[:, None]).to(dtype)
    a[1, group:2 * group] = 0
    signs = weights.random_signs(group, seed=group + 1)
    want = act8.quantize_reference(a, fmt, group, signs)
    assert not torch.equal(want, act8.quantize_reference(a, fmt)), "the rotation changed nothing"
    assert torch.equal(act8.quantize_triton(a, fmt, group, signs), want)
    assert torch.equal(act8.quantize_triton(rotation.rotate_triton(a, group, signs=signs), fmt), want)
    with pytest.raises(ValueError, match="rotation group"):
        act8.quantize_triton(a[:, :96], fmt, 64, weights.random_signs(64, seed=0))


def test_top_k_slots_are_summed_in_slot_order_then_rounded_once():
    """3 tokens x 5 slots, D = 1100 (two programs a token, the second partial): ((y0 + y1) + y2) + ... in
    float32, then one rounding to fp16, bit for bit."""
    y = torch.randn(15, 1100, generator=torch.Generator().manual_seed(5)) * 100
    slots = y.view(3, 5, 1100)
    acc = slots[:, 0]
    for j in range(1, 5):
        acc = acc + slots[:, j]
    got = sum_top_k_slots(y, 5, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, acc.half())
    assert torch.equal(sum_top_k_slots(y, 5, torch.float32), acc)


@triton.jit
def _dp4a_kernel(u_ptr, v_ptr, c_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _dp4a(tl.load(u_ptr + i), tl.load(v_ptr + i), tl.load(c_ptr + i), False))


def test_integer_dot_of_four_bytes_unsigned_by_signed_plus_c():
    gen = torch.Generator().manual_seed(2)
    u = torch.randint(0, 256, (64, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    v = torch.randint(-128, 128, (64, 4), generator=gen, dtype=torch.int32).to(torch.int8)
    c = torch.randint(-1 << 20, 1 << 20, (64,), generator=gen, dtype=torch.int32)
    out = torch.empty(64, dtype=torch.int32)
    _dp4a_kernel[(1,)](u.view(torch.int32).reshape(64), v.view(torch.int32).reshape(64), c, out, N=64)
    assert torch.equal(out, c + (u.int() * v.int()).sum(1))


@triton.jit
def _step_kernel(x_ptr, d_ptr, act_ptr, out_ptr, G, R: tl.constexpr, WORDS: tl.constexpr, NB: tl.constexpr,
                 FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.arange(0, R)
    x = tl.load(x_ptr + r[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    d = tl.load(d_ptr + r[:, None] * NB + tl.arange(0, NB)[None, :]).to(tl.float32)
    g = tl.arange(0, BLOCK_K // 32)
    out = _dp4a_step(x, d, tl.load(act_ptr + g), tl.load(act_ptr + G + g), tl.load(act_ptr + 2 * G + g),
                     tl.load(act_ptr + 3 * G + g), tl.load(act_ptr + 4 * G + g), tl.load(act_ptr + 5 * G + g),
                     tl.load(act_ptr + 6 * G + g), tl.load(act_ptr + 7 * G + g), tl.load(act_ptr + 8 * G + g),
                     tl.load(act_ptr + 9 * G + g).to(tl.float32, bitcast=True), FORMAT, BLOCK_K, False)
    tl.store(out_ptr + r[:, None] * NB + tl.arange(0, NB)[None, :], out)


@pytest.mark.parametrize("fmt", ["q2_0", "q1_0"])
def test_every_bit_pattern_of_a_block_through_the_integer_dot(fmt):
    """256 rows of one K step (two q blocks): every byte value at every code position of a block, random d and
    activations (which reach ±127); each block's Σ level·d·s·q against float64 from qblocks.dequantize."""
    f = qblocks.BLOCK_FORMATS[fmt]
    gen = torch.Generator().manual_seed(3)
    codes = torch.cat([_every_byte_at_every_position(), _every_byte_at_every_position().flip(0)], 1)  # [256, 32]
    d = (torch.rand(256, 2, generator=gen) * 2 - 1).half()
    block_k = 2 * f.block
    a = torch.randn(1, block_k, generator=gen)
    planes = act8.quantize_reference(a, fmt)[0]
    out = torch.empty((256, 2), dtype=torch.float32)
    _step_kernel[(1,)](codes.view(torch.int32).contiguous(), d, planes, out, block_k // 32, R=256,
                       WORDS=block_k * f.bits // 32, NB=2, FORMAT=FORMAT_IDS[fmt], BLOCK_K=block_k)
    w = qblocks.dequantize(f, d, codes, torch.float64).reshape(256, 2, f.block)
    xq = act8.fake_quantize(a).double().reshape(2, f.block)
    want = (w * xq).sum(-1)
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


# (format, experts, D, I, tokens): K not a multiple of the K step (192 -> a 256 step; 640 -> 512), one expert left
# without tokens and token 0 routed twice to one expert (_problem), 1, 3 and 8 tokens.
CASES = [("q2_0", 5, 64, 192, 1), ("q2_0", 3, 640, 64, 3), ("q1_0", 3, 128, 128, 8), ("q1_0", 2, 384, 128, 3)]


@pytest.mark.parametrize("fmt,num_e,d,i,tokens", CASES)
def test_dp4a_body_matches_the_int8_reference_and_the_float64_oracle(fmt, num_e, d, i, tokens):
    x, w, ids, gu, dn = _problem(fmt, num_e, d, i, tokens=tokens, top_k=2, seed=d + i + tokens)
    got = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True, int8_activations=True).double()
    ref = fused_moe_reference(x, w, ids, gu, dn, int8_activations=True).double()
    want = oracle(x, w, ids, gu, dn)
    assert (got - ref).abs().max() < 1e-5 * ref.abs().max(), "dp4a body differs from the int8-activation reference"
    assert (got - want).norm() < INT8_BOUND * want.norm(), "dp4a body is further from the oracle than int8 allows"
    assert not torch.equal(ref, fused_moe_reference(x, w, ids, gu, dn).double())  # the mode does round


def test_dp4a_body_with_half_precision_activations():
    x, w, ids, gu, dn = _problem("q2_0", 3, 128, 64, tokens=2, top_k=2, seed=14)
    got = moe.fused_moe_triton(x.half(), w.half(), ids, gu, dn, gemv=True, int8_activations=True)
    assert got.dtype == torch.float16
    want = oracle(x.half().float(), w.half().float(), ids, gu, dn)
    assert (got.double() - want).norm() < INT8_BOUND * want.norm()


@pytest.mark.parametrize("fmt", ["q2_0", "q1_0"])
def test_dp4a_body_reads_every_code_it_is_given(fmt):
    """Flipping one code bit of expert 0's gate_up, then down, changes the output."""
    x, w, ids, gu, dn = _problem(fmt, 2, 128, 128, tokens=2, top_k=1, seed=4)
    ids[:] = 0
    before = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True, int8_activations=True)
    for proj in (gu, dn):
        saved = proj.tensors["codes"].clone()
        proj.tensors["codes"].reshape(-1)[5] ^= 0x10
        after = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True, int8_activations=True)
        assert not torch.equal(before, after), f"{fmt}: a flipped code bit left the dp4a output unchanged"
        proj.tensors["codes"].copy_(saved)


def test_int8_mode_takes_the_dp4a_body_at_decode_only_and_the_reference_only_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "launch_expert_dp4a", lambda *a, **k: calls.append("dp4a"))
    monkeypatch.setattr(moe, "launch_expert_gemv", lambda *a, **k: calls.append("gemv"))
    monkeypatch.setattr(moe, "launch_expert_gemm", lambda *a, **k: calls.append("gemm"))
    x, w, ids, gu, dn = _problem("q2_0", 5, 64, 64, tokens=2, top_k=2, seed=3)
    moe.fused_moe_triton(x, w, ids, gu, dn, int8_activations=True)  # 4 pairs <= 5 experts: decode
    moe.fused_moe_triton(x, w, ids, gu, dn)
    moe.fused_moe_triton(x, w, ids, gu, dn, block_m=moe.DECODE_BLOCK_M, int8_activations=True)
    assert calls == ["dp4a", "dp4a", "gemv", "gemv", "gemm", "gemm"]
    # unset: the GPU decode bodies take int8 activations, the reference does not; 0: none; 1: both
    assert moe.int8_settings(None) == (True, False)
    assert moe.int8_settings("0") == (False, False) and moe.int8_settings("1") == (True, True)
    with pytest.raises(ValueError, match="unset, 0 or 1"):
        moe.int8_settings("yes")
    monkeypatch.setattr(moe, "int8_decode", True)
    monkeypatch.setattr(moe, "int8_reference", False)
    assert torch.equal(moe.fused_moe(x, w, ids, gu, dn), fused_moe_reference(x, w, ids, gu, dn))
    monkeypatch.setattr(moe, "int8_reference", True)
    assert torch.equal(moe.fused_moe(x, w, ids, gu, dn), fused_moe_reference(x, w, ids, gu, dn, int8_activations=True))
