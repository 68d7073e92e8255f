"""Triton paged attention over plain float pages: the fast body of ``DenseKVStore``.

Same meaning as ``paged_kv.paged_attention_reference`` (read that first); three kernels:

- ``write_kv_pages``: scatters a step's new K and V into their slots in one launch. A
  negative slot means "padding row, store nothing", which lets CUDA-graph replays pad a
  batch up to its captured size without touching any sequence's pages.
- ``paged_decode``: one query token per sequence (flash-decoding). A program owns one
  (sequence, KV head, split): it reads each K/V tile once for all query heads of its GQA
  group, because decode is bound by reading the pages, not by arithmetic. Long contexts
  are cut into ``num_splits`` ranges whose partial results a merge kernel combines by
  their log-sum-exp. Split lengths are computed on the device from ``seq_lens``, so one
  launch (and one captured graph) is valid for any context length.
- ``paged_prefill``: a varlen chunk of queries per sequence attending causally to the
  cached prefix plus itself (whole prompts, chunked prefill, and mixed steps). Optionally
  with a recent window (server/kernels/turbo/recent.py): keys within W of the query come
  from each sequence's exact rows; only the few key tiles the window's edge crosses read both.

Softmax runs in float32 in the log2 domain (exp2 is one instruction); tiles multiply in
the pages' dtype. bf16 is converted before arithmetic, so the CPU interpreter is exact
for fp16/fp32 (shared/ENVIRONMENT.md).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from server.kernels import pdl
from server.kernels.backend import multiprocessors
from server.kernels.paged_kv import AttentionMetadata, decode_rows_apart
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.timing import timed

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) dominates


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_pages_ptr, v_pages_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_slot, stride_pslot, stride_ph,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        dst = slot * stride_pslot + head * stride_ph + dims
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=dim_mask)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=dim_mask)
        tl.store(k_pages_ptr + dst, k.to(k_pages_ptr.dtype.element_ty), mask=dim_mask)
        tl.store(v_pages_ptr + dst, v.to(v_pages_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _load_kv_tile(pages_ptr, block_table_row, toks, tok_mask, kv_head, dims, dim_mask,
                  stride_page, stride_slot, stride_head, PAGE_SIZE: tl.constexpr, near_first=0,
                  NEAR: tl.constexpr = False):
    """[BLOCK_N, BLOCK_D] of K or V for the given token positions, through the block table; NEAR: from a
    sequence's exact rows instead (pages_ptr at its first, position near_first), zero before them."""
    if NEAR:
        tok_mask &= toks >= near_first
        rows = (toks - near_first).to(tl.int64) * stride_slot + kv_head * stride_head
    else:
        pages = tl.load(block_table_row + toks // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
        rows = pages * stride_page + (toks % PAGE_SIZE) * stride_slot + kv_head * stride_head
    return tl.load(pages_ptr + rows[:, None] + dims[None, :],
                   mask=tok_mask[:, None] & dim_mask[None, :], other=0.0)


@triton.jit
def _attend_tile(q, visible, acc, l, m, k_pages_ptr, v_pages_ptr, block_table_row, toks, tok_mask, kv_head,
                 dims, dim_mask, stride_page, stride_slot, stride_head, scale_log2,
                 PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, near_first=0, NEAR: tl.constexpr = False):
    """One BLOCK_N tile of flash attention: scores (log2 domain), online-softmax rescale, P·V accumulate."""
    k = _load_kv_tile(k_pages_ptr, block_table_row, toks, tok_mask, kv_head, dims, dim_mask,
                      stride_page, stride_slot, stride_head, PAGE_SIZE, near_first, NEAR)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    v = _load_kv_tile(v_pages_ptr, block_table_row, toks, tok_mask, kv_head, dims, dim_mask,
                      stride_page, stride_slot, stride_head, PAGE_SIZE, near_first, NEAR)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l = l * alpha + tl.sum(p, axis=1)
    return acc, l, m_new


@triton.jit
def _decode_split_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_page, stride_slot, stride_head, stride_bt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # server/kernels/pdl.py: the next kernel may be scheduled now; q and the step's K/V are the qkv's
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole tiles per split, so only the last tile of the sequence is ragged.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q = q.to(k_pages_ptr.dtype.element_ty)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        acc, l, m = _attend_tile(q, tok_mask[None, :], acc, l, m, k_pages_ptr, v_pages_ptr, block_table_row, toks, tok_mask,
                                 kv_head, dims, dim_mask, stride_page, stride_slot, stride_head, scale_log2,
                                 PAGE_SIZE, DOT_PRECISION)

    # An empty range (a split past the end, or a padding row with seq_len 0) has l == 0:
    # it contributes output 0 and log-sum-exp -inf, never NaN.
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # [S, Hq, splits] row
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out, mask=mask)
        lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # the output projection may start streaming its weights; the partials are the split kernel's
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * NUM_HEADS + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits)
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # all splits empty: every weight is 0
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, axis=0)
    parts = tl.load(part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * BLOCK_D + dims[None, :])
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit
def _prefill_range(q, q_pos, acc, l, m, lo, hi, end, k_pages_ptr, v_pages_ptr, window, block_table_row, kv_head,
                   dims, dim_mask, stride_page, stride_slot, stride_head, scale_log2,
                   PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SIDE: tl.constexpr,
                   near_first=0):
    """Key tiles [lo, hi) of a query block (keys >= end masked), causally. SIDE 0: every key; 1: only keys far
    from the query (j <= t - window); 2: only near ones (t - window < j <= t), from the sequence's exact rows
    (k_pages_ptr / v_pages_ptr at its row of position near_first)."""
    newest = q_pos - window if SIDE == 1 else q_pos  # the last key each query reads here
    for n0 in range(lo, hi, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        visible = tok_mask[None, :] & (toks[None, :] <= newest[:, None])
        if SIDE == 2:
            visible &= toks[None, :] > newest[:, None] - window
        acc, l, m = _attend_tile(q, visible, acc, l, m, k_pages_ptr, v_pages_ptr, block_table_row, toks, tok_mask,
                                 kv_head, dims, dim_mask, stride_page, stride_slot, stride_head, scale_log2,
                                 PAGE_SIZE, DOT_PRECISION, near_first, SIDE == 2)
    return acc, l, m


@triton.jit
def _prefill_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_page, stride_slot, stride_head, stride_bt,
    k_near_ptr, v_near_ptr, stride_near_seq, window,  # last: placed earlier, they cost the plain kernel 12 registers
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, RECENT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = seq_len - q_len + rows  # position of each query in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q = q.to(k_pages_ptr.dtype.element_ty)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Causal: this block's last query sees keys up to its own position; an idle block
    # (past the sequence's queries) runs no iteration and stores nothing.
    end = tl.where(block_m * BLOCK_M < q_len, tl.minimum(seq_len, seq_len - q_len + (block_m + 1) * BLOCK_M), 0)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if RECENT:
        # Key j is near for query t when j > t - window: one pass over the far pages' keys, one over the
        # sequence's exact rows; the online softmax merges them as it merges tiles. The far pass ends at
        # near_start, where every key is near for the block's last query (end - 1), so for all; the near pass
        # starts at far_end, before which every key is far for its first query. Only the tiles between, two or
        # three, are read twice. A query can see no key in a whole tile of a pass, so the running max starts
        # finite: exp2(-inf - -inf) would be NaN (the plain kernel's first tile always shows key 0).
        m = tl.full([BLOCK_M], -1.0e30, tl.float32)
        first_q = seq_len - q_len + block_m * BLOCK_M
        far_end = tl.minimum(tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N, end)
        near_start = tl.minimum(tl.cdiv(tl.maximum(end - window, 0), BLOCK_N) * BLOCK_N, end)
        acc, l, m = _prefill_range(q, q_pos, acc, l, m, 0, near_start, end, k_pages_ptr, v_pages_ptr, window,
                                   block_table_row, kv_head, dims, dim_mask, stride_page, stride_slot, stride_head,
                                   scale_log2, PAGE_SIZE, BLOCK_N, DOT_PRECISION, 1)
        near_first = tl.maximum(seq_len - q_len - window + 1, 0)  # the first position any query reads exactly
        near = seq.to(tl.int64) * stride_near_seq
        acc, l, m = _prefill_range(q, q_pos, acc, l, m, far_end, end, end, k_near_ptr + near, v_near_ptr + near,
                                   window, block_table_row, kv_head, dims, dim_mask, stride_page, stride_slot,
                                   stride_head, scale_log2, PAGE_SIZE, BLOCK_N, DOT_PRECISION, 2, near_first)
    else:
        # Every row sees key 0 in the first tile, so the running max is finite from then on.
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        acc, l, m = _prefill_range(q, q_pos, acc, l, m, 0, end, end, k_pages_ptr, v_pages_ptr, window,
                                   block_table_row, kv_head, dims, dim_mask, stride_page, stride_slot, stride_head,
                                   scale_log2, PAGE_SIZE, BLOCK_N, DOT_PRECISION, 0)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Enough programs for two waves on every SM (one per SM leaves bandwidth idle)."""
    return 2 * multiprocessors(device) if device.type == "cuda" else 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Power of two (bounded recompiles) that fills the GPU without splits of a few tokens."""
    wanted = triton.cdiv(_target_programs(device), max(1, num_seqs * num_kv_heads))
    wanted = min(wanted, triton.cdiv(max(max_seq_len, 1), MIN_TOKENS_PER_SPLIT), MAX_SPLITS)
    return 1 if wanted <= 1 else triton.next_power_of_2(wanted)


def _check_pages(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    if q.dim() != 3 or k_pages.dim() != 4:
        raise ValueError(
            f"paged attention expects q [tokens, q_heads, head_dim] and pages [pages, page_size, kv_heads, "
            f"head_dim]; got q {tuple(q.shape)} and pages {tuple(k_pages.shape)}"
        )
    if k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride() or k_pages.dtype != v_pages.dtype:
        raise ValueError("K and V pages must have the same shape, strides and dtype")
    if k_pages.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the last (head_dim) dimension of q and of the pages must be contiguous")
    kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    if q.shape[2] != head_dim or q.shape[1] % kv_heads != 0:
        raise ValueError(
            f"q has {q.shape[1]} heads of dim {q.shape[2]}; pages have {kv_heads} KV heads of dim {head_dim}: "
            f"query heads must be a multiple of KV heads and head dims must match"
        )


def _dot_precision(pages: torch.Tensor) -> str:
    # fp32 pages are the exactness path (tests, CPU-sized models): no TF32 rounding there.
    return "ieee" if pages.dtype == torch.float32 else "tf32"


def write_kv_pages(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into their slots; slots < 0 are padding and store nothing."""
    tokens, kv_heads, head_dim = k.shape
    if k_pages.shape[2:] != (kv_heads, head_dim) or v.shape != k.shape or slot_mapping.shape != (tokens,):
        raise ValueError(
            f"write_kv_pages: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
            f"must agree with pages [..., {k_pages.shape[2]} kv_heads, {k_pages.shape[3]} head_dim]"
        )
    if tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_pages.stride() != v_pages.stride() or not k_pages.is_contiguous():
        raise ValueError("write_kv_pages needs contiguous pages and a contiguous head_dim in k and v")
    with timed("dense_kv_write", k.device):
        _write_kv_kernel[(tokens, kv_heads)](
            k, v, k_pages, v_pages, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            slot_mapping.stride(0), k_pages.stride(1), k_pages.stride(2),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        )


def paged_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_splits: int) -> torch.Tensor:
    """One query per sequence: q [S, q_heads, D] -> [S, q_heads, D]. num_splits: a power of two."""
    _check_pages(q, k_pages, v_pages)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    num_seqs, q_heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = q_heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits > 1:
        part_out = torch.empty((num_seqs, q_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the single split writes the output itself
    with timed("dense_paged_decode", q.device):
        _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
            q, k_pages, v_pages, block_tables, seq_lens, out, part_out, part_lse,
            scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), block_tables.stride(0),
            PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=64 if block_d <= 128 else 32,
            NUM_SPLITS=num_splits, DOT_PRECISION=_dot_precision(k_pages),
            num_warps=4, num_stages=3, **pdl.launch_options(q.device),
        )
        if num_splits > 1:
            _decode_merge_kernel[(num_seqs, q_heads)](
                part_out, part_lse, out, out.stride(0), out.stride(1),
                NUM_HEADS=q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
                **pdl.launch_options(q.device),
            )
    return out


def _check_near_rows(k_pages: torch.Tensor, exact, num_seqs: int, max_query_len: int
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    if not (isinstance(exact, tuple) and len(exact) == 3):
        raise ValueError("exact must be a tuple (exact K rows, exact V rows, window W)")
    k_near, v_near, window = exact
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2**31:
        raise ValueError(
            f"the recent window W must be an int >= 1 (1: a query reads only its own key exactly), got {window!r}"
        )
    rows = max_query_len + window - 1
    for name, near in (("K", k_near), ("V", v_near)):
        if (near.dim() != 4 or near.shape[0] != num_seqs or near.shape[1] < rows
                or near.shape[2:] != k_pages.shape[2:] or near.dtype != k_pages.dtype
                or near.stride()[1:] != k_pages.stride()[1:] or near.stride() != k_near.stride()):
            raise ValueError(
                f"exact {name} rows {tuple(near.shape)} {near.dtype} strides {near.stride()} must be [{num_seqs} "
                f"sequences, >= {rows} rows (max_query_len + W - 1), {k_pages.shape[2]} KV heads, {k_pages.shape[3]}] "
                f"in the pages' dtype {k_pages.dtype}, laid out as a page's rows {k_pages.stride()[1:]} (contiguous "
                f"when the pages are), K and V alike"
            )
    return k_near, v_near, window


def _prefill_launches(block_d: int, window: bool) -> list[dict]:
    """Tile sizes and launch options of the prefill kernel for a head of ``block_d`` dims, without or with the
    recent window, fastest first.

    H200, a 2048-token chunk over 64K / 4K cached tokens, 16 query / 8 KV heads (44 settings a kernel swept at
    d128, docs/BENCHMARKS.md): 128 x 64 tiles, 8 warps, 3 stages, registers capped at 128 took d128's plain kernel
    from 5.21 to 3.03 ms; d64's from 3.14 to 2.19. The windowed kernel (two passes, ~190 registers uncapped) spills
    more under the cap: its exact rows read as [sequence, row] arrays, it took 4.50 ms in 3 stages, 3.38 in 2
    (3.17 / 3.50 when it read them through the block tables; 7.05 ms before the sweep). Uncapped, 8 warps ran
    1.3x slower; capped, 4 warps about 3x. The d128 tiles take 98.5 KB of shared memory in 3 stages:
    a GPU with less falls back to the earlier 64 x 64 tiles in two stages (82 KB). 256 needs 32-row tiles to hold
    [BLOCK, D] in registers.
    """
    block = 64 if block_d < 256 else 32
    earlier = dict(BLOCK_M=block, BLOCK_N=block, num_warps=4 if block_d <= 64 else 8, num_stages=2,
                   **({"maxnreg": 128} if block_d == 128 else {}))  # the window's d128 kernel: 18.7 -> 14.2 ms
    if block_d <= 128:
        stages = 2 if window and block_d == 128 else 3
        return [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=stages, maxnreg=128), earlier]
    return [earlier]


_unfit_launches: set[tuple] = set()  # (device, block_d, window) whose fastest launch did not build


def paged_prefill(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                  scale: float, exact: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """Varlen causal attention: q [T, q_heads, D] rows grouped by query_start_loc -> same shape.

    ``exact`` = (K rows, V rows, W), each [num_seqs, >= max_query_len + W - 1, kv_heads, D]: a query at position t
    reads key and value j from them when j > t - W and from k_pages / v_pages otherwise (server/kernels/turbo/
    recent.py: the recent window, exact beside the decoded turbo pages). Row i of sequence s holds position
    max(0, first - W + 1) + i, first being the sequence's first query position: the positions its queries read
    exactly, in order; rows past its last position are never read.
    """
    _check_pages(q, k_pages, v_pages)
    num_seqs = seq_lens.shape[0]
    k_near, v_near, window = ((k_pages, v_pages, 0) if exact is None else
                              _check_near_rows(k_pages, exact, num_seqs, max_query_len))
    tokens, q_heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty_like(q)
    if tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    def run(launch: dict) -> None:
        with timed("dense_paged_prefill", q.device):
            _prefill_kernel[(num_seqs, q_heads, triton.cdiv(max_query_len, launch["BLOCK_M"]))](
                q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, out,
                scale * LOG2E,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), block_tables.stride(0),
                k_near, v_near, k_near.stride(0), window,
                PAGE_SIZE=page_size, GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
                DOT_PRECISION=_dot_precision(k_pages), RECENT=exact is not None, **launch,
            )

    launches = _prefill_launches(block_d, exact is not None)
    fastest, earliest = launches[0], launches[-1]
    kind = (q.device, block_d, exact is not None)
    unfit = kind in _unfit_launches
    try:
        run(earliest if unfit else fastest)
    except OutOfResources as exc:  # slower but correct, said once, never silent
        if unfit or fastest is earliest:
            raise
        _unfit_launches.add(kind)
        log.warning("dense prefill: %s does not fit %s (%s); using %s", fastest, q.device, exc, earliest)
        run(earliest)
    return out


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Fast body of ``paged_attention_reference``: decode kernel for decode-only steps, varlen prefill for chunks;
    a step of both takes each group through its kernel (paged_kv.decode_rows_apart)."""
    if meta.is_decode_only and q.shape[0] == len(meta.seq_lens_cpu):
        splits = choose_num_splits(q.shape[0], k_pages.shape[2], meta.max_seq_len, q.device)
        return paged_decode(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, scale, splits)
    if 1 in meta.query_lens_cpu:
        out = torch.empty_like(q)
        for rows, group in decode_rows_apart(meta):
            out[rows] = paged_attention(q[rows], k_pages, v_pages, group, scale)
        return out
    return paged_prefill(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                         meta.max_query_len, scale)
