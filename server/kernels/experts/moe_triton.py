"""Triton bodies of the quantized MoE MLP (specs/expert-formats.md, "Kernels").

One kernel, `_expert_gemm`, computes out[p, n] for the pairs p of one padded block of one
expert (routing.py) and a block of output rows n, streaming the expert's packed weights once
for the whole block and dequantizing each tile inside the K loop into tensor-core operands:
  - "dual" (gate_up): gate rows n and up rows N + n are read in the same pass and the
    epilogue writes h = silu(gate) · up;
  - "routed" (down): the epilogue multiplies by the pair's routing weight; the top-k slots
    of a token are summed afterwards in a fixed order, so results do not depend on timing.
Decode and prefill are two launch shapes of it: BLOCK_M = 16 pairs per block with narrow
row blocks for a few tokens per expert (weights streamed once, many programs in flight);
BLOCK_M = 64 with wider tiles for many tokens, where each dequantized tile feeds a real GEMM.

Exactness: E8 tiles are built as integers (4·w for e8p points, 2·r for residual points),
exact in bf16/fp16, with the 1/4, 1/(2·2.04) and the row scale applied to the float32
accumulators; q1_0/q2_0 tiles are their integer levels with d applied per K block. So the
only rounding besides the activations' own dtype is float32 accumulation.
Codebook tables are 1 KiB int32 words (one per code) read through L1, never constant memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from server.kernels.experts.e8p import RESIDUAL_SCALE

FORMAT_IDS = {"e8p": 0, "e8p3": 1, "q1_0": 2, "q2_0": 3, "bf16": 4}
K_UNIT = {"e8p": 8, "e8p3": 8, "q1_0": 128, "q2_0": 64, "bf16": 1}  # BLOCK_K must be a multiple
E8P = tl.constexpr(FORMAT_IDS["e8p"])
E8P3 = tl.constexpr(FORMAT_IDS["e8p3"])
Q1_0 = tl.constexpr(FORMAT_IDS["q1_0"])
Q2_0 = tl.constexpr(FORMAT_IDS["q2_0"])
BF16 = tl.constexpr(FORMAT_IDS["bf16"])
RESIDUAL_FACTOR = tl.constexpr(1.0 / (2.0 * RESIDUAL_SCALE))  # 2·r tiles -> r / 2.04


@triton.jit
def _dot(a, w_nk, IEEE: tl.constexpr):
    """a [M, K] · w_nkᵀ -> [M, N] float32 (w_nk [N, K] holds values exact in a's dtype)."""
    b = tl.trans(w_nk.to(a.dtype))
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _e8p_tile4(codes_ptrs, mask, table_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] codes -> [BLOCK_N, BLOCK_K] int32 tile of 4·w (spec decode rule)."""
    if EVEN_K:
        c = tl.load(codes_ptrs).to(tl.int32) & 0xFFFF
    else:
        c = tl.load(codes_ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    s = c & 0xFF
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    p = (p ^ (p >> 1)) & 1  # popcount(s) & 1: the shift is -1/4 when set
    f = s ^ p
    word = tl.load(table_ptr + (c >> 8))  # 2 bits per |coordinate| - 1/2, bit 16: odd row
    k8 = tl.arange(0, 8)[None, None, :]
    mag = ((word[:, :, None] >> (2 * k8)) & 3) * 4 + 2
    neg = ((f[:, :, None] >> k8) & 1) ^ tl.where(k8 == 7, (word[:, :, None] >> 16) & 1, 0)
    v = tl.where(neg != 0, -mag, mag) + (1 - 2 * p)[:, :, None]
    return tl.reshape(v, (BLOCK_N, BLOCK_K))


@triton.jit
def _residual_tile2(res_ptrs, mask, rtable_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] residual codes -> [BLOCK_N, BLOCK_K] int32 tile of 2·r."""
    if EVEN_K:
        r = tl.load(res_ptrs).to(tl.int32) & 0xFF
    else:
        r = tl.load(res_ptrs, mask=mask, other=0).to(tl.int32) & 0xFF
    word = tl.load(rtable_ptr + r)
    k8 = tl.arange(0, 8)[None, None, :]
    return tl.reshape(((word[:, :, None] >> (4 * k8)) & 15) - 4, (BLOCK_N, BLOCK_K))


@triton.jit
def _qblock_levels(code_ptrs, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, 16] code bytes of one q1_0/q2_0 block -> [BLOCK_N, BLOCK_K] int32 levels (LSB first)."""
    b = tl.load(code_ptrs).to(tl.int32)
    j = tl.arange(0, 8 // BITS)[None, None, :]
    c = (b[:, :, None] >> (BITS * j)) & ((1 << BITS) - 1)
    if BITS == 1:
        lv = 2 * c - 1  # bit set: +d, clear: -d
    else:
        lv = c - 1  # (code - 1)·d
    return tl.reshape(lv, (BLOCK_N, BLOCK_K))


@triton.jit
def _qblock_product(a, k0, rows, w_ptr, d_ptr, stride_wn, stride_dn, BITS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One GGUF block per K step (BLOCK_K == block): integer levels through the dot, d on the result."""
    offs_b = k0 * BITS // 8 + tl.arange(0, BLOCK_K * BITS // 8)
    lv = _qblock_levels(w_ptr + rows[:, None] * stride_wn + offs_b[None, :], BITS, BLOCK_N, BLOCK_K)
    d = tl.load(d_ptr + rows * stride_dn + k0 // BLOCK_K).to(tl.float32)
    return _dot(a, lv, IEEE) * d[None, :]


@triton.jit
def _tile_product(a, k0, rows, K, w_ptr, aux_ptr, table_ptr, rtable_ptr, stride_wn, stride_xn,
                  FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  IEEE: tl.constexpr):
    """a [M, BLOCK_K] · W[rows, k0:k0+BLOCK_K]ᵀ for one expert (pointers at the expert), row scale excluded.

    ``rows`` are clamped into the matrix, so weight loads need no row mask (surplus rows are
    dropped at the store); q formats always have whole blocks, EVEN_K drops the K mask.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if FORMAT == BF16:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        return _dot(a, w.to(tl.float32), IEEE)
    elif FORMAT == Q1_0:
        return _qblock_product(a, k0, rows, w_ptr, aux_ptr, stride_wn, stride_xn, 1, BLOCK_N, BLOCK_K, IEEE)
    elif FORMAT == Q2_0:
        return _qblock_product(a, k0, rows, w_ptr, aux_ptr, stride_wn, stride_xn, 2, BLOCK_N, BLOCK_K, IEEE)
    else:
        g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        gmask = (g < K // 8)[None, :]
        part = _dot(a, _e8p_tile4(w_ptr + rows[:, None] * stride_wn + g[None, :], gmask, table_ptr,
                                  BLOCK_N, BLOCK_K, EVEN_K), IEEE) * 0.25
        if FORMAT == E8P3:
            part += _dot(a, _residual_tile2(aux_ptr + rows[:, None] * stride_xn + g[None, :], gmask, rtable_ptr,
                                            BLOCK_N, BLOCK_K, EVEN_K), IEEE) * RESIDUAL_FACTOR
        return part


@triton.jit
def _row_scaled(acc, rows, scale_ptr, stride_sn, FORMAT: tl.constexpr):
    if FORMAT == E8P or FORMAT == E8P3:
        s = tl.load(scale_ptr + rows * stride_sn).to(tl.float32)
        acc = acc * s[None, :]
    return acc


@triton.jit
def _expert_gemm(a_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, routing_ptr,
                 w_ptr, aux_ptr, scale_ptr, table_ptr, rtable_ptr,
                 N, K, num_pairs, stride_am, stride_om,
                 stride_we, stride_wn, stride_xe, stride_xn, stride_se, stride_sn,
                 FORMAT: tl.constexpr, DUAL: tl.constexpr, ROUTED: tl.constexpr, A_ROW_DIV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE: tl.constexpr):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return  # a padding block past the last expert's pairs
    pairs = tl.load(pair_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    # Padding pairs and surplus rows read real (clamped) data and are dropped at the store.
    a_ptrs = a_ptr + (tl.minimum(pairs, num_pairs - 1) // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    out_rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(out_rows, N - 1)
    e64 = expert.to(tl.int64)
    w_e = w_ptr + e64 * stride_we
    x_e = aux_ptr + e64 * stride_xe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + (k0 + offs_k)[None, :])
        else:
            a = tl.load(a_ptrs + (k0 + offs_k)[None, :], mask=((k0 + offs_k) < K)[None, :], other=0.0)
        acc += _tile_product(a, k0, rows, K, w_e, x_e, table_ptr, rtable_ptr, stride_wn, stride_xn,
                             FORMAT, BLOCK_N, BLOCK_K, EVEN_K, IEEE)
        if DUAL:  # up rows sit N below the gate rows; same pass, same activation tile
            acc_up += _tile_product(a, k0, rows + N, K, w_e, x_e, table_ptr, rtable_ptr, stride_wn,
                                    stride_xn, FORMAT, BLOCK_N, BLOCK_K, EVEN_K, IEEE)
    s_e = scale_ptr + e64 * stride_se
    val = _row_scaled(acc, rows, s_e, stride_sn, FORMAT)
    if DUAL:
        up = _row_scaled(acc_up, rows + N, s_e, stride_sn, FORMAT)
        val = val * tl.sigmoid(val) * up
    if ROUTED:
        val = val * tl.load(routing_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + out_rows[None, :]
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & (out_rows < N)[None, :])
