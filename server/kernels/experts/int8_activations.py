"""8-bit activations for the integer decode bodies of quantized experts: definitions and kernels. q1_0/q2_0
(moe_dp4a.py) take groups of 32 in the plane layout below; e8p/e8p3 (moe_cuda.py's integer body) groups of
E8_GROUP = 256 in input order (the section at the end of this file).

An activation row (the rotated x for gate_up, the rotated h for down) is cut into groups of GROUP = 32 (E8:
E8_GROUP) consecutive values along K; a group gets one float32 scale s = max|a| · fp32(1/127) and int8 q = round(a / s) (half
to even; q = 0 for an all-zero group), so a ≈ s·q with |a - s·q| <= s / 2 ≈ max|a| / 254. s is a product, not a
quotient, because torch on CUDA divides by a Python scalar as a multiply by its reciprocal: only a product is
rounded the same by torch on CPU and GPU and by the kernel (H200 check, 07:11 UTC: max|a| / 127 differed). This is llama.cpp's
q8_1-style activation quantization, and it changes the op's numerics: `fake_quantize` gives the values the
integer body multiplies, and moe_reference.fused_moe_reference(..., int8_activations=True) is the op with them.

The kernels' layout (`quantize_reference`, `quantize_triton`): one int32 tensor [T, PLANES, K / 32], plane-major,
so a K step of the decode body reads each plane as one contiguous run of words:
  planes 0-7  the group's 32 q as bytes, in the order the weight codes come out of one shift and one mask per 4
              weights (moe_dp4a.py): q2_0 plane 4h + j holds q[16h + 4b + j] in byte b (field j of byte b of the
              group's code word h); q1_0 plane j holds q[8b + j] in byte b (bit j of byte b of the code word);
  plane 8     -Σq of the group: the integer dot starts from it, which turns Σ c·q into Σ (c - 1)·q (q2_0 levels)
              or, with the code bits doubled, Σ (2c - 1)·q (q1_0 levels) at no cost;
  plane 9     the bits of s (float32).

Rotated weights (weights.py, "Incoherence" in the spec) multiply the rotated activation R·a. `quantize_triton`
given the weights' rotation (group, signs) rotates and rounds in one launch, which a decode step would otherwise
spend two on (rotation.rotate_triton, then this quantization); it keeps the two-step chain's planes bit for bit,
the rotation stored in a's dtype included (`quantize_reference` with the same rotation is that chain in torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels import pdl, rotation
from server.kernels.experts.moe_triton import FORMAT_IDS, Q2_0
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.rotation import rotate_rows
from server.kernels.timing import timed

GROUP = 32
PLANES = 10
E8_GROUP = 256  # the E8 formats' integer-MMA body (moe_cuda.py) takes a group per K step of 256 inputs
INV_127 = float(torch.tensor(1 / 127, dtype=torch.float32))  # fp32(1/127), the scale's factor
_INV_127 = tl.constexpr(INV_127)
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + _ROUND) - _ROUND is v rounded half to even for |v| < 2^22


def int8_group(fmt: str, k: int) -> int | None:
    """Values per scale of the 8-bit activations that an integer body multiplies with ``fmt`` weights of ``k``
    inputs: GROUP for q1_0/q2_0 (moe_dp4a.py), E8_GROUP for e8p/e8p3 (moe_cuda.py's integer body, which takes a
    group a K step); None where no integer body takes such weights."""
    group = {"q1_0": GROUP, "q2_0": GROUP, "e8p": E8_GROUP, "e8p3": E8_GROUP}.get(fmt)
    return group if group and k % group == 0 else None


def group_scales(a: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """a [T, K] (K a multiple of ``group``) -> (q [T, K/group, group] float32 integers in [-127, 127], s [T, K/group]
    float32)."""
    if a.shape[-1] % group:
        raise ValueError(f"8-bit activations come in groups of {group}; a row of {a.shape[-1]} values is not a multiple")
    g = a.float().reshape(a.shape[0], -1, group)
    s = g.abs().amax(-1) * torch.tensor(INV_127, dtype=torch.float32, device=a.device)
    q = torch.where(s[..., None] > 0, torch.round(g / torch.where(s > 0, s, 1)[..., None]), 0.0)
    return q, s


def fake_quantize(a: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The values the integer bodies multiply: s·q per group, float32, a's shape."""
    q, s = group_scales(a, group)
    return (q * s[..., None]).reshape(a.shape)


