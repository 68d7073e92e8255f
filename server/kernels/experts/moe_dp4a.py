"""Decode body of q1_0/q2_0 experts on 8-bit activations and 4-way integer dot products (llama.cpp's MMVQ idea).

Same program shape as the GEMV body (moe_gemv.py: one program per (pair, block of output rows), weights streamed
once per pair, the same epilogues), but the activations arrive quantized (int8_activations.py: int8 q and one
float32 scale s per 32 inputs, bytes already in the order below), so a weight never becomes a float:
  q2_0: a code word holds 16 2-bit codes, 4 per byte; (word >> 2j) & 0x03030303 puts field j of each byte in that
        byte (one shift and one mask, or one mask for j = 0), and one dp4a.u32.s32 multiplies the 4 codes with 4
        int8 activations and adds to an int32; a group of 32 inputs is two words, 8 dp4a;
  q1_0: a word holds 32 bits; (word >> (j - 1)) & 0x02020202 puts 2·bit j of each byte in that byte; 8 dp4a.
The int32 sum starts at -Σq of the group, so it ends as Σ (c - 1)·q (q2_0 levels) or Σ (2c - 1)·q (q1_0): exact
(|sum| <= 32·3·127), with no offset left to remove. Per group one int-to-float conversion and one multiply by s;
per q block one multiply by d into a float32 accumulator per (row, q block of the step). The core is 0.69
instructions per weight for q2_0 (3 shifts + 4 masks + 4 dp4a per 16 weights); with addresses, loads and the
scales the K loop is 1.0-1.2 per weight at sm_90 (`python bench/sass_experts.py --dp4a`, Triton 3.6.0) against
3.7-4.1 for the float GEMV body, so the body streams instead of issuing: H200, D=6144 I=2048 E=64 top-8, kernels
only with both quantization launches, q2_0 one token 34.7 us (58 % of copy; float GEMV body 61.6 us), 8 tokens
180 us (89 %; 400 us); q1_0 28.7 and 136 us (63.3 and 408 us). At one token the launches' ramps and tails
are what is left (each quantization launch 5 us alone; PDL overlaps them: 41.2 -> 37.5 us at a 512 step); since
the rotations moved into the quantization launches and the top-k sum into one launch (sum_top_k_slots), the whole
op is five launches: 35.8 us in a CUDA graph for q2_0 at one token (56 % of copy; gate_up 19.8 and down 13.6 us
alone, which no overlap of the small launches can get under).

Numerics: the products are exact; what changes is the activations, rounded to int8 per 32 (|error| <= s/2 per
value). The reference with the same rounding is moe_reference.fused_moe_reference(..., int8_activations=True).

The interpreter has no inline assembly: there (``ASM=False``) `_dp4a` is the same sum in plain integer
arithmetic, so CI checks the byte order, the offsets and the scaling, and the GPU check
(bench/kernels_experts.check_dp4a) checks the assembly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels import pdl
from server.kernels.experts.moe_gemv import _gemv_store, _gemv_tile_rows
from server.kernels.experts.moe_triton import Q1_0, Q2_0
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.timing import timed

Q2_FIELDS = tl.constexpr(0x03030303)  # the low 2 bits of every byte
Q1_DOUBLED = tl.constexpr(0x02020202)  # bit 1 of every byte: 2·(code bit) once the bit is shifted there


@triton.jit
def _dp4a(u, v, c, ASM: tl.constexpr):
    """c + Σ_b u_b·v_b over the 4 bytes b of int32 words: u's bytes unsigned, v's signed (PTX dp4a.u32.s32)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [u, v, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    acc = c + (u & 0xFF) * ((v << 24) >> 24)
    acc += ((u >> 8) & 0xFF) * ((v << 16) >> 24)
    acc += ((u >> 16) & 0xFF) * ((v << 8) >> 24)
    return acc + ((u >> 24) & 0xFF) * (v >> 24)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """tl.load, masked (reading 0 where the mask is off) only when ``MASKED``."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    return tl.load(ptrs)


@triton.jit
def _dp4a_loads(act_row_ptr, G, w_e, d_e, rows, k0, K, stride_wn, stride_dn,
                FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GUARD: tl.constexpr,
                WAIT: tl.constexpr):
    """The loads of the K step at k0: code words [R, BLOCK_K·BITS/32] int32, d [R, BLOCK_K/QB] float32, and the
    step's groups of the activation row: planes 0-7, -Σq and s, each [BLOCK_K/32] (int8_activations.py's layout).
    ``GUARD`` as in moe_gemv._q_loads: k0 may lie past K, and such a step reads nothing. What lies past K reads 0,
    which adds nothing. ``WAIT`` (PDL): the weights, which no earlier kernel writes, are requested before
    gdc_wait, the activations (the quantization launch's output) after it."""
    BITS: tl.constexpr = 1 if FORMAT == Q1_0 else 2
    QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64
    words = k0 * BITS // 32 + tl.arange(0, BLOCK_K * BITS // 32)
    blk = k0 // QB + tl.arange(0, BLOCK_K // QB)
    g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w_ptrs = w_e.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_wn // 4) + words[None, :]
    d_ptrs = d_e + rows[:, None] * stride_dn + blk[None, :]
    p_ptrs = act_row_ptr + g
    if EVEN_K:  # one scalar predicate: the step is whole or lies entirely past K
        x_mask, d_mask, g_mask = k0 < K, k0 < K, k0 < K
    else:  # q formats hold whole blocks: a word, block or group is in K when its first weight is
        x_mask = (words < K * BITS // 32)[None, :]
        d_mask = (blk < K // QB)[None, :]
        g_mask = g < K // 32
    MASKED: tl.constexpr = GUARD or not EVEN_K
    x = _load(w_ptrs, x_mask, MASKED)
    d = _load(d_ptrs, d_mask, MASKED).to(tl.float32)
    if WAIT:
        gdc_wait()
    p0 = _load(p_ptrs, g_mask, MASKED)
    p1 = _load(p_ptrs + G, g_mask, MASKED)
    p2 = _load(p_ptrs + 2 * G, g_mask, MASKED)
    p3 = _load(p_ptrs + 3 * G, g_mask, MASKED)
    p4 = _load(p_ptrs + 4 * G, g_mask, MASKED)
    p5 = _load(p_ptrs + 5 * G, g_mask, MASKED)
    p6 = _load(p_ptrs + 6 * G, g_mask, MASKED)
    p7 = _load(p_ptrs + 7 * G, g_mask, MASKED)
    neg_sum = _load(p_ptrs + 8 * G, g_mask, MASKED)
    s = _load(p_ptrs + 9 * G, g_mask, MASKED).to(tl.float32, bitcast=True)
    return x, d, p0, p1, p2, p3, p4, p5, p6, p7, neg_sum, s


@triton.jit
def _dp4a_step(x, d, p0, p1, p2, p3, p4, p5, p6, p7, neg_sum, s,
               FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """One K step from its loads -> [R, BLOCK_K/QB] float32 Σ level·s·q per q block, times d."""
    QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64
    R: tl.constexpr = x.shape[0]
    c = neg_sum[None, :]
    if FORMAT == Q2_0:  # a group is two words: h = 0 (planes 0-3), h = 1 (planes 4-7)
        x0, x1 = tl.split(tl.reshape(x, (R, BLOCK_K // 32, 2)))
        t = _dp4a(x0 & Q2_FIELDS, p0[None, :], c, ASM)
        t = _dp4a((x0 >> 2) & Q2_FIELDS, p1[None, :], t, ASM)
        t = _dp4a((x0 >> 4) & Q2_FIELDS, p2[None, :], t, ASM)
        t = _dp4a((x0 >> 6) & Q2_FIELDS, p3[None, :], t, ASM)
        t = _dp4a(x1 & Q2_FIELDS, p4[None, :], t, ASM)
        t = _dp4a((x1 >> 2) & Q2_FIELDS, p5[None, :], t, ASM)
        t = _dp4a((x1 >> 4) & Q2_FIELDS, p6[None, :], t, ASM)
        t = _dp4a((x1 >> 6) & Q2_FIELDS, p7[None, :], t, ASM)
    else:  # a group is one word; byte b of u_j is 2·bit j of byte b
        t = _dp4a((x << 1) & Q1_DOUBLED, p0[None, :], c, ASM)
        t = _dp4a(x & Q1_DOUBLED, p1[None, :], t, ASM)
        t = _dp4a((x >> 1) & Q1_DOUBLED, p2[None, :], t, ASM)
        t = _dp4a((x >> 2) & Q1_DOUBLED, p3[None, :], t, ASM)
        t = _dp4a((x >> 3) & Q1_DOUBLED, p4[None, :], t, ASM)
        t = _dp4a((x >> 4) & Q1_DOUBLED, p5[None, :], t, ASM)
        t = _dp4a((x >> 5) & Q1_DOUBLED, p6[None, :], t, ASM)
        t = _dp4a((x >> 6) & Q1_DOUBLED, p7[None, :], t, ASM)
    v = t.to(tl.float32) * s[None, :]
    return tl.sum(tl.reshape(v, (R, BLOCK_K // QB, QB // 32)), 2) * d


@triton.jit
def _dp4a_rows(act_row_ptr, G, w_e, d_e, rows, K, stride_wn, stride_dn,
               FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
               USE_PDL: tl.constexpr):
    """[R] float32 (s·q) · W[rows]ᵀ for one quantized activation row; the loads of step k + 1 are issued before
    step k's arithmetic (as moe_gemv._gemv_rows). (Peeling the last step so that the loop's loads need no
    predicate took more registers and loads at sm_90, Triton 3.6.0: 72 -> 96 registers, q2_0 gate_up.)"""
    QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64
    acc = tl.zeros((rows.shape[0], BLOCK_K // QB), dtype=tl.float32)
    x, d, p0, p1, p2, p3, p4, p5, p6, p7, ns, s = _dp4a_loads(act_row_ptr, G, w_e, d_e, rows, 0, K, stride_wn,
                                                              stride_dn, FORMAT, BLOCK_K, EVEN_K, False, USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        nx, nd, n0, n1, n2, n3, n4, n5, n6, n7, nns, n_s = _dp4a_loads(
            act_row_ptr, G, w_e, d_e, rows, k0 + BLOCK_K, K, stride_wn, stride_dn, FORMAT, BLOCK_K, EVEN_K, True, False)
        acc += _dp4a_step(x, d, p0, p1, p2, p3, p4, p5, p6, p7, ns, s, FORMAT, BLOCK_K, ASM)
        x, d, p0, p1, p2, p3, p4, p5, p6, p7, ns, s = nx, nd, n0, n1, n2, n3, n4, n5, n6, n7, nns, n_s
    return tl.sum(acc, 1)


@triton.jit
def _expert_dp4a(act_ptr, out_ptr, expert_ids_ptr, routing_ptr, w_ptr, d_ptr,
                 N, K, G, stride_am, stride_om, stride_we, stride_wn, stride_de, stride_dn,
                 FORMAT: tl.constexpr, DUAL: tl.constexpr, ROUTED: tl.constexpr, A_ROW_DIV: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """out[p, rows] for pair p = program_id(0) (expert expert_ids[p], quantized activation row p // A_ROW_DIV of
    act [rows, PLANES, G = K/32] int32); epilogues as moe_gemv._expert_gemv (DUAL: silu(gate)·up; ROUTED).

    ``USE_PDL`` (server/kernels/pdl.py): the next launch may be scheduled at once, and this one's first weight
    step streams before it waits for the quantization launch before it: that small launch's ramp and tail
    overlap the weight stream instead of idling the memory system."""
    if USE_PDL:
        gdc_launch_dependents()
    pair = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    act_row_ptr = act_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    rows = _gemv_tile_rows(N, BLOCK_N, DUAL)
    acc = _dp4a_rows(act_row_ptr, G, w_ptr + expert * stride_we, d_ptr + expert * stride_de, rows, K,
                     stride_wn, stride_dn, FORMAT, BLOCK_K, EVEN_K, ASM, USE_PDL)
    _gemv_store(acc, out_ptr, routing_ptr, pair, stride_om, N, BLOCK_N, DUAL, ROUTED)


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, D, TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, cols] = Σ_j y[t·TOP_K + j, cols] in slot order, in out's dtype (one launch for torch's sum and cast)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()  # y is the down launch's output
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < D
    acc = tl.load(y_ptr + t * TOP_K * D + cols, mask=live)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * D + cols, mask=live)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=live)


SUM_BLOCK = 1024  # columns per program: a token of D = 6144 takes 6


def sum_top_k_slots(y_pairs: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """y_pairs [tokens·top_k, D] float32 (a token's slots consecutive) -> [tokens, D] in ``dtype``: the slots summed
    in slot order (no atomics: the same bits every run)."""
    pairs, d = y_pairs.shape
    out = torch.empty((pairs // top_k, d), dtype=dtype, device=y_pairs.device)
    with timed("experts_sum_slots", y_pairs.device):
        _sum_slots_kernel[(pairs // top_k, triton.cdiv(d, SUM_BLOCK))](
            y_pairs, out, d, TOP_K=top_k, BLOCK=SUM_BLOCK, **pdl.launch_options(y_pairs.device))
    return out
