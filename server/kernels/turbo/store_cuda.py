"""The turbo store in CUDA C: one thread quantizes one 128-value group, everything in its registers.

Same contract as quantize.store_turbo_triton (specs/turboquant.md; format.py's row layout), different
machinery. The Triton kernel spreads a group over many threads, so its butterflies cost shuffles and its
sign patterns, row sums, index packing and norm scatter are per-thread data and layout conversions; the
sm_90 SASS counted ~58 instructions per stored value (partial key offset; docs/BENCHMARKS.md), issue-bound
at a fifth of copy bandwidth. Here (server/kernels/nvrtc.py: compiled at run time by NVRTC, no headers):
  * a warp takes 32 consecutive tokens of ONE KV head (an "item", per 128-value group); the 32 rows reach
    shared memory by coalesced 16-byte cp.async copies (rows padded to 272 bytes, so each lane's 16-byte
    reads of its own row hit distinct banks), into two buffers per warp: the next item's copies go out
    when an item starts, so loads overlap the arithmetic;
  * the rotation's signs are the spec's constants and each value's position is a compile-time register
    index, so the first sign table folds into the butterflies' adds and the second into which side of
    zero counts as negative: the Hadamard transform is exactly 7 adds per value, no shuffle, no select;
  * no division: the unnormalized group is compared with the midpoints times n sqrt(G), the magnitude
    by a branch-free binary search (as quantize.py, with the same one-ulp rule for ties below zero);
    n sqrt(G) = ||H D1 x|| is summed from the rotated magnitudes, so the inputs die in the butterflies
    (a sum over them kept 128 more values alive: 168 registers spilled);
  * indices accumulate as the magnitude's bits (j) and a negative-side bit per value, in words already
    in format.py's positions; ||c||^2 comes from popcounts of those words (how many j >= k), and the
    stored codes from a few word operations per 16 values;
  * rows go out as 16-byte stores, norms as fp16 (round to nearest);
  * the key offset: o(p) = const (LDG broadcasts: one head per warp) and, on the head's P turned pairs
    only (P <= MAX_PAIRS), RoPE(p) mean, whose two dims are picked by a switch (warp-uniform, the pair
    list being per head; lane i loads pair i, the loop takes it by shuffle); the sink replaces const at
    position 0.
sm_90 SASS of an item (bench/turbo_store_sass.py): 20.0 (turbo3) / 26.5 (turbo4) instructions per value
without an offset, 21.9 / 28.4 with a fixed one, at 161-168 registers (12 warps per SM). Where K and V are one
kind and no key pairs turn, they go through one copy of that code at up to 255 registers (8 warps per SM),
about 25 % faster (`default_launch`).
Results equal quantize_reference up to rounding order, as the Triton kernel's do: a value within an ulp
or two of a midpoint may land on the other side, and with a key offset on a pair whose const is nonzero
k - const - turn rounds twice where the reference rounds k - (const + turn) once (MUFU sin/cos as
sincos.py). `supports` says which calls it takes (D a multiple of 128, fp16/bf16 K/V, 16-byte aligned
rows); anything else, and every call where CUDA C cannot run, stays on the Triton kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from server.kernels import nvrtc
from server.kernels.backend import multiprocessors
from server.kernels.rotation import SIGNS1, SIGNS2
from server.kernels.timing import timed
from server.kernels.turbo.key_offset import KeyOffset

KERNEL_NAME = "turbo_store"
GROUP = 128
OFFSET_NONE, OFFSET_FIXED, OFFSET_PAIRS = 0, 1, 2
# Turned pairs per KV head the kernel takes: one per lane, each turned in a loop (two switches); the engine's
# partial offset has 8 (16 at d256). Turned on all 64 pairs measured slower than Triton (0.356 vs 0.181 ms,
# docs/BENCHMARKS.md) with the loop of 08:56 UTC, so more pairs stay on the Triton kernel.
MAX_PAIRS = 16


@dataclass(frozen=True)
class CudaStoreLaunch:
    """``warps`` per block; ``min_blocks`` per SM asked of the register allocator (__launch_bounds__), and as
    many blocks launched per SM (half for K, half for V), each warp looping over its items."""

    warps: int = 2
    min_blocks: int = 6
    # K and V of one kind through one copy of the code (V skips the offset at run time; with two, ptxas lays
    # their loops out interleaved): `default_launch` says where
    one_body: bool = False


CUDA_STORE_LAUNCH = CudaStoreLaunch()
# H200, turbo3 K+V, 32768 tokens x 8 heads, bf16, engine slots (docs/BENCHMARKS.md, 2026-11-30 about 21:37 UTC),
# ms: no offset 0.104 two bodies / 0.076 one body (6 or 4 blocks); fixed offset 0.104 / 0.087 (6) / 0.081 (4);
# partial offset 0.123 / 0.211 (6: 1.6 KB of spills) / 0.142 (4). So one body at 4 blocks where no pairs turn
# (turbo4: 0.137 -> 0.104 with no offset, 0.139 -> 0.109 fixed).
ONE_BODY_LAUNCH = CudaStoreLaunch(one_body=True, min_blocks=4)


def offset_build(key_offset: KeyOffset | None, key_offset_turns: bool) -> int:
    """The source's offset build for a call: OFFSET_NONE, OFFSET_FIXED or OFFSET_PAIRS."""
    return OFFSET_NONE if key_offset is None else (OFFSET_PAIRS if key_offset_turns else OFFSET_FIXED)


