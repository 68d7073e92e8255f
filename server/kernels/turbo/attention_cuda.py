"""Turbo decode attention in CUDA C: the codes decoded straight into `mma.sync` operand registers.

Same contract as attention.decode_attention_triton (one query per sequence, flash-decoding splits, the
partials' log-sum-exp merge and inverse rotation), different machinery. Triton decides where a decoded value
lives: its decoded K/V tiles go through shared memory to the mma, with 7-8 barriers per 64-token step, and
that plateaued at ~30 % issue utilization (docs/BENCHMARKS.md). Here (server/kernels/nvrtc.py: compiled at
run time by NVRTC, no headers, PTX for everything beyond plain C):
  * one CTA of 8 warps (4 at D = 256) per (sequence, KV head, split); EACH WARP streams its own 16-token
    tiles (tile i of the split goes to warp i % 8) with its own online softmax, no barrier in the main loop;
    the warps merge
    once at the end through shared memory into attention.py's partials (part_acc in the rotated domain,
    part_m in log2 units, part_l), and the last CTA of a (sequence, KV head) to finish (an atomic count per
    row, reset by that CTA) merges the splits and rotates back: one launch, no merge kernel;
  * scores: S^T [16 tokens x 8 heads] = K [16 x D] . Q^T [D x 8] by m16n8k16 f16 mmas; lane (g, t)
    (g = lane / 4, t = lane % 4) decodes tokens g and g + 8, the t-th quarter of each group's values,
    straight into the A fragments (the contraction runs in a column order of our choosing; Q^T, the B
    operand held in registers for the whole loop, follows it);
  * values: O^T [D x 8] += V^T [D x 16] . P^T [16 x 8]; lane (g, t) decodes tokens 2t, 2t+1, 2t+8, 2t+9,
    the g-th eighth of each group's values, and pairs the two tokens of a dim with one PRMT (the A fragment
    holds token pairs); P^T comes from S^T's accumulator by movmatrix.trans;
  * codes by the byte-permute lookup of codes.py (fp16 centroids as byte tables, ~1 PRMT a value), norms
    after the mma (K: the token's scores; V: P's column), one group's norm per accumulator;
  * the key offset (key_offset.py): score += <q, RoPE(p) mean> over the KV head's P turning pairs as one
    more mma per 8 pairs: A = cos/sin(p theta_f) of the lane's tokens (angles as the model rounds them, MUFU
    after a Cody-Waite reduction), B = the pairs' (A, B) terms of attention.py's _offset_terms; both split
    into fp16 high + low parts (3 mmas) so the fp16 operands cost no accuracy; position 0 gets
    <q, sink - const - mean> more;
  * ``int8_keys`` (a build of ``source``; INT8_KEYS the default): scores by m16n8k32 int8 mmas. K codes
    decode to int8 centroids (int8_centroids: the codebook as int8 times a least-squares unit)
    by ONE PRMT per 4 values (lookup_s8; fp16 takes 2 lookups + 2 interleaves), straight into the A fragments
    (lane t's 4 bytes are 4 consecutive values of its chunk); Q^T is rounded to int8 once per warp, per head
    and group (step max |q'| / 127), as B; score = exact int32 sum * step * centroid unit * K norm. sm_90, turbo3,
    D = 128, per 16-token step: 362 instructions instead of 417 (PRMT 112 instead of 160), 442 instead of 494
    with the partial8 offset. Accuracy: rounding q (|error| <= step / 2) and the centroids adds a logit error
    whose rms the uniform-rounding model predicts within 20 % (CPU test), 1/53 (turbo2), 1/28 (turbo3), 1/13
    (turbo4) of the logit error turbo's quantization itself makes vs the unquantized keys; on the tests' keys
    (N(0.5, 4) per dim, logits of std ~2) outputs move by up to 2.2e-2 of their scale from the exact-centroid
    oracle (D = 64, turbo4 K, partial8 offset; the fp16 build: ~3e-3), so the GPU tests check this build against
    its own definition. The query's rounding is most of it: a hi + lo / 254 split (two int8 mmas) made it
    negligible but cost 15 % at b8/64K with the partial8 offset (0.2554 ms against 0.2219; H200 10:53 UTC),
    where the build already sits at 128 registers. Values stay fp16 (int8 V would need a per-tile P scale and
    32 int-to-float conversions a step);
  * loads: each warp prefetches its next tile's code words and norms into registers (and the one after's
    block-table entry) while a tile computes; the first tile's while the query is rotated.
  * ``recent`` (a build of ``source``; recent.py): positions seq_len - W on come from the ring. The main loop
    stops its pages at that edge; after it, each warp runs its tiles that reach the edge once more with A
    fragments loaded straight from the ring rows (16-byte loads of 8 values, bf16 converted to fp16, norm 1),
    the tokens below the edge masked, so a straddling tile counts once in each pass. Those tiles run after the
    loop, not in it, because the ring's registers beside the prefetched Step spilled the Step in the main loop
    (sm_90, turbo3, D = 128, partial8: 152 bytes); after it, 128 registers and no spills, a main loop of 984
    instructions per two steps against 976, and the no-window source's PTX unchanged.
The kernel is bound by its integer pipe (PRMT, LOP3, shifts: ~270 of ~420 instructions a 16-token step at
turbo3, D = 128), not by memory: ncu at b8/64K has the ALU pipe 74 % busy against DRAM 39 % (H200, 2026-11-30;
`bench/turbo_decode_sweep.py --ncu-cuda`). Decoding V straight into token pairs (the two tokens' selectors
interleaved by nibble instead of 16 PRMT a chunk to pair them) took 4 % of those instructions away but measured
1-2 % slower on the engine's build (window and partial offset) and was dropped. A variant that copied whole
tiles with cp.async into a shared-memory ring (3 tiles in flight a warp, no registers held) measured 8-10 %
slower at b8/64K and b8/16K (its address work added ~60 instructions a step; H200, 2026-11-30) and was dropped.
`supports` says which calls it takes (anything else stays on Triton); `source` generates the CUDA C per
specialization (bit widths, head dim, page size, pair tiles, query dtype, launch settings).
"""

from __future__ import annotations

import functools
import os

import torch

from server.kernels import nvrtc
from server.kernels.backend import multiprocessors
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.timing import timed
from server.kernels.turbo import attention
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.codes import lookup_table
from server.kernels.turbo.format import group_size
from server.kernels.turbo.key_offset import KeyOffset
from server.kernels.turbo.quantize import TurboPages
from server.kernels.turbo.recent import RecentWindow

KERNEL_NAME = "turbo_decode"
# Warps per CTA: 8 beat 4 (one Q rotation and merge per 8 warps; b8/64K 0.226 vs 0.239 ms, b8/16K 0.073 vs
# 0.078 ms, H200, bench/turbo_decode_sweep.py), except where their outputs do not fit (default_warps).
WARPS = 8
TILE = 16  # tokens per warp step: the mma's M (scores) and K (values) side
RESIDENT_WARPS = 16  # warps per SM at 128 registers: the split rule fills one wave of them (choose_splits)
LONG_SPLIT_TOKENS = 2048  # one CTA per SM gives splits longer than this: fill the wave instead (choose_splits)
MAX_GQA = 8  # the mma's N side holds the query heads of one KV head
STATIC_SHARED = 48 * 1024  # static shared memory a CTA may declare (more needs an opt-in the launcher lacks)
# Scores by int8 mmas (module docstring) unless a call says otherwise: opt-in, TURBOSERVE_TURBO_INT8_KEYS=1. H200
# (2026-11-30 10:56 UTC, turbo3, 32q/8kv, d128): b8/64K 0.2027 ms (partial8 0.2228) against the fp16 build's
# 0.2363 (0.2663); b8/16K 0.0686 (0.0751) against 0.0727 (0.0837), one call. Off by default: its rounding adds
# error by construction while the quality targets are unmet. The embedded model's perplexity through the decode
# kernel moved +0.28 % (turbo3) / +0.51 % (turbo4) with it, within the +0.63 % that switching these calls from
# CUDA C to the Triton decode moved it (docs/BENCHMARKS.md, Quality).
INT8_KEYS = os.environ.get("TURBOSERVE_TURBO_INT8_KEYS") == "1"

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

