"""Tensor-core decode body of the quantized MoE MLP for q2_0 ("swap AB").

At decode an expert sees a handful of tokens, so `_expert_gemm`'s tl.dot (pairs as M, weight rows
as N) pads M to 16 and sends every dequantized weight tile through shared memory as the B operand.
Here the roles are swapped: a program takes BLOCK_N weight rows of one expert as the MMA's M side
(sm_90 warpgroup MMA, 64 rows a step) and one block's tokens as N (BLOCK_T = 16, padding pairs
masked), so the weights are the large operand and the activations the small one.

Dequantization, ~1 instruction per weight (spec "Kernels": weights cross memory once, the SMs
must not become the limit). A 32-bit word holds 16 q2_0 codes; fields s and s + 8 (bits 2s and
2s + 16) sit in the two 16-bit halves at the same place, so one AND with 0x00030003 << 2f and one
OR with the pattern of 2^(M - 2f) (M mantissa bits: 10 for fp16, 7 for bf16) give two numbers
2^(M - 2f) + q exactly (the field lands in the mantissa where the ulp is 1), and one x2
subtraction of 2^(M - 2f) + 1 leaves the exact levels q - 1 (qblocks.py). In place this works
while the field stays under the exponent (fp16: f <= 4, bf16: f <= 2); the other fields take one
shift of the word by 6 (and 12 for bf16). So a word costs 8 LOP3 + 8 HADD2 + 1-2 SHF for 16
weights. The block scale d multiplies the float32 MMA result of its 64 inputs, so the operand
stays exact and no large offset is subtracted from a sum. (Folding d into the operand instead,
one HMUL2 more per two weights, measured 10-30 % slower on the H200: docs/BENCHMARKS.md 01:22.)

The columns of a tile are ordered (`tile_order`, `_q2_levels`) so that the dequantized registers
already form the MMA's register operand: sm_90 SASS shows no shared-memory round trip of the tile
and 2.4-2.5 instructions per weight in the K loop (bench/sass_experts.py), against 3.7-4.2 for the
GEMV body. Measured (H200, D=6144 I=2048 top-8, kernels only): 40 % of copy bandwidth at 8 tokens
(64 pairs) against the GEMV body's 35 % at 01:22, but 20 % against 25 % at one token: with 8 busy
experts its few, long programs cannot keep enough loads in flight. Since 04:44 the GEMV body (which
borrows `_levels_pair` for its exact fp16 levels) is ahead at 8 tokens too (40 % against 39 %), so
moe.use_mma takes this body only beyond 64 pairs (moe.MMA_MIN_PAIRS).

The interpreter has no inline assembly; there (``ASM=False``) the same levels come from plain
shifts and masks, so CI checks the tile order, the scaling and the epilogues, and the GPU check
(bench/kernels_experts.check_mma) checks the assembly against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.experts.moe_triton import block_pairs_and_rows

Q2_BLOCK = tl.constexpr(64)  # weights per q2_0 scale d


def tile_order(a: torch.Tensor) -> torch.Tensor:
    """Activations [rows, K] -> the same values in the order of the dequantized tiles (`_q2_levels`).

    Tile column 16w + 2s + h holds weight 16w + 8h + s (field s of half h of word w), so that the
    two levels of one fp16x2 register sit side by side in the MMA operand.
    """
    blocks = a.reshape(a.shape[0], -1, 4, 2, 4, 2)  # [rows, block, t, h, c, j]: weight 16t + 8h + 2c + j
    return blocks.permute(0, 1, 4, 5, 2, 3).reshape(a.shape)  # column 16c + 8j + 2t + h


@triton.jit
def _levels_pair(word, S: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """int32 words [R, W] -> [R, W, 2]: (level of field S, level of field S + 8), levels q - 1, exact."""
    if ASM:
        IN_PLACE: tl.constexpr = 3 if BF16 else 5  # fields whose bits stay under the exponent
        SHIFT: tl.constexpr = 6 * (S // IN_PLACE)
        FIELD: tl.constexpr = S - 3 * (S // IN_PLACE)  # the field's index after the shift
        if BF16:  # fp16/bf16 pattern of 2^(M - 2·FIELD), M mantissa bits: its ulp is 1 at bit 2·FIELD
            magic: tl.constexpr = (127 + 7 - 2 * FIELD) << 7
        else:
            magic: tl.constexpr = (15 + 10 - 2 * FIELD) << 10
        minus: tl.constexpr = (magic + (1 << (2 * FIELD))) * 0x10001  # the pattern of 2^(M - 2·FIELD) + 1
        src = word >> SHIFT if SHIFT > 0 else word
        sub: tl.constexpr = "sub.rn.bf16x2" if BF16 else "sub.rn.f16x2"
        # One LOP3 (AND with the field mask, OR with the exponent) and one HADD2 per two weights; the
        # constants arrive as operands, which ptxas folds into the instructions' immediates.
        # pack=2: the assembly reads the first copy of each operand and writes both halves of $0.
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $1, $3, $5, 0xEA; " + sub + " $0, t, $7; }", "=r,r,r,r,r,r,r,r,r",
            [tl.join(src, src), 0x00030003 << (2 * FIELD), magic * 0x10001, minus],
            dtype=tl.bfloat16 if BF16 else tl.float16, is_pure=True, pack=2)
    lo = ((word >> (2 * S)) & 3) - 1
    hi = ((word >> (2 * S + 16)) & 3) - 1
    return tl.join(lo, hi).to(tl.bfloat16 if BF16 else tl.float16)


@triton.jit
def _q2_levels(word, BF16: tl.constexpr, ASM: tl.constexpr):
    """int32 words [R, 4] (one q2_0 block per row) -> [R, 64] levels q - 1 in tile order (`tile_order`).

    The join tree puts field s = 4a + 2b + c of half h of word t at index (t, h, a, b, c); the permute
    makes it (a, b, c, t, h), i.e. column 16(2a + b) + 8c + 2t + h. That is the sm_90 warpgroup MMA's
    register layout for A: the thread that decoded word t of a row holds exactly the columns that
    layout gives it (pairs h in one register), so the tile feeds the MMA from registers, without the
    shared-memory round trip that a convert_layout would cost (sm_90 SASS: no STS/LDS of the tile).
    """
    c0 = tl.join(tl.join(_levels_pair(word, 0, BF16, ASM), _levels_pair(word, 4, BF16, ASM)),
                 tl.join(_levels_pair(word, 2, BF16, ASM), _levels_pair(word, 6, BF16, ASM)))
    c1 = tl.join(tl.join(_levels_pair(word, 1, BF16, ASM), _levels_pair(word, 5, BF16, ASM)),
                 tl.join(_levels_pair(word, 3, BF16, ASM), _levels_pair(word, 7, BF16, ASM)))
    tile = tl.permute(tl.join(c0, c1), (0, 3, 4, 5, 1, 2))  # [R, a, b, c, t, h]
    return tl.reshape(tile, (word.shape[0], word.shape[1] * 16))


@triton.jit
def _q2_rows_times_tokens(w_e, d_e, rows, a_ptrs, pmask, K, stride_wn, stride_dn,
                          BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr,
                          UNROLL: tl.constexpr):
    """[BLOCK_N, BLOCK_T] float32 W[rows] · aᵀ for one expert's q2_0 rows and the block's activation rows."""
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    word_ptrs = w_e.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_wn // 4) + tl.arange(0, 4)[None, :]
    offs_k = tl.arange(0, Q2_BLOCK)
    for k0 in tl.range(0, K, Q2_BLOCK * UNROLL):
        for b in tl.static_range(UNROLL):  # UNROLL q blocks per iteration: one loop overhead for all
            kb = k0 + b * Q2_BLOCK
            words = tl.load(word_ptrs + kb // 16)
            d = tl.load(d_e + rows * stride_dn + kb // Q2_BLOCK).to(tl.float32)
            # Activations in tile order (`tile_order`); padding pairs are not fetched (zeros).
            x = tl.load(a_ptrs + (kb + offs_k)[None, :], mask=pmask[:, None], other=0.0)
            acc += tl.dot(_q2_levels(words, BF16, ASM), tl.trans(x)) * d[:, None]
    return acc


@triton.jit
def _expert_mma(a_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, routing_ptr, w_ptr, d_ptr,
                N, K, num_pairs, stride_am, stride_om, stride_we, stride_wn, stride_de, stride_dn,
                DUAL: tl.constexpr, ROUTED: tl.constexpr, A_ROW_DIV: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, ASM: tl.constexpr, UNROLL: tl.constexpr):
    """out[p, rows] for the pairs p of block program_id(0) (routing.align_pairs) and BLOCK_N rows.

    Same epilogues as `_expert_gemm`: DUAL reads gate rows n and up rows N + n and writes
    silu(gate)·up; ROUTED multiplies by routing[p]. Activations are fp16 or bf16, the MMA's operands.
    """
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return  # a padding block past the last expert's pairs
    pairs, pmask, a_rows, out_rows, rows = block_pairs_and_rows(pair_ids_ptr, num_pairs, N, A_ROW_DIV, BLOCK_T,
                                                                BLOCK_N)  # fmt: skip
    a_ptrs = a_ptr + a_rows[:, None] * stride_am
    e64 = expert.to(tl.int64)
    w_e = w_ptr + e64 * stride_we
    d_e = d_ptr + e64 * stride_de
    BF16: tl.constexpr = a_ptr.dtype.element_ty == tl.bfloat16
    val = _q2_rows_times_tokens(w_e, d_e, rows, a_ptrs, pmask, K, stride_wn, stride_dn, BLOCK_N, BLOCK_T, BF16, ASM,
                                UNROLL)
    if DUAL:
        up = _q2_rows_times_tokens(w_e, d_e, rows + N, a_ptrs, pmask, K, stride_wn, stride_dn, BLOCK_N, BLOCK_T, BF16,
                                   ASM, UNROLL)
        val = val * tl.sigmoid(val) * up
    if ROUTED:
        val = val * tl.load(routing_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pairs.to(tl.int64)[None, :] * stride_om + out_rows[:, None]
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=pmask[None, :] & (out_rows < N)[:, None])
