"""TurboKVStore: one layer's K and V pages in turbo2/3/4 (specs/turboquant.md), a KVLayerStore.

Pages: codes [num_pages, kv_heads, page_size, row_bytes] uint8 and norms
[num_pages, kv_heads, page_size, D / G] fp16, separately for K and V (format.py has the row
layout). A page's rows for one head are contiguous, so a decode program reads
page_size * row_bytes consecutive bytes per page.

Key offset: the store quantizes k - m, with m = ``k_offset`` (float32 [kv_heads, D], fixed
for the store's life; zeros by default, which is the spec's plain format). Attention then
sees k - m instead of k, which changes every score of a query row by the same <q, m>, and
softmax (causal mask included) is blind to that: the output is that of the keys the pages
stand for (decoded + m), and no attention kernel knows about m. It pays because real keys
share a large common direction per head: subtracting it leaves the quantizer the part that
differs between tokens (server/runtime/kv_calibration.py picks m; docs/BENCHMARKS.md has the
perplexity).
"""

from __future__ import annotations

import torch

from server.kernels.backend import use_triton
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.rotation import SIGNS1, SIGNS2, inv_sqrt_group, sign_words_tensor
from server.kernels.turbo.attention import attention_over_decoded_pages, decode_attention_triton
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.format import RowLayout, bits_per_value, group_size, quantize_reference
from server.kernels.turbo.quantize import TurboPages, store_turbo_triton


def _empty_pages(num_pages: int, page_size: int, kv_heads: int, layout: RowLayout, device) -> TurboPages:
    book = codebook(layout.bits, layout.group)
    return TurboPages(
        codes=torch.zeros(num_pages, kv_heads, page_size, layout.row_bytes, dtype=torch.uint8, device=device),
        norms=torch.zeros(num_pages, kv_heads, page_size, layout.num_groups, dtype=torch.float16, device=device),
        bits=layout.bits,
        centroids=book.centroids_tensor(device),
        midpoints=book.midpoints_tensor(device),
        polynomial=book.odd_polynomial_tensor(device),
    )


class TurboKVStore:
    """Quantized paged K/V; K and V may use different kinds (e.g. turbo4 K with turbo3 V)."""

    # server/runtime/cuda_graphs.py: a negative slot stores nothing, a seq_len-0 row attends to
    # nothing and comes out zero, and split ranges are computed on the device from seq_lens
    # (the host metadata only fixes the launch shape), so one captured decode serves every length.
    cuda_graph_safe = True

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, k_kind: str,
                 v_kind: str, device: torch.device | str, out_dtype: torch.dtype):
        group_size(head_dim)  # refuses head dims that are not a multiple of 64, with the fix in the message
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} pages of {page_size}")
        self.page_size = page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.k_kind, self.v_kind = k_kind, v_kind
        self.out_dtype = out_dtype  # what prefill decodes pages to on the fast path
        self.k = _empty_pages(num_pages, page_size, num_kv_heads, RowLayout(k_kind, head_dim), device)
        self.v = _empty_pages(num_pages, page_size, num_kv_heads, RowLayout(v_kind, head_dim), device)
        group = group_size(head_dim)
        self.signs = (sign_words_tensor(SIGNS1, device), sign_words_tensor(SIGNS2, device))
        self.inv_sqrt = inv_sqrt_group(group)
        self.k_offset = torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device)

    def set_k_offset(self, offset: torch.Tensor) -> None:
        """Quantize k - offset from now on ([kv_heads, D], finite). Set it before the first write:
        pages written earlier hold k minus the old offset, and one sequence must not mix the two
        (softmax is blind to one shift per row, not to a different shift per key)."""
        if tuple(offset.shape) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"k_offset must have shape [{self.num_kv_heads}, {self.head_dim}] (kv_heads, head_dim), "
                             f"got {tuple(offset.shape)}")
        if not torch.isfinite(offset).all():
            raise ValueError("k_offset must be finite; a NaN or infinity would poison every key it is subtracted from")
        self.k_offset.copy_(offset)  # in place: captured CUDA graphs keep reading this tensor

    @staticmethod
    def bits_per_value(kind: str) -> float:
        """The spec's table: index bits plus a 16-bit norm per 128 values."""
        return bits_per_value(kind)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, k_kind: str, v_kind: str) -> int:
        """Bytes of K plus V for one token of one layer (indices and norms)."""
        return num_kv_heads * (RowLayout(k_kind, head_dim).bytes_per_head + RowLayout(v_kind, head_dim).bytes_per_head)

    def _check(self, name: str, t: torch.Tensor, tokens: int | None = None) -> None:
        want = (self.num_kv_heads, self.head_dim)
        if t.dim() != 3 or tuple(t.shape[1:]) != want or (tokens is not None and t.shape[0] != tokens):
            raise ValueError(f"{name} must have shape [tokens, {want[0]}, {want[1]}], got {tuple(t.shape)}")

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._check("k", k)
        self._check("v", v, k.shape[0])
        if slot_mapping.shape != (k.shape[0],):
            raise ValueError(f"slot_mapping must have one slot per token ({k.shape[0]}), got {tuple(slot_mapping.shape)}")
        if use_triton(k):
            store_turbo_triton(k, v, slot_mapping, self.k, self.v, self.signs, self.inv_sqrt, self.k_offset)
            return
        keep = slot_mapping >= 0  # a negative slot marks a padding token
        slots = slot_mapping[keep].long()
        page, offset = slots // self.page_size, slots % self.page_size
        for pages, kind, x in ((self.k, self.k_kind, k.float() - self.k_offset), (self.v, self.v_kind, v)):
            codes, norms = quantize_reference(x[keep], kind)
            pages.codes[page, :, offset] = codes
            pages.norms[page, :, offset] = norms

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dim() != 3 or q.shape[-1] != self.head_dim or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"q must be [tokens, a multiple of {self.num_kv_heads} heads, {self.head_dim}], "
                             f"got {tuple(q.shape)}")
        if use_triton(q) and meta.is_decode_only:
            return decode_attention_triton(q, self.k, self.v, meta, scale, self.signs, self.inv_sqrt)
        return attention_over_decoded_pages(q, self.k, self.v, self.k_kind, self.v_kind, meta, scale,
                                            page_dtype=self.out_dtype)
