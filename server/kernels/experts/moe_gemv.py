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

Exactness and cost per weight. q1_0/q2_0 codes become exact fp16 levels two at a time (one LOP3
and one HADD2/HFMA2 per two weights: `_q_levels`, moe_mma._levels_pair), converted to float32 and
accumulated with one FFMA each, so no offset is removed afterwards. An E8 nibble n (B = 4 bits)
becomes the float32 1 + n/16 with one shift and one LOP3 (its bits placed at the top of the
mantissa under the exponent of 1.0), and one FFMA accumulates a·(1 + n/16); the offset is removed
once per row with Σa over K, summed in the kernel from the very values multiplied:
Σ a·n = 16·(Σ a·(1 + n/16) - Σ a). The offset is 1, not a large MAGIC (moe_triton._dot), so the
float32 error stays within a small factor (at most 8) of a plain dot product's; every lane keeps one
accumulator per E8 code position (a code's 8 products are summed in the thread that decoded it) or
per q block and row it owns.

q1_0/q2_0 decode runs the integer-dot body on 8-bit activations by default (moe_dp4a.py, which shares this
body's tile rows and epilogue); this body serves them with TURBOSERVE_INT8_EXPERT_ACTIVATIONS=0.

Activations of any float dtype are converted to float32 as they are loaded, and the loads of each
K step are issued one step ahead (`_gemv_rows`): no conversion or summing launches run before the
kernel, and a program keeps weight bytes in flight while it computes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from server.kernels.experts.e8p import RESIDUAL_SCALE
from server.kernels.experts.moe_mma import _levels_pair
from server.kernels.experts.moe_triton import (
    E8P3, Q1_0, Q2_0, _e8p_code_nibbles,
)

ONE_F32 = tl.constexpr(0x3F800000)  # bit pattern of 1.0f


# The kernel argument ``field_mask``: the top 4 bits of a float32 mantissa, where `_placed8` puts an E8 nibble.
# It arrives at run time so that ptxas merges the AND and the OR with 1.0f into one LOP3 (an instruction holds
# one immediate; two constant operands cost a second LOP3 per weight).
E8_FIELD_MASK = 0xF << 19
RESIDUAL_OF_SUMS = tl.constexpr(1.0 / RESIDUAL_SCALE)


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
def _q_loads(a_row_ptr, w_e, aux_e, rows, k0, K, stride_wn, stride_xn,
             FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GUARD: tl.constexpr):
    """The loads of one K step of q1_0/q2_0 W[rows]: (a [BLOCK_K] float32,
    code words [R, BLOCK_K·BITS/32] int32, d [R, BLOCK_K/QB] float32).

    ``GUARD``: k0 may lie past K (a prefetch beyond the last step), so every load is predicated on
    k0 < K and such a step reads nothing. Masked blocks read 0 (a, d), so they add nothing.
    """
    BITS: tl.constexpr = 1 if FORMAT == Q1_0 else 2
    QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64  # weights per block (one d)
    offs = k0 + tl.arange(0, BLOCK_K)  # `_q_levels` keeps the weights in their own order
    words = k0 * BITS // 32 + tl.arange(0, BLOCK_K * BITS // 32)
    blk = k0 // QB + tl.arange(0, BLOCK_K // QB)
    a_ptrs = a_row_ptr + offs
    w_ptrs = w_e.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_wn // 4) + words[None, :]
    d_ptrs = aux_e + rows[:, None] * stride_xn + blk[None, :]
    if EVEN_K and not GUARD:
        a = tl.load(a_ptrs)
        x = tl.load(w_ptrs)
        d = tl.load(d_ptrs)
    elif EVEN_K:  # one scalar predicate: the step is whole or lies entirely past K
        live = k0 < K
        a = tl.load(a_ptrs, mask=live, other=0.0)
        x = tl.load(w_ptrs, mask=live, other=0)
        d = tl.load(d_ptrs, mask=live, other=0.0)
    else:  # q formats hold whole blocks, so a word or a block is in K when its first weight is
        a = tl.load(a_ptrs, mask=offs < K, other=0.0)
        x = tl.load(w_ptrs, mask=(words < K * BITS // 32)[None, :], other=0)
        d = tl.load(d_ptrs, mask=(blk < K // QB)[None, :], other=0.0)
    return a.to(tl.float32), x, d.to(tl.float32)


@triton.jit
def _q1_levels_pair(word, F: tl.constexpr, ASM: tl.constexpr):
    """int32 words [R, W] of q1_0 codes -> [R, W, 2] fp16: (level of bit F, level of bit F + 16), 2c - 1, exact.

    As moe_mma._levels_pair for one-bit fields: an AND/OR (one LOP3) puts bit B of each half under the
    exponent of 2^(10 - B), whose ulp is 1 there, giving v = 2^(10 - B) + c; one HFMA2 makes
    2v - (2^(11 - B) + 1) = 2c - 1. The constant is exact in fp16 for B >= 1 (2^(11 - B) + 1 <= 1025), so
    bit 0 is moved to bit 1 first and bits 10-15 to 1-6 (bits 10 and up would sit in the exponent).
    """
    if ASM:
        if F == 0:
            src = word << 1
        elif F <= 9:
            src = word
        else:
            src = word >> 9
        B: tl.constexpr = 1 if F == 0 else (F if F <= 9 else F - 9)  # the bit's place after the shift
        magic: tl.constexpr = (15 + 10 - B) << 10  # fp16 pattern of 2^(10 - B)
        minus: tl.constexpr = 0x8000 | ((15 + 11 - B) << 10) | (1 << (B - 1))  # -(2^(11 - B) + 1)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $1, $3, $5, 0xEA; fma.rn.f16x2 $0, t, $7, $9; }", "=r,r,r,r,r,r,r,r,r,r,r",
            [tl.join(src, src), (1 << B) * 0x10001, magic * 0x10001, 0x40004000, minus * 0x10001],
            dtype=tl.float16, is_pure=True, pack=2)
    lo = ((word >> F) & 1) * 2 - 1
    hi = ((word >> (F + 16)) & 1) * 2 - 1
    return tl.join(lo, hi).to(tl.float16)


@triton.jit
def _q_levels(x, FORMAT: tl.constexpr, ASM: tl.constexpr):
    """int32 words [R, W] of q1_0/q2_0 codes -> [R, W·32/BITS] float32 levels (q1_0 2c - 1, q2_0 c - 1), exact,
    in natural order.

    Two fp16 levels per LOP3 + HADD2/HFMA2 (`_q1_levels_pair`, moe_mma._levels_pair), so no offset has to be
    removed from the products afterwards (which would take Σa per block: a cross-thread reduction per step).
    The pairs hold fields f and f + 16/BITS of a word (its two 16-bit halves h); the join tree puts field f
    of half h at index (16/BITS)·h + f, the weight's own place.
    """
    if FORMAT == Q2_0:
        c0 = tl.join(tl.join(_levels_pair(x, 0, False, ASM), _levels_pair(x, 4, False, ASM)),
                     tl.join(_levels_pair(x, 2, False, ASM), _levels_pair(x, 6, False, ASM)))
        c1 = tl.join(tl.join(_levels_pair(x, 1, False, ASM), _levels_pair(x, 5, False, ASM)),
                     tl.join(_levels_pair(x, 3, False, ASM), _levels_pair(x, 7, False, ASM)))
        levels = tl.join(c0, c1)
    else:
        c0 = tl.join(tl.join(tl.join(_q1_levels_pair(x, 0, ASM), _q1_levels_pair(x, 8, ASM)),
                             tl.join(_q1_levels_pair(x, 4, ASM), _q1_levels_pair(x, 12, ASM))),
                     tl.join(tl.join(_q1_levels_pair(x, 2, ASM), _q1_levels_pair(x, 10, ASM)),
                             tl.join(_q1_levels_pair(x, 6, ASM), _q1_levels_pair(x, 14, ASM))))
        c1 = tl.join(tl.join(tl.join(_q1_levels_pair(x, 1, ASM), _q1_levels_pair(x, 9, ASM)),
                             tl.join(_q1_levels_pair(x, 5, ASM), _q1_levels_pair(x, 13, ASM))),
                     tl.join(tl.join(_q1_levels_pair(x, 3, ASM), _q1_levels_pair(x, 11, ASM)),
                             tl.join(_q1_levels_pair(x, 7, ASM), _q1_levels_pair(x, 15, ASM))))
        levels = tl.join(c0, c1)
    return tl.reshape(levels, (x.shape[0], x.shape[1] * (16 if FORMAT == Q2_0 else 32))).to(tl.float32)


@triton.jit
def _q_step(a, x, d, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """One K step of q1_0/q2_0 from its loads (`_q_loads`) -> [R, BLOCK_K/QB] float32 Σ a·level · d per block."""
    QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64
    s = _q_levels(x, FORMAT, ASM) * a[None, :]
    return tl.sum(tl.reshape(s, (x.shape[0], BLOCK_K // QB, QB)), 2) * d


@triton.jit
def _e8_loads(a_row_ptr, w_e, aux_e, rows, k0, K, stride_wn, stride_xn,
              FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GUARD: tl.constexpr):
    """The loads of one K step of E8 W[rows]: (a [BLOCK_K] float32, codes [R, BLOCK_K/8] int32 (low 16 bits),
    residual codes (e8p3, low 8 bits; e8p: a [1, 1] zero)). ``GUARD`` as in `_q_loads`."""
    offs = k0 + tl.arange(0, BLOCK_K)
    g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    c_ptrs = w_e + rows[:, None] * stride_wn + g[None, :]
    r_ptrs = aux_e + rows[:, None] * stride_xn + g[None, :]
    r = tl.zeros((1, 1), dtype=tl.int32)  # no residual (e8p)
    if EVEN_K and not GUARD:
        a = tl.load(a_row_ptr + offs)
        c = tl.load(c_ptrs)
        if FORMAT == E8P3:
            r = tl.load(r_ptrs).to(tl.int32) & 0xFF
    elif EVEN_K:
        live = k0 < K
        a = tl.load(a_row_ptr + offs, mask=live, other=0.0)
        c = tl.load(c_ptrs, mask=live, other=0)
        if FORMAT == E8P3:
            r = tl.load(r_ptrs, mask=live, other=0).to(tl.int32) & 0xFF
    else:
        gmask = (g < K // 8)[None, :]
        a = tl.load(a_row_ptr + offs, mask=offs < K, other=0.0)
        c = tl.load(c_ptrs, mask=gmask, other=0)
        if FORMAT == E8P3:
            r = tl.load(r_ptrs, mask=gmask, other=0).to(tl.int32) & 0xFF
    return a.to(tl.float32), c.to(tl.int32) & 0xFFFF, r


@triton.jit
def _e8_step(a, c, r, field_mask, table, rtable, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of E8 from its loads (`_e8_loads`) -> ([R, BLOCK_K/8] Σ a·(1 + n/16) per code, the same
    for the residual's nibbles m (e8p3; else the first again)). ``table`` / ``rtable``: e8p.kernel_table() /
    e8p.residual_table_packed() held in registers."""
    abs_word, sign_word = _lookup2(table, c >> 8, (c & 0xFF) + 256)
    n = _placed8(_e8p_code_nibbles(abs_word, sign_word), 4, 0)
    main = (n & field_mask | ONE_F32).to(tl.float32, bitcast=True) * a[None, :]
    # A code's 8 products are summed in the thread that decoded it.
    main = tl.sum(tl.reshape(main, (c.shape[0], BLOCK_K // 8, 8)), 2)
    if FORMAT == E8P3:
        m = _placed8(_lookup(rtable, r), 4, 0)
        res = (m & field_mask | ONE_F32).to(tl.float32, bitcast=True) * a[None, :]
        return main, tl.sum(tl.reshape(res, (c.shape[0], BLOCK_K // 8, 8)), 2)
    return main, main  # (no residual)


@triton.jit
def _gemv_rows(a_row_ptr, field_mask, w_e, aux_e, scale_e, table_ptr, rtable_ptr, rows, K,
               stride_wn, stride_xn, stride_sn,
               FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               ASM: tl.constexpr):
    """[BLOCK_N] float32 a · W[rows]ᵀ for one activation row (weights: one expert's, pointers at it).

    The loads of step k + 1 are issued before step k's arithmetic and carried in registers, so a program
    keeps a step of weight bytes in flight while it computes (H200, docs/BENCHMARKS.md 04:44 block: one
    token 72.0 -> 69.9 us for q2_0, 117.0 -> 107.2 us for e8p against loading each step where it is used).
    """
    if FORMAT == Q1_0 or FORMAT == Q2_0:
        QB: tl.constexpr = 128 if FORMAT == Q1_0 else 64
        acc = tl.zeros((BLOCK_N, BLOCK_K // QB), dtype=tl.float32)
        a, x, d = _q_loads(a_row_ptr, w_e, aux_e, rows, 0, K, stride_wn, stride_xn, FORMAT, BLOCK_K, EVEN_K, False)
        for k0 in range(0, K, BLOCK_K):
            a_next, x_next, d_next = _q_loads(a_row_ptr, w_e, aux_e, rows, k0 + BLOCK_K, K, stride_wn, stride_xn,
                                              FORMAT, BLOCK_K, EVEN_K, True)
            acc += _q_step(a, x, d, FORMAT, BLOCK_K, ASM)
            a, x, d = a_next, x_next, d_next
        return tl.sum(acc, 1)
    # One accumulator per (row, code position): a code's 8 products are summed in the thread that
    # decoded it, which keeps 8x fewer accumulator registers than one per weight (more programs per SM,
    # more weight bytes in flight) and still K/BLOCK_K-long float32 sums.
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    acc_r = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    a_acc = tl.zeros((BLOCK_K,), dtype=tl.float32)  # Σa of the very values multiplied (the nibble offsets)
    table = tl.load(table_ptr + tl.arange(0, 512))  # e8p.kernel_table(): abs words, then sign words
    rtable = tl.load(rtable_ptr + tl.arange(0, 256))
    a, c, r = _e8_loads(a_row_ptr, w_e, aux_e, rows, 0, K, stride_wn, stride_xn, FORMAT, BLOCK_K, EVEN_K, False)
    for k0 in range(0, K, BLOCK_K):
        a_next, c_next, r_next = _e8_loads(a_row_ptr, w_e, aux_e, rows, k0 + BLOCK_K, K, stride_wn, stride_xn,
                                           FORMAT, BLOCK_K, EVEN_K, True)
        s, s_r = _e8_step(a, c, r, field_mask, table, rtable, FORMAT, BLOCK_K)
        acc += s
        if FORMAT == E8P3:
            acc_r += s_r
        a_acc += a
        a, c, r = a_next, c_next, r_next
    # E8 nibble n = (4w + 15)/2: Σ a·w = (2·Σ a·n - 15·Σa)/4 = 8·Σ a(1 + n/16) - (47/4)·Σa.
    a_total = tl.sum(a_acc, 0)
    val = 8 * tl.sum(acc, 1) - 11.75 * a_total
    if FORMAT == E8P3:
        # residual nibble m = 2r + 4: Σ a·r = (Σ a·m - 4·Σa)/2 = 8·Σ a(1 + m/16) - 10·Σa;
        # stored points are r / 2.04.
        val += RESIDUAL_OF_SUMS * (8 * tl.sum(acc_r, 1) - 10 * a_total)
    return val * tl.load(scale_e + rows * stride_sn).to(tl.float32)


@triton.jit
def _expert_gemv(a_ptr, out_ptr, expert_ids_ptr, routing_ptr,
                 w_ptr, aux_ptr, scale_ptr, table_ptr, rtable_ptr,
                 N, K, field_mask, stride_am, stride_om,
                 stride_we, stride_wn, stride_xe, stride_xn, stride_se, stride_sn,
                 FORMAT: tl.constexpr, DUAL: tl.constexpr, ROUTED: tl.constexpr, A_ROW_DIV: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """out[p, rows] for pair p = program_id(0) (expert expert_ids[p], activation row p // A_ROW_DIV).

    Same epilogues as `_expert_gemm`: DUAL reads gate rows n and up rows N + n and writes
    silu(gate)·up; ROUTED multiplies by routing[p]. Activations of any float dtype are converted to float32
    as loaded, and the sums that remove the field offsets are taken in the kernel from those same values
    (no conversion or summing launches before it).
    """
    pair = tl.program_id(0)
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    a_row_ptr = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    w_e = w_ptr + expert * stride_we
    aux_e = aux_ptr + expert * stride_xe
    scale_e = scale_ptr + expert * stride_se
    rows = _gemv_tile_rows(N, BLOCK_N, DUAL)
    acc = _gemv_rows(a_row_ptr, field_mask, w_e, aux_e, scale_e, table_ptr, rtable_ptr, rows, K,
                     stride_wn, stride_xn, stride_sn, FORMAT, rows.shape[0], BLOCK_K, EVEN_K, ASM)
    _gemv_store(acc, out_ptr, routing_ptr, pair, stride_om, N, BLOCK_N, DUAL, ROUTED)


@triton.jit
def _gemv_tile_rows(N, BLOCK_N: tl.constexpr, DUAL: tl.constexpr):
    """The weight rows program_id(1) reads: BLOCK_N rows, or for DUAL gate row n and up row N + n interleaved
    (2·BLOCK_N, one pass over K reads both). Surplus rows read real (clamped) data and are dropped at the store."""
    if DUAL:
        i = tl.arange(0, 2 * BLOCK_N)
        rows = tl.minimum(tl.program_id(1) * BLOCK_N + i // 2, N - 1) + i % 2 * N
    else:
        rows = tl.minimum(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    return rows


@triton.jit
def _gemv_store(acc, out_ptr, routing_ptr, pair, stride_om, N, BLOCK_N: tl.constexpr, DUAL: tl.constexpr,
                ROUTED: tl.constexpr):
    """Epilogue of a GEMV-shaped program: acc over `_gemv_tile_rows` -> out[pair, rows] (DUAL: silu(gate)·up;
    ROUTED: × routing[pair]), in out's dtype."""
    if DUAL:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        val = gate * tl.sigmoid(gate) * up
    else:
        val = acc
    if ROUTED:
        val = val * tl.load(routing_ptr + pair).to(tl.float32)
    out_rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + out_rows, val.to(out_ptr.dtype.element_ty), mask=out_rows < N)
