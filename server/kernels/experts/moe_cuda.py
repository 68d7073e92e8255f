"""e8p / e8p3 expert decode on tensor cores, in CUDA C (compiled at run time by NVRTC, server/kernels/nvrtc.py).

Why CUDA C: the Triton GEMV body (moe_gemv.py) multiplies on CUDA cores, one FFMA per weight, and looks its E8
tables up through tl.gather; it is instruction-bound near 20 % of the copy bandwidth (docs/BENCHMARKS.md). Here
each 16-bit code is decoded straight into the registers of an `mma.sync.m16n8k16` A operand (16 rows x 16 K of
weights), so the tensor core does every multiply and a weight costs only its decode. Triton decides itself
where an MMA operand lives, so it cannot express that.

Same op contract as `moe._expert_gemv`: one CTA per (pair, block of output rows); the pair's expert id is read
from the flattened topk ids on the device (no host sync, CUDA-graph capturable); gate_up reads gate row n and
up row I + n in one pass and writes silu(gate)·up per pair (``dual``); down multiplies by the pair's routing
weight and writes float32 rows that the caller sums over the top-k slots. The pair's activation row is column 0
of the MMA's B operand (the other 7 columns are zero): the decode, not the MMA, is the cost.

Layout per warp (lane = 4g + t): a lane owns rows g and g + 8 of each 16-row tile and, per K step of 256
inputs, the 8 consecutive codes (one 16-byte load per row) at code index 32s + 8t + i, i = 0..7. Code i of a
lane fills two MMAs: its coordinate pairs (0,1), (2,3) are the A registers a0/a2 (a1/a3: row g + 8) of the
first, (4,5), (6,7) of the second, whose B registers are the activation pairs of those same 8 inputs (one
16-byte load by the lanes of column 0). The contraction order over K is thereby permuted consistently for A and B.

Decode (spec "E8P codebook"): with n_k = (4·w_k + 15)/2 in [0, 15], the code's 8 nibbles are
N = ABS[a] ^ SIGN[s] (`kernel_tables_cpu`: sign flips and the -1/4 shift are XORs on the nibbles 8 + 2|x|; the
odd-row flip of the last coordinate is folded into ABS). The nibbles of
coordinates 2j and 2j + 1 sit 16 bits apart, pre-rotated so that rotating N right by 4j puts them in the top
mantissa bits of two halves: one LOP3 then makes the fp16 (bf16) pair 1 + n/16, exact. The MMA sums
S = Σ x·(1 + n/16); an MMA with A = 1 sums Σx from the same operands, and Σ x·w = 8·S - 11.75·Σx (as
moe_gemv.py, offset 1, so float32 error stays within a small factor of a plain dot product). e8p3's residual
code m_k = 2r_k + 4 goes through the same scheme into its own accumulator: Σ x·r = 8·S_r - 10·Σx, stored
points r / 2.04. Per code: two LDS.32 (ABS, SIGN; e8p3 a third), one XOR, three funnel shifts, four LOP3
(sm_90 SASS of a whole K step, bench/cuda_sass.py: 18.6 instructions a code for e8p, 34.7 for e8p3).

A CTA's warps split K (warp w takes K steps w, w + W, ...) and add their accumulators in shared memory; code
loads of the next step are issued before the current step's decode (16-byte loads, one step ahead).
Requirements (`supports`): fp16/bf16 activations, K a multiple of 64 (whole 16-byte code loads per row), 16-byte
aligned rows; otherwise the caller keeps the Triton body.

The integer body (moe_cuda_int8.py), on int8 activations, replaces this one by default wherever K is whole
groups of 256; both build from PRELUDE (types, wide loads, row setup, step loads, the output store).

Measured (H200, D=6144 I=2048 E64 top-8): the whole op at one token e8p 83.8 us, 8 tokens 399.8 us; e8p3 120.7
and 684.1 us (docs/BENCHMARKS.md, 08:50 UTC block). ncu (19:40 UTC block) shows it bound by the integer pipe: 73 %
busy at 8 tokens, and its table loads take 3.1 shared-memory wavefronts each from bank conflicts.
"""

from __future__ import annotations

import functools

import torch

from server.kernels import nvrtc
from server.kernels.experts import e8p
from server.kernels.experts.weights import ExpertWeights
from server.kernels.timing import timed