def default_launch(k_bits: int, v_bits: int, offset: int) -> CudaStoreLaunch:
    """The launch a store call gets: ONE_BODY_LAUNCH where K and V are one kind and no key pairs turn (``offset``
    OFFSET_NONE or OFFSET_FIXED), else CUDA_STORE_LAUNCH (measurements above)."""
    return ONE_BODY_LAUNCH if k_bits == v_bits and offset != OFFSET_PAIRS else CUDA_STORE_LAUNCH

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef long long i64;

#define D @D@
#define NG (D / 128)
#define HEADS @HEADS@
#define KB @KB@
#define VB @VB@
#define PS @PS@
#define OFFSET @OFFSET@
#define IN_BF16 @BF16@
#define WARPS @WARPS@
#define MIN_BLOCKS @MIN_BLOCKS@
#define STAGE_ROW 272  /* bytes per staged row: 256 + 16, so lanes' 16-byte reads of their rows miss no bank */
#define STAGE_BYTES (32 * STAGE_ROW)  /* one item: 32 rows */
/* K and V of one kind through one copy of the code (CudaStoreLaunch.one_body) */
#define ONE_BODY (@ONE_BODY@ && KB == VB)

/* specs/turboquant.md "Rotation": element e's sign is bit (e & 31) of word (e >> 5), set means -1 */
#define SIGN1(e) ((((e) >> 5) == 0 ? @S1_0@ : ((e) >> 5) == 1 ? @S1_1@ : ((e) >> 5) == 2 ? @S1_2@ : @S1_3@) >> ((e) & 31) & 1)
#define SIGN2(e) ((((e) >> 5) == 0 ? @S2_0@ : ((e) >> 5) == 1 ? @S2_1@ : ((e) >> 5) == 2 ? @S2_2@ : @S2_3@) >> ((e) & 31) & 1)
#define SQRT_G 11.313708498984761f  /* sqrt(128): the butterflies' outputs are sqrt(G) times y */
#define INV_SQRT_G 0.08838834764831845f
/* sincos.py's reduction of an angle to [-pi, pi] before the MUFU sin/cos */
#define TWO_PI_HI 6.2831854820251465f
#define TWO_PI_LO -1.7484556000744883e-07f
#define INV_TWO_PI 0.15915494309189535f
/* format.py: the bit of word e / 8 (4-bit values: nibble e % 8) or e / 16 (2-bit fields: bit
   4 (e % 8) + 2 ((e / 8) % 2)) where value e of a group starts */
#define AT(e) (BITS == 4 ? 4 * ((e) & 7) : 4 * ((e) & 7) + 2 * (((e) >> 3) & 1))

__device__ __forceinline__ float bits_f(u32 x) { return __uint_as_float(x); }
__device__ __forceinline__ u32 f_bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float lo_f(u32 x) {  /* the low 16-bit value of a pair -> float */
#if IN_BF16
  return bits_f(x << 16);
#else
  float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(x)); return f;
#endif
}
__device__ __forceinline__ float hi_f(u32 x) {
#if IN_BF16
  return bits_f(x & 0xFFFF0000u);
#else
  float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(x)); return f;
