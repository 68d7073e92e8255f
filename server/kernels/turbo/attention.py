"""Attention over turbo pages: a fused decode kernel (flash-decoding) and a decode-then-attend path.

Decode (every sequence has one new query), specs/turboquant.md "Decoding":
  * grid (sequence, KV head, context split): all query heads of a KV head live in one
    program, so GQA shares a single read of the pages;
  * Q is rotated once in the program (and pre-scaled by softmax scale * log2 e);
    scores = norm_k * <R q, c[idx_k]>; V is accumulated in the rotated domain as
    sum_j p_j * norm_v * c[idx_v] with an online softmax;
  * codes are read as 32-bit words and decoded inside the loading thread
    (codes.decode_rows): with fp16/bf16 queries (the GPU case) by a byte-permute lookup
    of fp16 centroids (about one PRMT per value), and Q, K, P, V are fp16 mma operands
    with fp32 accumulation; with fp32 queries (CPU tests) indices and the codebook's odd
    polynomial in fp32;
  * a second small kernel merges the splits (log-sum-exp) and applies the one inverse
    rotation per output.

Everything else (prefill, chunked prefill, mixed batches, CPU) decodes the pages that the
batch references into compact dense pages and runs dense paged attention over them (the
Triton varlen kernel of dense_attention.py on GPU, ``paged_attention_reference`` otherwise):
correct for any chunk boundary, not fused in the rotated domain (yet).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from server.kernels.backend import use_triton
from server.kernels.dense_attention import paged_attention as dense_paged_attention
from server.kernels.paged_kv import AttentionMetadata, paged_attention_reference
from server.kernels.rotation import rotate, rotate_rows
from server.kernels.timing import timed
from server.kernels.turbo.codes import centroid_by_polynomial, decode_rows, lookup_table
from server.kernels.turbo.format import dequantize_rotated, group_size
from server.kernels.turbo.quantize import TurboPages

LOG2E = 1.4426950408889634
# Tokens per inner step and warps: 64 / 4 measured fastest (with 128 / 8 close), programs per
# SM 8 at batch 8 (vs 4 and 16) while batch 1 at 64K wanted splits of >= ~1000 tokens: the H200
# sweep of bench/turbo_decode_sweep.py, docs/BENCHMARKS.md.
BLOCK_N = 64
NUM_WARPS = 4
PROGRAMS_PER_SM = 8
MIN_SPLIT_TOKENS = 1024  # shorter splits spend more on their Q rotation and partial outputs than they hide
MAX_REGISTERS = None  # ptxas's choice (162 at 64 / 4: 3 programs per SM); the sweep also tries 128
NUM_STAGES = None  # Triton's default (3) for the cp.async pipeline of the code loads; the sweep also tries 5


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
def _decode_kernel(q_ptr, q_stride_t, q_stride_h, q_start_ptr, seq_lens_ptr, tables_ptr, tables_stride,
                   k_codes, k_norms, k_poly, k_table, v_codes, v_norms, v_poly, v_table, first_ptr, second_ptr,
                   inv_sqrt, qk_scale, part_acc_ptr, part_m_ptr, part_l_ptr, chunk, num_splits,
                   H_KV: tl.constexpr, GQA: tl.constexpr, GQA_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr, K_BITS: tl.constexpr,
                   V_BITS: tl.constexpr, BLOCK: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    NG: tl.constexpr = D // G
    OP: tl.constexpr = tl.float16 if F16 else tl.float32
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    if start < seq_len:  # splits past the end (short rows, seq_len-0 padding) do nothing; merge skips them
        g = tl.arange(0, GQA_PAD)
        heads = kv_head * GQA + g
        q_row = tl.load(q_start_ptr + seq).to(tl.int64)
        q = tl.load(q_ptr + q_row * q_stride_t + heads[:, None] * q_stride_h + tl.arange(0, D)[None, :],
                    mask=(g < GQA)[:, None], other=0.0).to(tl.float32)
        q = rotate_rows(tl.reshape(q, (GQA_PAD * NG, G)), first_ptr, second_ptr, inv_sqrt, GQA_PAD * NG, G, LOG2_G)
        q = (tl.reshape(q, (GQA_PAD, D)) * qk_scale).to(OP)

        m = tl.full((GQA_PAD,), float("-inf"), tl.float32)
        l = tl.zeros((GQA_PAD, BLOCK), tl.float32)  # per token slot; summed once at the end (no cross-warp sum per step)
        acc = tl.zeros((GQA_PAD, D), tl.float32)
        # Norms are 2-byte loads, too narrow for the pipeliner's cp.async: load each block's one
        # step ahead (with its page-table entries) so their latency hides behind a whole step.
        valid, row, k_norm, v_norm = _block_rows(start, end, seq, kv_head, tables_ptr, tables_stride, k_norms,
                                                 v_norms, H_KV, PAGE_SIZE, NG, BLOCK)
        for t0 in range(start, end, BLOCK):
            valid_next, row_next, k_norm_next, v_norm_next = _block_rows(
                t0 + BLOCK, end, seq, kv_head, tables_ptr, tables_stride, k_norms, v_norms, H_KV, PAGE_SIZE, NG, BLOCK)
            k = _centroids(k_codes + row * (D * K_BITS // 8), valid, k_table, k_poly, BLOCK, D, K_BITS, F16, ASM)
            # Both dots put the decoded tile on the mma's row side (K @ Q^T, V^T @ P^T): with 64+
            # rows sm_90 gets wgmma straight from shared memory instead of mma.sync fragments
            # (SASS main loop 1670 -> 1439 instructions at 64 tokens / 4 warps).
            if NG == 1:  # one norm per token: scale the scores, not every element
                scores = tl.trans(tl.dot(k, tl.trans(q))) * tl.reshape(k_norm, (BLOCK,))[None, :]
            else:
                k = tl.reshape(tl.reshape(k, (BLOCK, NG, G)) * k_norm[:, :, None].to(OP), (BLOCK, D))
                scores = tl.trans(tl.dot(k, tl.trans(q)))
            scores = tl.where(valid[None, :], scores, float("-inf"))

            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha[:, None] + p

            v = _centroids(v_codes + row * (D * V_BITS // 8), valid, v_table, v_poly, BLOCK, D, V_BITS, F16, ASM)
            if NG == 1:  # fold the value norms into the probabilities
                acc = acc * alpha[:, None] + tl.trans(tl.dot(tl.trans(v), tl.trans((p * tl.reshape(v_norm, (BLOCK,))[None, :]).to(OP))))
            else:
                v = tl.reshape(tl.reshape(v, (BLOCK, NG, G)) * v_norm[:, :, None].to(OP), (BLOCK, D))
                acc = acc * alpha[:, None] + tl.trans(tl.dot(tl.trans(v), tl.trans(p.to(OP))))
            m = m_new
            valid, row, k_norm, v_norm = valid_next, row_next, k_norm_next, v_norm_next

        part = (seq * (H_KV * GQA) + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=(g < GQA)[:, None])
        tl.store(part_m_ptr + part, m, mask=g < GQA)
        tl.store(part_l_ptr + part, tl.sum(l, axis=1), mask=g < GQA)


@triton.jit
def _merge_kernel(out_ptr, out_stride_t, out_stride_h, q_start_ptr, seq_lens_ptr, part_acc_ptr, part_m_ptr,
                  part_l_ptr, chunk, num_splits, first_ptr, second_ptr, inv_sqrt,
                  H_KV: tl.constexpr, GQA: tl.constexpr, GQA_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr):
    NG: tl.constexpr = D // G
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GQA_PAD)
    heads = kv_head * GQA + g
    part0 = (seq * (H_KV * GQA) + heads) * num_splits
    used = tl.minimum((tl.load(seq_lens_ptr + seq) + chunk - 1) // chunk, num_splits)  # splits the decode kernel wrote
    sp = tl.arange(0, SPLITS_PAD)
    present = (g < GQA)[:, None] & (sp < used)[None, :]
    m_all = tl.load(part_m_ptr + part0[:, None] + sp[None, :], mask=present, other=float("-inf"))
    m_max = tl.max(m_all, axis=1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # padded heads, seq_len 0: keep the math finite

    out = tl.zeros((GQA_PAD, D), tl.float32)
    denom = tl.zeros((GQA_PAD,), tl.float32)
    for i in range(used):
        m_i = tl.load(part_m_ptr + part0 + i, mask=g < GQA, other=float("-inf"))
        w = tl.exp2(m_i - m_max)
        denom += w * tl.load(part_l_ptr + part0 + i, mask=g < GQA, other=0.0)
        acc = tl.load(part_acc_ptr + (part0 + i)[:, None] * D + tl.arange(0, D)[None, :],
                      mask=(g < GQA)[:, None], other=0.0)
        out += w[:, None] * acc
    out = out / tl.where(denom > 0, denom, 1.0)[:, None]
    # Back from the rotated domain: the inverse swaps the sign tables (rotation.py).
    out = rotate_rows(tl.reshape(out, (GQA_PAD * NG, G)), second_ptr, first_ptr, inv_sqrt, GQA_PAD * NG, G, LOG2_G)
    out = tl.reshape(out, (GQA_PAD, D))
    q_row = tl.load(q_start_ptr + seq).to(tl.int64)
    tl.store(out_ptr + q_row * out_stride_t + heads[:, None] * out_stride_h + tl.arange(0, D)[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(g < GQA)[:, None])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def choose_splits(num_seqs: int, kv_heads: int, max_seq_len: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Split long contexts toward PROGRAMS_PER_SM programs per SM (flash-decoding), but not into splits
    shorter than MIN_SPLIT_TOKENS unless that leaves SMs without a program."""
    blocks = max(1, triton.cdiv(max_seq_len, block_n))
    rows = max(1, num_seqs * kv_heads)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(device), rows)
    long_enough = max(triton.cdiv(_sm_count(device), rows), triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS))
    return max(1, min(blocks, wanted, long_enough))