E8_FORMATS = ("e8p", "e8p3")
K_STEP = 256  # inputs per warp step: 8 codes per lane and row, 4 lanes per row
MAX_WARPS = 8  # the shared-memory reduction holds 8 warps (MAX_WARPS in SOURCE)
# Output rows per CTA: dual, 16 gate + 16 up rows (two 16-row tiles, 16 outputs); down, two tiles.
ROWS_PER_CTA = {True: 16, False: 32}
# The fp16 / bf16 bit layout of 1 + n/16: where a nibble goes in each half (its first bit), the mask of the
# two nibbles, and the pattern of 1.0 in both halves.
_FIELD = {torch.float16: (6, 0x03C003C0, 0x3C003C00), torch.bfloat16: (3, 0x00780078, 0x3F803F80)}

PRELUDE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define MAX_WARPS 8
#define RESIDUAL_INV @RESIDUAL_INV@f

struct u32x4 { u32 x, y, z, w; };
struct u32x2 { u32 x, y; };

__device__ __forceinline__ u32x4 ld_u32x4(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32x2 ld_u32x2(const void* p) {
    u32x2 v;
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}


__device__ __forceinline__ u32 word_of(const u32x4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

__device__ __forceinline__ float half_to_float(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }

template <bool BF16>
__device__ __forceinline__ u16 float_to_act(float f) {
    u16 h;
    if (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Weight row of output r of tile ``tile`` in the CTA's rows from ``first``: DUAL tiles are the gate rows (0) and the
// up rows (1, stored n_out further) of the same 16 outputs; else tile m holds outputs 16m .. 16m + 15. Clamped:
// surplus rows read real data and are dropped at the store.
template <bool DUAL>
__device__ __forceinline__ int weight_row(int first, int tile, int r, int n_out) {
    return min(first + (DUAL ? 0 : 16 * tile) + r, n_out - 1) + (DUAL ? tile * n_out : 0);
}

// The fp16 scale of that weight row, as a float (``__restrict__`` keeps its load on the read-only path).
template <bool DUAL>
__device__ __forceinline__ float row_scale(const u16* __restrict__ scale, int expert, int first, int tile, int r,
                                           int n_out, int stride_se, int stride_sn) {
    const int row = weight_row<DUAL>(first, tile, r, n_out);
    return half_to_float(scale[(long long)expert * stride_se + (long long)row * stride_sn]);
}

// The expert of this CTA's pair; an id outside [0, num_experts) reads expert 0 (in bounds) and writes zeros.
__device__ __forceinline__ int pair_expert(const int* expert_ids, int num_experts, bool& valid) {
    const int expert = expert_ids[blockIdx.x];
    valid = expert >= 0 && expert < num_experts;
    return valid ? expert : 0;
}

// The code (and residual) rows of this lane: tile m holds rows g and g + 8 of its 16.
template <bool E8P3, bool DUAL>
__device__ __forceinline__ void lane_rows(const u16* codes, const u8* residual, int expert, int first, int g, int n_out,
        int stride_ce, int stride_cn, int stride_re, int stride_rn, const u16* crow[2][2], const u8* rrow[2][2]) {
    for (int m = 0; m < 2; ++m)
        for (int h = 0; h < 2; ++h) {
            const int r = weight_row<DUAL>(first, m, g + 8 * h, n_out);
            crow[m][h] = codes + (long long)expert * stride_ce + (long long)r * stride_cn;
            rrow[m][h] = E8P3 ? residual + (long long)expert * stride_re + (long long)r * stride_rn : (const u8*)0;
        }
}

// A body's CTA setup, shared as text (a struct returning these perturbed ptxas's schedule of the main loop): the
// warp (of warps) and the lane's MMA coordinates g, t (lane = 4g + t), the CTA's (token, expert) pair (valid: the
// expert id is in range), its first output row, and the lane's code and residual rows (lane_rows). It reads the
// body's own parameters (expert_ids, num_experts, codes, residual, n_out, strides) and TILES.
#define CTA_PLACE()                                                                                              \
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;                        \
    const int g = lane >> 2, t = lane & 3;                                                                        \
    bool valid;                                                                                                   \
    const int pair = blockIdx.x, expert = pair_expert(expert_ids, num_experts, valid);                            \
    const int first = blockIdx.y * (DUAL ? 16 : 32);                                                              \
    const u16* crow[TILES][2];                                                                                    \
    const u8* rrow[TILES][2];                                                                                     \
    lane_rows<E8P3, DUAL>(codes, residual, expert, first, g, n_out, stride_ce, stride_cn, stride_re, stride_rn, crow, \
                          rrow)

// The codes of K step s: a lane's 8 codes of each of its rows, one 16-byte load each (8 bytes of residuals). Steps
// past K, and chunks past K in a partial last step, read nothing (code 0, against zero activations).
template <bool E8P3>
__device__ __forceinline__ void load_step(const u16* const crow[2][2], const u8* const rrow[2][2], int s, int steps,
                                          int k8, int t, u32x4 dst[2][2], u32x2 rdst[2][2]) {
    const int c0 = s * 32 + 8 * t;
    const bool live = s < steps && c0 < k8;
    for (int m = 0; m < 2; ++m)
        for (int h = 0; h < 2; ++h) {
            dst[m][h] = live ? ld_u32x4(crow[m][h] + c0) : u32x4{0u, 0u, 0u, 0u};
            if (E8P3) rdst[m][h] = live ? ld_u32x2(rrow[m][h] + c0) : u32x2{0u, 0u};
        }
}

// The step loaded ahead becomes the current one.
template <bool E8P3>
__device__ __forceinline__ void advance(u32x4 cur[2][2], const u32x4 nxt[2][2], u32x2 rcur[2][2],
                                        const u32x2 rnxt[2][2]) {
    for (int m = 0; m < 2; ++m)
        for (int h = 0; h < 2; ++h) { cur[m][h] = nxt[m][h]; if (E8P3) rcur[m][h] = rnxt[m][h]; }
}

// Output row ``row`` of pair ``pair`` from its gate and up values (DUAL: silu(gate)·up in the activations' dtype)
// or its value (× the pair's routing weight, float32); an invalid expert id writes 0.
template <bool BF16, bool DUAL>
__device__ __forceinline__ void store_output(void* out, const float* routing, const float* val, int pair, int row,
                                             bool valid, int stride_out) {
    if (DUAL) {
        const float gate = val[0], up = val[1];
        const float h = valid ? gate / (1.f + __expf(-gate)) * up : 0.f;
        ((u16*)out)[(long long)pair * stride_out + row] = float_to_act<BF16>(h);
    } else {
        ((float*)out)[(long long)pair * stride_out + row] = valid ? val[0] * routing[pair] : 0.f;
    }
}

""".replace("@RESIDUAL_INV@", repr(1.0 / e8p.RESIDUAL_SCALE))

SOURCE = PRELUDE + r"""
__device__ __forceinline__ u32 ror(u32 v, int n) {
    u32 r;
    asm("shf.r.wrap.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(v), "r"(n));
    return r;
}

template <bool BF16>
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (BF16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 8 nibbles of a code (pre-rotated words) -> 4 A registers: the pairs of 1 + n/16 of coordinates (2j, 2j+1).
// ``mask`` arrives as a kernel argument: an instruction takes one immediate, so with the mask in a register
// the AND and the OR with 1.0 are one LOP3 (two immediates cost a second LOP3 per register).
template <bool BF16>
__device__ __forceinline__ void pairs(u32 n, u32 mask, u32* a) {
    const u32 one = BF16 ? 0x3F803F80u : 0x3C003C00u;
    a[0] = (n & mask) | one;
    a[1] = (ror(n, 4) & mask) | one;
    a[2] = (ror(n, 8) & mask) | one;
    a[3] = (ror(n, 12) & mask) | one;
}

// Code HALF (0: low 16 bits, 1: high) of a 32-bit word of codes -> its nibble word ABS[a] ^ SIGN[s]: byte
// offsets straight from the word (one shift and one AND each) into the shared tables.
template <int HALF>
__device__ __forceinline__ u32 nibbles(const char* abs_tab, const char* sign_tab, u32 w) {
    u32 ia = HALF ? (w >> 22) & 0x3FCu : (w >> 6) & 0x3FCu;
    u32 is = HALF ? (w >> 14) & 0x3FCu : (w << 2) & 0x3FCu;
    return *(const u32*)(abs_tab + ia) ^ *(const u32*)(sign_tab + is);
}

// Residual byte J (0..3) of a 32-bit word -> its nibble word RES[r].
template <int J>
__device__ __forceinline__ u32 residual_nibbles(const char* res_tab, u32 w) {
    u32 i = J == 0 ? (w << 2) & 0x3FCu : (w >> (8 * J - 2)) & 0x3FCu;
    return *(const u32*)(res_tab + i);
}

// One CTA: pair blockIdx.x, output rows block blockIdx.y; warps split K and add up in shared memory.
template <bool BF16, bool E8P3, bool DUAL>
__device__ __forceinline__ void expert_decode(
        const u16* __restrict__ act, void* __restrict__ out, const int* __restrict__ expert_ids,
        const float* __restrict__ routing, const u16* __restrict__ codes, const u8* __restrict__ residual,
        const u16* __restrict__ scale, const u32* __restrict__ table,
        int n_out, int k, int num_experts, int a_row_div, int stride_a, int stride_out,
        int stride_ce, int stride_cn, int stride_re, int stride_rn, int stride_se, int stride_sn, u32 mask) {
    constexpr int TILES = 2;
    __shared__ u32 abs_tab[256], sign_tab[256], res_tab[256];
    __shared__ float red[MAX_WARPS][2 * TILES][16];
    __shared__ float red_sum[MAX_WARPS];
    const int n_tab = E8P3 ? 768 : 512;
    for (int i = threadIdx.x; i < n_tab; i += blockDim.x)
        (i < 256 ? abs_tab : i < 512 ? sign_tab : res_tab)[i & 255] = table[i];

    CTA_PLACE();
    const u16* arow = act + (long long)(pair / a_row_div) * stride_a;
    const int k8 = k >> 3, steps = (k8 + 31) >> 5;

    float acc[TILES][4], acc_r[TILES][4], acc_sum[4];
    for (int j = 0; j < 4; ++j) {
        acc_sum[j] = 0.f;
        for (int m = 0; m < TILES; ++m) acc[m][j] = acc_r[m][j] = 0.f;
    }
    u32x4 cur[TILES][2], nxt[TILES][2];
    u32x2 rcur[TILES][2], rnxt[TILES][2];
    const u32x4 zero4 = {0u, 0u, 0u, 0u};
    load_step<E8P3>(crow, rrow, warp, steps, k8, t, cur, rcur);
    __syncthreads();  // the table is in shared memory
    const char *ta = (const char*)abs_tab, *ts = (const char*)sign_tab, *tr = (const char*)res_tab;
    const u32 one2 = BF16 ? 0x3F803F80u : 0x3C003C00u;

    for (int s = warp; s < steps; s += warps) {
        load_step<E8P3>(crow, rrow, s + warps, steps, k8, t, nxt, rnxt);
        const int c0 = s * 32 + 8 * t;
        const bool act_live = g == 0 && c0 < k8;
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            u32x4 x = act_live ? ld_u32x4(arow + (long long)(c0 + i) * 8) : zero4;
            mma<BF16>(acc_sum, one2, one2, one2, one2, x.x, x.y);
            mma<BF16>(acc_sum, one2, one2, one2, one2, x.z, x.w);
            #pragma unroll
            for (int m = 0; m < TILES; ++m) {
                u32 lo[4], hi[4];
                u32 w0 = word_of(cur[m][0], i >> 1), w1 = word_of(cur[m][1], i >> 1);
                if (i & 1) { pairs<BF16>(nibbles<1>(ta, ts, w0), mask, lo); pairs<BF16>(nibbles<1>(ta, ts, w1), mask, hi); }
                else { pairs<BF16>(nibbles<0>(ta, ts, w0), mask, lo); pairs<BF16>(nibbles<0>(ta, ts, w1), mask, hi); }
                mma<BF16>(acc[m], lo[0], hi[0], lo[1], hi[1], x.x, x.y);
                mma<BF16>(acc[m], lo[2], hi[2], lo[3], hi[3], x.z, x.w);
                if (E8P3) {
                    u32 r0 = i < 4 ? rcur[m][0].x : rcur[m][0].y, r1 = i < 4 ? rcur[m][1].x : rcur[m][1].y;
                    u32 n0, n1;
                    switch (i & 3) {
                        case 0: n0 = residual_nibbles<0>(tr, r0); n1 = residual_nibbles<0>(tr, r1); break;
                        case 1: n0 = residual_nibbles<1>(tr, r0); n1 = residual_nibbles<1>(tr, r1); break;
                        case 2: n0 = residual_nibbles<2>(tr, r0); n1 = residual_nibbles<2>(tr, r1); break;
                        default: n0 = residual_nibbles<3>(tr, r0); n1 = residual_nibbles<3>(tr, r1); break;
                    }
                    pairs<BF16>(n0, mask, lo);
                    pairs<BF16>(n1, mask, hi);
                    mma<BF16>(acc_r[m], lo[0], hi[0], lo[1], hi[1], x.x, x.y);
                    mma<BF16>(acc_r[m], lo[2], hi[2], lo[3], hi[3], x.z, x.w);
                }
            }
        }
        advance<E8P3>(cur, nxt, rcur, rnxt);
    }

    // Column 0 of C (the pair) lives in the lanes t == 0: c0 is row g, c2 row g + 8.
    if (t == 0) {
        for (int m = 0; m < TILES; ++m) {
            red[warp][m][g] = acc[m][0];
            red[warp][m][g + 8] = acc[m][2];
            red[warp][TILES + m][g] = acc_r[m][0];
            red[warp][TILES + m][g + 8] = acc_r[m][2];
        }
        if (g == 0) red_sum[warp] = acc_sum[0];
    }
    __syncthreads();
    const int j = threadIdx.x;
    if (j >= (DUAL ? 16 : 32)) return;
    float sum_x = 0.f;
    for (int w = 0; w < warps; ++w) sum_x += red_sum[w];
    float val[TILES];
    for (int m = 0; m < (DUAL ? 2 : 1); ++m) {
        const int tile = DUAL ? m : j >> 4, r = j & 15;
        float s_main = 0.f, s_res = 0.f;
        for (int w = 0; w < warps; ++w) { s_main += red[w][tile][r]; s_res += red[w][TILES + tile][r]; }
        float v = 8.f * s_main - 11.75f * sum_x;
        if (E8P3) v += (8.f * s_res - 10.f * sum_x) * RESIDUAL_INV;
        val[m] = v * row_scale<DUAL>(scale, expert, first, tile, r, n_out, stride_se, stride_sn);
    }
    if (first + j < n_out) store_output<BF16, DUAL>(out, routing, val, pair, first + j, valid, stride_out);
}

#define EXPERT_KERNEL(NAME, BF16, E8P3, DUAL)                                                             \
extern "C" __global__ void __launch_bounds__(256) NAME(                                                  \
        const u16* act, void* out, const int* expert_ids, const float* routing, const u16* codes,        \
        const u8* residual, const u16* scale, const u32* table, int n_out, int k, int num_experts,      \
        int a_row_div, int stride_a, int stride_out, int stride_ce, int stride_cn, int stride_re,       \
        int stride_rn, int stride_se, int stride_sn, u32 mask) {                                        \
    expert_decode<BF16, E8P3, DUAL>(act, out, expert_ids, routing, codes, residual, scale, table, n_out, k, \
        num_experts, a_row_div, stride_a, stride_out, stride_ce, stride_cn, stride_re, stride_rn,      \
        stride_se, stride_sn, mask);                                                                    \
}

EXPERT_KERNEL(experts_e8p_gate_up_f16, false, false, true)
EXPERT_KERNEL(experts_e8p_down_f16, false, false, false)
EXPERT_KERNEL(experts_e8p3_gate_up_f16, false, true, true)
EXPERT_KERNEL(experts_e8p3_down_f16, false, true, false)
EXPERT_KERNEL(experts_e8p_gate_up_bf16, true, false, true)
EXPERT_KERNEL(experts_e8p_down_bf16, true, false, false)
EXPERT_KERNEL(experts_e8p3_gate_up_bf16, true, true, true)
EXPERT_KERNEL(experts_e8p3_down_bf16, true, true, false)
"""


def kernel_name(fmt: str, dual: bool, dtype: torch.dtype) -> str:
    return f"experts_{fmt}_{'gate_up' if dual else 'down'}_{'bf16' if dtype == torch.bfloat16 else 'f16'}"


# Nibble of coordinate k in the float body's table words: coordinate 2j at nibble j and 2j + 1 at j + 4 (the two
# halves of A register j).
_PLACE = (0, 4, 1, 5, 2, 6, 3, 7)


def table_words(place: tuple[int, ...]) -> torch.Tensor:
    """[768] int64: ABS (256 rows a), SIGN (256 sign bytes s), RES (256 residual codes) nibble words, coordinate k
    at nibble place[k].

    n_k = (4·w_k + 15)/2 = ABS[a]_k ^ SIGN[s]_k: ABS holds 8 + 2|x_k| (odd); SIGN holds 0xE where coordinate k
    is negative and the shift parity p in bit 0 (with p = 0, 8 - 2|x| = (8 + 2|x|) ^ 0xE; with p = 1 both are
    one less, which for these odd / even values is the XOR with 1). The sign flip of coordinate 7 in odd-sum rows
    (decode rule) is that XOR with 0xE, folded into ABS. RES holds 2r_k + 4.
    """
    k = torch.arange(8)
    abs_n = 8 + (e8p.abs_table() * 2).long()
    abs_n[:, 7] ^= e8p.abs_row_odd().long() * 0xE
    s = torch.arange(256)
    p = ((s[:, None] >> k) & 1).sum(1) & 1
    f = s ^ p
    sign_n = ((f[:, None] >> k) & 1) * 0xE | p[:, None]
    res_n = (e8p.residual_table() * 2 + 4).long()
    shifts = 4 * torch.tensor(place)
    return torch.cat([(n << shifts).sum(-1) for n in (abs_n, sign_n, res_n)])


def int32_words(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@functools.cache
def kernel_tables_cpu(dtype: torch.dtype) -> torch.Tensor:
    """[768] int32: the float body's table words (table_words), rotated left so that the nibbles of pair 0 sit
    where `pairs` reads them for activations of ``dtype``."""
    words, rot = table_words(_PLACE), _FIELD[dtype][0]
    return int32_words(((words << rot) | (words >> (32 - rot))) & 0xFFFFFFFF)


@functools.cache
def _tables(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return kernel_tables_cpu(dtype).to(device)


def supports(a: torch.Tensor, w: ExpertWeights) -> bool:
    """Whether the CUDA body takes activations ``a`` times weights ``w``: e8p/e8p3, fp16/bf16 activations on a GPU,
    K a multiple of 64, and rows aligned for its wide loads (16 bytes of activations and codes, 8 of residuals)."""
    if w.format not in E8_FORMATS or a.dtype not in _FIELD or a.device.type != "cuda" or w.shape[2] % 64:
        return False
    return rows_aligned([(a, 16), *weight_loads(w)])


def weight_loads(w: ExpertWeights) -> list[tuple[torch.Tensor, int]]:
    """(tensor, width) of the weights' wide loads: 16-byte code loads, 8-byte residual loads."""
    return [(w.tensors["codes"], 16)] + ([(w.tensors["residual"], 8)] if w.format == "e8p3" else [])


def rows_aligned(loads: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether every (tensor, width) is contiguous along its rows with base and row strides multiples of width."""
    return all(t.stride(-1) == 1 and t.data_ptr() % width == 0
               and all(st * t.element_size() % width == 0 for st in t.stride()[:-1]) for t, width in loads)


def expert_kernel(a: torch.Tensor, w: ExpertWeights, dual: bool):
    """The compiled kernel for this launch, or None where the CUDA body cannot take it (the caller's Triton path)."""
    if not supports(a, w):
        return None
    return nvrtc.cuda_kernel(SOURCE, kernel_name(w.format, dual, a.dtype), a.device)


# Warps per CTA (they split K) of the gate_up and down launches; module-level so benchmark sweeps set them.
warps = {True: 4, False: 4}


def launch_shape(a: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights, table: torch.Tensor,
                 dual: bool, routing: torch.Tensor | None, a_row_div: int) -> tuple[tuple, tuple, list]:
    """(grid, block, arguments) of a launch of either body (moe_cuda_int8.py takes the same arguments; this body
    appends the nibble mask): a CTA per (pair, row block), ``warps`` K-splitting warps, no more than K has steps."""
    num_e, rows, k = w.shape
    n = rows // 2 if dual else rows
    t = w.tensors
    codes, scale = t["codes"], t["scale"]
    residual = t.get("residual", codes)  # e8p: never read
    grid = (expert_ids.numel(), -(-n // ROWS_PER_CTA[dual]), 1)
    block = (32 * max(1, min(warps[dual], MAX_WARPS, -(-k // K_STEP))), 1, 1)
    return grid, block, [
        a, out, expert_ids, routing if routing is not None else out, codes, residual, scale, table, n, k, num_e,
        a_row_div, a.stride(0), out.stride(0), codes.stride(0), codes.stride(1), residual.stride(0),
        residual.stride(1), scale.stride(0), scale.stride(1)]


def launch_expert_cuda(kernel, a: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights,
                       dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """As moe.launch_expert_gemv, through ``kernel`` (from `expert_kernel`): out[p, :N] for every pair p of
    expert_ids [pairs] int32 (gate·up epilogue in a's dtype when ``dual``; else × routing[p], float32 out)."""
    grid, block, args = launch_shape(a, out, expert_ids, w, _tables(a.dtype, a.device), dual, routing, a_row_div)
    with timed(f"experts_{w.format}_{'gate_up' if dual else 'down'}_cuda", a.device):
        kernel(grid=grid, block=block, args=args + [_FIELD[a.dtype][1]])
