"""e8p / e8p3 expert decode on int8 activations through integer MMAs, in CUDA C (NVRTC, as moe_cuda.py).

The default GEMV-regime body of the E8 formats wherever a projection's K is whole groups of 256 (moe.py); the
float body (moe_cuda.py) serves elsewhere, and both build from its PRELUDE. Same op contract, CTA shape and lane
layout as the float body; what changes is the multiply.

The activations arrive as int8 in groups of E8_GROUP = 256 (int8_activations.quantize_rows_triton: the rotation
and the rounding in one launch; a row is K int8 q, then per group its scale s and Σq). The table words
(`kernel_tables_cpu`) hold n_k = (4·w_k + 15)/2 of coordinates 0-3 in the low nibbles of their four bytes and of
4-7 in the high ones, so N & 0x0F0F0F0F (n) and N & 0xF0F0F0F0 (16·n) are the u8 A operands of two
mma.m16n8k32 against the s8 activations of the same inputs, each one LOP3 with the XOR of the two lookups
(ABS[a] ^ SIGN[s]) folded in. A table offset is a byte permute plus a multiply by 4, which ptxas puts on the FMA
pipe. A K step is one group, so its int32 sums are exact; once a step they become Σ a·w = s·(Σq·n / 2 - 3.75·Σq)
(e8p3's residual m = 2r + 4: s·(Σq·m / 2 - 2·Σq) / 2.04). 16 MMAs a K step, where the float body issues 48 (its
Σx MMAs and its 1 + n/16 operand building are gone).

Measured (H200, D=6144 I=2048 E64 top-8, docs/BENCHMARKS.md 19:40 UTC block): the whole op at one token e8p
64.3 us (28 % of copy; the float body's op 83.8 us at 08:50), 8 tokens 345.9 us (41 %; 399.8); e8p3 88.4 us and
519.4 us (120.7, 684.1). 459 instructions a K step (the first form 558, at the same speed), the ALU 41 % busy;
what binds now is the conflicted table loads and the latency of the code stream (ncu stalls: MIO throttle, short
and long scoreboard). Tried and slower, in that block: lane-private conflict-free tables (64 KiB a CTA: they take
the L1's capacity), 16 table copies, the activation row staged in shared memory, codes two K steps ahead.
"""

from __future__ import annotations

import functools

import torch

from server.kernels import nvrtc
from server.kernels.experts.int8_activations import E8_GROUP
from server.kernels.experts.moe_cuda import (
    E8_FORMATS,
    PRELUDE,
    int32_words,
    launch_shape,
    rows_aligned,
    table_words,
    weight_loads,
)
from server.kernels.experts.weights import ExpertWeights
from server.kernels.timing import timed

