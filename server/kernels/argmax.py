"""Greedy token choice: the argmax of each row of the logits, in two short passes.

torch.argmax reduces one row in one thread block: at batch 1 with a 128K vocabulary that is one SM
reading 512 KB, 27 us of every 8B decode step on the H200 (docs/BENCHMARKS.md), as long as a few
transformer layers' norms. Here program (row, chunk) reduces CHUNK logits to their maximum and its
first index, and a second pass takes, per row, the first chunk that holds the row's maximum: the
first index of the maximum, as torch.argmax. NaN ranks as +inf (torch ranks it above +inf; a row
with NaN logits has no meaningful token either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.timing import timed

CHUNK = 2048  # 63 programs a row for a 128K vocabulary: enough SMs reading at batch 1, a short second pass


@triton.jit
def _chunk_max_kernel(x_ptr, stride_row, n_cols, max_ptr, idx_ptr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, best)
    tl.store(idx_ptr + out, chunk * CHUNK + where)


@triton.jit
def _row_pick_kernel(max_ptr, idx_ptr, out_ptr, n_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_PAD)
    maxes = tl.load(max_ptr + row * n_chunks + chunks, mask=chunks < n_chunks, other=float("-inf"))
    first = tl.argmax(maxes, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * n_chunks + first))


def argmax_rows(x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """x [B, V] -> int64 [B]: the first index of each row's maximum (torch.argmax(x, dim=-1))."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows expects [rows, columns >= 1], got {tuple(x.shape)}")
    rows, cols = x.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    n_chunks = triton.cdiv(cols, chunk)
    maxes = torch.empty((rows, n_chunks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, n_chunks), dtype=torch.int64, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    with timed("argmax", x.device):
        _chunk_max_kernel[(rows, n_chunks)](x, x.stride(0), cols, maxes, indices, CHUNK=chunk)
        _row_pick_kernel[(rows,)](maxes, indices, out, n_chunks, CHUNKS_PAD=triton.next_power_of_2(n_chunks))
    return out
