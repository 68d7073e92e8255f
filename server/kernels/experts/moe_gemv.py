"""One-token-per-program decode body of the quantized MoE MLP (CUDA cores, no tensor cores).

When experts see about one token each (decode), `_expert_gemm`'s tl.dot pads every expert's
pairs to 16 rows and sends each dequantized tile through shared memory into the MMA layout;
at one token that round trip costs more than the multiply. `_expert_gemv` instead runs one
program per (pair, block of output rows): it reads pair p's expert id straight from topk_ids
(no padded blocks), decodes each code word with the same word-wide helpers as moe_triton.py,
and multiplies on CUDA cores with the fields kept where they were decoded. The E8 tables are
held in registers and looked up through tl.gather, which Triton runs from shared memory: the
same random per-lane lookups through L1 serialize on cache lines (spec "Kernels"; measured
1.2-1.3x on the H200, docs/BENCHMARKS.md).

Exactness and cost per weight: a B-bit field c (an E8 nibble or residual nibble, B = 4; a q
code, B = 1 or 2) becomes the float32 1 + c/2^B with one shift and one LOP3 (its bits placed
at the top of the mantissa under the exponent of 1.0, no int-to-float conversion), and one
FFMA accumulates a·(1 + c/2^B), rounding once like any float32 dot product. The offsets are
removed once per row (E8: Σa over K) or once per q block (Σa over the block) with the
precomputed activation sums:  Σ a·c = 2^B·(Σ a·(1 + c/2^B) - Σ a).
The offset is 1, not a large MAGIC (moe_triton._dot), so the float32 error stays within a
small factor (at most 8) of a plain dot product's; every lane keeps one accumulator per
E8 code position (a code's 8 products are summed in the thread that decoded it) or per q block
and row it owns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from server.kernels.experts.e8p import RESIDUAL_SCALE
from server.kernels.experts.moe_triton import (
    E8P3, Q1_0, Q2_0, _e8p_code_nibbles,
)

ONE_F32 = tl.constexpr(0x3F800000)  # bit pattern of 1.0f


def field_bits(fmt: str) -> int:
    """Bits of the fields the GEMV body turns into floats: q codes as stored, E8 nibbles (moe_triton.py)."""
    return {"q1_0": 1, "q2_0": 2}.get(fmt, 4)


def field_mask(fmt: str) -> int:
    """The kernel argument ``field_mask``: the top field_bits(fmt) bits of a float32 mantissa."""
    return ((1 << field_bits(fmt)) - 1) << (23 - field_bits(fmt))

RESIDUAL_OF_SUMS = tl.constexpr(1.0 / RESIDUAL_SCALE)


@triton.jit
def _one_plus_field(c, field_mask, BITS: tl.constexpr):
    """int32 BITS-bit fields c (other bits of the word above them) -> float32 1 + c / 2**BITS, exactly.

    No int-to-float conversion: c goes right under the exponent of 1.0. ``field_mask`` (from
    `field_mask()`) arrives at run time so that ptxas merges the AND and the OR into one LOP3
    (an instruction holds one immediate; two constant operands cost a second LOP3 per weight).
    """
    return (((c << (23 - BITS)) & field_mask) | ONE_F32).to(tl.float32, bitcast=True)


@triton.jit
def _placed8(x, BITS: tl.constexpr, OFFSET: tl.constexpr):
    """The 8 BITS-bit fields of int32 words x [R, C] at bits OFFSET + BITS·j -> [R, 8·C], j minor.

    Each field is moved to the top of a float32 mantissa (bits 23 - BITS .. 22) by ONE shift and
    not masked: the caller's `& field_mask | 1.0f` is then a single LOP3 per weight. Joined like
    moe_triton._fields8, so a field stays in the thread that loaded its word.
    """
    TOP: tl.constexpr = 23 - BITS
    v0 = _shift_to(x, OFFSET, TOP)
    v1 = _shift_to(x, OFFSET + BITS, TOP)
    v2 = _shift_to(x, OFFSET + 2 * BITS, TOP)
    v3 = _shift_to(x, OFFSET + 3 * BITS, TOP)
    v4 = _shift_to(x, OFFSET + 4 * BITS, TOP)
    v5 = _shift_to(x, OFFSET + 5 * BITS, TOP)
    v6 = _shift_to(x, OFFSET + 6 * BITS, TOP)
    v7 = _shift_to(x, OFFSET + 7 * BITS, TOP)
    c0 = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    c1 = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(c0, c1), (x.shape[0], x.shape[1] * 8))


@triton.jit
def _shift_to(x, FROM: tl.constexpr, TO: tl.constexpr):
    if FROM <= TO:
        return x << (TO - FROM)
    return x >> (FROM - TO)


@triton.jit
def _q_tile_order(t, BITS: tl.constexpr):
    """Tile position t of a q1_0/q2_0 field (as _q_row_sums joins them) -> its weight's offset in the K step.

    q2_0: t = (8w + j)·2 + h holds the field at bits 2(8h + j) of word w: weight 16w + 8h + j.
    q1_0: t = (8w + j)·4 + 2b + a holds group g = 2a + b, bit 8g + j of word w: weight 32w + 16a + 8b + j.
    Activations are loaded in this order, so Σ a·w pairs each field with its own input.
    """
    if BITS == 2:
        return t // 16 * 16 + t % 2 * 8 + t % 16 // 2
    return t // 32 * 32 + t % 2 * 16 + t // 2 % 2 * 8 + t % 32 // 4


@triton.jit
def _lookup(table, idx):
    """table [S] (registers) at int32 indices idx [R, C] -> [R, C]: Triton's gather goes through shared
    memory, where 32 lanes reading random words conflict on a few banks at most; the same lookups
    through L1 cost a wavefront per distinct 128-byte line (up to 8 for 1 KiB), the serialization the
    spec warns about ("Kernels")."""
    return tl.reshape(tl.gather(table, tl.reshape(idx, (idx.shape[0] * idx.shape[1],)), 0), (idx.shape[0], idx.shape[1]))


@triton.jit
def _lookup2(table, idx0, idx1):
    """Two lookups of the same shape in one gather (one copy of the table into shared memory per step)."""
    both = tl.reshape(tl.join(idx0, idx1), (idx0.shape[0] * idx0.shape[1] * 2,))
    return tl.split(tl.reshape(tl.gather(table, both, 0), (idx0.shape[0], idx0.shape[1], 2)))


@triton.jit
def _q_row_sums(a, field_mask, w_e, k0, rows, K, stride_wn,
                FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Per-lane products a·(1 + c/2^B) for one K step of q1_0/q2_0 W[rows] -> [BLOCK_N, BLOCK_K].

    The caller reduces them per block, since d changes per block.
    """
    BITS: tl.constexpr = 1 if FORMAT == Q1_0 else 2
    words = k0 * BITS // 32 + tl.arange(0, BLOCK_K * BITS // 32)
    ptrs = w_e.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_wn // 4) + words[None, :]
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(words < K * BITS // 32)[None, :], other=0)
    if BITS == 2:  # tile order of the 16 fields of a word: see _q_tile_order
        f = tl.join(_placed8(x, 2, 0), _placed8(x, 2, 16))
    else:
        f = tl.join(tl.join(_placed8(x, 1, 0), _placed8(x, 1, 8)), tl.join(_placed8(x, 1, 16), _placed8(x, 1, 24)))
    return (tl.reshape(f, (rows.shape[0], BLOCK_K)) & field_mask | ONE_F32).to(tl.float32, bitcast=True) * a[None, :]


@triton.jit
def _e8_row_sums(a, field_mask, w_e, aux_e, table, rtable, k0, rows, K, stride_wn, stride_xn,
                 FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Per-lane products a·(1 + n/16) for one K step of E8 W[rows] -> [BLOCK_N, BLOCK_K] (and the residual's).

    ``table`` / ``rtable``: e8p.kernel_table() / e8p.residual_table_packed() held in registers.
    """
    g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    gmask = (g < K // 8)[None, :]
    if EVEN_K:
        c = tl.load(w_e + rows[:, None] * stride_wn + g[None, :]).to(tl.int32) & 0xFFFF
    else:
        c = tl.load(w_e + rows[:, None] * stride_wn + g[None, :], mask=gmask, other=0).to(tl.int32) & 0xFFFF
    abs_word, sign_word = _lookup2(table, c >> 8, (c & 0xFF) + 256)
    n = _placed8(_e8p_code_nibbles(abs_word, sign_word), 4, 0)
    main = (n & field_mask | ONE_F32).to(tl.float32, bitcast=True) * a[None, :]
    if FORMAT == E8P3:
        if EVEN_K:
            r = tl.load(aux_e + rows[:, None] * stride_xn + g[None, :]).to(tl.int32) & 0xFF
        else:
            r = tl.load(aux_e + rows[:, None] * stride_xn + g[None, :], mask=gmask, other=0).to(tl.int32) & 0xFF
        m = _placed8(_lookup(rtable, r), 4, 0)
        return main, (m & field_mask | ONE_F32).to(tl.float32, bitcast=True) * a[None, :]
    return main, main  # (no residual)


@triton.jit
def _gemv_rows(a_row_ptr, field_mask, a_sum_row_ptr, w_e, aux_e, scale_e, table_ptr, rtable_ptr, rows, K,
               stride_wn, stride_xn, stride_sn,
               FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               STAGES: tl.constexpr):
    """[BLOCK_N] float32 a · W[rows]ᵀ for one activation row (weights: one expert's, pointers at it)."""
    offs_k = tl.arange(0, BLOCK_K)
    if FORMAT == Q1_0 or FORMAT == Q2_0:
        # level = 2c - 1 (q1_0, c < 2) or c - 1 (q2_0, c < 4):
        # in both Σ a·level = 4·Σ a(1 + c/2**BITS) - 5·Σa, times d.
        QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64  # weights per block (one d)
        NB: tl.constexpr = BLOCK_K // QB
        acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        offs_q = _q_tile_order(offs_k, 1 if FORMAT == Q1_0 else 2)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            blk = k0 // QB + tl.arange(0, NB)
            if EVEN_K:
                a = tl.load(a_row_ptr + k0 + offs_q).to(tl.float32)
                a_blk = tl.load(a_sum_row_ptr + blk)
                d = tl.load(aux_e + rows[:, None] * stride_xn + blk[None, :]).to(tl.float32)
            else:  # masked blocks: a, Σa and d are 0, so they add nothing
                a = tl.load(a_row_ptr + k0 + offs_q, mask=(k0 + offs_q) < K, other=0.0).to(tl.float32)
                a_blk = tl.load(a_sum_row_ptr + blk, mask=blk < K // QB, other=0.0)
                d = tl.load(aux_e + rows[:, None] * stride_xn + blk[None, :], mask=(blk < K // QB)[None, :],
                            other=0.0).to(tl.float32)
            s = _q_row_sums(a, field_mask, w_e, k0, rows, K, stride_wn, FORMAT, BLOCK_K, EVEN_K)
            s_blk = tl.sum(tl.reshape(s, (BLOCK_N, NB, QB)), 2)
            acc += (4 * s_blk - 5 * a_blk[None, :]) * d
        return tl.sum(acc, 1)
    # One accumulator per (row, code position): a code's 8 products are summed in the thread that
    # decoded it, which keeps 8x fewer accumulator registers than one per weight (more programs per SM,
    # more weight bytes in flight) and still K/BLOCK_K-long float32 sums.
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    acc_r = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    table = tl.load(table_ptr + tl.arange(0, 512))  # e8p.kernel_table(): abs words, then sign words
    rtable = tl.load(rtable_ptr + tl.arange(0, 256))
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            a = tl.load(a_row_ptr + k0 + offs_k).to(tl.float32)
        else:
            a = tl.load(a_row_ptr + k0 + offs_k, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
        s, s_r = _e8_row_sums(a, field_mask, w_e, aux_e, table, rtable, k0, rows, K, stride_wn, stride_xn,
                              FORMAT, BLOCK_K, EVEN_K)
        acc += tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_K // 8, 8)), 2)
        if FORMAT == E8P3:
            acc_r += tl.sum(tl.reshape(s_r, (BLOCK_N, BLOCK_K // 8, 8)), 2)
    # E8 nibble n = (4w + 15)/2: Σ a·w = (2·Σ a·n - 15·Σa)/4 = 8·Σ a(1 + n/16) - (47/4)·Σa.
    a_total = tl.load(a_sum_row_ptr)
    val = 8 * tl.sum(acc, 1) - 11.75 * a_total
    if FORMAT == E8P3:
        # residual nibble m = 2r + 4: Σ a·r = (Σ a·m - 4·Σa)/2 = 8·Σ a(1 + m/16) - 10·Σa;
        # stored points are r / 2.04.
        val += RESIDUAL_OF_SUMS * (8 * tl.sum(acc_r, 1) - 10 * a_total)
    return val * tl.load(scale_e + rows * stride_sn).to(tl.float32)


@triton.jit
def _expert_gemv(a_ptr, a_sum_ptr, out_ptr, expert_ids_ptr, routing_ptr,
                 w_ptr, aux_ptr, scale_ptr, table_ptr, rtable_ptr,
                 N, K, field_mask, stride_am, stride_sm, stride_om,
                 stride_we, stride_wn, stride_xe, stride_xn, stride_se, stride_sn,
                 FORMAT: tl.constexpr, DUAL: tl.constexpr, ROUTED: tl.constexpr, A_ROW_DIV: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr):
    """out[p, rows] for pair p = program_id(0) (expert expert_ids[p], activation row p // A_ROW_DIV).

    Same epilogues as `_expert_gemm`: DUAL reads gate rows n and up rows N + n and writes
    silu(gate)·up; ROUTED multiplies by routing[p]. a_sum holds Σa per row (E8) or per q block.
    """
    pair = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    a_row = (pair // A_ROW_DIV).to(tl.int64)
    out_rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e = w_ptr + expert * stride_we
    aux_e = aux_ptr + expert * stride_xe
    scale_e = scale_ptr + expert * stride_se
    a_row_ptr = a_ptr + a_row * stride_am
    a_sum_row_ptr = a_sum_ptr + a_row * stride_sm
    # Surplus rows read real (clamped) data and are dropped at the store.
    if DUAL:  # gate row n and up row N + n interleaved in one tile: one pass over K reads both
        i = tl.arange(0, 2 * BLOCK_N)
        rows = tl.minimum(tl.program_id(1) * BLOCK_N + i // 2, N - 1) + i % 2 * N
        both = _gemv_rows(a_row_ptr, field_mask, a_sum_row_ptr, w_e, aux_e, scale_e, table_ptr, rtable_ptr, rows, K,
                          stride_wn, stride_xn, stride_sn, FORMAT, 2 * BLOCK_N, BLOCK_K, EVEN_K, STAGES)
        gate, up = tl.split(tl.reshape(both, (BLOCK_N, 2)))
        val = gate * tl.sigmoid(gate) * up
    else:
        val = _gemv_rows(a_row_ptr, field_mask, a_sum_row_ptr, w_e, aux_e, scale_e, table_ptr, rtable_ptr,
                         tl.minimum(out_rows, N - 1), K, stride_wn, stride_xn, stride_sn, FORMAT, BLOCK_N, BLOCK_K,
                         EVEN_K, STAGES)
    if ROUTED:
        val = val * tl.load(routing_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + out_rows, val.to(out_ptr.dtype.element_ty), mask=out_rows < N)