SOURCE = PRELUDE + r"""
__device__ __forceinline__ void mma_u8s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (a ^ b) & c and (a ^ b) & ~c, one LOP3 each: the XOR of the two lookups folded into the operand masks.
__device__ __forceinline__ u32 xor_and(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0x28;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 xor_and_not(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0x14;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Byte B of a code word times 4: a table entry's byte offset. The byte permute is the only integer-pipe op; the
// multiply goes to the FMA pipe (IMAD.SHL), as the integer pipe is the one that binds (ncu, docs/BENCHMARKS.md).
template <int B>
__device__ __forceinline__ u32 entry_offset(u32 w) { return __byte_perm(w, 0u, 0x4440u | B) * 4u; }

// The same op on int8 activations (int8_activations.quantize_rows_triton: a row is K int8 q, then per group of 256
// inputs its scale s and Σq). The nibble words (kernel_tables_cpu) hold n_k of coordinates 0-3 in the low
// nibbles of their bytes and of 4-7 in the high ones, so N & 0x0F0F0F0F and N & 0xF0F0F0F0 are the u8 A operands
// n and 16·n of an integer MMA (one LOP3 each, the XOR of the two lookups folded in); the q of the same inputs
// are its B operand. A K step is one group: Σq·n exact in int32, then Σ a·w = s·(Σq·n / 2 - 3.75·Σq).
template <bool BF16, bool E8P3, bool DUAL>
__device__ __forceinline__ void expert_decode_int8(
        const u32* __restrict__ act, void* __restrict__ out, const int* __restrict__ expert_ids,
        const float* __restrict__ routing, const u16* __restrict__ codes, const u8* __restrict__ residual,
        const u16* __restrict__ scale, const u32* __restrict__ table,
        int n_out, int k, int num_experts, int a_row_div, int stride_a, int stride_out,
        int stride_ce, int stride_cn, int stride_re, int stride_rn, int stride_se, int stride_sn) {
    constexpr int TILES = 2;
    constexpr u32 LOW = 0x0F0F0F0Fu;
    __shared__ u32 tab[768];  // ABS, SIGN, RES
    __shared__ float red[MAX_WARPS][TILES][16];
    for (int i = threadIdx.x; i < (E8P3 ? 768 : 512); i += blockDim.x) tab[i] = table[i];
    // The word at byte offset OFF of table T (0 ABS, 1 SIGN, 2 RES).
    #define TAB(T, OFF) (*(const u32*)((const char*)tab + 1024 * (T) + (OFF)))

    CTA_PLACE();
    const u32* arow = act + (long long)(pair / a_row_div) * stride_a;
    const int steps = k >> 8;  // K is whole groups
    const float* group_scale = (const float*)(arow + (k >> 2));
    const int* group_sum = (const int*)(arow + (k >> 2) + steps);

    float acc[TILES][2];
    for (int m = 0; m < TILES; ++m) acc[m][0] = acc[m][1] = 0.f;
    u32x4 cur[TILES][2], nxt[TILES][2];
    u32x2 rcur[TILES][2], rnxt[TILES][2];
    const u32x4 zero4 = {0u, 0u, 0u, 0u};
    load_step<E8P3>(crow, rrow, warp, steps, k >> 3, t, cur, rcur);
    __syncthreads();  // the tables are in shared memory

    for (int s = warp; s < steps; s += warps) {
        load_step<E8P3>(crow, rrow, s + warps, steps, k >> 3, t, nxt, rnxt);
        const int c0 = s * 32 + 8 * t;
        // B, column 0 (lanes g == 0): the q of codes c0 + 2j and c0 + 2j + 1, 8 bytes each (low word: coordinates 0-3)
        u32x4 x[4];
        #pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = g == 0 ? ld_u32x4(arow + 2 * (c0 + 2 * j)) : zero4;
        const float group_s = group_scale[s];
        const float group_q = (float)group_sum[s];
        #pragma unroll
        for (int m = 0; m < TILES; ++m) {
            int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0}, rlo[4] = {0, 0, 0, 0}, rhi[4] = {0, 0, 0, 0};
            #pragma unroll
            for (int j = 0; j < 4; ++j) {  // codes 2j (low half of word j) and 2j + 1 (high half)
                const u32 w0 = word_of(cur[m][0], j), w1 = word_of(cur[m][1], j);  // rows g, g + 8
                // Code 2j is bytes 0 (s) and 1 (a) of its word, code 2j + 1 bytes 2 and 3; rows g (w0), g + 8 (w1).
                const u32 a00 = TAB(0, entry_offset<1>(w0)), s00 = TAB(1, entry_offset<0>(w0));
                const u32 a01 = TAB(0, entry_offset<3>(w0)), s01 = TAB(1, entry_offset<2>(w0));
                const u32 a10 = TAB(0, entry_offset<1>(w1)), s10 = TAB(1, entry_offset<0>(w1));
                const u32 a11 = TAB(0, entry_offset<3>(w1)), s11 = TAB(1, entry_offset<2>(w1));
                mma_u8s8(lo, xor_and(a00, s00, LOW), xor_and(a10, s10, LOW), xor_and(a01, s01, LOW),
                         xor_and(a11, s11, LOW), x[j].x, x[j].z);
                mma_u8s8(hi, xor_and_not(a00, s00, LOW), xor_and_not(a10, s10, LOW), xor_and_not(a01, s01, LOW),
                         xor_and_not(a11, s11, LOW), x[j].y, x[j].w);
                if (E8P3) {  // residual code i is byte i % 4 of word i / 4
                    const u32 r0 = j < 2 ? rcur[m][0].x : rcur[m][0].y, r1 = j < 2 ? rcur[m][1].x : rcur[m][1].y;
                    const u32 m00 = TAB(2, (j & 1) ? entry_offset<2>(r0) : entry_offset<0>(r0));
                    const u32 m01 = TAB(2, (j & 1) ? entry_offset<3>(r0) : entry_offset<1>(r0));
                    const u32 m10 = TAB(2, (j & 1) ? entry_offset<2>(r1) : entry_offset<0>(r1));
                    const u32 m11 = TAB(2, (j & 1) ? entry_offset<3>(r1) : entry_offset<1>(r1));
                    mma_u8s8(rlo, m00 & LOW, m10 & LOW, m01 & LOW, m11 & LOW, x[j].x, x[j].z);
                    mma_u8s8(rhi, m00 & ~LOW, m10 & ~LOW, m01 & ~LOW, m11 & ~LOW, x[j].y, x[j].w);
                }
            }
            // Column 0 of C: c0 is row g, c2 row g + 8 (lanes t == 0). Σq·n = lo + hi / 16, exact in float32.
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                float v = 0.5f * ((float)lo[2 * h] + 0.0625f * (float)hi[2 * h]) - 3.75f * group_q;
                if (E8P3) v += RESIDUAL_INV * (0.5f * ((float)rlo[2 * h] + 0.0625f * (float)rhi[2 * h]) - 2.f * group_q);
                acc[m][h] += v * group_s;
            }
        }
        advance<E8P3>(cur, nxt, rcur, rnxt);
    }
    #undef TAB

    if (t == 0)
        for (int m = 0; m < TILES; ++m) { red[warp][m][g] = acc[m][0]; red[warp][m][g + 8] = acc[m][1]; }
    __syncthreads();
    const int j = threadIdx.x;
    if (j >= (DUAL ? 16 : 32)) return;
    float val[TILES];
    for (int m = 0; m < (DUAL ? 2 : 1); ++m) {
        const int tile = DUAL ? m : j >> 4, r = j & 15;
        float v = 0.f;
        for (int w = 0; w < warps; ++w) v += red[w][tile][r];
        val[m] = v * row_scale<DUAL>(scale, expert, first, tile, r, n_out, stride_se, stride_sn);
    }
    if (first + j < n_out) store_output<BF16, DUAL>(out, routing, val, pair, first + j, valid, stride_out);
}

#define EXPERT_KERNEL_INT8(NAME, BF16, E8P3, DUAL)                                                        \
extern "C" __global__ void __launch_bounds__(256) NAME(                                                  \
        const u32* act, void* out, const int* expert_ids, const float* routing, const u16* codes,        \
        const u8* residual, const u16* scale, const u32* table, int n_out, int k, int num_experts,      \
        int a_row_div, int stride_a, int stride_out, int stride_ce, int stride_cn, int stride_re,       \
        int stride_rn, int stride_se, int stride_sn) {                                                  \
    expert_decode_int8<BF16, E8P3, DUAL>(act, out, expert_ids, routing, codes, residual, scale, table, n_out, \
        k, num_experts, a_row_div, stride_a, stride_out, stride_ce, stride_cn, stride_re, stride_rn,   \
        stride_se, stride_sn);                                                                          \
}

EXPERT_KERNEL_INT8(experts_e8p_gate_up_int8_f16, false, false, true)
EXPERT_KERNEL_INT8(experts_e8p_gate_up_int8_bf16, true, false, true)
EXPERT_KERNEL_INT8(experts_e8p_down_int8, false, false, false)
EXPERT_KERNEL_INT8(experts_e8p3_gate_up_int8_f16, false, true, true)
EXPERT_KERNEL_INT8(experts_e8p3_gate_up_int8_bf16, true, true, true)
EXPERT_KERNEL_INT8(experts_e8p3_down_int8, false, true, false)

"""
# Coordinate k's nibble in a table word: coordinates 0-3 in the low nibbles of bytes 0-3, 4-7 in the high ones.
_PLACE = (0, 2, 4, 6, 1, 3, 5, 7)
_DTYPES = (torch.float16, torch.bfloat16)  # of h, which gate_up writes in the activations' dtype


