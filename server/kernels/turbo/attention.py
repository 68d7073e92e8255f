"""Attention over turbo pages: a fused decode kernel (flash-decoding) and a decode-then-attend path.

Decode (every sequence has one new query), specs/turboquant.md "Decoding":
  * grid (sequence, KV head, context split): all query heads of a KV head live in one
    program, so GQA shares a single read of the pages;
  * Q is rotated once in the program (and pre-scaled by softmax scale * log2 e);
    scores = norm_k * <R q, c[idx_k]>; V is accumulated in the rotated domain as
    sum_j p_j * norm_v * c[idx_v] with an online softmax over only the query rows that can
    hold heads (the mma needs 16; _query_rows);
  * codes are read as 32-bit words and decoded inside the loading thread
    (codes.decode_rows): with fp16/bf16 queries (the GPU case) by a byte-permute lookup
    of fp16 centroids (about one PRMT per value), and Q, K, P, V are fp16 mma operands
    with fp32 accumulation; with fp32 queries (CPU tests) indices and the codebook's odd
    polynomial in fp32; the decoded tiles' column chunks are relabeled (COLUMN_ORDER) so
    their way through shared memory to the mma is free of bank conflicts;
  * with a key offset (the pages hold k - o(p), key_offset.py) each tile's scores get
    <q, o(p) - const> back (const is softmax-invariant): A, B of the unrotated query and the mean
    over the KV head's P turning pairs are turned by the tile start's angles, then one dot with a
    constant [BLOCK, 2P] table of the in-tile angles gives the tile's bias (fp16 operands on the
    GPU, fp32 "ieee" otherwise), and position 0 gets <q, sink - const - mean> more; OFFSET=False
    compiles today's kernel unchanged (layout_change.md "Fused decode");
  * with a recent window (recent.py) the splits share the positions below seq_len - W, and one more program
    per (sequence, KV head) reads the ring's last W: exact rows already rotated (rotate(k - o(p)), rotate(v)) in
    the model's dtype, through the same score / softmax / accumulate step (no norms). A program of its own, not
    a second loop in the last split: the page loop then keeps its registers (sm_90, turbo3, partial offset of 8
    pairs, Triton 3.6: 492 instructions a step and no spill against the plain kernel's 491; the second loop had
    cost 513 and six spills; H200 timings in bench/turbo_recent_triton.py). Its ring loop is not pipelined, so a
    program's shared memory stays within the 4 programs an SM that MAX_REGISTERS plans for (41 KB against 57 KB
    pipelined). RECENT=False compiles the kernel without it;
  * a second small kernel, one program per (sequence, query head), merges the splits
    (log-sum-exp) and applies the one inverse rotation per output.

Everything else (prefill, chunked prefill, mixed batches, CPU) decodes the pages that the
batch references into compact dense pages and runs dense paged attention over them (the
Triton varlen kernel of dense_attention.py on GPU, ``paged_attention_reference`` otherwise):
correct for any chunk boundary, not fused in the rotated domain (yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from server.kernels import pdl
from server.kernels.backend import inline_ptx, multiprocessors, use_triton
from server.kernels.dense_attention import paged_attention as dense_paged_attention
from server.kernels.dense_attention import paged_prefill
from server.kernels.paged_kv import AttentionMetadata, paged_attention_reference
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.rotation import rotate, rotate_rows
from server.kernels.timing import timed
from server.kernels.turbo.codes import centroid_by_polynomial, decode_rows, lookup_table
from server.kernels.turbo.dense_pages import dense_pages_triton
from server.kernels.turbo.format import dequantize_rotated, group_size
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at
from server.kernels.turbo.quantize import TurboPages, offset_arguments, offset_mode, quantize_rows, recent_arguments
from server.kernels.turbo.recent import RecentWindow
from server.kernels.turbo.sincos import sincos

LOG2E = 1.4426950408889634
# Tokens per inner step and warps: 64 / 4 measured fastest (with 128 / 8 close), programs per
# SM 8 at batch 8 (vs 4 and 16) while batch 1 at 64K wanted splits of >= ~1000 tokens: the H200
# sweeps of bench/turbo_decode_sweep.py, docs/BENCHMARKS.md. Fewer (sequence, KV head) rows than that
# fills: shorter splits while they fit one wave (choose_splits).
BLOCK_N = 64
NUM_WARPS = 4
PROGRAMS_PER_SM = 8
RESIDENT_PROGRAMS = 4  # programs an SM holds at once at MAX_REGISTERS: one wave
MIN_SPLIT_TOKENS = 1024  # shorter splits spend more on their Q rotation and partial outputs than they hide
MIN_SPLIT_BLOCKS = 2  # ... and never shorter than this many blocks
# 4 programs per SM instead of ptxas's 3 (137 registers): turbo3 b8/64K 0.429 -> 0.405 ms, b1/64K
# 0.073 -> 0.063 ms (H200, docs/BENCHMARKS.md 2026-11-30 01:38); a few instructions more, no spills.
MAX_REGISTERS = 128
NUM_STAGES = None  # Triton's default (3) for the cp.async pipeline of the code loads; the sweep also tries 5
# Column chunk order of the decoded tiles per index width (_permute_columns). The decode gives
# neighbouring lanes column chunks of one row that the swizzled shared-memory tile behind the mma
# operand maps to the same bank group: every store of a decoded tile was 2-way bank-conflicted
# (45 % of the shared store wavefronts at turbo3, ncu on the H200). These orders make the stores
# conflict-free in the compiled sm_90 layouts ("tile stores" of `python bench/turbo_sass.py`):
# turbo3 b8/64K 0.462 -> 0.405 ms, b1/64K 0.071 -> 0.063 ms (H200, docs/BENCHMARKS.md 01:38 block).
COLUMN_ORDER = {(2, 128): (1, 0, 2, 3), (3, 128): (1, 0, 2, 3), (4, 128): (2, 0, 1, 3),
                (2, 256): (2, 3, 0, 1, 4), (3, 256): (2, 1, 0, 3, 4), (4, 256): (3, 4, 2, 0, 1)}
# The key offset's bias operand: up to this many columns (2 x the turned pairs) its heads are padded once per
# program, beyond it every step (_turned_offset has the sm_90 counts for both).
EARLY_PAD_COLUMNS = tl.constexpr(32)
MERGE_SPLIT_TILE = 64  # splits a merge program reads at once ([64, D] float32: 64 registers a thread at D = 128)
MERGE_NUM_WARPS = 2  # vs 4: 3.92 vs 4.19 us a layer at batch 1, 2K; 1: 4.62 (H200, BENCHMARKS "short contexts")


@triton.jit
def _centroids(row_ptrs, valid, table_ptr, poly_ptr, BLOCK: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
               F16: tl.constexpr, ASM: tl.constexpr):
    """The rows' centroids [BLOCK, D]: fp16 by lookup (F16), float32 by the odd polynomial."""
    if F16:
        c = decode_rows(row_ptrs, valid, table_ptr, BLOCK, D, BITS, True, ASM)
    else:
        c = centroid_by_polynomial(decode_rows(row_ptrs, valid, table_ptr, BLOCK, D, BITS, False), poly_ptr, BITS)
    return c


