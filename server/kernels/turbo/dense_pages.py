"""Turbo pages back to dense pages in the original domain, in one launch: what prefill's attention reads.

A prefill chunk attends over its sequence's whole prefix, so attention.attention_over_decoded_pages decodes every
page the chunk references, every chunk. Its torch body (attention.decoded_pages, then key_offset_at) spent about ten
float32 or int64 passes over each decoded value (unpack, gather, scale, rotate, copy, offset angles, add, cast):
through the engine, a 65536-token prompt in the default 2048-token chunks took 8.7 s to its first token against
bf16's 2.3 s (H200, docs/BENCHMARKS.md). Here one program decodes ROWS page rows: the codes read once, centroids
times norm, the inverse rotation and (keys) o(p) in registers, one store in the output dtype. Centroids come from
the codebook's odd polynomial (codes.centroid_by_polynomial, ~1e-7 relative), not a table: a per-value table load
made the kernel 13x slower (H200, 64K tokens x 8 heads to bf16: 1.18 ms against 0.090 ms, 1.31 against 0.234 with
o(p)). Otherwise the torch body's arithmetic (rotate_rows is what rotation.rotate runs on GPUs), except o(p)'s
angles: sincos.py here, torch's sin/cos there, as in the store kernel that took o(p) away (quantize.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.backend import inline_ptx
from server.kernels.rotation import SIGNS1, SIGNS2, device_sign_words, inv_sqrt_group, rotate_rows
from server.kernels.timing import timed
from server.kernels.turbo.codes import centroid_by_polynomial, decode_rows
from server.kernels.turbo.format import group_size
from server.kernels.turbo.key_offset import KeyOffset
from server.kernels.turbo.quantize import TurboPages, offset_arguments, offset_values
from server.kernels.turbo.sincos import sincos

VALUES_PER_PROGRAM = 4096


@triton.jit
def _dense_pages_kernel(codes_ptr, norms_ptr, poly_ptr, page_ids_ptr, page_start_ptr, out_ptr, first_ptr, second_ptr,
                        inv_sqrt, const_ptr, mean_ptr, sink_ptr, inv_freq_ptr, n_rows, H: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                        LOG2_G: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr):
    # Rows in the pages' own order (output page, KV head, slot): a program reads ROWS consecutive code rows.
    NG: tl.constexpr = D // G
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    out_page = rows // (H * PAGE_SIZE)
    head = rows // PAGE_SIZE % H
    slot = rows % PAGE_SIZE
    page = tl.load(page_ids_ptr + out_page, mask=ok, other=0).to(tl.int64)
    src = (page * H + head) * PAGE_SIZE + slot
    idx = decode_rows(codes_ptr + src * (D * BITS // 8), ok, poly_ptr, ROWS, D, BITS, False, ASM)
    norms = tl.load(norms_ptr + src[:, None] * NG + tl.arange(0, NG)[None, :], mask=ok[:, None], other=0.0)
    x = tl.reshape(centroid_by_polynomial(idx, poly_ptr, BITS), (ROWS * NG, G))
    x = x * tl.reshape(norms.to(tl.float32), (ROWS * NG,))[:, None]
    x = tl.reshape(rotate_rows(x, second_ptr, first_ptr, inv_sqrt, ROWS * NG, G, LOG2_G), (ROWS, D))  # the inverse
    d = tl.arange(0, D)[None, :]
    if OFFSET:  # keys get o(p) back: p = the page's first position + the slot
        p = (tl.load(page_start_ptr + out_page, mask=ok, other=0) + slot)[:, None]
        cos, sin = sincos(p.to(tl.float32) * tl.load(inv_freq_ptr + d % (D // 2)), ASM)
        x += offset_values(const_ptr, mean_ptr, sink_ptr, head, d, p, cos, sin, ok, D)
    dst = ((out_page.to(tl.int64) * PAGE_SIZE + slot) * H + head) * D
    tl.store(out_ptr + dst[:, None] + d, x.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def dense_pages_triton(pages: TurboPages, page_ids: torch.Tensor, dtype: torch.dtype,
                       key_offset: KeyOffset | None = None, page_start: torch.Tensor | None = None) -> torch.Tensor:
    """The listed pages [n] decoded to the original domain: [n, page_size, kv_heads, D] in ``dtype``, as
    attention.decoded_pages; with ``key_offset``, keys plus o(p), p = page_start [n] (each page's first position)
    + the row."""
    num_pages, heads, page_size, row_bytes = pages.codes.shape
    head_dim = row_bytes * 8 // pages.bits
    group = group_size(head_dim)
    out = torch.empty(len(page_ids), page_size, heads, head_dim, dtype=dtype, device=pages.codes.device)
    n_rows = len(page_ids) * heads * page_size
    if n_rows == 0:
        return out
    if key_offset is not None and (page_start is None or page_start.shape != page_ids.shape):
        raise ValueError("a key offset needs page_start: each listed page's first position")
    rows = max(1, VALUES_PER_PROGRAM // head_dim)
    device = pages.codes.device
    with timed("turbo_dense_pages", device):
        _dense_pages_kernel[(triton.cdiv(n_rows, rows),)](
            pages.codes, pages.norms, pages.polynomial, page_ids, page_ids if page_start is None else page_start, out,
            device_sign_words(SIGNS1, device), device_sign_words(SIGNS2, device), inv_sqrt_group(group),
            *offset_arguments(key_offset, pages.centroids),
            n_rows, H=heads, PAGE_SIZE=page_size, ROWS=rows, D=head_dim, G=group, LOG2_G=group.bit_length() - 1,
            BITS=pages.bits, OFFSET=key_offset is not None, ASM=inline_ptx(device),
        )
    return out