def byte_slots(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(plane, byte) of each of a group's 32 positions for weights in ``fmt`` (the module docstring's order)."""
    k = torch.arange(GROUP)
    if fmt == "q2_0":
        return 4 * (k // 16) + k % 4, k // 4 % 4
    if fmt == "q1_0":
        return k % 8, k // 8
    raise ValueError(f"8-bit activations pair with q1_0/q2_0 weights, not {fmt!r}")


def quantize_reference(a: torch.Tensor, fmt: str, group: int = 0, signs=None) -> torch.Tensor:
    """a [T, K] -> int32 [T, PLANES, K/32] (module docstring), in torch; with ``signs`` (a rotation as
    weights.ExpertWeights holds it: ``group`` and the two sign tables) of R·a stored in a's dtype first."""
    if signs is not None:
        a = rotation.rotate_reference(a, group, signs=signs).to(a.dtype)
    q, s = group_scales(a)
    plane, byte = byte_slots(fmt)
    qb = (q.to(torch.int64) & 0xFF) << (8 * byte.to(a.device))  # [T, G, 32]
    words = torch.zeros((*q.shape[:2], 8), dtype=torch.int64, device=a.device)
    words.index_add_(2, plane.to(a.device), qb)
    out = torch.empty((a.shape[0], PLANES, q.shape[1]), dtype=torch.int32, device=a.device)
    out[:, :8] = (words - (words >= 1 << 31).long() * (1 << 32)).to(torch.int32).transpose(1, 2)
    out[:, 8] = -q.sum(-1).to(torch.int32)
    out[:, 9] = s.view(torch.int32)
    return out


@triton.jit
def _rounded(a, s):
    """int32 q = round(a / s), 0 where s = 0: the IEEE division and the round-half-even of the torch definition
    (group_scales, whose scale s = max|a| · _INV_127 the caller forms the same way), bit for bit."""
    v = tl.math.div_rn(a, tl.where(s > 0, s, 1.0))
    return ((v + _ROUND) - _ROUND).to(tl.int32)