def kernel_name(fmt: str, dual: bool, dtype: torch.dtype) -> str:
    """gate_up writes h in the activations' dtype, down float32."""
    return f"experts_{fmt}_gate_up_int8_{'bf16' if dtype == torch.bfloat16 else 'f16'}" if dual else f"experts_{fmt}_down_int8"


@functools.cache
def kernel_tables_cpu() -> torch.Tensor:
    """[768] int32: the table words (moe_cuda.table_words): word & 0x0F0F0F0F holds n of coordinates 0-3 in bytes
    0-3, word & 0xF0F0F0F0 16·n of coordinates 4-7."""
    return int32_words(table_words(_PLACE))


@functools.cache
def _tables(device: torch.device) -> torch.Tensor:
    return kernel_tables_cpu().to(device)


def supports(w: ExpertWeights) -> bool:
    """Whether this body takes weights ``w`` (activations from quantize_rows_triton): e8p/e8p3 on a GPU, K whole
    groups of E8_GROUP (one a K step), rows aligned for the wide loads."""
    return (w.format in E8_FORMATS and w.device.type == "cuda" and w.shape[2] % E8_GROUP == 0
            and rows_aligned(weight_loads(w)))


def expert_kernel(w: ExpertWeights, dual: bool, dtype: torch.dtype):
    """The compiled kernel for weights ``w`` (gate_up writing h in ``dtype``), or None where it cannot take them
    (the caller's float path)."""
    if not supports(w) or dtype not in _DTYPES:
        return None
    return nvrtc.cuda_kernel(SOURCE, kernel_name(w.format, dual, dtype), w.device)


def launch_expert_cuda(kernel, act: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights,
                       dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """As moe_cuda.launch_expert_cuda through this body (``kernel`` from `expert_kernel`), on activation rows from
    int8_activations.quantize_rows_triton (act [rows, row_words(K)] int32)."""
    grid, block, args = launch_shape(act, out, expert_ids, w, _tables(act.device), dual, routing, a_row_div)
    with timed(f"experts_{w.format}_{'gate_up' if dual else 'down'}_int8", act.device):
        kernel(grid=grid, block=block, args=args)