def decode_attention_triton(q: torch.Tensor, k_pages: TurboPages, v_pages: TurboPages, meta: AttentionMetadata,
                            scale: float, signs: tuple[torch.Tensor, torch.Tensor], inv_sqrt: float,
                            num_splits: int | None = None, block_n: int = BLOCK_N,
                            num_warps: int = NUM_WARPS, max_registers: int | None = MAX_REGISTERS,
                            num_stages: int | None = NUM_STAGES) -> torch.Tensor:
    """q [S, q_heads, D] (one query per sequence) -> attention output [S, q_heads, D] in q's dtype.

    ``num_splits`` and the launch settings exist for tests and the benchmark's sweep.
    """
    num_seqs, q_heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    kv_heads, page_size = k_pages.codes.shape[1], k_pages.codes.shape[2]
    gqa = q_heads // kv_heads
    group = group_size(head_dim)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_splits(num_seqs, kv_heads, meta.max_seq_len, q.device, block_n)
    blocks = max(1, triton.cdiv(meta.max_seq_len, block_n))
    chunk = triton.cdiv(blocks, num_splits) * block_n
    num_splits = max(1, triton.cdiv(meta.max_seq_len, chunk))
    part_acc = torch.empty(num_seqs * q_heads * num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(num_seqs * q_heads * num_splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    gqa_pad = max(16, triton.next_power_of_2(gqa))  # tl.dot needs at least 16 rows
    shape = dict(H_KV=kv_heads, GQA=gqa, GQA_PAD=gqa_pad, D=head_dim, G=group, LOG2_G=group.bit_length() - 1)
    with timed("turbo_decode_attention", q.device):
        _decode_kernel[(num_seqs, kv_heads, num_splits)](
            q, q.stride(0), q.stride(1), meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.block_tables.stride(0), k_pages.codes, k_pages.norms, k_pages.polynomial,
            lookup_table(k_pages.bits, group, q.device), v_pages.codes, v_pages.norms, v_pages.polynomial,
            lookup_table(v_pages.bits, group, q.device), signs[0], signs[1], inv_sqrt,
            scale * LOG2E, part_acc, part_m, part_l, chunk, num_splits,
            PAGE_SIZE=page_size, K_BITS=k_pages.bits, V_BITS=v_pages.bits, BLOCK=block_n,
            F16=q.dtype != torch.float32, ASM=q.device.type == "cuda" and torch.version.cuda is not None,
            num_warps=num_warps, **({} if max_registers is None else {"maxnreg": max_registers}),
            **({} if num_stages is None else {"num_stages": num_stages}),
            **shape,
        )
        _merge_kernel[(num_seqs, kv_heads)](
            out, out.stride(0), out.stride(1), meta.query_start_loc, meta.seq_lens, part_acc, part_m, part_l,
            chunk, num_splits, signs[0], signs[1], inv_sqrt, SPLITS_PAD=triton.next_power_of_2(num_splits),
            **shape,
        )
    return out


def decoded_pages(pages: TurboPages, kind: str, page_ids: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The listed pages in the original domain: [len(page_ids), page_size, kv_heads, D] in ``dtype``."""
    rotated = dequantize_rotated(pages.codes[page_ids], pages.norms[page_ids], kind, head_dim)
    return rotate(rotated, group_size(head_dim), inverse=True).to(dtype).transpose(1, 2).contiguous()


def attention_over_decoded_pages(q: torch.Tensor, k_pages: TurboPages, v_pages: TurboPages, k_kind: str,
                                 v_kind: str, meta: AttentionMetadata, scale: float,
                                 fast: bool | None = None, page_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Any batch (prefill, chunked prefill, decode, mixed): decode only the referenced pages, then attend.

    ``fast`` picks the dense Triton attention over pages decoded to ``page_dtype`` (default q's
    dtype), by default when ``use_triton(q)``; tests force it on CPU. The reference decodes to float32.
    """
    page_size = k_pages.codes.shape[2]
    used = [meta.block_tables[s, : -(-n // page_size)] for s, n in enumerate(meta.seq_lens_cpu)]
    used = torch.cat(used).long() if used else torch.zeros(0, dtype=torch.long, device=q.device)
    page_ids, compact = torch.unique(used, return_inverse=True)
    tables = torch.zeros_like(meta.block_tables)
    offset = 0
    for s, n in enumerate(meta.seq_lens_cpu):
        n_pages = -(-n // page_size)
        tables[s, :n_pages] = compact[offset : offset + n_pages].to(tables.dtype)
        offset += n_pages
    head_dim = q.shape[-1]
    fast = use_triton(q) if fast is None else fast
    dtype = (page_dtype or q.dtype) if fast else torch.float32
    k = decoded_pages(k_pages, k_kind, page_ids, head_dim, dtype)
    v = decoded_pages(v_pages, v_kind, page_ids, head_dim, dtype)
    compact_meta = AttentionMetadata(meta.slot_mapping, tables, meta.seq_lens, meta.query_start_loc,
                                     meta.seq_lens_cpu, meta.query_lens_cpu)
    if fast:
        return dense_paged_attention(q, k, v, compact_meta, scale)
    return paged_attention_reference(q, k, v, compact_meta, scale)