@triton.jit
def _quantize_kernel(a_ptr, out_ptr, first_ptr, second_ptr, inv_sqrt, G, stride_a, stride_o, FORMAT: tl.constexpr,
                     BLOCK_G: tl.constexpr, ROTATION: tl.constexpr, LOG2_ROTATION: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """Groups [pid1·BLOCK_G, +BLOCK_G) of activation row pid0 -> the PLANES words of each (`quantize_reference`).
    ``ROTATION`` (0: none): the rotation group; the program's BLOCK_G·32 values are whole rotation groups, rotated
    in registers (rotation.rotate_rows, bit for bit rotation.rotate_triton) and rounded to a's dtype, as the
    two-step chain stores them. ``USE_PDL``: the integer-dot launch after it is scheduled at once and streams its
    first weights meanwhile."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()  # a is the previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    k = tl.arange(0, 32)
    live = g < G
    if ROTATION:
        ROWS: tl.constexpr = BLOCK_G * 32 // ROTATION
        offs = (tl.program_id(1) * BLOCK_G * 32 + tl.arange(0, ROWS)[:, None] * ROTATION
                + tl.arange(0, ROTATION)[None, :])
        x = tl.load(a_ptr + row * stride_a + offs, mask=offs < G * 32, other=0.0).to(tl.float32)
        y = rotate_rows(x, first_ptr, second_ptr, inv_sqrt, ROWS, ROTATION, LOG2_ROTATION)
        a = tl.reshape(y.to(a_ptr.dtype.element_ty).to(tl.float32), (BLOCK_G, 32))
    else:
        a = tl.load(a_ptr + row * stride_a + g[:, None] * 32 + k[None, :], mask=live[:, None], other=0.0)
        a = a.to(tl.float32)
    s = tl.max(tl.abs(a), 1) * _INV_127
    q = _rounded(a, s[:, None])
    if FORMAT == Q2_0:
        plane = 4 * (k // 16) + k % 4
        byte = k // 4 % 4
    else:
        plane = k % 8
        byte = k // 8
    placed = (q & 0xFF) << (8 * byte)[None, :]  # [BLOCK_G, 32]; fields of one word are disjoint, so sum = OR
    words = tl.sum(tl.where((plane[:, None] == tl.arange(0, 8)[None, :])[None, :, :], placed[:, :, None], 0), 1)
    base = out_ptr + row * stride_o
    tl.store(base + tl.arange(0, 8)[None, :] * G + g[:, None], words, mask=live[:, None])
    tl.store(base + 8 * G + g, -tl.sum(q, 1), mask=live)
    tl.store(base + 9 * G + g, s.to(tl.int32, bitcast=True), mask=live)


# Groups per program (at least one rotation group): a token of D = 6144 takes 24 programs. H200, D=6144 I=2048 E=64
# top-8 q2_0 with the rotation in the launch (HW block, 10:55 UTC): 8 beat 16, the launch alone 5.3-5.4 vs 5.9-6.0 us,
# the kernels of a decode at one token 34.7 vs 35.6 us (8 tokens 180.1 vs 181.4 us); module-level for the sweep.
QUANTIZE_BLOCK_G = 8


def quantize_triton(a: torch.Tensor, fmt: str, group: int = 0, signs=None) -> torch.Tensor:
    """As quantize_reference (with the same rotation, if any), one Triton launch (a [T, K] rows, any float dtype)."""
    if a.shape[-1] % GROUP:
        raise ValueError(f"8-bit activations come in groups of {GROUP}; a row of {a.shape[-1]} values is not a multiple")
    if fmt not in ("q1_0", "q2_0"):
        raise ValueError(f"8-bit activations pair with q1_0/q2_0 weights, not {fmt!r}")
    a = a.contiguous()
    groups = a.shape[1] // GROUP
    out = torch.empty((a.shape[0], PLANES, groups), dtype=torch.int32, device=a.device)
    first = second = out  # the sign tables' arguments, never read without a rotation
    rot = 0
    if signs is not None:
        rotation.check_group(group, signs)
        if a.shape[1] % group:
            raise ValueError(f"a row of {a.shape[1]} values is not a multiple of the rotation group {group}")
        first, second = (rotation.device_sign_words(w, a.device) for w in signs)
        rot = group
    block_g = max(QUANTIZE_BLOCK_G, rot // GROUP)  # whole rotation groups per program
    grid = (a.shape[0], triton.cdiv(groups, block_g))
    with timed("experts_int8_activations", a.device):
        _quantize_kernel[grid](a, out, first, second, rotation.inv_sqrt_group(max(rot, 1)), groups, a.stride(0),
                               out.stride(0), FORMAT=FORMAT_IDS[fmt], BLOCK_G=block_g, ROTATION=rot,
                               LOG2_ROTATION=max(rot, 1).bit_length() - 1, **pdl.launch_options(a.device))
    return out


# ---- E8 formats: groups of E8_GROUP, q in input order (moe_cuda.py's integer-MMA body) --------------------------
# A row of K activations is int32 words: K/4 words of q (byte b of word w is q[4w + b]), then one float32 scale per
# group, then Σq per group, padded to a multiple of 4 words so that every row starts 16-byte aligned.


def row_words(k: int) -> int:
    """int32 words of one quantized row of ``k`` activations (quantize_rows_reference's layout)."""
    return -(-(k // 4 + 2 * (k // E8_GROUP)) // 4) * 4


def quantize_rows_reference(a: torch.Tensor, group: int = 0, signs=None) -> torch.Tensor:
    """a [T, K] (K a multiple of E8_GROUP) -> int32 [T, row_words(K)] (layout above; the padding words are 0), in
    torch; with ``signs`` of R·a stored in a's dtype first (as quantize_reference)."""
    if signs is not None:
        a = rotation.rotate_reference(a, group, signs=signs).to(a.dtype)
    q, s = group_scales(a, E8_GROUP)
    t, k = a.shape
    qb = (q.reshape(t, k // 4, 4).to(torch.int64) & 0xFF) << (8 * torch.arange(4, device=a.device))
    words = qb.sum(-1)
    out = torch.zeros((t, row_words(k)), dtype=torch.int32, device=a.device)
    out[:, : k // 4] = (words - (words >= 1 << 31).long() * (1 << 32)).to(torch.int32)
    groups = k // E8_GROUP
    out[:, k // 4 : k // 4 + groups] = s.view(torch.int32)
    out[:, k // 4 + groups : k // 4 + 2 * groups] = q.sum(-1).to(torch.int32)
    return out


@triton.jit
def _quantize_rows_kernel(a_ptr, out_ptr, first_ptr, second_ptr, inv_sqrt, K, G, stride_a, stride_o,
                          ROTATION: tl.constexpr, LOG2_ROTATION: tl.constexpr, USE_PDL: tl.constexpr):
    """Group pid1 of activation row pid0 -> its 64 words of q, its scale and its Σq (quantize_rows_reference);
    ``ROTATION`` and ``USE_PDL`` as in _quantize_kernel."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()  # a is the previous kernel's output
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    if ROTATION:
        ROWS: tl.constexpr = 256 // ROTATION
        offs = grp * 256 + tl.arange(0, ROWS)[:, None] * ROTATION + tl.arange(0, ROTATION)[None, :]
        x = tl.load(a_ptr + row * stride_a + offs).to(tl.float32)
        y = rotate_rows(x, first_ptr, second_ptr, inv_sqrt, ROWS, ROTATION, LOG2_ROTATION)
        a = tl.reshape(y.to(a_ptr.dtype.element_ty).to(tl.float32), (64, 4))
    else:
        offs = grp * 256 + tl.arange(0, 64)[:, None] * 4 + tl.arange(0, 4)[None, :]
        a = tl.load(a_ptr + row * stride_a + offs).to(tl.float32)
    s = tl.max(tl.max(tl.abs(a), 1), 0) * _INV_127
    q = _rounded(a, s)
    words = tl.sum((q & 0xFF) << (8 * tl.arange(0, 4))[None, :], 1)  # disjoint bytes: the sum is their OR
    base = out_ptr + row * stride_o
    tl.store(base + grp * 64 + tl.arange(0, 64), words)
    tl.store(base + K // 4 + grp, s.to(tl.int32, bitcast=True))
    tl.store(base + K // 4 + G + grp, tl.sum(tl.sum(q, 1), 0))


def quantize_rows_triton(a: torch.Tensor, group: int = 0, signs=None) -> torch.Tensor:
    """As quantize_rows_reference (with the same rotation, if any; the padding words are left unwritten), one Triton
    launch of a program per group (a [T, K] rows, any float dtype)."""
    if a.shape[-1] % E8_GROUP:
        raise ValueError(f"E8 int8 activations come in groups of {E8_GROUP}; "
                         f"a row of {a.shape[-1]} values is not a multiple")
    a = a.contiguous()
    t, k = a.shape
    out = torch.empty((t, row_words(k)), dtype=torch.int32, device=a.device)
    first = second = out  # the sign tables' arguments, never read without a rotation
    rot = 0
    if signs is not None:
        rotation.check_group(group, signs)
        if group > E8_GROUP or E8_GROUP % group:
            raise ValueError(f"a rotation group of {group} does not tile the {E8_GROUP}-value int8 groups")
        first, second = (rotation.device_sign_words(w, a.device) for w in signs)
        rot = group
    with timed("experts_int8_rows", a.device):
        _quantize_rows_kernel[(t, k // E8_GROUP)](
            a, out, first, second, rotation.inv_sqrt_group(max(rot, 1)), k, k // E8_GROUP, a.stride(0), out.stride(0),
            ROTATION=rot, LOG2_ROTATION=max(rot, 1).bit_length() - 1, **pdl.launch_options(a.device))
    return out