#define D @D@
#define G @G@
#define NG (D / G)
#define KB @KB@
#define VB @VB@
#define PS @PS@
#define NPT @NPT@
#define Q_BF16 @QBF16@
#define WARPS @WARPS@
#define MIN_BLOCKS @MIN_BLOCKS@
#define INT8_KEYS @INT8K@
#define RECENT @RECENT@  /* a recent window (recent.py): the last ring_size positions from its ring */
#define K8_TABLE {@K8TABLE@}  /* int8 centroids as PRMT byte tables (int8_table_words) */
#define K8_UNIT @K8UNIT@      /* what one int8 centroid step is worth (int8_centroids) */
#define KROW (D * KB / 8)
#define VROW (D * VB / 8)
#define KCH (G / 32)   /* 8-value chunks a lane decodes per K token and group */
#define VCH (G / 64)   /* ... per V token and group */
#define KLO (KB == 4 ? KCH : KCH / 2)   /* index words (turbo3: low plane) a lane reads per K token and group */
#define VLO (VB == 4 ? VCH : 1)
#define KW (KLO + (KB == 3))
#define VW (VLO + (VB == 3))

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
  u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s)); return r;
}
__device__ __forceinline__ u32 rotl(u32 x, u32 n) {
  u32 r; asm("shf.l.wrap.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(x), "r"(n)); return r;
}
__device__ __forceinline__ float ex2(float x) {
  float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r;
}
__device__ __forceinline__ float lo_f(u32 x) {  /* fp16 in the low half -> float */
  float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(x)); return f;
}
__device__ __forceinline__ float hi_f(u32 x) {
  float f; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(x)); return f;
}
__device__ __forceinline__ u32 pack(float lo, float hi) {  /* two floats -> fp16x2, lo in the low half */
  u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
__device__ __forceinline__ float bits_f(u32 x) { float f; asm("mov.b32 %0, %1;" : "=f"(f) : "r"(x)); return f; }
__device__ __forceinline__ u32 f_bits(float x) { u32 r; asm("mov.b32 %0, %1;" : "=r"(r) : "f"(x)); return r; }
__device__ __forceinline__ float shfl_xor(float x, int m) {
  float r; asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(x), "r"(m)); return r;
}
__device__ __forceinline__ u32 shfl_idx(u32 x, int lane) {
  u32 r; asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(x), "r"(lane)); return r;
}
__device__ __forceinline__ bool any_sync(bool p) {
  u32 r;
  asm volatile("{.reg .pred p, q; setp.ne.u32 p, %1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 %0, 1, 0, q;}"
               : "=r"(r) : "r"((u32)p));
  return r != 0;
}
__device__ __forceinline__ u32 trans8x8(u32 x) {
  u32 r; asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x)); return r;
}
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 ldg(const u32* p) {
  u32 r; asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}
__device__ __forceinline__ void ldg2(const u32* p, u32& a, u32& b) {
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
}
__device__ __forceinline__ void ldg4(const u32* p, u32& a, u32& b, u32& c, u32& d) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}
__device__ __forceinline__ u32 ldg_u16(const u16* p) {
  u16 r; asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p)); return r;
}
__device__ __forceinline__ float q_to_f(u16 x) {
#if Q_BF16
  return bits_f(((u32)x) << 16);
#else
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
#endif
}

/* n consecutive index words (n = 1, 2, 4; p aligned to n words: format.py's rows are) */
template <int N> __device__ __forceinline__ void load_words(const u32* p, u32* w) {
  if (N == 4) ldg4(p, w[0], w[1], w[2], w[3]);
  else if (N == 2) ldg2(p, w[0], w[1]);
  else w[0] = ldg(p);
}

/* The nibble selector of 8-value chunk c (values 8c .. 8c+7 of a row, format.py): turbo4 the stored word;
   turbo2 one half of a 16-value word; turbo3 that plus bit 2 from the high plane's word (bit 4k + j of it
   is bit 2 of value 8j + k of its 32, j = c % 4), moved to bit 4k + 2 by a rotation. */
template <int BITS> __device__ __forceinline__ u32 selector(u32 low, u32 c, u32 high) {
  if (BITS == 4) return low;
  u32 s = (low >> (2 * (c & 1))) & 0x33333333u;
  if (BITS == 3) s |= rotl(high, (2 - (c & 3)) & 31) & 0x44444444u;
  return s;
}

/* fp16 centroids of the 8 values of a selector as 4 fp16 pairs (values 0-1, 2-3, 4-5, 6-7): codes.py's
   _LOOKUP8_PTX / _LOOKUP16_PTX sequences */
template <int BITS> __device__ __forceinline__ void lookup(u32 s, const u32 (&t)[8], u32 (&o)[4]) {
  if (BITS == 4) {
    u32 w4 = s << 4, s7 = s & 0x77777777u;
    u32 m = prmt(w4, s, 0xD9C8);
    u32 l = (prmt(t[0], t[1], s7) & ~m) | (prmt(t[4], t[5], s7) & m);
    u32 h = (prmt(t[2], t[3], s7) & ~m) | (prmt(t[6], t[7], s7) & m);
    o[0] = prmt(l, h, 0x5140); o[1] = prmt(l, h, 0x7362);
    m = prmt(w4, s, 0xFBEA); s7 >>= 16;
    l = (prmt(t[0], t[1], s7) & ~m) | (prmt(t[4], t[5], s7) & m);
    h = (prmt(t[2], t[3], s7) & ~m) | (prmt(t[6], t[7], s7) & m);
    o[2] = prmt(l, h, 0x5140); o[3] = prmt(l, h, 0x7362);
  } else {
    u32 l = prmt(t[0], t[1], s), h = prmt(t[2], t[3], s);
    o[0] = prmt(l, h, 0x5140); o[1] = prmt(l, h, 0x7362);
    s >>= 16;
    l = prmt(t[0], t[1], s); h = prmt(t[2], t[3], s);
    o[2] = prmt(l, h, 0x5140); o[3] = prmt(l, h, 0x7362);
  }
}

/* int8 centroids of the 8 values of a selector, byte k = value k: lo values 0-3, hi values 4-7; one PRMT per
   4 values (the 8 int8 centroids fill PRMT's two table registers). turbo4: centroids 0-7 in t[0..1], 8-15 in
   t[2..3], picked per byte by index bit 3 as in lookup<4> (the same byte masks: byte k of the result is value k). */
template <int BITS> __device__ __forceinline__ void lookup_s8(u32 s, const u32 (&t)[4], u32& lo, u32& hi) {
  if (BITS == 4) {
    const u32 w4 = s << 4, s7 = s & 0x77777777u, s7h = s7 >> 16;
    const u32 m0 = prmt(w4, s, 0xD9C8), m1 = prmt(w4, s, 0xFBEA);
    lo = (prmt(t[0], t[1], s7) & ~m0) | (prmt(t[2], t[3], s7) & m0);
    hi = (prmt(t[0], t[1], s7h) & ~m1) | (prmt(t[2], t[3], s7h) & m1);
  } else {
    lo = prmt(t[0], t[1], s);
    hi = prmt(t[0], t[1], s >> 16);
  }
}
__device__ __forceinline__ void imma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float i2f(int x) { float f; asm("cvt.rn.f32.s32 %0, %1;" : "=f"(f) : "r"(x)); return f; }
__device__ __forceinline__ u32 s8x4(float x0, float x1, float x2, float x3) {  /* nearest; |x| <= 127 */
  int i0, i1, i2, i3;
  asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i0) : "f"(x0)); asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i1) : "f"(x1));
  asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i2) : "f"(x2)); asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i3) : "f"(x3));
  return ((u32)i0 & 0xFFu) | (((u32)i1 & 0xFFu) << 8) | (((u32)i2 & 0xFFu) << 16) | ((u32)i3 << 24);
}

/* What one warp step reads: the index words of its lane's K tokens (g, g+8) and V tokens (2t, 2t+1, 2t+8,
   2t+9), the K and V norms of tokens g and g+8 (fp16, NG of them in a word) */
