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

Exactness and cost: tiles are small non-negative integers (nibbles of the E8 codes, raw q
codes) turned into exact bf16/fp16 operands by an OR and a bitcast (`_dot`); the affine maps
back to weights (4·w = 2n - 15, r, q levels), the 1/4, 1/2.04, d and the row scale are applied
to the float32 accumulators with precomputed activation sums. So the only rounding besides
the activations' own dtype is float32 accumulation, and a weight costs a shift and a mask.
Codebook tables are 3 KiB of int32 words (e8p.kernel_table, residual table) read through L1 here, from
shared memory in the GEMV body (moe_gemv.py), never constant memory.
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
EIGHTS = tl.constexpr(0x88888888 - (1 << 32))  # 8 in every nibble, as a signed int32
RESIDUAL_FACTOR = tl.constexpr(1.0 / (2.0 * RESIDUAL_SCALE))  # 2·r sums -> r / 2.04


@triton.jit
def _dot(a, n_nk, MAGIC: tl.constexpr, IEEE: tl.constexpr):
    """a [M, K] · (MAGIC + n)ᵀ -> [M, N] float32, for small non-negative integers n [N, K].

    For bf16 (MAGIC 128) and fp16 (MAGIC 1024) activations, MAGIC + n is an exactly representable
    float whose bit pattern is MAGIC's with n in the low mantissa bits: the operand is built with
    one OR and a bitcast instead of an int-to-float conversion per weight. Callers subtract
    MAGIC·Σa (precomputed row sums of the same rounded activations) once per row or block.
    """
    if MAGIC == 128:
        w = (n_nk | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif MAGIC == 1024:
        w = (n_nk | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        w = n_nk.to(a.dtype)
    if IEEE:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _fields8(x, WIDTH: tl.constexpr):
    """[R, C] int32 -> [R, 8·C] int32: the 8 WIDTH-bit fields of each word, LSB first.

    Built with tl.join, whose new minor dimension stays inside a thread: the thread that decoded
    a code also expands it, instead of every lane of a broadcast layout redoing the per-code work.
    Field k = 4a + 2b + c sits at index (a, b, c) of the joined [R, C, 2, 2, 2].
    """
    m = (1 << WIDTH) - 1
    v0 = x & m
    v1 = (x >> WIDTH) & m
    v2 = (x >> 2 * WIDTH) & m
    v3 = (x >> 3 * WIDTH) & m
    v4 = (x >> 4 * WIDTH) & m
    v5 = (x >> 5 * WIDTH) & m
    v6 = (x >> 6 * WIDTH) & m
    v7 = (x >> 7 * WIDTH) & m
    c0 = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    c1 = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(c0, c1), (x.shape[0], x.shape[1] * 8))


@triton.jit
def _fields4(x):
    """[R, C] int32 bytes -> [R, 4·C]: the four 2-bit fields of each byte, LSB first (k = 2a + b at (a, b))."""
    b0 = tl.join(x & 3, (x >> 4) & 3)
    b1 = tl.join((x >> 2) & 3, (x >> 6) & 3)
    return tl.reshape(tl.join(b0, b1), (x.shape[0], x.shape[1] * 4))


@triton.jit
def _e8p_nibbles(codes_ptrs, mask, table_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] codes -> [BLOCK_N, BLOCK_K] int32 tile of n = (4·w + 15) / 2 in [0, 15].

    ``table_ptr`` is e8p.kernel_table(), read through L1 (the GEMV body reads it from shared memory).
    """
    if EVEN_K:
        c = tl.load(codes_ptrs).to(tl.int32) & 0xFFFF
    else:
        c = tl.load(codes_ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
    return _fields8(_e8p_code_nibbles(tl.load(table_ptr + (c >> 8)), tl.load(table_ptr + 256 + (c & 0xFF))), 4)


@triton.jit
def _e8p_code_nibbles(abs_word, sign_word):
    """The table words of a code (row c >> 8, sign byte c & 0xFF) -> its 8 nibbles n_k in one int32.

    Per code (spec decode rule, on whole 32-bit words): 4·w_k = ±(4|x_k|) + (p ? -1 : +1), so
    n_k = 8 - p ± 2|x_k|. The abs word holds t_k = 2|x_k| per nibble (bit 31: odd row), the sign
    word 0xE in the nibbles of negative coordinates and p in bit 0 of every nibble
    (e8p.sign_table_packed); an odd row flips nibble 7's sign. No nibble borrows: 8 + t_k <= 15 and
    8 - p - t_k >= 0, so n = 0x88888888 + t - p·0x11111111 - 2·t·negative, word-wide.
    """
    sign_word = sign_word ^ ((abs_word >> 31) & -0x20000000)  # arithmetic shift: odd rows -> 0xE0000000
    twice_abs = abs_word & 0x77777777
    return twice_abs + EIGHTS - (sign_word & 0x11111111) - ((twice_abs << 1) & sign_word)


@triton.jit
def _residual_nibbles(res_ptrs, mask, rtable_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] residual codes -> [BLOCK_N, BLOCK_K] int32 tile of 2·r + 4 in [0, 8]."""
    if EVEN_K:
        r = tl.load(res_ptrs).to(tl.int32) & 0xFF
    else:
        r = tl.load(res_ptrs, mask=mask, other=0).to(tl.int32) & 0xFF
    return _fields8(tl.load(rtable_ptr + r), 4)


@triton.jit
def _qblock_codes(code_ptrs, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, 16] code bytes of one q1_0/q2_0 block -> [BLOCK_N, BLOCK_K] int32 codes (LSB first)."""
    b = tl.load(code_ptrs).to(tl.int32)
    if BITS == 1:
        codes = _fields8(b, 1)
    else:
        codes = _fields4(b)
    return codes


@triton.jit
def _qblock_product(a, a_sum, k0, rows, w_ptr, d_ptr, stride_wn, stride_dn, BITS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAGIC: tl.constexpr, IEEE: tl.constexpr):
    """One GGUF block per K step (BLOCK_K == block): codes through the dot, levels and d on the result.

    q1_0 level 2c - 1, q2_0 level c - 1, so a·level = L·(a·(MAGIC + c)) - (L·MAGIC + 1)·Σa with
    L = 2 or 1; ``a_sum`` is Σa over this block.
    """
    offs_b = k0 * BITS // 8 + tl.arange(0, BLOCK_K * BITS // 8)
    codes = _qblock_codes(w_ptr + rows[:, None] * stride_wn + offs_b[None, :], BITS, BLOCK_N, BLOCK_K)
    d = tl.load(d_ptr + rows * stride_dn + k0 // BLOCK_K).to(tl.float32)
    dot = _dot(a, codes, MAGIC, IEEE) * (3 - BITS) - ((3 - BITS) * MAGIC + 1) * a_sum[:, None]  # L = 3 - BITS
    return dot * d[None, :]


@triton.jit
def _tile_product(a, a_sum, k0, rows, K, w_ptr, aux_ptr, table_ptr, rtable_ptr, stride_wn, stride_xn,
                  FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  MAGIC: tl.constexpr, IEEE: tl.constexpr):
    """One K step of a · W[rows]ᵀ for one expert (pointers at the expert).

    bf16 and q formats return finished products (row scale of E8 excluded); E8 formats return
    a·(MAGIC + n) sums, finished once per row by `_finish_e8` (their correction is linear in Σa).
    ``rows`` are clamped into the matrix, so weight loads need no row mask (surplus rows are
    dropped at the store); q formats always have whole blocks, EVEN_K drops the K mask.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if FORMAT == BF16:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        if IEEE:
            return tl.dot(a, tl.trans(w.to(a.dtype)), input_precision="ieee")
        return tl.dot(a, tl.trans(w.to(a.dtype)))
    elif FORMAT == Q1_0:
        return _qblock_product(a, a_sum, k0, rows, w_ptr, aux_ptr, stride_wn, stride_xn, 1, BLOCK_N, BLOCK_K,
                               MAGIC, IEEE)
    elif FORMAT == Q2_0:
        return _qblock_product(a, a_sum, k0, rows, w_ptr, aux_ptr, stride_wn, stride_xn, 2, BLOCK_N, BLOCK_K,
                               MAGIC, IEEE)
    else:
        g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        gmask = (g < K // 8)[None, :]
        return _dot(a, _e8p_nibbles(w_ptr + rows[:, None] * stride_wn + g[None, :], gmask, table_ptr,
                                    BLOCK_N, BLOCK_K, EVEN_K), MAGIC, IEEE)


@triton.jit
def _residual_product(a, k0, rows, K, aux_ptr, rtable_ptr, stride_xn, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MAGIC: tl.constexpr, IEEE: tl.constexpr):
    g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return _dot(a, _residual_nibbles(aux_ptr + rows[:, None] * stride_xn + g[None, :], (g < K // 8)[None, :],
                                     rtable_ptr, BLOCK_N, BLOCK_K, EVEN_K), MAGIC, IEEE)


@triton.jit
def _finish(acc, acc_r, a_total, rows, scale_ptr, stride_sn, FORMAT: tl.constexpr, MAGIC: tl.constexpr):
    """E8: 4·w = 2n - 15 and 2·r = (2r + 4) - 4, minus the MAGIC offsets, times the row scale."""
    if FORMAT == E8P or FORMAT == E8P3:
        acc = 0.5 * acc - (0.25 * (2 * MAGIC + 15)) * a_total[:, None]
        if FORMAT == E8P3:
            acc += RESIDUAL_FACTOR * (acc_r - (MAGIC + 4) * a_total[:, None])
        s = tl.load(scale_ptr + rows * stride_sn).to(tl.float32)
        acc = acc * s[None, :]
    return acc


@triton.jit
def block_pairs_and_rows(pair_ids_ptr, num_pairs, N, A_ROW_DIV: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """(pairs, their mask, activation rows, output rows, clamped weight rows) of program (block, row tile).

    Padding pairs and surplus rows read real (clamped) data and are dropped at the store."""
    pairs = tl.load(pair_ids_ptr + tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))
    a_rows = (tl.minimum(pairs, num_pairs - 1) // A_ROW_DIV).to(tl.int64)
    out_rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, a_rows, out_rows, tl.minimum(out_rows, N - 1)


@triton.jit
def _expert_gemm(a_ptr, a_sum_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, routing_ptr,
                 w_ptr, aux_ptr, scale_ptr, table_ptr, rtable_ptr,
                 N, K, num_pairs, stride_am, stride_sm, stride_om,
                 stride_we, stride_wn, stride_xe, stride_xn, stride_se, stride_sn,
                 FORMAT: tl.constexpr, DUAL: tl.constexpr, ROUTED: tl.constexpr, A_ROW_DIV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 MAGIC: tl.constexpr, IEEE: tl.constexpr):
    """a_sum [rows of a, K / block] holds Σa per q block (q formats) or per row (E8 formats)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return  # a padding block past the last expert's pairs
    pairs, pmask, a_rows, out_rows, rows = block_pairs_and_rows(pair_ids_ptr, num_pairs, N, A_ROW_DIV, BLOCK_M,
                                                                BLOCK_N)  # fmt: skip
    a_ptrs = a_ptr + a_rows[:, None] * stride_am
    sum_ptrs = a_sum_ptr + a_rows * stride_sm
    e64 = expert.to(tl.int64)
    w_e = w_ptr + e64 * stride_we
    x_e = aux_ptr + e64 * stride_xe
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_r = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up_r = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs + (k0 + offs_k)[None, :])
        else:
            a = tl.load(a_ptrs + (k0 + offs_k)[None, :], mask=((k0 + offs_k) < K)[None, :], other=0.0)
        if FORMAT == Q1_0 or FORMAT == Q2_0:
            a_sum = tl.load(sum_ptrs + k0 // BLOCK_K)
        else:
            a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused: E8 corrects once per row
        acc += _tile_product(a, a_sum, k0, rows, K, w_e, x_e, table_ptr, rtable_ptr, stride_wn, stride_xn,
                             FORMAT, BLOCK_N, BLOCK_K, EVEN_K, MAGIC, IEEE)
        if FORMAT == E8P3:
            acc_r += _residual_product(a, k0, rows, K, x_e, rtable_ptr, stride_xn, BLOCK_N, BLOCK_K, EVEN_K,
                                       MAGIC, IEEE)
        if DUAL:  # up rows sit N below the gate rows; same pass, same activation tile
            acc_up += _tile_product(a, a_sum, k0, rows + N, K, w_e, x_e, table_ptr, rtable_ptr, stride_wn,
                                    stride_xn, FORMAT, BLOCK_N, BLOCK_K, EVEN_K, MAGIC, IEEE)
            if FORMAT == E8P3:
                acc_up_r += _residual_product(a, k0, rows + N, K, x_e, rtable_ptr, stride_xn, BLOCK_N, BLOCK_K,
                                              EVEN_K, MAGIC, IEEE)
    if FORMAT == E8P or FORMAT == E8P3:
        a_total = tl.load(sum_ptrs)
    else:
        a_total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    s_e = scale_ptr + e64 * stride_se
    val = _finish(acc, acc_r, a_total, rows, s_e, stride_sn, FORMAT, MAGIC)
    if DUAL:
        up = _finish(acc_up, acc_up_r, a_total, rows + N, s_e, stride_sn, FORMAT, MAGIC)
        val = val * tl.sigmoid(val) * up
    if ROUTED:
        val = val * tl.load(routing_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + out_rows[None, :]
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & (out_rows < N)[None, :])