#endif
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a; asm("{.reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t;}" : "=r"(a) : "l"(p)); return a;
}
__device__ __forceinline__ void copy16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void copies_issued() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void copies_but_last_done() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void stg4(void* p, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ u16 to_half(float x) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x)); return h;
}
__device__ __forceinline__ u32 shfl_idx(u32 x, int lane) {
  u32 r; asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(x), "r"(lane)); return r;
}
__device__ __forceinline__ float shfl_idx_f(float x, int lane) { return bits_f(shfl_idx(f_bits(x), lane)); }
__device__ __forceinline__ float cos_approx(float x) { float r; asm("cos.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float sin_approx(float x) { float r; asm("sin.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }

/* x[d] -= v for a run-time d in [0, 128) (anything else: nothing); the registers need compile-time indices */
__device__ __forceinline__ void sub_at(float (&x)[128], int d, float v) {
  switch (d) {
@CASES@
    default: break;
  }
}

/* Stage item `item` (= (tile * HEADS + h) * NG + g: tokens 32 tile .. 32 tile + 31 of head h, group g) into
   this warp's buffer: 16 copies per lane, two rows of 16 chunks each per warp instruction. Tokens past the
   end (and items past the last) are not copied: their rows are never stored. No branch: a branch here lets
   the compiler hoist the item's arithmetic above the copies, which then hold their addresses through it. */
__device__ __forceinline__ void stage_item(u32 buf, const u16* __restrict__ src, int stride_t, int stride_h,
                                           int T, int item, int items, int lane) {
  const int g = item % NG, h = item / NG % HEADS, tok = item / NG / HEADS * 32 + (lane >> 4);
  const int end = item < items ? T : 0;
  const u16* p = src + (i64)tok * stride_t + (i64)h * stride_h + g * 128 + (lane & 15) * 8;
  const u32 dst = buf + (lane >> 4) * STAGE_ROW + (lane & 15) * 16;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if (tok + 2 * i < end) copy16(dst + 2 * i * STAGE_ROW, p);
    p += 2 * (i64)stride_t;
  }
  copies_issued();
}