struct Step {
  u32 k[2][NG][KW];
  u32 v[4][NG][VW];
  u32 kn[2], vn[2];
};

#if RECENT
#if INT8_KEYS
#error "the recent window's rows need fp16 query fragments: no int8-keys build of it"
#endif

/* 8 consecutive values of a ring row (16 bytes, in the query's dtype) as 4 fp16 pairs, the mma's operand type:
   a bf16 ring converts (exact within fp16's range, |x| < 65504); zeros where the token is not read (a masked
   token's A fragment must be finite: its P column is 0, and 0 times NaN is not) */
__device__ __forceinline__ void ring_words(const bool read, const u16* p, u32 (&o)[4]) {
  o[0] = o[1] = o[2] = o[3] = 0u;
  if (read) ldg4((const u32*)p, o[0], o[1], o[2], o[3]);
#if Q_BF16
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = pack(bits_f(o[i] << 16), bits_f(o[i] & 0xFFFF0000u));
#endif
}
#endif

/* The index words of one row from 8-value chunk cb on: LO words of the stored indices (turbo3: of its low plane)
   and, for turbo3, the high plane's word after them (format.py) */
template <int BITS, int LO> __device__ __forceinline__ void load_row(const u32* row, int cb, u32* w) {
  load_words<LO>(row + (BITS == 4 ? cb : cb / 2), w);
  if (BITS == 3) w[LO] = ldg(row + D / 16 + cb / 4);
}

__device__ __forceinline__ void load_step(Step& st, const unsigned char* const (&kp)[2],
                                          const unsigned char* const (&vp)[4], const u16* const (&knp)[2],
                                          const u16* const (&vnp)[2], int g, int t) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) load_row<KB, KLO>((const u32*)kp[i], gi * (G / 8) + t * KCH, st.k[i][gi]);
    if (NG == 1) { st.kn[i] = ldg_u16(knp[i]); st.vn[i] = ldg_u16(vnp[i]); }
    else { st.kn[i] = ldg((const u32*)knp[i]); st.vn[i] = ldg((const u32*)vnp[i]); }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) load_row<VB, VLO>((const u32*)vp[i], gi * (G / 8) + g * VCH, st.v[i][gi]);
}

/* cos, sin of a float32 angle: Cody-Waite reduction to [-pi, pi] then MUFU (sincos.py's numbers) */
__device__ __forceinline__ void sincos_approx(float a, float& c, float& s) {
  float turns;
  asm("cvt.rmi.f32.f32 %0, %1;" : "=f"(turns) : "f"(a * 0.15915494309189535f + 0.5f));
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(turns), "f"(-6.2831854820251465f), "f"(a));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(turns), "f"(1.7484556000744883e-07f), "f"(r));
  asm("cos.approx.f32 %0, %1;" : "=f"(c) : "f"(r));
  asm("sin.approx.f32 %0, %1;" : "=f"(s) : "f"(r));
}
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
/* x as fp16 high + low parts (x - high), both fp16x2 with the pair's two values */
__device__ __forceinline__ void split2(float x0, float x1, u32& hi, u32& lo) {
  hi = pack(x0, x1);
  lo = pack(x0 - lo_f(hi), x1 - hi_f(hi));
}

/* x, read here by an op the compiler cannot drop (tid's bit 31 is 0), so that a value loaded before the main
   loop is waited for before it. Every global load of the kernel shares one dependency barrier: ptxas put the
   wait for the key offset's frequencies at their first use in the loop, where it also waited for the tile the
   loop had just started to prefetch (sm_90 SASS: partial8 b8/64K 0.271 -> 0.254 ms with this, H200). The
   window's build had no such wait and measured 0.5 % slower with it, so it keeps the plain load. */
__device__ __forceinline__ float settled(float x, int tid) {
#if RECENT
  return x;
#else
  return bits_f(f_bits(x) | ((u32)tid >> 31));
#endif
}
__device__ __forceinline__ float ldcg(const float* p) {  /* another CTA's partial result: from L2, not L1 */
  float r; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p)); return r;
}
__device__ __forceinline__ int ctaid_x() { int r; asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ int tid_x() { int r; asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r)); return r; }
__device__ __forceinline__ int ctaid_y() { int r; asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r)); return r; }
__device__ __forceinline__ int ld_volatile(const int* p) {
  int r; asm volatile("ld.global.u32 %0, [%1];" : "=r"(r) : "l"(p)); return r;
}
__device__ __forceinline__ u16 to_q_type(float x) {
  u16 r;
#if Q_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
  return r;
}

/* The spec's rotation of the 8 rows x (8 x D floats, in shared memory), group by group (spec "Rotation"):
   forward (first = SIGNS1, second = SIGNS2) D2 H D1 x / sqrt(G), inverse with the tables swapped; times scale. */
__device__ __forceinline__ void rotate_rows(float (*x)[D], const int* first, const int* second, float scale, int tid) {
  for (int i = tid; i < 8 * D; i += WARPS * 32) {
    const int e = i % G;
    x[i / D][i % D] = bits_f(f_bits(x[i / D][i % D]) ^ ((((u32)first[e >> 5] >> (e & 31)) & 1u) << 31));
  }
  __syncthreads();
#pragma unroll 1
  for (int h = 1; h < G; h <<= 1) {  /* H: butterflies (a + b, a - b) on pairs (j, j + h) */
    for (int i = tid; i < 8 * D / 2; i += WARPS * 32) {
      const int row = i / (D / 2), p = i % (D / 2);
      const int j = (p / h) * 2 * h + p % h;
      const float a = x[row][j], b = x[row][j + h];
      x[row][j] = a + b;
      x[row][j + h] = a - b;
    }
    __syncthreads();
  }
  for (int i = tid; i < 8 * D; i += WARPS * 32) {
    const int e = i % G;
    x[i / D][i % D] = bits_f(f_bits(x[i / D][i % D] * scale) ^ ((((u32)second[e >> 5] >> (e & 31)) & 1u) << 31));
  }
  __syncthreads();
}

/* Tokens per split of a sequence: whole rounds of the warps' 16-token tiles, cut from the sequence's own length,
   not the launch's planned one (a CUDA graph plans for the longest context; short sequences would leave most
   splits idle). The merge recomputes it to know how many splits wrote. */