@triton.jit
def _block_rows(t0, end, seq, kv_head, tables_ptr, tables_stride, k_norms, v_norms, H_KV: tl.constexpr,
                PAGE_SIZE: tl.constexpr, NG: tl.constexpr, BLOCK: tl.constexpr):
    """Tokens t0 .. t0 + BLOCK (those < end are valid): their page rows and K, V norms [BLOCK, NG] (float32)."""
    tok = t0 + tl.arange(0, BLOCK)
    valid = tok < end
    page = tl.load(tables_ptr + seq * tables_stride + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = (page * H_KV + kv_head) * PAGE_SIZE + tok % PAGE_SIZE
    norm_offs = row[:, None] * NG + tl.arange(0, NG)[None, :]
    k_norm = tl.load(k_norms + norm_offs, mask=valid[:, None], other=0.0).to(tl.float32)
    v_norm = tl.load(v_norms + norm_offs, mask=valid[:, None], other=0.0).to(tl.float32)
    return valid, row, k_norm, v_norm


@triton.jit
def _permute_columns(x, ROWS: tl.constexpr, D: tl.constexpr, ORDER: tl.constexpr):
    """Reorder the 8-column chunks of each row by a permutation of the chunk index's bits: bit
    axis i (the most significant first) of the result is bit axis ORDER[i] of x. () keeps x.

    A relabeling inside the registers of a decoded tile (see COLUMN_ORDER): attention is the same
    in any column order as long as q's columns follow K's and the output undoes V's.
    """
    if len(ORDER) > 0:
        x = tl.reshape(x, (ROWS, 2, 2, 2, 2, 8) if len(ORDER) == 4 else (ROWS, 2, 2, 2, 2, 2, 8))
        if len(ORDER) == 4:
            x = tl.permute(x, (0, 1 + ORDER[0], 1 + ORDER[1], 1 + ORDER[2], 1 + ORDER[3], 5))
        else:
            x = tl.permute(x, (0, 1 + ORDER[0], 1 + ORDER[1], 1 + ORDER[2], 1 + ORDER[3], 1 + ORDER[4], 6))
        x = tl.reshape(x, (ROWS, D))
    return x


@triton.jit
def _tile(codes, row, valid, norm, table_ptr, poly_ptr, BLOCK: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
          BITS: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr, ORDER: tl.constexpr):
    """The rows' rotated values [BLOCK, D] as mma operands; with several groups per head scaled by their
    norms (one norm per token scales the scores or probabilities instead: fewer multiplies)."""
    NG: tl.constexpr = D // G
    c = _centroids(codes + row * (D * BITS // 8), valid, table_ptr, poly_ptr, BLOCK, D, BITS, F16, ASM)
    if NG > 1:
        c = tl.reshape(tl.reshape(c, (BLOCK, NG, G)) * norm[:, :, None].to(c.dtype), (BLOCK, D))
    return _permute_columns(c, BLOCK, D, ORDER)


@triton.jit
def _query_rows(N: tl.constexpr, H: tl.constexpr):
    """(holds a head, which head) for the N rows of the padded query tile when the softmax keeps H columns.

    The mma's N side keeps column bit 0 and the highest column bit in each thread's registers, so
    the softmax can drop them for free (_real_columns) when the heads sit in rows with those bits 0:
    H = N / 2 uses rows 0 .. N/2 - 1, H = N / 4 the even ones among them.
    """
    r = tl.arange(0, N)
    if H <= N // 4:
        real = (r < N // 2) & (r % 2 == 0)
        head = r // 2
    else:
        real = r < H
        head = r
    return real, head


@triton.jit
def _real_columns(x, ROWS: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """[ROWS, N] -> [ROWS, H]: the columns that hold query heads (_query_rows); register moves only."""
    if H <= N // 2:  # drop the highest column bit
        x, _ = tl.split(tl.permute(tl.reshape(x, (ROWS, 2, N // 2)), (0, 2, 1)))
    if H <= N // 4:  # drop column bit 0
        x, _ = tl.split(tl.reshape(x, (ROWS, N // 4, 2)))
    return x


@triton.jit
def _padded_columns(x, ROWS: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """[ROWS, H] -> [ROWS, N] with zeros in the padding columns (inverse of _real_columns)."""
    if H <= N // 4:
        x = tl.reshape(tl.join(x, tl.zeros_like(x)), (ROWS, N // 2))
    if H <= N // 2:
        x = tl.reshape(tl.permute(tl.join(x, tl.zeros_like(x)), (0, 2, 1)), (ROWS, N))
    return x


@triton.jit
def _offset_terms(q_ptr, q_row, q_stride_t, q_stride_h, kv_head, const_ptr, mean_ptr, sink_ptr, pairs_ptr, qk_scale,
                  GQA: tl.constexpr, GQA_PAD: tl.constexpr, H: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                  PP: tl.constexpr):
    """X, Y and the sink's extra score [H] of the program's query heads (pre-scaled, not rotated). For few
    pairs (2 PP <= EARLY_PAD_COLUMNS) X^T, Y^T [2 PP, GQA_PAD] with the heads already in the columns of the
    padded query tile (_query_rows), else X, Y [H, 2 PP] (_turned_offset pads them each step).

    Over the KV head's P turning rotate-half pairs f = pairs[j] (padded to PP with zeros),
    <q, RoPE(p) mean> = sum_j cos(theta_f p) A_j + sin(theta_f p) B_j with A = q1 m1 + q2 m2 and
    B = q2 m1 - q1 m2, (q1, q2) and (m1, m2) the pair's dims (f, f + D/2); X stacks (A, B) and Y (B, -A), so
    that turning by an angle is X cos + Y sin. The mean is zero on the other pairs: they add nothing.
    <q, const> is the same for every key of the row, which softmax ignores: never added. Position 0 holds
    the sink instead of const + RoPE(0) mean = const + mean, so it scores <q, sink - const - mean> more
    than the bias gives it (the const dropped there too: layout_change.md "Fused decode").
    """
    HALF: tl.constexpr = D // 2
    EARLY: tl.constexpr = 2 * PP <= EARLY_PAD_COLUMNS
    R: tl.constexpr = GQA_PAD if EARLY else H
    if EARLY:
        real, g = _query_rows(GQA_PAD, H)
        real = (real & (g < GQA))[:, None]
    else:
        g = tl.arange(0, H)
        real = (g < GQA)[:, None]
    j = tl.arange(0, PP)[None, :]
    rows = q_ptr + q_row * q_stride_t + (kv_head * GQA + g)[:, None] * q_stride_h
    f = tl.load(pairs_ptr + kv_head * P + j, mask=j < P, other=0)
    q1 = tl.load(rows + f, mask=real, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(rows + HALF + f, mask=real, other=0.0).to(tl.float32) * qk_scale
    m1 = tl.load(mean_ptr + kv_head * D + f, mask=j < P, other=0.0)
    m2 = tl.load(mean_ptr + kv_head * D + HALF + f, mask=j < P, other=0.0)
    a, b = q1 * m1 + q2 * m2, q2 * m1 - q1 * m2
    x = tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (R, 2 * PP))
    y = tl.reshape(tl.permute(tl.join(b, -a), (0, 2, 1)), (R, 2 * PP))
    h = tl.arange(0, H)[:, None]
    d = kv_head * D + tl.arange(0, D)[None, :]
    q = tl.load(q_ptr + q_row * q_stride_t + (kv_head * GQA + h) * q_stride_h + tl.arange(0, D)[None, :],
                mask=h < GQA, other=0.0).to(tl.float32) * qk_scale
    extra = tl.load(sink_ptr + d) - tl.load(const_ptr + d) - tl.load(mean_ptr + d)
    if EARLY:
        x, y = tl.trans(x), tl.trans(y)
    return x, y, tl.sum(q * extra, axis=1)


@triton.jit
def _turn_table(inv_freq_ptr, pairs_ptr, kv_head, BLOCK: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
                OP: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK, 2 PP]: cos(theta_f t) in column j, sin(theta_f t) in column PP + j, f = pairs[j], t = 0 .. BLOCK - 1.

    Built once per program in a plain blocked layout, which the compiler keeps in shared memory for the
    mma (a table joined from two halves stayed in 32 registers a thread and spilled)."""
    col = tl.arange(0, 2 * PP)[None, :]
    f = tl.load(pairs_ptr + kv_head * P + col % PP, mask=col % PP < P, other=0)
    angle = tl.arange(0, BLOCK).to(tl.float32)[:, None] * tl.load(inv_freq_ptr + f)
    cos, sin = sincos(angle, ASM)
    return tl.where(col < PP, cos, sin).to(OP)


@triton.jit
def _turned_offset(t0, x, y, inv_freq_ptr, pairs_ptr, kv_head, P: tl.constexpr, PP: tl.constexpr,
                   GQA_PAD: tl.constexpr, H: tl.constexpr, OP: tl.constexpr, ASM: tl.constexpr):
    """(A, B) turned by the angles theta_f t0 of the tile's first position, as the [2 PP, GQA_PAD] operand of
    the dot with the table whose result is <q, RoPE(t0 + t) mean> (layout_change.md "Fused decode").

    The angles are float32 products as the model rounds them. Shapes chosen by the sm_90 instruction
    count (`python bench/turbo_sass.py --offset`, turbo3 64 tokens / 4 warps, per step): with few pairs
    (PP = 8) the heads come padded (_offset_terms) and each of the 2 PP columns computes its pair's
    angle: 496 instructions, 8 barriers (padding here and joining the PP angles each went through shared
    memory: 547, 15 barriers); with all 64 pairs the PP angles joined in registers and the heads padded
    here, as zeros like P's (_padded_columns): 547 instructions, 8 barriers (605, 11 the other way)."""
    if 2 * PP <= EARLY_PAD_COLUMNS:
        col = tl.arange(0, 2 * PP) % PP  # A's and B's column of a pair: one angle; padding: pair 0's, times 0
        freq = tl.load(inv_freq_ptr + tl.load(pairs_ptr + kv_head * P + col, mask=col < P, other=0))
        cos, sin = sincos(freq * t0, ASM)
        turned = (x * cos[:, None] + y * sin[:, None]).to(OP)
    else:
        j = tl.arange(0, PP)  # padding j >= P: pair 0's angle, times zero A and B
        cos, sin = sincos(tl.load(inv_freq_ptr + tl.load(pairs_ptr + kv_head * P + j, mask=j < P, other=0)) * t0,
                          ASM)
        cos = tl.reshape(tl.permute(tl.join(cos, cos), (1, 0)), (2 * PP,))  # A's and B's row of a pair: one angle
        sin = tl.reshape(tl.permute(tl.join(sin, sin), (1, 0)), (2 * PP,))
        turned = _padded_columns(tl.trans((x * cos[None, :] + y * sin[None, :]).to(OP)), 2 * PP, GQA_PAD, H)
    return turned


@triton.jit
def _split_tokens(seq_len, num_splits, BLOCK: tl.constexpr):
    """Tokens per split of a sequence: whole blocks, cut from the sequence's own length, not the launch's planned
    one (a CUDA graph plans for the longest context; short sequences would leave most splits idle)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK), 1) * BLOCK


@triton.jit
def _tile_scores(k, q, BLOCK: tl.constexpr, GQA_PAD: tl.constexpr, H: tl.constexpr):
    """[H, BLOCK]: <q, k> of the program's heads with a tile's keys [BLOCK, D] (q pre-scaled, both rotated).

    The decoded tile sits on the mma's row side (K @ Q^T, and V^T @ P^T in _accumulate): with 64+ rows
    sm_90 gets wgmma straight from shared memory instead of mma.sync fragments (SASS main loop
    1670 -> 1439 instructions at 64 tokens / 4 warps)."""
    return tl.trans(_real_columns(tl.dot(k, tl.trans(q)), BLOCK, GQA_PAD, H))


@triton.jit
def _offset_scores(scores, t0, table, turned, sink_extra, BLOCK: tl.constexpr, GQA_PAD: tl.constexpr,
                   H: tl.constexpr, F16: tl.constexpr):
    """scores plus <q, o(p) - const> of the tile's positions t0 .. t0 + BLOCK (the keys lost o(p), key_offset.py):
    the bias dot of the turned (A, B) with the in-tile angle table, and the sink's extra score at position 0."""
    bias = tl.dot(table, turned, input_precision="tf32" if F16 else "ieee")  # fp32: exact "ieee"
    scores += tl.trans(_real_columns(bias, BLOCK, GQA_PAD, H))
    return scores + tl.where((t0 + tl.arange(0, BLOCK) == 0)[None, :], sink_extra[:, None], 0.0)


@triton.jit
def _softmax_step(scores, valid, m, l):
    """The online softmax over one tile (scores [H, BLOCK] in log2 units, valid [BLOCK]): (p, alpha, m_new, l),
    p = 2^(s - m_new) per key, alpha the factor that rescales what was accumulated under m."""
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return p, alpha, m_new, l * alpha[:, None] + p


@triton.jit
def _accumulate(acc_t, alpha, p, v, D: tl.constexpr, GQA_PAD: tl.constexpr, H: tl.constexpr):
    """acc_t [D, H] rescaled by alpha plus V^T P for the tile's values v [BLOCK, D] and probabilities p, the mma
    operand [BLOCK, GQA_PAD] (_padded_columns of the softmax's p in the operand type)."""
    return acc_t * alpha[None, :] + _real_columns(tl.dot(tl.trans(v), p), D, GQA_PAD, H)


@triton.jit
def _ring_tile(ring_ptr, ring_row, tok, valid, window, kv_head, H_KV: tl.constexpr, D: tl.constexpr,
               OP: tl.constexpr):
    """The recent window's rows of positions tok [ROWS] as mma operands [ROWS, D]: index tok % W of the
    sequence's ring row (recent.py), already rotated and exact, in their natural column order (the ring's
    program takes q back to it once instead of permuting every tile)."""
    at = ((ring_row * window + tok % window) * H_KV + kv_head) * D
    x = tl.load(ring_ptr + at[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    return x.to(OP)


@triton.jit
def _decode_kernel(q_ptr, q_stride_t, q_stride_h, q_start_ptr, seq_lens_ptr, tables_ptr, tables_stride,
                   k_codes, k_norms, k_poly, k_table, v_codes, v_norms, v_poly, v_table, first_ptr, second_ptr,
                   inv_sqrt, qk_scale, const_ptr, mean_ptr, sink_ptr, inv_freq_ptr, pairs_ptr, part_acc_ptr,
                   part_m_ptr, part_l_ptr, num_splits, new_k_ptr, new_k_stride_t, new_k_stride_h, new_v_ptr,
                   new_v_stride_t, new_v_stride_h, new_slot_ptr, new_pos_ptr, k_mid, k_cent, v_mid, v_cent,
                   recent_k_ptr, recent_v_ptr, recent_rows_ptr, window, H_KV: tl.constexpr, GQA: tl.constexpr,
                   GQA_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr, K_BITS: tl.constexpr,
                   V_BITS: tl.constexpr, BLOCK: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
                   K_ORDER: tl.constexpr, V_ORDER: tl.constexpr, V_UNDO: tl.constexpr, OFFSET: tl.constexpr,
                   P: tl.constexpr, PP: tl.constexpr, STORE: tl.constexpr, STORE_OFFSET: tl.constexpr,
                   RECENT: tl.constexpr, K_UNDO: tl.constexpr, USE_PDL: tl.constexpr):
    # STORE: the step's new K and V (NewTokens) are quantized here, not by a store launch before; STORE_OFFSET is
    # what their keys lose first ("none", "fixed" or "turned", quantize.store_turbo_triton's K_OFFSET).
    # RECENT: positions j >= seq_len - window come from the recent window's ring (recent.py), not the pages.
    NG: tl.constexpr = D // G
    OP: tl.constexpr = tl.float16 if F16 else tl.float32
    if USE_PDL:  # server/kernels/pdl.py: the merge may be scheduled now; q, pages and ring are the store's output
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    paged_len = seq_len
    ring: tl.constexpr = False  # a constexpr: without RECENT the ring's branch is never traced
    if RECENT:  # program 0 reads the ring's [seq_len - window, seq_len), programs 1.. split the pages below it
        paged_len = tl.maximum(seq_len - window, 0)
        split = split - 1
        ring = split < 0
    chunk = _split_tokens(paged_len, num_splits, BLOCK)
    start = split * chunk
    end = tl.minimum(start + chunk, paged_len)
    busy = start < seq_len  # splits past the end (short rows, seq_len-0 padding) do nothing; merge skips them
    if RECENT:  # (start stays a multiple of BLOCK for the page loop's address arithmetic)
        busy = tl.where(ring, seq_len > 0, start < paged_len)

    if busy:
        # The softmax runs over the H <= GQA_PAD columns that can hold heads (_query_rows): 4 for GQA <= 4,
        # 8 for GQA <= 8: 2-4x less exp/max/rescale work per step than over the padded tile.
        H: tl.constexpr = GQA_PAD if 2 * GQA > GQA_PAD else (GQA_PAD // 2 if 4 * GQA > GQA_PAD else GQA_PAD // 4)
        real, g = _query_rows(GQA_PAD, H)
        q_row = tl.load(q_start_ptr + seq).to(tl.int64)
        if STORE:  # the new token, position seq_len - 1, lies in the last split: no other program reads it
            if split == (seq_len - 1) // chunk:
                new_row = q_row * H_KV + kv_head  # row of the new k, v: the step's token q_row, this KV head
                quantize_rows(new_k_ptr, new_k_stride_t, new_k_stride_h, new_slot_ptr, new_pos_ptr, k_codes, k_norms,
                              k_mid, k_cent, const_ptr, mean_ptr, sink_ptr, inv_freq_ptr, first_ptr, second_ptr,
                              inv_sqrt, new_row + 1, new_row, 1, new_k_ptr, new_slot_ptr, 1, H_KV, PAGE_SIZE, 1,
                              D, G, LOG2_G, K_BITS, STORE_OFFSET, 1, ASM, False)
                quantize_rows(new_v_ptr, new_v_stride_t, new_v_stride_h, new_slot_ptr, new_pos_ptr, v_codes, v_norms,
                              v_mid, v_cent, const_ptr, mean_ptr, sink_ptr, inv_freq_ptr, first_ptr, second_ptr,
                              inv_sqrt, new_row + 1, new_row, 1, new_v_ptr, new_slot_ptr, 1, H_KV, PAGE_SIZE, 1,
                              D, G, LOG2_G, V_BITS, "none", 1, ASM, False)
                tl.debug_barrier()  # a CTA barrier orders its threads' global stores before their loads below
        if OFFSET:  # the pages hold k - o(p): scores get <q, o(p) - const> back (key_offset.py)
            x, y, sink_extra = _offset_terms(q_ptr, q_row, q_stride_t, q_stride_h, kv_head, const_ptr, mean_ptr,
                                             sink_ptr, pairs_ptr, qk_scale, GQA, GQA_PAD, H, D, P, PP)
            table = _turn_table(inv_freq_ptr, pairs_ptr, kv_head, BLOCK, P, PP, OP, ASM)
        q = tl.load(q_ptr + q_row * q_stride_t + (kv_head * GQA + g)[:, None] * q_stride_h + tl.arange(0, D)[None, :],
                    mask=(real & (g < GQA))[:, None], other=0.0).to(tl.float32)
        q = rotate_rows(tl.reshape(q, (GQA_PAD * NG, G)), first_ptr, second_ptr, inv_sqrt, GQA_PAD * NG, G, LOG2_G)
        q = (tl.reshape(q, (GQA_PAD, D)) * qk_scale).to(OP)
        q = _permute_columns(q, GQA_PAD, D, K_ORDER)  # K's column order (see _permute_columns)

        m = tl.full((H,), float("-inf"), tl.float32)
        l = tl.zeros((H, BLOCK), tl.float32)  # per token slot; summed once at the end (no cross-warp sum per step)
        acc_t = tl.zeros((D, H), tl.float32)
        if not ring:
            # Norms are 2-byte loads, too narrow for the pipeliner's cp.async: load each block's one
            # step ahead (with its page-table entries) so their latency hides behind a whole step.
            valid, row, k_norm, v_norm = _block_rows(start, end, seq, kv_head, tables_ptr, tables_stride, k_norms,
                                                     v_norms, H_KV, PAGE_SIZE, NG, BLOCK)
            for t0 in range(start, end, BLOCK):
                valid_next, row_next, k_norm_next, v_norm_next = _block_rows(
                    t0 + BLOCK, end, seq, kv_head, tables_ptr, tables_stride, k_norms, v_norms, H_KV, PAGE_SIZE, NG,
                    BLOCK)
                if OFFSET:  # before the K tile: both dots' operands then share one barrier (550 -> 532 per step)
                    turned = _turned_offset(t0, x, y, inv_freq_ptr, pairs_ptr, kv_head, P, PP, GQA_PAD, H, OP, ASM)
                k = _tile(k_codes, row, valid, k_norm, k_table, k_poly, BLOCK, D, G, K_BITS, F16, ASM, K_ORDER)
                scores = _tile_scores(k, q, BLOCK, GQA_PAD, H)
                if NG == 1:
                    scores = scores * tl.reshape(k_norm, (BLOCK,))[None, :]
                if OFFSET:
                    scores = _offset_scores(scores, t0, table, turned, sink_extra, BLOCK, GQA_PAD, H, F16)
                p, alpha, m, l = _softmax_step(scores, valid, m, l)
                if NG == 1:  # fold the value norms into the probabilities
                    p = p * tl.reshape(v_norm, (BLOCK,))[None, :]
                p = _padded_columns(tl.trans(p.to(OP)), BLOCK, GQA_PAD, H)  # before the V tile: same sm_90 code
                v = _tile(v_codes, row, valid, v_norm, v_table, v_poly, BLOCK, D, G, V_BITS, F16, ASM, V_ORDER)
                acc_t = _accumulate(acc_t, alpha, p, v, D, GQA_PAD, H)
                valid, row, k_norm, v_norm = valid_next, row_next, k_norm_next, v_norm_next
        else:  # the same step over exact rows: the ring holds rotate(k - o(p)) like the pages, and no norms
            ring_row = tl.load(recent_rows_ptr + seq).to(tl.int64)
            q_natural = _permute_columns(q, GQA_PAD, D, K_UNDO)
            # Not pipelined: its cp.async stages took 32 KB more shared memory (57 KB a program, so 3 programs
            # an SM instead of 4 for every program of the launch, sm_90), for a loop of 2-3 steps.
            for t0 in tl.range(paged_len, seq_len, BLOCK, num_stages=1):
                tok = t0 + tl.arange(0, BLOCK)
                valid = tok < seq_len
                if OFFSET:
                    turned = _turned_offset(t0, x, y, inv_freq_ptr, pairs_ptr, kv_head, P, PP, GQA_PAD, H, OP, ASM)
                k = _ring_tile(recent_k_ptr, ring_row, tok, valid, window, kv_head, H_KV, D, OP)
                scores = _tile_scores(k, q_natural, BLOCK, GQA_PAD, H)
                if OFFSET:
                    scores = _offset_scores(scores, t0, table, turned, sink_extra, BLOCK, GQA_PAD, H, F16)
                p, alpha, m, l = _softmax_step(scores, valid, m, l)
                p = _padded_columns(tl.trans(p.to(OP)), BLOCK, GQA_PAD, H)
                v = _ring_tile(recent_v_ptr, ring_row, tok, valid, window, kv_head, H_KV, D, OP)
                acc_t = _accumulate(acc_t, alpha, p, v, D, GQA_PAD, H)
            acc_t = tl.trans(_permute_columns(tl.trans(acc_t), H, D, V_ORDER))  # to V's order, which V_UNDO undoes

        acc = _permute_columns(tl.trans(acc_t), H, D, V_UNDO)  # back from V's column order
        h = tl.arange(0, H)
        slot = split
        slots = num_splits
        if RECENT:  # the ring's partial first, then the page splits'
            slot = split + 1
            slots = num_splits + 1
        part = (seq * (H_KV * GQA) + kv_head * GQA + h) * slots + slot
        tl.store(part_acc_ptr + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=(h < GQA)[:, None])
        tl.store(part_m_ptr + part, m, mask=h < GQA)
        tl.store(part_l_ptr + part, tl.sum(l, axis=1), mask=h < GQA)


@triton.jit
def _merge_kernel(out_ptr, out_stride_t, out_stride_h, q_start_ptr, seq_lens_ptr, part_acc_ptr, part_m_ptr,
                  part_l_ptr, num_splits, first_ptr, second_ptr, inv_sqrt, window, BLOCK: tl.constexpr,
                  SPLIT_TILE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr,
                  RECENT: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per (sequence, query head): log-sum-exp merge of its splits, SPLIT_TILE at a time. RECENT: the
    ring program's partial comes first, then the page splits' over the seq_len - window positions below it."""
    NG: tl.constexpr = D // G
    if USE_PDL:  # the output projection may start streaming its weights; the partials are the decode's output
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # RECENT: the ring's partial (slot 0, written when seq_len > 0) is read on its own, so 64 page splits still
    # take one SPLIT_TILE pass (65 slots in tiles of 64 took two: the window's cost at batch 1 was mostly that).
    ring = seq_len > 0
    if RECENT:
        paged_len = tl.maximum(seq_len - window, 0)
        ring_part = (seq * tl.num_programs(1) + head) * (num_splits + 1)
        part0 = ring_part + 1
        used = tl.minimum(tl.cdiv(paged_len, _split_tokens(paged_len, num_splits, BLOCK)), num_splits)
        m_max = tl.load(part_m_ptr + ring_part, mask=ring, other=float("-inf"))
    else:
        part0 = (seq * tl.num_programs(1) + head) * num_splits
        used = tl.minimum(tl.cdiv(seq_len, _split_tokens(seq_len, num_splits, BLOCK)), num_splits)  # splits that wrote
        m_max = float("-inf")
    tile = tl.arange(0, SPLIT_TILE)
    for s0 in range(0, used, SPLIT_TILE):
        m_max = tl.maximum(m_max, tl.max(tl.load(part_m_ptr + part0 + s0 + tile, mask=s0 + tile < used,
                                                 other=float("-inf"))))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # seq_len 0: no split, keep the math finite

    out = tl.zeros((D,), tl.float32)
    denom = 0.0
    if RECENT:
        w_ring = tl.exp2(tl.load(part_m_ptr + ring_part, mask=ring, other=float("-inf")) - m_max)
        denom = w_ring * tl.load(part_l_ptr + ring_part, mask=ring, other=0.0)
        out = w_ring * tl.load(part_acc_ptr + ring_part * D + tl.arange(0, D), mask=ring, other=0.0)
    for s0 in range(0, used, SPLIT_TILE):
        present = s0 + tile < used
        w = tl.exp2(tl.load(part_m_ptr + part0 + s0 + tile, mask=present, other=float("-inf")) - m_max)
        denom += tl.sum(w * tl.load(part_l_ptr + part0 + s0 + tile, mask=present, other=0.0))
        acc = tl.load(part_acc_ptr + (part0 + s0 + tile)[:, None] * D + tl.arange(0, D)[None, :],
                      mask=present[:, None], other=0.0)
        out += tl.sum(w[:, None] * acc, axis=0)
    out = out / tl.where(denom > 0, denom, 1.0)
    # Back from the rotated domain: the inverse swaps the sign tables (rotation.py).
    out = tl.reshape(rotate_rows(tl.reshape(out, (NG, G)), second_ptr, first_ptr, inv_sqrt, NG, G, LOG2_G), (D,))
    q_row = tl.load(q_start_ptr + seq).to(tl.int64)
    tl.store(out_ptr + q_row * out_stride_t + head * out_stride_h + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class NewTokens:
    """A decode step's new K and V for the decode kernel to store itself (TurboKVStore's fused write): k, v
    [S, kv_heads, D] (last dim contiguous), row t the token of the sequence whose query is row t; its slot and
    position; the key offset its keys lose (the store's, turned or fixed; None: the spec's plain format)."""

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    key_offset: KeyOffset | None
    key_offset_turns: bool

    def select(self, rows: torch.Tensor | slice) -> NewTokens:
        """These tokens at ``rows`` only (paged_kv.select_sequences)."""
        return NewTokens(self.k[rows], self.v[rows], self.slot_mapping[rows], self.positions[rows], self.key_offset,
                         self.key_offset_turns)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(i) for i in range(len(order)))


def _new_token_arguments(new: NewTokens | None, q: torch.Tensor, key_offset: KeyOffset | None, k_pages: TurboPages,
                         v_pages: TurboPages, f32: torch.Tensor, i32: torch.Tensor) -> tuple:
    """The decode kernel's arguments from new_k_ptr to v_cent (any float32 / int32 tensor for pointers
    never read without STORE)."""
    if new is None:
        return (f32, 0, 0, f32, 0, 0, i32, i32, f32, f32, f32, f32)
    if key_offset is not None and new.key_offset is not key_offset:
        raise ValueError("the decode adds back a key offset the new tokens do not lose: pass the store's offset "
                         "as both key_offset and new_tokens.key_offset")
    k, v, num_seqs = new.k, new.v, q.shape[0]
    want = (num_seqs, k_pages.codes.shape[1], q.shape[2])
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != want or t.stride(-1) != 1:
            raise ValueError(f"new_tokens.{name} must be [{want[0]} sequences, {want[1]} KV heads, {want[2]}] with a "
                             f"contiguous last dim (one new token per sequence), got {tuple(t.shape)} {t.stride()}")
    for name, t in (("slot_mapping", new.slot_mapping), ("positions", new.positions)):
        if tuple(t.shape) != (num_seqs,):
            raise ValueError(f"new_tokens.{name} must have one entry per sequence ({num_seqs}), got {tuple(t.shape)}")
    return (k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), new.slot_mapping, new.positions,
            k_pages.midpoints, k_pages.centroids, v_pages.midpoints, v_pages.centroids)


def whole_block_splits(tokens: int, block: int, splits: int) -> int:
    """The split count a decode launch planned for ``tokens`` ends with when asked for ``splits``: splits of whole
    ``block``s (what the kernels' split lengths come to at that length), none of them left empty."""
    blocks = max(1, triton.cdiv(tokens, block))
    return max(1, triton.cdiv(blocks, triton.cdiv(blocks, splits)))


def choose_splits(num_seqs: int, kv_heads: int, max_seq_len: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Split long contexts into at most PROGRAMS_PER_SM programs per SM (flash-decoding), but not into
    splits shorter than MIN_SPLIT_TOKENS unless they all fit one wave (RESIDENT_PROGRAMS per SM), and never
    shorter than MIN_SPLIT_BLOCKS blocks. Returns the count the launch ends with (whole blocks per split).

    At most, not about: one program over two waves of the 4 resident programs per SM is a third
    wave (H200, b8/64K at 128 registers: 16 splits 0.470 ms, the 17 of rounding up 0.494 ms).
    One wave of short splits beats fewer long ones when the rows are few: H200, 2026-11-30 10:49 UTC,
    bench/turbo_b1_sweep.py (batch 1, 8 KV heads, turbo3, partial key offset, microseconds a layer in a
    decode graph): 16K 65 splits 24.5, 33 splits 25.1, the rule before's 17 (splits of >= 1024 tokens) 32.7;
    4K 33 splits of 2 blocks 13.3, 65 of 1 block 14.8, the rule before's 17 14.7; 64K 65 splits (unchanged) 64.1.
    """
    blocks = max(1, triton.cdiv(max_seq_len, block_n))
    rows = max(1, num_seqs * kv_heads)
    sms = multiprocessors(device)
    wanted = PROGRAMS_PER_SM * sms // rows
    long_enough = max(RESIDENT_PROGRAMS * sms // rows, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS))
    return whole_block_splits(max_seq_len, block_n, min(triton.cdiv(blocks, MIN_SPLIT_BLOCKS), wanted, long_enough))


def decode_attention_triton(q: torch.Tensor, k_pages: TurboPages, v_pages: TurboPages, meta: AttentionMetadata,
                            scale: float, signs: tuple[torch.Tensor, torch.Tensor], inv_sqrt: float,
                            key_offset: KeyOffset | None = None, num_splits: int | None = None, block_n: int = BLOCK_N,
                            num_warps: int = NUM_WARPS, max_registers: int | None = MAX_REGISTERS,
                            num_stages: int | None = NUM_STAGES,
                            column_order: dict[tuple[int, int], tuple[int, ...]] = COLUMN_ORDER,
                            new_tokens: NewTokens | None = None, recent: RecentWindow | None = None) -> torch.Tensor:
    """q [S, q_heads, D] (one query per sequence) -> attention output [S, q_heads, D] in q's dtype.

    ``key_offset``: the o(p) the K pages lost (key_offset.py; float32 contiguous tensors), added back
    as <q, o(p)> in the scores; None compiles the plain kernel. ``new_tokens``: the step's K and V, not yet
    stored; the program whose split holds position seq_len - 1 quantizes them into their slots (as
    quantize.store_turbo_triton would) before it reads its pages, which saves the store's launch on a decode
    step's critical path. ``recent``: the recent window (recent.py), its ring already holding the step's token
    (store_turbo's recent): sequence s reads positions j >= seq_len - W from ring row meta.recent_rows[s] and
    the rest from the pages; None compiles the kernel without it. ``num_splits`` and the launch settings exist
    for tests and the benchmark's sweep.
    """
    num_seqs, q_heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    kv_heads, page_size = k_pages.codes.shape[1], k_pages.codes.shape[2]
    gqa = q_heads // kv_heads
    group = group_size(head_dim)
    out = torch.empty_like(q)
    if new_tokens is not None and recent is not None:
        raise ValueError("the fused store (new_tokens) does not write the recent window: store the step's tokens "
                         "with store_turbo(..., recent=...) first and pass new_tokens=None")
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_splits(num_seqs, kv_heads, meta.max_seq_len, q.device, block_n)
    num_splits = whole_block_splits(meta.max_seq_len, block_n, num_splits)
    programs = num_splits + (recent is not None)  # per (sequence, KV head): the splits and the ring's program
    part_acc = torch.empty(num_seqs * q_heads * programs, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs * q_heads * programs, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    gqa_pad = max(16, triton.next_power_of_2(gqa))  # tl.dot needs at least 16 rows
    pairs = 0 if key_offset is None else key_offset.pairs.shape[1]
    padded_pairs = max(8, triton.next_power_of_2(pairs))  # the bias dot's K = 2 PP: at least 16
    shape = dict(H_KV=kv_heads, GQA=gqa, GQA_PAD=gqa_pad, D=head_dim, G=group, LOG2_G=group.bit_length() - 1)
    new = _new_token_arguments(new_tokens, q, key_offset, k_pages, v_pages, part_m, meta.seq_lens)
    ring = recent_arguments(recent, meta.recent_rows, "meta.recent_rows", num_seqs, kv_heads, head_dim, part_m,
                            meta.seq_lens)
    store_offset = None if new_tokens is None else new_tokens.key_offset
    offset = key_offset if key_offset is not None else store_offset  # the same one where both are given
    with timed("turbo_decode_attention", q.device):
        _decode_kernel[(num_seqs, kv_heads, programs)](
            q, q.stride(0), q.stride(1), meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.block_tables.stride(0), k_pages.codes, k_pages.norms, k_pages.polynomial,
            lookup_table(k_pages.bits, group, q.device), v_pages.codes, v_pages.norms, v_pages.polynomial,
            lookup_table(v_pages.bits, group, q.device), signs[0], signs[1], inv_sqrt,
            scale * LOG2E, *offset_arguments(offset, part_m),
            meta.seq_lens if key_offset is None else key_offset.pairs,  # never read without OFFSET
            part_acc, part_m, part_l, num_splits, *new, *ring, OFFSET=key_offset is not None, P=pairs,
            PP=padded_pairs, STORE=new_tokens is not None,
            STORE_OFFSET=offset_mode(store_offset, store_offset is not None and new_tokens.key_offset_turns),
            RECENT=recent is not None,
            PAGE_SIZE=page_size, K_BITS=k_pages.bits, V_BITS=v_pages.bits, BLOCK=block_n,
            K_ORDER=column_order.get((k_pages.bits, head_dim), ()), V_ORDER=column_order.get((v_pages.bits, head_dim), ()),
            V_UNDO=_inverse(column_order.get((v_pages.bits, head_dim), ())),
            K_UNDO=_inverse(column_order.get((k_pages.bits, head_dim), ())),
            F16=q.dtype != torch.float32, ASM=inline_ptx(q.device),
            num_warps=num_warps, **({} if max_registers is None else {"maxnreg": max_registers}),
            **({} if num_stages is None else {"num_stages": num_stages}),
            **shape, **pdl.launch_options(q.device),
        )
        _merge_kernel[(num_seqs, q_heads)](
            out, out.stride(0), out.stride(1), meta.query_start_loc, meta.seq_lens, part_acc, part_m, part_l,
            num_splits, signs[0], signs[1], inv_sqrt, ring[3], BLOCK=block_n, SPLIT_TILE=MERGE_SPLIT_TILE, D=head_dim,
            G=group, LOG2_G=group.bit_length() - 1, RECENT=recent is not None, num_warps=MERGE_NUM_WARPS,
            **pdl.launch_options(q.device),
        )
    return out


def decoded_pages(pages: TurboPages, kind: str, page_ids: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The listed pages in the original domain: [len(page_ids), page_size, kv_heads, D] in ``dtype``."""
    rotated = dequantize_rotated(pages.codes[page_ids], pages.norms[page_ids], kind, head_dim)
    return rotate(rotated, group_size(head_dim), inverse=True).to(dtype).transpose(1, 2).contiguous()


def _decoded_page_layout(meta: AttentionMetadata, page_size: int, device: torch.device):
    """(page_ids, compact block tables, each decoded page's first position) of a step: each sequence's pages in
    table order become consecutive decoded pages of its own, with no sort and no host sync (a page two sequences
    listed would be decoded twice, which stays right). Once a step: every layer decodes the same pages."""
    def build():
        n_pages = [-(-n // page_size) for n in meta.seq_lens_cpu]
        used = [meta.block_tables[s, :n] for s, n in enumerate(n_pages)]
        page_ids = torch.cat(used).long() if used else torch.zeros(0, dtype=torch.long, device=device)
        tables = torch.zeros_like(meta.block_tables)
        offset = 0
        for s, n in enumerate(n_pages):
            tables[s, :n] = torch.arange(offset, offset + n, dtype=tables.dtype, device=device)
            offset += n
        page_start = torch.cat([torch.arange(n, device=device) * page_size for n in n_pages]) if n_pages else page_ids
        return page_ids, tables, page_start

    return meta.step_value(f"decoded page layout {page_size}", build)


def attention_over_decoded_pages(q: torch.Tensor, k_pages: TurboPages, v_pages: TurboPages, k_kind: str,
                                 v_kind: str, meta: AttentionMetadata, scale: float,
                                 key_offset: KeyOffset | None = None, fast: bool | None = None,
                                 page_dtype: torch.dtype | None = None,
                                 exact: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """Any batch (prefill, chunked prefill, decode, mixed): decode only the referenced pages, then attend.

    ``exact``: the recent window's rows of the step and W (exact_rows.exact_rows_triton); each query then reads its
    last W positions from them (dense_attention.paged_prefill), fast path only.
    ``key_offset``: what the K pages lost before quantizing (key_offset.py); each decoded key gets
    o(p) of its position p (= its block-table index * page_size + its row) back.
    ``fast`` picks the dense Triton attention over pages decoded to ``page_dtype`` (default q's
    dtype), by default when ``use_triton(q)``; tests force it on CPU. The reference decodes to float32.
    """
    page_size = k_pages.codes.shape[2]
    page_ids, tables, page_start = _decoded_page_layout(meta, page_size, q.device)
    head_dim = q.shape[-1]
    fast = use_triton(q) if fast is None else fast
    dtype = (page_dtype or q.dtype) if fast else torch.float32
    if fast:  # one launch each (dense_pages.py)
        k = dense_pages_triton(k_pages, page_ids, dtype, key_offset, page_start)
        v = dense_pages_triton(v_pages, page_ids, dtype)
    else:
        k = decoded_pages(k_pages, k_kind, page_ids, head_dim, dtype)
        if key_offset is not None:
            positions = (page_start[:, None] + torch.arange(page_size, device=q.device)).reshape(-1)
            k = k + key_offset_at(key_offset, positions).reshape(k.shape)
        v = decoded_pages(v_pages, v_kind, page_ids, head_dim, dtype)
    if exact is not None:
        if not fast:
            raise ValueError("the reference reads the recent window through recent.attention_with_recent_reference")
        return paged_prefill(q, k, v, tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, scale,
                             exact=exact)
    compact_meta = AttentionMetadata(meta.slot_mapping, tables, meta.seq_lens, meta.query_start_loc,
                                     meta.seq_lens_cpu, meta.query_lens_cpu, prompt_dtype=meta.prompt_dtype)
    if fast:
        return dense_paged_attention(q, k, v, compact_meta, scale)
    return paged_attention_reference(q, k, v, compact_meta, scale)