template <int BITS, int OFF>
__device__ __forceinline__ void store_items(
    const u16* __restrict__ src, int stride_t, int stride_h, int T,
    const i64* __restrict__ slots, const i64* __restrict__ positions,
    unsigned char* __restrict__ codes, u16* __restrict__ norms,
    const float* __restrict__ mid, const float* __restrict__ cent,
    const float* __restrict__ cst, const float* __restrict__ mean, const float* __restrict__ sink,
    const float* __restrict__ inv_freq, const int* __restrict__ pairs, int P,
    unsigned char* stage, int warp, int warps, bool keys) {
  constexpr int HALF = 1 << (BITS - 1);
  constexpr int ROW_BYTES = D * BITS / 8;
  constexpr int WORDS = BITS == 4 ? 16 : 8;  /* j / negative-side words per group: 8 (4-bit) or 16 values each */
  const int lane = threadIdx.x & 31;
  float p[HALF], dq[HALF];  /* p[k]: positive midpoint k (k >= 1); dq[k]: c_k^2 - c_(k-1)^2 (c: positive centroids) */
  p[0] = 0.f;
  dq[0] = cent[HALF] * cent[HALF];
#pragma unroll
  for (int k = 1; k < HALF; ++k) {
    p[k] = mid[HALF - 1 + k];
    dq[k] = cent[HALF + k] * cent[HALF + k] - cent[HALF + k - 1] * cent[HALF + k - 1];
  }
  const int items = (T + 31) / 32 * HEADS * NG;
  const u32 buf = smem_addr(stage);
  stage_item(buf, src, stride_t, stride_h, T, warp, items, lane);
  for (int item = warp, parity = 0; item < items; item += warps, parity ^= 1) {
    /* two buffers: the next item's copies go out first, into the buffer the lanes finished reading one
       item ago (the __syncwarp after the reads), so nothing waits for them and they hold no registers */
    stage_item(buf + (parity ^ 1) * STAGE_BYTES, src, stride_t, stride_h, T, item + warps, items, lane);
    const int g = item % NG, h = item / NG % HEADS, tok = item / NG / HEADS * 32 + lane;
    int pair_f = 0;  /* lane i < P: pair i of the head (its dim, frequency, mean), loaded at once, not in turn */
    float pair_freq = 0.f, pair_m1 = 0.f, pair_m2 = 0.f;
    if (OFF == 2 && keys && lane < P) {
      pair_f = pairs[h * P + lane];
      pair_freq = inv_freq[pair_f];
      pair_m1 = mean[h * D + pair_f];
      pair_m2 = mean[h * D + pair_f + D / 2];
    }
    copies_but_last_done();
    __syncwarp();
    const uint4* own = (const uint4*)(stage + parity * STAGE_BYTES + lane * STAGE_ROW);
    float x[128];
#pragma unroll
    for (int c = 0; c < 16; ++c) {
      const uint4 w = own[c];
      x[8 * c + 0] = lo_f(w.x); x[8 * c + 1] = hi_f(w.x); x[8 * c + 2] = lo_f(w.y); x[8 * c + 3] = hi_f(w.y);
      x[8 * c + 4] = lo_f(w.z); x[8 * c + 5] = hi_f(w.z); x[8 * c + 6] = lo_f(w.w); x[8 * c + 7] = hi_f(w.w);
    }
    __syncwarp();  /* every lane holds its row: the buffer may take the item after next */
    const bool live = tok < T;
    const i64 slot = live ? slots[tok] : -1;
    if (OFF != 0 && keys) {  /* k - o(p): key_offset.py */
      const i64 pos = live ? positions[tok] : 1;
      const float* o = (OFF == 2 && pos == 0 ? sink : cst) + h * D + g * 128;
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        const float4 f = ((const float4*)o)[c];
        x[4 * c] -= f.x; x[4 * c + 1] -= f.y; x[4 * c + 2] -= f.z; x[4 * c + 3] -= f.w;
      }
      if (OFF == 2) {
        const float pf = (float)pos;
        for (int i = 0; i < P; ++i) {  /* the head's turned rotate-half pairs (f, f + D/2), from lane i */
          const int f = (int)shfl_idx((u32)pair_f, i);
          float angle = pf * shfl_idx_f(pair_freq, i);
          const float turns = floorf(angle * INV_TWO_PI + 0.5f);
          angle = fmaf(turns, -TWO_PI_LO, fmaf(turns, -TWO_PI_HI, angle));
          const float cs = cos_approx(angle), sn = sin_approx(angle);
          const float m1 = shfl_idx_f(pair_m1, i), m2 = shfl_idx_f(pair_m2, i);
          const bool turn = pos != 0;  /* position 0 holds the sink alone */
          sub_at(x, f - g * 128, turn ? m1 * cs - m2 * sn : 0.f);
          sub_at(x, f + D / 2 - g * 128, turn ? m2 * cs + m1 * sn : 0.f);
        }
      }
    }
    /* y = D2 H D1 x (times sqrt(G)): D1 as negations the first adds absorb, D2 in the last stage's adds */
#pragma unroll
    for (int e = 0; e < 128; ++e)
      if (SIGN1(e)) x[e] = -x[e];
#pragma unroll
    for (int stage = 0; stage < 7; ++stage) {  /* butterflies h = 1, 2, ..., 64 in the reference's order */
      const int s = 1 << stage;
#pragma unroll
      for (int e = 0; e < 128; ++e) {
        if (!(e & s)) {
          const float a = x[e], b = x[e + s];
          if (s < 64) {
            x[e] = a + b;
            x[e + s] = a - b;
          } else {  /* -(a + b) = -a - b exactly: round to nearest is symmetric */
            x[e] = SIGN2(e) ? -a - b : a + b;
            x[e + s] = SIGN2(e + s) ? b - a : a - b;
          }
        }
      }
    }
    u32 jw[WORDS], nw[WORDS];  /* per value: j (magnitude's index) and whether y < 0, at format.py's positions */
#pragma unroll
    for (int w = 0; w < WORDS; ++w) jw[w] = nw[w] = 0;
    /* First the side of zero and |y| by its bits, in place, one ulp smaller below zero: there a tie goes to
       the upper index (toward zero), quantize._tie_magnitude; -0.0 counts as above zero, as y >= 0 does in
       the reference. n sqrt(G) = ||H D1 x|| is summed from these magnitudes (they differ from |y| by at most
       an ulp): a sum over the inputs would keep all 128 alive beside the outputs; four partial sums keep the
       dependency chain short. */
    float n4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 128; ++e) {
      const bool neg = x[e] < 0.f;
      u32 bits = f_bits(x[e]);
      if (neg) {
        bits += 0x7FFFFFFFu;
        nw[BITS == 4 ? e >> 3 : e >> 4] |= 1u << AT(e);
      }
      x[e] = bits_f(bits);
      n4[e & 3] = fmaf(x[e], x[e], n4[e & 3]);
    }
    const float n = sqrtf((n4[0] + n4[1]) + (n4[2] + n4[3]));
    float t[HALF];  /* midpoints times n sqrt(G): the unnormalized, unscaled group is compared with them */