__device__ __forceinline__ int split_tokens(int seq_len, int num_splits) {
  const int per_split = (seq_len + num_splits - 1) / num_splits;
  return max(1, (per_split + 16 * WARPS - 1) / (16 * WARPS)) * 16 * WARPS;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
turbo_decode(const u16* __restrict__ q, int q_stride_t, int q_stride_h, const int* __restrict__ q_start,
             const int* __restrict__ seq_lens, const int* __restrict__ tables, int tables_stride, int h_kv, int gqa,
             const unsigned char* __restrict__ k_codes, const u16* __restrict__ k_norms,
             const int* __restrict__ k_table, const unsigned char* __restrict__ v_codes,
             const u16* __restrict__ v_norms, const int* __restrict__ v_table,
             const int* __restrict__ signs1, const int* __restrict__ signs2, double inv_sqrt_d, double qk_scale_d,
             const float* __restrict__ off_const, const float* __restrict__ off_mean,
             const float* __restrict__ off_sink,
             const float* __restrict__ inv_freq, const int* __restrict__ pairs, int num_pairs,
             float* __restrict__ part_acc, float* __restrict__ part_m, float* __restrict__ part_l,
             int num_splits, u16* __restrict__ out, int out_stride_t, int out_stride_h, u32* __restrict__ counters
#if RECENT
             , const u16* __restrict__ ring_k, const u16* __restrict__ ring_v, const int* __restrict__ recent_rows,
             int ring_size, int ring_stride_row, int ring_stride_slot, int ring_stride_head
#endif
             ) {
  const int seq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int seq_len = seq_lens[seq];
  const int chunk = split_tokens(seq_len, num_splits);
  const int start = split * chunk;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  if (start >= seq_len) {  /* splits past the end write nothing; the merge skips them */
    if (seq_len == 0 && split == 0)  /* a seq_len-0 (padding) row attends to nothing: zeros */
      for (int i = tid; i < gqa * D; i += WARPS * 32)
        out[(long long)q_start[seq] * out_stride_t + (long long)(kvh * gqa + i / D) * out_stride_h + i % D] = 0;
    return;
  }
  const int end = min(start + chunk, seq_len);
#if RECENT
  /* positions from ring_lo on are read from the ring (after the main loop), those below from the pages */
  const int ring_lo = max(0, seq_len - ring_size), page_end = min(end, ring_lo);
#else
  const int page_end = end;
#endif
  const float qk_scale = (float)qk_scale_d, inv_sqrt = (float)inv_sqrt_d;

  /* the queries (raw, then rotated and scaled) and the offset's A and B terms per head and (padded) pair
     live only before the main loop; the warps' outputs after it reuse their space */
  constexpr int PRE = 8 * D + (NPT > 0 ? 8 * 2 * NPT * 8 : 0), POST = WARPS * 8 * D;
  __shared__ float pre[PRE > POST ? PRE : POST];
  float (*qs)[D] = (float (*)[D])pre;
  float (*wacc)[8][D] = (float (*)[8][D])pre;
  __shared__ float wm[WARPS][8], wl[WARPS][8];
#if NPT > 0
  float (*ab)[2][NPT * 8] = (float (*)[2][NPT * 8])(pre + 8 * D);
  __shared__ float sink_x[8];
#endif
  const int* table = tables + (long long)seq * tables_stride;
  const u32 head_rows = (u32)kvh * PS;

  /* Loads tile t0's data of this lane into st (t0 < page_end). PS % 16 == 0: the tile lies in one page, whose
     entry the previous step loaded (page), and the lane's tokens are constant offsets from its first row. */
  auto load_tile = [&](Step& st, int t0, int page) {
#if PS % 16 == 0
    const u64 base = (u64)((u32)page * (u32)(h_kv * PS) + head_rows + (u32)(t0 % PS));
    const unsigned char* k0 = k_codes + base * KROW + g * KROW;
    const unsigned char* v0 = v_codes + base * VROW + 2 * t * VROW;
    const u16* kn0 = k_norms + base * NG + g * NG;
    const u16* vn0 = v_norms + base * NG + g * NG;
    const unsigned char* const kp[2] = {k0, k0 + 8 * KROW};
    const unsigned char* const vp[4] = {v0, v0 + VROW, v0 + 8 * VROW, v0 + 9 * VROW};
    const u16* const knp[2] = {kn0, kn0 + 8 * NG};
    const u16* const vnp[2] = {vn0, vn0 + 8 * NG};
#else
    int tok = t0 + (lane & 15);
    tok = tok < page_end ? tok : t0;
    const u32 row = (u32)table[tok / PS] * (u32)(h_kv * PS) + head_rows + (u32)(tok % PS);
    const u32 rk[2] = {shfl_idx(row, g), shfl_idx(row, g + 8)};
    const u32 rv[4] = {shfl_idx(row, 2 * t), shfl_idx(row, 2 * t + 1), shfl_idx(row, 2 * t + 8),
                       shfl_idx(row, 2 * t + 9)};
    const unsigned char* const kp[2] = {k_codes + (u64)rk[0] * KROW, k_codes + (u64)rk[1] * KROW};
    const unsigned char* const vp[4] = {v_codes + (u64)rv[0] * VROW, v_codes + (u64)rv[1] * VROW,
                                        v_codes + (u64)rv[2] * VROW, v_codes + (u64)rv[3] * VROW};
    const u16* const knp[2] = {k_norms + (u64)rk[0] * NG, k_norms + (u64)rk[1] * NG};
    const u16* const vnp[2] = {v_norms + (u64)rk[0] * NG, v_norms + (u64)rk[1] * NG};
#endif
    load_step(st, kp, vp, knp, vnp, g, t);
  };
  auto page_of = [&](int t0) -> int {
#if PS % 16 == 0
    return t0 < page_end ? table[t0 / PS] : 0;
#else
    return 0;
#endif
  };

  /* the first tile's words load while the query is rotated */
  int t0 = start + 16 * warp;
  Step sa, sb;
  if (t0 < page_end) load_tile(sa, t0, page_of(t0));
  int page_next = page_of(t0 + 16 * WARPS);

  /* ---- queries: load, offset terms from the unrotated query, rotate (spec "Rotation"), scale ---- */
  const long long q_row = q_start[seq];
  for (int i = tid; i < 8 * D; i += WARPS * 32) {
    const int h = i / D, d = i % D;
    qs[h][d] = h < gqa ? q_to_f(q[q_row * q_stride_t + (long long)(kvh * gqa + h) * q_stride_h + d]) : 0.0f;
  }
  __syncthreads();
#if NPT > 0
  for (int i = tid; i < 8 * NPT * 8; i += WARPS * 32) {
    const int h = i / (NPT * 8), j = i % (NPT * 8);
    float a = 0.0f, b = 0.0f;
    if (j < num_pairs) {
      const int f = pairs[kvh * num_pairs + j];
      const float q1 = qs[h][f] * qk_scale, q2 = qs[h][f + D / 2] * qk_scale;
      const float m1 = off_mean[kvh * D + f], m2 = off_mean[kvh * D + D / 2 + f];
      a = q1 * m1 + q2 * m2;
      b = q2 * m1 - q1 * m2;
    }
    ab[h][0][j] = a;
    ab[h][1][j] = b;
  }
  for (int h = warp; h < 8; h += WARPS) {  /* <q, sink - const - mean>: position 0's extra score */
    float x = 0.0f;
    for (int d = lane; d < D; d += 32)
      x += qs[h][d] * qk_scale * (off_sink[kvh * D + d] - off_const[kvh * D + d] - off_mean[kvh * D + d]);
    for (int m = 16; m > 0; m >>= 1) x += shfl_xor(x, m);
    if (lane == 0) sink_x[h] = x;
  }
  __syncthreads();
#endif
  rotate_rows(qs, signs1, signs2, inv_sqrt * qk_scale, tid);  /* and the softmax scale * log2 e */

#if INT8_KEYS
  /* Q^T as int8 B fragments of m16n8k32, head g: k-step c of group gi pairs the lane's logical rows 4t..4t+3
     with physical dims base + 8c .. +3 and rows 16+4t..+3 with base + 8c + 4 .. +7 (base = gi G + t G/4): the
     8 values of the lane's chunk c, as the K side decodes them. One scale per head and group (max |q| -> 127);
     kscale: what an int32 score unit of heads 2t, 2t+1 is worth (q unit times K8_UNIT) */
  u32 qb[NG][KCH][2];
  float kscale[NG][2];
#pragma unroll
  for (int gi = 0; gi < NG; ++gi) {
    const int base = gi * G + t * (G / 4);
    float mx = 0.0f;
    for (int d = base; d < base + G / 4; ++d) mx = fmaxf(mx, fabsf(qs[g][d]));
    mx = fmaxf(mx, shfl_xor(mx, 1));
    mx = fmaxf(mx, shfl_xor(mx, 2));
    const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
#pragma unroll
    for (int c = 0; c < KCH; ++c) {
      const int d = base + 8 * c;
      qb[gi][c][0] = s8x4(qs[g][d] * inv, qs[g][d + 1] * inv, qs[g][d + 2] * inv, qs[g][d + 3] * inv);
      qb[gi][c][1] = s8x4(qs[g][d + 4] * inv, qs[g][d + 5] * inv, qs[g][d + 6] * inv, qs[g][d + 7] * inv);
    }
    const float unit = mx * (1.0f / 127.0f) * K8_UNIT;
    kscale[gi][0] = bits_f(shfl_idx(f_bits(unit), 8 * t));      /* lane (g = 2t, 0) */
    kscale[gi][1] = bits_f(shfl_idx(f_bits(unit), 8 * t + 4));  /* lane (g = 2t + 1, 0) */
  }
#else
  /* Q^T as B fragments, head g: k-step s of group gi pairs the lane's logical columns 2t, 2t+1 with
     physical dims base + 4s, +1 and 2t+8, 2t+9 with base + 4s + 2, +3 (base = gi G + t G/4) */
  u32 qb[NG][G / 16][2];
#pragma unroll
  for (int gi = 0; gi < NG; ++gi)
#pragma unroll
    for (int s = 0; s < G / 16; ++s) {
      const int d = gi * G + t * (G / 4) + 4 * s;
      qb[gi][s][0] = pack(qs[g][d], qs[g][d + 1]);
      qb[gi][s][1] = pack(qs[g][d + 2], qs[g][d + 3]);
    }
#endif
#if NPT > 0
  /* the offset's B fragments (rows: cos columns 0-7 then sin columns 8-15 of 8 pairs; column: head g)
     and this lane's pairs' frequencies (pairs 8 pt + 2t, +1; padding: frequency 0, terms 0) */
  u32 obh[NPT][2], obl[NPT][2];
  float freq[NPT][2];
#pragma unroll
  for (int pt = 0; pt < NPT; ++pt) {
    const int j = pt * 8 + 2 * t;
    split2(ab[g][0][j], ab[g][0][j + 1], obh[pt][0], obl[pt][0]);
    split2(ab[g][1][j], ab[g][1][j + 1], obh[pt][1], obl[pt][1]);
    freq[pt][0] = settled(j < num_pairs ? inv_freq[pairs[kvh * num_pairs + j]] : 0.0f, tid);
    freq[pt][1] = settled(j + 1 < num_pairs ? inv_freq[pairs[kvh * num_pairs + j + 1]] : 0.0f, tid);
  }
  const float sink0 = sink_x[2 * t], sink1 = sink_x[2 * t + 1];
#endif

  /* per-thread copies: PRMT cannot read uniform registers (codes._table_word) */
  const u32 not_uniform = (u32)tid & (u32)((u64)k_table >> 63);
  u32 lut_v[8];
#if INT8_KEYS
  u32 lut_k[4];
  const u32 k8_table[4] = K8_TABLE;
#pragma unroll
  for (int i = 0; i < 4; ++i) lut_k[i] = k8_table[i] | not_uniform;
#pragma unroll
  for (int i = 0; i < 8; ++i) lut_v[i] = (i < 4 || VB == 4) ? ((u32)v_table[i] | not_uniform) : 0u;
#else
  u32 lut_k[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    lut_k[i] = (i < 4 || KB == 4) ? ((u32)k_table[i] | not_uniform) : 0u;
    lut_v[i] = KB == VB ? lut_k[i] : (i < 4 || VB == 4) ? ((u32)v_table[i] | not_uniform) : 0u;  /* same table */
  }
#endif

  float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;  /* heads 2t, 2t+1 */
  float acc[NG][G / 16][4];
#pragma unroll
  for (int gi = 0; gi < NG; ++gi)
#pragma unroll
    for (int s = 0; s < G / 16; ++s) acc[gi][s][0] = acc[gi][s][1] = acc[gi][s][2] = acc[gi][s][3] = 0.0f;

  /* One warp step: scores, softmax and values of tile t0's tokens below ``limit`` from the words in cur. With a
     recent window, the ring pass (``ring``; the constant argument specializes the inlined copy) takes the tile's
     tokens in [ring_lo, end) instead, cur unread: a token's A fragments are its ring row's values (rotated
     domain, natural column order as the decoded codes; zeros for the others), its K and V norms 1; the key
     offset's terms are the same (a ring row holds k - o(p), as a page). A tile that straddles ring_lo runs both
     passes, each masking the other's tokens: the online softmax takes them as two steps. */
  auto compute = [&](const Step& cur, const int t0, const int limit, const bool ring) {
    /* ---- scores S^T [16 tokens x 8 heads]: lane holds tokens g, g+8 of heads 2t, 2t+1 ---- */
    bool valid0 = t0 + g < limit, valid1 = t0 + g + 8 < limit;
#if RECENT
    /* the ring pass: which of the lane's tokens it reads (K: g, g+8; V: 2t, 2t+1, 2t+8, 2t+9), at which element
       offsets of the ring (position p at ring index p % ring_size of the sequence's row) */
    bool rv[4] = {false, false, false, false};
    u32 ok[2] = {0u, 0u}, ov[4] = {0u, 0u, 0u, 0u};
    if (ring) {
      const int row = recent_rows[seq], slot0 = ring_lo % ring_size;
      auto at = [&](const int tok, bool& hit, u32& off) {
        hit = tok >= ring_lo && tok < end;
        int slot = slot0 + (tok - ring_lo);
        slot -= slot >= ring_size ? ring_size : 0;
        off = hit ? (u32)(row * ring_stride_row + slot * ring_stride_slot + kvh * ring_stride_head) : 0u;
      };
      at(t0 + g, valid0, ok[0]);
      at(t0 + g + 8, valid1, ok[1]);
      at(t0 + 2 * t, rv[0], ov[0]);
      at(t0 + 2 * t + 1, rv[1], ov[1]);
      at(t0 + 2 * t + 8, rv[2], ov[2]);
      at(t0 + 2 * t + 9, rv[3], ov[3]);
    }
#endif
    float s[4];
#if INT8_KEYS
    {
      int sk[NG][4];  /* exact: |sum| <= G 127^2 < 2^21 */
#pragma unroll
      for (int gi = 0; gi < NG; ++gi) {
        sk[gi][0] = sk[gi][1] = sk[gi][2] = sk[gi][3] = 0;
#pragma unroll
        for (int c = 0; c < KCH; ++c) {
          const u32 cb = gi * (G / 8) + t * KCH + c;
          u32 a0, a1, a2, a3;
          lookup_s8<KB>(selector<KB>(cur.k[0][gi][KB == 4 ? c : c / 2], cb, cur.k[0][gi][KW - 1]), lut_k, a0, a2);
          lookup_s8<KB>(selector<KB>(cur.k[1][gi][KB == 4 ? c : c / 2], cb, cur.k[1][gi][KW - 1]), lut_k, a1, a3);
          imma(sk[gi], a0, a1, a2, a3, qb[gi][c][0], qb[gi][c][1]);
        }
      }
      const float kn0 = lo_f(cur.kn[0]), kn1 = lo_f(cur.kn[1]);
      s[0] = i2f(sk[0][0]) * (kn0 * kscale[0][0]); s[1] = i2f(sk[0][1]) * (kn0 * kscale[0][1]);
      s[2] = i2f(sk[0][2]) * (kn1 * kscale[0][0]); s[3] = i2f(sk[0][3]) * (kn1 * kscale[0][1]);
#if NG == 2
      const float kh0 = hi_f(cur.kn[0]), kh1 = hi_f(cur.kn[1]);
      s[0] += i2f(sk[1][0]) * (kh0 * kscale[1][0]); s[1] += i2f(sk[1][1]) * (kh0 * kscale[1][1]);
      s[2] += i2f(sk[1][2]) * (kh1 * kscale[1][0]); s[3] += i2f(sk[1][3]) * (kh1 * kscale[1][1]);
#endif
    }
#else
    float sc[NG][4];
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
      sc[gi][0] = sc[gi][1] = sc[gi][2] = sc[gi][3] = 0.0f;
#pragma unroll
      for (int c = 0; c < KCH; ++c) {
        const u32 cb = gi * (G / 8) + t * KCH + c;
        u32 x0[4], x1[4];
#if RECENT
        if (ring) {
          ring_words(valid0, ring_k + ok[0] + 8 * cb, x0);
          ring_words(valid1, ring_k + ok[1] + 8 * cb, x1);
        } else
#endif
        {
          lookup<KB>(selector<KB>(cur.k[0][gi][KB == 4 ? c : c / 2], cb, cur.k[0][gi][KW - 1]), lut_k, x0);
          lookup<KB>(selector<KB>(cur.k[1][gi][KB == 4 ? c : c / 2], cb, cur.k[1][gi][KW - 1]), lut_k, x1);
        }
        mma(sc[gi], x0[0], x1[0], x0[1], x1[1], qb[gi][2 * c][0], qb[gi][2 * c][1]);
        mma(sc[gi], x0[2], x1[2], x0[3], x1[3], qb[gi][2 * c + 1][0], qb[gi][2 * c + 1][1]);
      }
    }
    {
#if RECENT
      const float kn0 = ring ? 1.0f : lo_f(cur.kn[0]), kn1 = ring ? 1.0f : lo_f(cur.kn[1]);
#else
      const float kn0 = lo_f(cur.kn[0]), kn1 = lo_f(cur.kn[1]);
#endif
      s[0] = sc[0][0] * kn0; s[1] = sc[0][1] * kn0; s[2] = sc[0][2] * kn1; s[3] = sc[0][3] * kn1;
#if NG == 2
#if RECENT
      const float kh0 = ring ? 1.0f : hi_f(cur.kn[0]), kh1 = ring ? 1.0f : hi_f(cur.kn[1]);
#else
      const float kh0 = hi_f(cur.kn[0]), kh1 = hi_f(cur.kn[1]);
#endif
      s[0] += sc[1][0] * kh0; s[1] += sc[1][1] * kh0; s[2] += sc[1][2] * kh1; s[3] += sc[1][3] * kh1;
#endif
    }
#endif
#if NPT > 0
    {
      const float p0 = (float)(t0 + g), p1 = (float)(t0 + g + 8);
#pragma unroll
      for (int pt = 0; pt < NPT; ++pt) {
        float c00, s00, c01, s01, c10, s10, c11, s11;  /* [token][pair] */
        sincos_approx(mul_rn(p0, freq[pt][0]), c00, s00);
        sincos_approx(mul_rn(p0, freq[pt][1]), c01, s01);
        sincos_approx(mul_rn(p1, freq[pt][0]), c10, s10);
        sincos_approx(mul_rn(p1, freq[pt][1]), c11, s11);
        u32 ch0, cl0, ch1, cl1, sh0, sl0, sh1, sl1;
        split2(c00, c01, ch0, cl0); split2(c10, c11, ch1, cl1);
        split2(s00, s01, sh0, sl0); split2(s10, s11, sh1, sl1);
        mma(s, ch0, ch1, sh0, sh1, obh[pt][0], obh[pt][1]);
        mma(s, ch0, ch1, sh0, sh1, obl[pt][0], obl[pt][1]);
        mma(s, cl0, cl1, sl0, sl1, obh[pt][0], obh[pt][1]);
      }
      if (t0 + g == 0) { s[0] += sink0; s[1] += sink1; }
    }
#endif
    if (!valid0) s[0] = s[1] = NEG_INF;
    if (!valid1) s[2] = s[3] = NEG_INF;

    /* ---- online softmax over the warp's tokens (log2 units) ---- */
    float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
    for (int m = 4; m < 32; m <<= 1) { mx0 = fmaxf(mx0, shfl_xor(mx0, m)); mx1 = fmaxf(mx1, shfl_xor(mx1, m)); }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float a0 = ex2(m0 - n0), a1 = ex2(m1 - n1);
    m0 = n0; m1 = n1;
    const float p[4] = {ex2(s[0] - n0), ex2(s[1] - n1), ex2(s[2] - n0), ex2(s[3] - n1)};
    l0 = l0 * a0 + p[0] + p[2];
    l1 = l1 * a1 + p[1] + p[3];
    if (any_sync(a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
      for (int gi = 0; gi < NG; ++gi)
#pragma unroll
        for (int s2 = 0; s2 < G / 16; ++s2) {
          acc[gi][s2][0] *= a0; acc[gi][s2][1] *= a1; acc[gi][s2][2] *= a0; acc[gi][s2][3] *= a1;
        }
    }

    /* ---- O^T [D x 8] += V^T [D x 16] . P^T [16 x 8]; P^T by transposing S^T's two 8x8 halves ---- */
#pragma unroll
    for (int gi = 0; gi < NG; ++gi) {
#if RECENT
      const float vn0 = valid0 ? (ring ? 1.0f : gi == 0 ? lo_f(cur.vn[0]) : hi_f(cur.vn[0])) : 0.0f;
      const float vn1 = valid1 ? (ring ? 1.0f : gi == 0 ? lo_f(cur.vn[1]) : hi_f(cur.vn[1])) : 0.0f;
#else
      const float vn0 = valid0 ? (gi == 0 ? lo_f(cur.vn[0]) : hi_f(cur.vn[0])) : 0.0f;
      const float vn1 = valid1 ? (gi == 0 ? lo_f(cur.vn[1]) : hi_f(cur.vn[1])) : 0.0f;
#endif
      const u32 pb0 = trans8x8(pack(p[0] * vn0, p[1] * vn0));
      const u32 pb1 = trans8x8(pack(p[2] * vn1, p[3] * vn1));
#pragma unroll
      for (int c = 0; c < VCH; ++c) {
        const u32 cb = gi * (G / 8) + g * VCH + c;
        u32 x[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#if RECENT
          if (ring) ring_words(rv[i], ring_v + ov[i] + 8 * cb, x[i]);
          else
#endif
          lookup<VB>(selector<VB>(cur.v[i][gi][VB == 4 ? c : 0], cb, cur.v[i][gi][VW - 1]), lut_v, x[i]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)  /* m-tile 4c + j: dims 2j, 2j+1 of the chunk; tokens paired per dim */
          mma(acc[gi][4 * c + j], prmt(x[0][j], x[1][j], 0x5410), prmt(x[0][j], x[1][j], 0x7632),
              prmt(x[2][j], x[3][j], 0x5410), prmt(x[2][j], x[3][j], 0x7632), pb0, pb1);
      }
    }
  };

  /* tile t0 + 64's words load into the other Step while tile t0 computes, and tile t0 + 128's page entry
     into page_next; the two Steps swap roles each step (no register copies) */
  auto step = [&](const Step& cur, Step& nxt, const int t0) {
    const int t1 = t0 + 16 * WARPS;
    if (t1 < page_end) load_tile(nxt, t1, page_next);
    page_next = page_of(t1 + 16 * WARPS);
    compute(cur, t0, page_end, false);
  };
#pragma unroll 1
  for (;;) {
    if (t0 >= page_end) break;
    step(sa, sb, t0);
    t0 += 16 * WARPS;
    if (t0 >= page_end) break;
    step(sb, sa, t0);
    t0 += 16 * WARPS;
  }
#if RECENT
  /* the ring pass: this warp's tiles that reach ring_lo, after the pages' (the Steps free; a sequence has
     ring_size / 16 + 1 such tiles at most, over all its warps, so their loads go unhidden) */
  t0 = start + 16 * warp;
  if (t0 + 16 <= ring_lo) t0 += ((ring_lo - 16 - t0) / (16 * WARPS) + 1) * (16 * WARPS);
#pragma unroll 1
  for (; t0 < end; t0 += 16 * WARPS) compute(sa, t0, end, true);
#endif

  /* ---- merge the warps: per head max, rescale, sum ---- */
#pragma unroll
  for (int m = 4; m < 32; m <<= 1) { l0 += shfl_xor(l0, m); l1 += shfl_xor(l1, m); }
  if (g == 0) { wm[warp][2 * t] = m0; wm[warp][2 * t + 1] = m1; }
  __syncthreads();
  float mc0 = NEG_INF, mc1 = NEG_INF;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) { mc0 = fmaxf(mc0, wm[w][2 * t]); mc1 = fmaxf(mc1, wm[w][2 * t + 1]); }
  const float f0 = m0 == NEG_INF ? 0.0f : ex2(m0 - mc0), f1 = m1 == NEG_INF ? 0.0f : ex2(m1 - mc1);
  if (g == 0) { wl[warp][2 * t] = l0 * f0; wl[warp][2 * t + 1] = l1 * f1; }
#pragma unroll
  for (int gi = 0; gi < NG; ++gi)
#pragma unroll
    for (int s2 = 0; s2 < G / 16; ++s2) {  /* m-tile s2: dims X = gi G + g G/8 + 2 s2 and X + 1 */
      const int x = gi * G + g * (G / 8) + 2 * s2;
      wacc[warp][2 * t][x] = acc[gi][s2][0] * f0;
      wacc[warp][2 * t + 1][x] = acc[gi][s2][1] * f1;
      wacc[warp][2 * t][x + 1] = acc[gi][s2][2] * f0;
      wacc[warp][2 * t + 1][x + 1] = acc[gi][s2][3] * f1;
    }
  __syncthreads();
  const long long part0 = ((long long)seq * h_kv * gqa + (long long)kvh * gqa) * num_splits + split;
  for (int i = tid; i < gqa * D; i += WARPS * 32) {
    const int h = i / D, d = i % D;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += wacc[w][h][d];
    part_acc[(part0 + (long long)h * num_splits) * D + d] = sum;
  }
  if (tid < gqa) {
    float ml = NEG_INF, l = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) { ml = fmaxf(ml, wm[w][tid]); l += wl[w][tid]; }
    part_m[part0 + (long long)tid * num_splits] = ml;
    part_l[part0 + (long long)tid * num_splits] = l;
  }

  /* ---- the last CTA of this (sequence, KV head) to finish merges its splits: attention._merge_kernel's
     log-sum-exp and inverse rotation, here instead of a second launch. Its indices are read afresh (asm
     volatile): values kept from before the main loop would hold registers through it (spills at 128). ---- */
  {
  const int seq = ctaid_x(), kvh = ctaid_y(), tid = tid_x(), warp = tid >> 5, lane = tid & 31;
  __shared__ int is_last;
  asm volatile("membar.gl;" ::: "memory");  /* this thread's partials, visible on the GPU before the count */
  __syncthreads();
  const int len = ld_volatile(seq_lens + seq), step = split_tokens(len, num_splits);
  const int used = min((len + step - 1) / step, num_splits);  /* CTAs of the row that do not exit early */
  if (tid == 0) {
    u32 done;
    asm volatile("atom.global.add.u32 %0, [%1], 1;" : "=r"(done) : "l"(counters + seq * h_kv + kvh) : "memory");
    is_last = (int)done + 1 == used;
    if (is_last) counters[seq * h_kv + kvh] = 0;  /* ready for the next launch (CUDA-graph replays) */
  }
  __syncthreads();
  if (!is_last) return;
  asm volatile("membar.gl;" ::: "memory");
  for (int h = warp; h < 8; h += WARPS) {  /* a warp per head; the rotation runs over all 8 rows */
    if (h >= gqa) {
      for (int d = lane; d < D; d += 32) qs[h][d] = 0.0f;
      continue;
    }
    const long long p0 = ((long long)seq * h_kv * gqa + (long long)kvh * gqa + h) * num_splits;
    float mm = NEG_INF;
    for (int sp = lane; sp < used; sp += 32) mm = fmaxf(mm, ldcg(part_m + p0 + sp));
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) mm = fmaxf(mm, shfl_xor(mm, m));
    float den = 0.0f, o[D / 32];
#pragma unroll
    for (int i = 0; i < D / 32; ++i) o[i] = 0.0f;
    for (int sp = 0; sp < used; ++sp) {
      const float w = ex2(ldcg(part_m + p0 + sp) - mm);
      den += w * ldcg(part_l + p0 + sp);
#pragma unroll
      for (int i = 0; i < D / 32; ++i) o[i] += w * ldcg(part_acc + (p0 + sp) * D + lane + 32 * i);
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i) qs[h][lane + 32 * i] = o[i] / den;
  }
  __syncthreads();
  rotate_rows(qs, signs2, signs1, (float)inv_sqrt_d, tid);  /* back from the rotated domain */
  for (int i = tid; i < gqa * D; i += WARPS * 32)
    out[(long long)ld_volatile(q_start + seq) * out_stride_t + (long long)(kvh * gqa + i / D) * out_stride_h + i % D] =
        to_q_type(qs[i / D][i % D]);
  }
}
"""


@functools.cache
def int8_centroids(bits: int, group: int) -> tuple[tuple[int, ...], float]:
    """(int8 centroids n, unit u): codebook(bits, group) as n * u, centroid i ~ n[i] * u (the int8 keys' decode,
    INT8_KEYS). Of the roundings n = round(c * M / max|c|), M = 64 .. 127 in steps of 1/16, the one whose
    least-squares unit u = (n . c) / (n . n) leaves the smallest sum of squared errors: a finer fit than M = 127
    alone (turbo3 at G = 128: 16x smaller squared error; turbo4 at G = 64: 2.9x)."""
    centroids = codebook(bits, group).centroids
    top = max(abs(c) for c in centroids)

    def fit(m: float) -> tuple[float, tuple[int, ...], float]:
        n = tuple(round(c * m / top) for c in centroids)
        unit = sum(a * c for a, c in zip(n, centroids)) / sum(a * a for a in n)
        return sum((a * unit - c) ** 2 for a, c in zip(n, centroids)), n, unit

    _, n, unit = min(fit(m / 16) for m in range(64 * 16, 127 * 16 + 1))
    return n, unit


def int8_table_words(bits: int, group: int) -> tuple[int, ...]:
    """The int8 centroids as four PRMT table words (u32): byte j of word w is centroid 4w + j in two's
    complement (centroids 0-7 in words 0-1, turbo4's 8-15 in words 2-3; missing ones 0), lookup_s8's tables."""
    values = list(int8_centroids(bits, group)[0]) + [0] * (16 - (1 << bits))
    return tuple(sum((v & 0xFF) << (8 * j) for j, v in enumerate(values[4 * w: 4 * w + 4])) for w in range(4))


@functools.cache  # one string per specialization: every decode call asks for it (nvrtc's cache keys on it)
def source(k_bits: int = 3, v_bits: int = 3, head_dim: int = 128, page_size: int = 16, pair_tiles: int = 1,
           bf16_queries: bool = True, blocks: int = 2, warps: int = 8, int8_keys: bool = False,
           recent: bool = False) -> str:
    """The CUDA C of one specialization (``pair_tiles``: key-offset pairs / 8 rounded up, 0 without an offset;
    ``blocks``: CTAs per SM that __launch_bounds__ asks registers for, min_blocks; ``int8_keys``: scores by
    int8 mmas, module docstring; ``recent``: a recent window's ring beside the pages, ring rows in the queries'
    dtype; without it the source compiles to the same PTX as before the window existed)."""
    group = group_size(head_dim)
    values = dict(D=head_dim, G=group, KB=k_bits, VB=v_bits, PS=page_size, NPT=pair_tiles,
                  QBF16=int(bf16_queries), WARPS=warps, MIN_BLOCKS=blocks, INT8K=int(int8_keys),
                  RECENT=int(recent),
                  K8TABLE=", ".join(f"{w:#010x}u" for w in int8_table_words(k_bits, group)),
                  K8UNIT=f"{int8_centroids(k_bits, group)[1]:.9e}f")
    text = _SOURCE
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    return text


def _shared_bytes(head_dim: int, pair_tiles: int, warps: int) -> int:
    """The kernel's static shared memory: the queries and offset terms (before the main loop) or the warps'
    outputs (after it, in the same space), and the warps' maxima and sums."""
    return 4 * max(8 * head_dim + 16 * 8 * pair_tiles, warps * 8 * head_dim) + 4 * (2 * warps * 8 + 8 + 1)


def default_warps(head_dim: int, pair_tiles: int) -> int:
    """WARPS per CTA where their outputs fit in static shared memory (not 8 at D = 256: 64 KB), else 4."""
    return WARPS if _shared_bytes(head_dim, pair_tiles, WARPS) <= STATIC_SHARED else 4


SOURCE = source()  # the engine default's build (turbo3, D = 128, page 16, 8 turned pairs, bf16): bench/cuda_sass.py


def supports(q: torch.Tensor, k_pages: TurboPages, v_pages: TurboPages, key_offset: KeyOffset | None) -> bool:
    """Whether the CUDA kernel takes this call: fp16/bf16 queries, at most 8 query heads per KV head,
    head_dim 64/128/256, and nvrtc.cuda_kernels_enabled. Anything else stays on the Triton kernel."""
    kv_heads = k_pages.codes.shape[1]
    return (q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128, 256)
            and q.shape[1] % kv_heads == 0 and q.shape[1] // kv_heads <= MAX_GQA and q.stride(-1) == 1
            and nvrtc.cuda_kernels_enabled(q.device))


