"""The recent window's exact rows of a prefill step, back in the original domain, in one launch.

A prefill chunk's queries read their last W positions exactly (recent.py). The dense prefill takes those
positions as rows beside the decoded pages (dense_attention.paged_prefill ``exact``): per sequence,
row i holds position j = max(0, first - W + 1) + i for j < seq_len, first being its first query position.
Position j's exact value is what the ring holds for it (rotate(k - o(j)) in the ring's dtype,
recent.recent_values), rotated back, keys with o(j) added back where o turns: before the chunk the ring as the
step found it; in the chunk the ring row the store writes, computed here from the step's own k and v (the store
runs after this kernel: it overwrites ring slots the chunk's first queries still read).

exact_rows_reference defines it in torch. Its torch predecessor (recent.exact_pages) spent about twenty launches
a layer on host-built indices and zero-filled page-shaped arrays the size of the decoded pages: at a 2048-token
chunk after 2048 tokens its layer took 3.6 ms of wall time for 0.44 ms of kernels, 0.34 ms with this kernel (H200,
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.backend import inline_ptx
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.rotation import SIGNS1, SIGNS2, device_sign_words, inv_sqrt_group, rotate_reference, rotate_rows
from server.kernels.timing import timed
from server.kernels.turbo.format import group_size
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at
from server.kernels.turbo.quantize import offset_arguments, offset_mode, offset_values
from server.kernels.turbo.recent import RecentWindow
from server.kernels.turbo.sincos import sincos

VALUES_PER_PROGRAM = 4096


@triton.jit
def _rotate_tile(x, first_ptr, second_ptr, inv_sqrt, ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 LOG2_G: tl.constexpr):
    """rotation.rotate_rows over every G-group of [ROWS, D] rows (swap the sign tables for the inverse)."""
    groups = tl.reshape(x, (ROWS * (D // G), G))
    return tl.reshape(rotate_rows(groups, first_ptr, second_ptr, inv_sqrt, ROWS * (D // G), G, LOG2_G), (ROWS, D))


@triton.jit
def _exact_rows(x_ptr, stride_t, stride_h, ring_ptr, out_ptr, stride_out, seq, q_start, first, lo, seq_len, ring_row,
                window, n_rows, first_ptr, second_ptr, inv_sqrt, const_ptr, mean_ptr, sink_ptr, inv_freq_ptr,
                H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr, ROWS: tl.constexpr,
                OFFSET: tl.constexpr, ASM: tl.constexpr):
    """ROWS (row, head) pairs of one sequence's K or V exact rows. OFFSET as the store's K_OFFSET: "none",
    "fixed" (o = const, subtracted before the ring and not added back: softmax ignores it) or "turned"."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = r // H
    head = r % H
    j = lo + i  # the position this row holds
    ok = (i < n_rows) & (j < seq_len)
    from_ring = j < first
    d = tl.arange(0, D)[None, :]
    ring_at = ((ring_row * window + j % window) * H + head).to(tl.int64) * D
    ring = tl.load(ring_ptr + ring_at[:, None] + d, mask=(ok & from_ring)[:, None], other=0.0).to(tl.float32)
    tok = (q_start + j - first).to(tl.int64)
    x = tl.load(x_ptr + (tok * stride_t + head * stride_h)[:, None] + d, mask=(ok & ~from_ring)[:, None],
                other=0.0).to(tl.float32)
    if OFFSET == "fixed":
        x -= tl.load(const_ptr + head[:, None] * D + d, mask=ok[:, None], other=0.0)
    if OFFSET == "turned":
        p = j[:, None]
        cos, sin = sincos(p.to(tl.float32) * tl.load(inv_freq_ptr + d % (D // 2)), ASM)
        o = offset_values(const_ptr, mean_ptr, sink_ptr, head, d, p, cos, sin, ok, D)
        x -= o
    x = _rotate_tile(x, first_ptr, second_ptr, inv_sqrt, ROWS, D, G, LOG2_G)
    x = x.to(ring_ptr.dtype.element_ty).to(tl.float32)  # what the store will leave in the ring for j
    y = _rotate_tile(tl.where(from_ring[:, None], ring, x), second_ptr, first_ptr, inv_sqrt, ROWS, D, G, LOG2_G)
    if OFFSET == "turned":
        y += o
    at = seq.to(tl.int64) * stride_out + (i * H + head).to(tl.int64) * D
    tl.store(out_ptr + at[:, None] + d, y.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _exact_rows_kernel(k_ptr, k_stride_t, k_stride_h, v_ptr, v_stride_t, v_stride_h, ring_k_ptr, ring_v_ptr,
                       ring_rows_ptr, seq_lens_ptr, query_start_ptr, out_k_ptr, out_v_ptr, stride_out, window, n_rows,
                       first_ptr, second_ptr, inv_sqrt, const_ptr, mean_ptr, sink_ptr, inv_freq_ptr,
                       H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr, ROWS: tl.constexpr,
                       K_OFFSET: tl.constexpr, ASM: tl.constexpr):
    seq = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.where(q_len > 0, tl.load(seq_lens_ptr + seq), 0)  # an idle sequence has no exact rows
    first = seq_len - q_len
    lo = tl.maximum(first - window + 1, 0)
    ring_row = tl.load(ring_rows_ptr + seq)
    if tl.program_id(2) == 0:
        _exact_rows(k_ptr, k_stride_t, k_stride_h, ring_k_ptr, out_k_ptr, stride_out, seq, q_start, first, lo, seq_len,
                    ring_row, window, n_rows, first_ptr, second_ptr, inv_sqrt, const_ptr, mean_ptr, sink_ptr,
                    inv_freq_ptr, H, D, G, LOG2_G, ROWS, K_OFFSET, ASM)
    else:
        _exact_rows(v_ptr, v_stride_t, v_stride_h, ring_v_ptr, out_v_ptr, stride_out, seq, q_start, first, lo, seq_len,
                    ring_row, window, n_rows, first_ptr, second_ptr, inv_sqrt, const_ptr, mean_ptr, sink_ptr,
                    inv_freq_ptr, H, D, G, LOG2_G, ROWS, "none", ASM)


def exact_rows_triton(k: torch.Tensor, v: torch.Tensor, recent: RecentWindow, meta: AttentionMetadata,
                      key_offset: KeyOffset | None, key_offset_turns: bool, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact K and V rows [num_seqs, max_query_len + W - 1, kv_heads, D] in ``dtype`` of a step whose k, v
    [T, kv_heads, D] are not stored yet (nor their ring rows), as paged_prefill's ``exact`` takes them.
    ``key_offset`` / ``key_offset_turns``: the store's (NewTokens'); o(j) goes back on the keys when it turns."""
    tokens, heads, head_dim = k.shape
    size, num_seqs = recent.size, len(meta.seq_lens_cpu)
    n_rows = meta.max_query_len + size - 1
    out_k = torch.empty(num_seqs, n_rows, heads, head_dim, dtype=dtype, device=k.device)
    out_v = torch.empty_like(out_k)
    if tokens == 0 or num_seqs == 0:
        return out_k, out_v
    if meta.recent_rows is None:
        raise ValueError("exact rows need meta.recent_rows: each sequence's row of the recent window")
    group = group_size(head_dim)
    rows = max(1, VALUES_PER_PROGRAM // head_dim)
    with timed("turbo_exact_rows", k.device):
        _exact_rows_kernel[(triton.cdiv(n_rows * heads, rows), num_seqs, 2)](
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), recent.k, recent.v, meta.recent_rows,
            meta.seq_lens, meta.query_start_loc, out_k, out_v, out_k.stride(0), size, n_rows,
            device_sign_words(SIGNS1, k.device), device_sign_words(SIGNS2, k.device), inv_sqrt_group(group),
            *offset_arguments(key_offset, recent.k), H=heads, D=head_dim, G=group, LOG2_G=group.bit_length() - 1,
            ROWS=rows, K_OFFSET=offset_mode(key_offset, key_offset_turns),
            ASM=inline_ptx(k.device),
        )
    return out_k, out_v


def exact_rows_reference(step_k_rows: torch.Tensor, step_v_rows: torch.Tensor, recent: RecentWindow,
                         meta: AttentionMetadata, key_offset: KeyOffset | None, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The meaning of exact_rows_triton, given the step's ring rows (recent.recent_values of its k and v, [T,
    kv_heads, D]); ``key_offset``: o(j) to add back to keys (pass it where it turns). Rows no query reads: zero."""
    size, num_seqs, device = recent.size, len(meta.seq_lens_cpu), step_k_rows.device
    shape = (num_seqs, meta.max_query_len + size - 1, *step_k_rows.shape[1:])
    out = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    rows_of_seq, start = meta.recent_rows.tolist(), 0
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        first = seq_len - q_len
        positions = torch.arange(max(0, first - size + 1) if q_len else seq_len, seq_len, device=device)
        for near, ring, step in zip(out, (recent.k, recent.v), (step_k_rows, step_v_rows)):
            rows = torch.cat([ring[rows_of_seq[s]][positions[positions < first] % size], step[start : start + q_len]])
            values = rotate_reference(rows.float(), group_size(rows.shape[-1]), inverse=True)
            if near is out[0] and key_offset is not None:
                values = values + key_offset_at(key_offset, positions)
            near[s, : len(positions)] = values.to(dtype)
        start += q_len
    return out