#pragma unroll
    for (int k = 1; k < HALF; ++k) t[k] = p[k] * n;
#pragma unroll
    for (int e = 0; e < 128; ++e) {
      const float a = x[e];
      const int w = BITS == 4 ? e >> 3 : e >> 4, at = AT(e);
      if (BITS == 2) {
        if (a >= t[1]) jw[w] |= 1u << at;
      } else if (BITS == 3) {  /* a binary search: j = 2 j1 + j0 midpoints at or below a */
        const bool j1 = a >= t[2];
        if (j1) jw[w] |= 2u << at;
        if (a >= (j1 ? t[3] : t[1])) jw[w] |= 1u << at;
      } else {
        const bool j2 = a >= t[4];
        const bool j1 = a >= (j2 ? t[6] : t[2]);
        if (j2) jw[w] |= 4u << at;
        if (j1) jw[w] |= 2u << at;
        if (a >= (j2 ? (j1 ? t[7] : t[5]) : (j1 ? t[3] : t[1]))) jw[w] |= 1u << at;
      }
    }
    /* ||c||^2 = sum_k (how many j >= k) (c_k^2 - c_(k-1)^2), the counts by popcount */
    int cnt[HALF];
#pragma unroll
    for (int k = 0; k < HALF; ++k) cnt[k] = 0;
#pragma unroll
    for (int w = 0; w < WORDS; ++w) {
      if (BITS == 2) {
        cnt[1] += __popc(jw[w]);
      } else if (BITS == 3) {
        const u32 b0 = jw[w] & 0x55555555u, b1 = (jw[w] >> 1) & 0x55555555u;
        cnt[1] += __popc(b0 | b1); cnt[2] += __popc(b1); cnt[3] += __popc(b0 & b1);
      } else {
        const u32 b0 = jw[w] & 0x11111111u, b1 = (jw[w] >> 1) & 0x11111111u, b2 = (jw[w] >> 2) & 0x11111111u;
        cnt[1] += __popc(b0 | b1 | b2); cnt[2] += __popc(b1 | b2); cnt[3] += __popc(b2 | (b1 & b0));
        cnt[4] += __popc(b2); cnt[5] += __popc(b2 & (b1 | b0)); cnt[6] += __popc(b2 & b1);
        cnt[7] += __popc(b2 & b1 & b0);
      }
    }
    float c2 = 128.f * dq[0];
#pragma unroll
    for (int k = 1; k < HALF; ++k) c2 = fmaf((float)cnt[k], dq[k], c2);
    const float cn = sqrtf(c2);
    const bool zero = !(n > 0.f);  /* a zero group stores index 0 everywhere and norm 0 */
    const float stored = zero ? 0.f : (cn > 1e-10f ? n / (cn * SQRT_G) : n * INV_SQRT_G);
    /* codes: idx = HALF + j above zero, HALF - 1 - j below: the low bits are j, flipped below zero */
    u32 out[WORDS + (BITS == 3 ? 4 : 0)];