def min_blocks(k_bits: int, v_bits: int, head_dim: int, pair_tiles: int, warps: int = WARPS) -> int:
    """CTAs per SM to ask registers for: the most that compile without spilling (sm_90 build, bench/cuda_sass.py),
    for 4-warp CTAs: 4 (128 registers) for D <= 128 up to 4 pair tiles (turbo3 at D = 128: 127-128), 3 with
    turbo4 at D = 128 (which spills at 128), 2 at D = 256 or with more pair tiles (D = 256 turned, 16 pair
    tiles, still spills). Wider CTAs: as many threads per SM."""
    if head_dim > 128 or pair_tiles > 4:
        blocks = 2
    else:
        blocks = 3 if head_dim == 128 and 4 in (k_bits, v_bits) else 4
    return max(1, blocks * 4 // warps)


def _kernel(q: torch.Tensor, k_bits: int, v_bits: int, page_size: int, pair_tiles: int, warps: int,
            blocks: int | None, int8_keys: bool, recent: bool):
    head_dim = q.shape[-1]
    if _shared_bytes(head_dim, pair_tiles, warps) > STATIC_SHARED:
        return None  # e.g. 8 warps at D = 256: their outputs alone need 64 KB
    blocks = blocks or min_blocks(k_bits, v_bits, head_dim, pair_tiles, warps)
    return nvrtc.cuda_kernel(source(k_bits, v_bits, head_dim, page_size, pair_tiles, q.dtype == torch.bfloat16,
                                    blocks, warps, int8_keys, recent), KERNEL_NAME, q.device)


def supports_recent(q: torch.Tensor, recent: RecentWindow) -> bool:
    """Whether the kernel reads this ring: rows in the queries' dtype (the build's), K and V alike, 16-byte aligned
    rows of 8-value chunks (one 16-byte load each), element offsets within int32."""
    k, v = recent.k, recent.v
    return (k.dtype == v.dtype == q.dtype and k.shape == v.shape and k.stride() == v.stride()
            and k.shape[-1] == q.shape[-1] and k.stride(-1) == 1 and all(st % 8 == 0 for st in k.stride()[:-1])
            and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0 and k.numel() < 2**31)


def choose_splits(num_seqs: int, kv_heads: int, max_seq_len: int, device: torch.device, warps: int = WARPS) -> int:
    """Whole waves of CTAs: one per SM (sms // rows splits) while that keeps splits at most LONG_SPLIT_TOKENS
    long, else one wave of all the CTAs an SM holds (RESIDENT_WARPS; a CTA's prologue, the query's rotation,
    costs a few tiles: longer splits amortize it; H200: 4 splits of 16K beat 8 at b8/64K). A count between
    the two puts a second CTA on some SMs only, which then finish last: H200, 2026-11-30 10:49 UTC,
    bench/turbo_b1_sweep.py (batch 1, 8 KV heads, turbo3, partial key offset, microseconds a layer): 16K 15
    splits 27.8, the 17 of the rule before 29.0, 33 splits 30.1; 64K 16 splits 55.8, 24 63.3, 33 53.5; 4K
    11 splits (16 asked, whole tiles) 19.6, 17 21.7."""
    sms, rows = multiprocessors(device), max(1, num_seqs * kv_heads)
    per_sm = max(1, sms // rows)
    wave = max(1, RESIDENT_WARPS // warps) * sms // rows
    splits = per_sm if -(-max_seq_len // per_sm) <= LONG_SPLIT_TOKENS else max(per_sm, wave)
    return max(1, min(-(-max_seq_len // (TILE * warps)), splits))


@functools.cache
def _empty(device: torch.device) -> torch.Tensor:
    """A placeholder for the key-offset pointers a plain launch never reads."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def decode_attention_cuda(q: torch.Tensor, k_pages: TurboPages, v_pages: TurboPages, meta: AttentionMetadata,
                          scale: float, signs: tuple[torch.Tensor, torch.Tensor], inv_sqrt: float,
                          key_offset: KeyOffset | None = None, num_splits: int | None = None,
                          warps: int | None = None, blocks: int | None = None,
                          int8_keys: bool | None = None, recent: RecentWindow | None = None) -> torch.Tensor | None:
    """attention.decode_attention_triton's contract on the CUDA C kernel; None where it cannot run (the
    caller takes the Triton kernel): ``supports`` (or, with a window, ``supports_recent``) says no, or NVRTC is
    missing or refuses the source.

    ``recent``: the recent window (recent.py), written with this step's token; sequence s reads positions
    seq_len - W and on from its ring row meta.recent_rows[s], the rest from the pages.
    Launch settings for tests and the benchmark's sweep: ``warps`` per CTA (None: default_warps), ``blocks``:
    CTAs per SM to fit in registers (None: min_blocks), ``int8_keys``: the scores' build (None: INT8_KEYS; with
    a window the fp16 build, and an explicit True is None: the ring rows need fp16 query fragments)."""
    rows = meta.recent_rows
    if recent is not None and (rows is None or rows.dtype != torch.int32 or rows.shape != (q.shape[0],)):
        raise ValueError(f"decode_attention_cuda: a recent window needs meta.recent_rows, each sequence's ring row "
                         f"as [{q.shape[0]}] int32 (the runtime hands them out with the pages); got "
                         f"{None if rows is None else (rows.dtype, tuple(rows.shape))}")
    if not supports(q, k_pages, v_pages, key_offset):
        return None
    if recent is not None:
        if int8_keys or not supports_recent(q, recent):
            return None
        int8_keys = False
    num_seqs, q_heads, head_dim = q.shape
    kv_heads, page_size = k_pages.codes.shape[1], k_pages.codes.shape[2]
    pairs = 0 if key_offset is None else key_offset.pairs.shape[1]
    # with an offset at least one pair tile: position 0's sink term rides on it even with no turning pair
    pair_tiles = 0 if key_offset is None else max(1, -(-pairs // 8))
    warps = warps or default_warps(head_dim, pair_tiles)
    kernel = _kernel(q, k_pages.bits, v_pages.bits, page_size, pair_tiles, warps, blocks,
                     INT8_KEYS if int8_keys is None else int8_keys, recent is not None)
    if kernel is None:
        return None
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_splits(num_seqs, kv_heads, meta.max_seq_len, q.device, warps)
    num_splits = attention.whole_block_splits(meta.max_seq_len, TILE * warps, num_splits)
    part_acc = torch.empty(num_seqs * q_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs * q_heads * num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    group = group_size(head_dim)
    empty = _empty(q.device)
    offset = (empty, empty, empty, empty, meta.seq_lens) if key_offset is None else (
        key_offset.const, key_offset.mean, key_offset.sink, key_offset.inv_freq, key_offset.pairs)
    ring = () if recent is None else (recent.k, recent.v, meta.recent_rows, recent.size, *recent.k.stride()[:3])
    with timed("turbo_decode_attention", q.device):
        kernel(grid=(num_seqs, kv_heads, num_splits), block=(warps * 32, 1, 1), args=[
            q, q.stride(0), q.stride(1), meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.block_tables.stride(0), kv_heads, q_heads // kv_heads, k_pages.codes, k_pages.norms,
            lookup_table(k_pages.bits, group, q.device), v_pages.codes, v_pages.norms,
            lookup_table(v_pages.bits, group, q.device), signs[0], signs[1], float(inv_sqrt),
            float(scale * attention.LOG2E), *offset, pairs, part_acc, part_m, part_l, num_splits,
            out, out.stride(0), out.stride(1), _split_counters(q.device, num_seqs * kv_heads), *ring])
    return out


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, one per (sequence, KV head): the splits finished so far, which the last one's CTA resets to 0
    after merging. Kept per device and grown outside CUDA-graph captures (the engine's eager warm-up before a
    capture sizes it, as lookup_table's cache); a capture that needs more gets zeros of its own (a captured
    memset). One decode at a time per device: the engine's layers run in one stream."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < n:
        counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        if torch.cuda.is_current_stream_capturing():
            return counters
        _COUNTERS[device] = counters
    return counters


_COUNTERS: dict[torch.device, torch.Tensor] = {}