#pragma unroll
    for (int w = 0; w < WORDS; ++w) {
      if constexpr (BITS == 2) out[w] = (jw[w] ^ nw[w]) | ((nw[w] ^ 0x55555555u) << 1);
      else if constexpr (BITS == 3) out[w] = jw[w] ^ (nw[w] * 3u);
      else out[w] = (jw[w] ^ (nw[w] * 7u)) | ((nw[w] ^ 0x11111111u) << 3);
    }
    if constexpr (BITS == 3) {  /* third bit plane: bit 4k + q of word c is bit 2 of value 32c + 8q + k */
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const u32 a = nw[2 * c], b = nw[2 * c + 1];
        out[WORDS + c] = ~((a & 0x11111111u) | ((a >> 1) & 0x22222222u) | ((b << 2) & 0x44444444u) |
                           ((b << 1) & 0x88888888u));
      }
    }
    if (zero) {
#pragma unroll
      for (int w = 0; w < WORDS + (BITS == 3 ? 4 : 0); ++w) out[w] = 0;
    }
    if (slot >= 0) {  /* a negative slot marks a padding token */
      const i64 row = (slot / PS * HEADS + h) * PS + slot % PS;
      unsigned char* r = codes + row * ROW_BYTES;
      if constexpr (BITS == 4) {
#pragma unroll
        for (int q = 0; q < 4; ++q) stg4(r + g * 64 + 16 * q, out[4 * q], out[4 * q + 1], out[4 * q + 2], out[4 * q + 3]);
      } else {
        stg4(r + g * 32, out[0], out[1], out[2], out[3]);
        stg4(r + g * 32 + 16, out[4], out[5], out[6], out[7]);
        if constexpr (BITS == 3) stg4(r + D / 4 + g * 16, out[8], out[9], out[10], out[11]);
      }
      norms[row * NG + g] = to_half(stored);
    }
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) turbo_store(
    const u16* __restrict__ k, int k_stride_t, int k_stride_h, const u16* __restrict__ v, int v_stride_t,
    int v_stride_h, int T, const i64* __restrict__ slots, const i64* __restrict__ positions,
    unsigned char* __restrict__ k_codes, u16* __restrict__ k_norms, const float* __restrict__ k_mid,
    const float* __restrict__ k_cent, unsigned char* __restrict__ v_codes, u16* __restrict__ v_norms,
    const float* __restrict__ v_mid, const float* __restrict__ v_cent, const float* __restrict__ cst,
    const float* __restrict__ mean, const float* __restrict__ sink, const float* __restrict__ inv_freq,
    const int* __restrict__ pairs, int P) {
  __shared__ __align__(16) unsigned char stage[WARPS][2 * STAGE_BYTES];
  const int warp = threadIdx.x >> 5;
  const int first = blockIdx.x * WARPS + warp, warps = gridDim.x * WARPS;
  const bool keys = blockIdx.y == 0;
#if ONE_BODY
  store_items<KB, OFFSET>(keys ? k : v, keys ? k_stride_t : v_stride_t, keys ? k_stride_h : v_stride_h, T, slots,
                          positions, keys ? k_codes : v_codes, keys ? k_norms : v_norms, keys ? k_mid : v_mid,
                          keys ? k_cent : v_cent, cst, mean, sink, inv_freq, pairs, P, stage[warp], first, warps,
                          keys);
#else
  if (keys)
    store_items<KB, OFFSET>(k, k_stride_t, k_stride_h, T, slots, positions, k_codes, k_norms, k_mid, k_cent,
                            cst, mean, sink, inv_freq, pairs, P, stage[warp], first, warps, true);
  else
    store_items<VB, 0>(v, v_stride_t, v_stride_h, T, slots, positions, v_codes, v_norms, v_mid, v_cent,
                       cst, mean, sink, inv_freq, pairs, P, stage[warp], first, warps, false);
#endif
}
"""


def _signs(name: str, words) -> dict[str, str]:
    return {f"{name}_{i}": f"0x{int(w) & 0xFFFFFFFF:08X}u" for i, w in enumerate(words)}


@functools.cache  # built once per specialization: every store call asks for it (host time per layer and step)
def source(k_bits: int = 3, v_bits: int = 3, head_dim: int = 128, heads: int = 8, page_size: int = 16,
           offset: int = OFFSET_PAIRS, bf16: bool = True, launch: CudaStoreLaunch = CUDA_STORE_LAUNCH) -> str:
    """The CUDA C of one specialization (``offset``: OFFSET_NONE, OFFSET_FIXED or OFFSET_PAIRS)."""
    values = dict(D=head_dim, HEADS=heads, KB=k_bits, VB=v_bits, PS=page_size, OFFSET=offset, BF16=int(bf16),
                  WARPS=launch.warps, MIN_BLOCKS=launch.min_blocks, ONE_BODY=int(launch.one_body), **_signs("S1", SIGNS1), **_signs("S2", SIGNS2),
                  CASES="\n".join(f"    case {d}: x[{d}] -= v; break;" for d in range(GROUP)))
    text = _SOURCE
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    return text


SOURCE = source()  # the engine default's build (turbo3, D = 128, 8 KV heads, page 16, partial key offset, bf16): bench/cuda_sass.py


def supports(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
             key_offset: KeyOffset | None = None, key_offset_turns: bool = True) -> bool:
    """Whether the CUDA kernel takes this call: fp16/bf16 K and V of one dtype, head_dim a multiple of 128,
    rows 16-byte aligned (strides multiples of 8 elements), int64 slots and positions, at most MAX_PAIRS
    turned pairs per KV head, and nvrtc.cuda_kernels_enabled. Anything else stays on the Triton kernel."""
    if key_offset is not None and key_offset_turns and key_offset.pairs.shape[1] > MAX_PAIRS:
        return False
    rows_aligned = all(t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0
                       for t in (k, v))
    return (k.dtype in (torch.float16, torch.bfloat16) and v.dtype == k.dtype and k.shape[-1] % GROUP == 0
            and rows_aligned and slot_mapping.dtype == torch.int64 and positions.dtype == torch.int64
            and slot_mapping.is_contiguous() and positions.is_contiguous() and nvrtc.cuda_kernels_enabled(k.device))


def fills_a_wave(num_tokens: int, heads: int, head_dim: int, device: torch.device,
                 launch: CudaStoreLaunch = CUDA_STORE_LAUNCH) -> bool:
    """Whether a call gives every resident warp an item (32 tokens of one head's group, K and V side), which is
    where this kernel beats the Triton one (quantize.store_turbo asks before dispatching here).

    An item costs its warp about the same time however few of its 32 tokens are real, since each lane runs a
    whole group serially (32K tokens x 8 heads: 16,384 items, about ten waves of 132 SMs x 12 warps, in
    0.13 ms). Below one wave the Triton kernel, which spreads a row over threads, wins: a decode step's one
    token per sequence. H200 (2026-11-30 09:19 UTC, `bench/e2e.py` depth-2048 shape, turbo3, b1 @ 16K, 24
    layers): this kernel at every store 456 tok/s, the Triton store at decode steps 589 tok/s.
    """
    if device.type != "cuda":
        return False
    items = -(-num_tokens // 32) * heads * max(1, head_dim // GROUP)
    return items >= multiprocessors(device) * launch.min_blocks * launch.warps // 2


def store_turbo_cuda(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                     k_pages, v_pages, key_offset: KeyOffset | None = None, key_offset_turns: bool = True,
                     launch: CudaStoreLaunch | None = None) -> bool:
    """quantize.store_turbo_triton's contract (``k_pages`` / ``v_pages``: quantize.TurboPages) on the CUDA C
    kernel; False where it cannot run (the caller takes the Triton kernel): ``supports`` says no, or NVRTC is
    missing or refuses the source. ``launch``: None is `default_launch`'s."""
    if not supports(k, v, slot_mapping, positions, key_offset, key_offset_turns):
        return False
    num_tokens, heads, head_dim = k.shape
    offset = offset_build(key_offset, key_offset_turns)
    launch = launch or default_launch(k_pages.bits, v_pages.bits, offset)
    page_size = k_pages.codes.shape[2]
    kernel = nvrtc.cuda_kernel(source(k_pages.bits, v_pages.bits, head_dim, heads, page_size, offset,
                                      k.dtype == torch.bfloat16, launch), KERNEL_NAME, k.device)
    if kernel is None:
        return False
    if num_tokens == 0:
        return True
    launch_store(kernel, k, v, slot_mapping, positions, k_pages, v_pages, key_offset, launch)
    return True


def launch_store(kernel, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                 k_pages, v_pages, key_offset: KeyOffset | None, launch: CudaStoreLaunch = CUDA_STORE_LAUNCH,
                 sides: int = 2) -> None:
    """One launch of a compiled store kernel (``sides`` 1: K only, for bench/turbo_store_probe.py)."""
    num_tokens, heads, head_dim = k.shape
    items = -(-num_tokens // 32) * heads * (head_dim // GROUP)
    blocks = max(1, min(-(-items // launch.warps), multiprocessors(k.device) * launch.min_blocks // 2))
    unused = k_pages.centroids  # any float32 pointer for the offset arguments: never read without OFFSET
    terms = ((unused,) * 4 + (slot_mapping, 0) if key_offset is None else
             (key_offset.const, key_offset.mean, key_offset.sink, key_offset.inv_freq, key_offset.pairs,
              key_offset.pairs.shape[1]))
    with timed("turbo_store", k.device):
        kernel(grid=(blocks, sides, 1), block=(32 * launch.warps, 1, 1), args=[
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), num_tokens, slot_mapping, positions,
            k_pages.codes, k_pages.norms, k_pages.midpoints, k_pages.centroids,
            v_pages.codes, v_pages.norms, v_pages.midpoints, v_pages.centroids, *terms])
