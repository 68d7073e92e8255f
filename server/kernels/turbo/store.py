"""TurboKVStore: one layer's K and V pages in turbo2/3/4 (specs/turboquant.md), a KVLayerStore.

Pages: codes [num_pages, kv_heads, page_size, row_bytes] uint8 and norms
[num_pages, kv_heads, page_size, D / G] fp16, separately for K and V (format.py has the row
layout). A page's rows for one head are contiguous, so a decode program reads
page_size * row_bytes consecutive bytes per page.

Per-head transform (ours, outside the spec's format; server/runtime/kv_calibration.py picks it,
docs/BENCHMARKS.md "Quality" has the perplexity). The store quantizes (k - m) * s and v * t
instead of k and v, with m, s, t float32 [kv_heads, D] fixed for the store's life (identity by
default: the spec's plain format), and attention undoes it exactly:
  * scores: q . k = (q / s) . ((k - m) * s) + q . m. Attention is given q / s, and the last term
    is one shift per query row, which softmax (causal mask included) is blind to.
  * values: sum_j p_j v_j = (sum_j p_j (v_j * t)) / t, so the output is divided by t.
m pays because real keys share a large direction per head: subtracting it leaves the
quantizer the part that differs between tokens. s and t move the quantizer's error (the
same in every rotated coordinate, so the same in every channel of what is stored) away from
the channels where queries are large (K) or values small (V). s and t are powers of two, so
q / s and out / t are exact in any float dtype and no attention kernel knows about any of it.
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

# Scales beyond 2^+-16 would push fp16 queries or outputs out of their range (and no statistics call for them).
MAX_SCALE_LOG2 = 16


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
        self.k_scale = torch.ones_like(self.k_offset)
        self.v_scale = torch.ones_like(self.k_offset)
        # 1 / s and 1 / t in the compute dtype (exact: powers of two), used only once scaled.
        self.q_multiplier = torch.ones(num_kv_heads, 1, head_dim, dtype=out_dtype, device=device)
        self.out_multiplier = torch.ones_like(self.q_multiplier)
        self.scaled = False

    def set_transform(self, k_offset: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
        """Quantize (k - k_offset) * k_scale and v * v_scale from now on (each [kv_heads, D]; None: the identity,
        i.e. offset 0 or scale 1). Set it before the first write and before CUDA graphs are captured: pages
        written earlier hold the old transform, and one sequence must not mix two (softmax is blind to one
        shift per row, not to a different shift per key)."""
        want = (self.num_kv_heads, self.head_dim)
        offset = torch.zeros(want) if k_offset is None else k_offset
        scales = [torch.ones(want) if t is None else t for t in (k_scale, v_scale)]
        for name, t in (("k_offset", offset), ("k_scale", scales[0]), ("v_scale", scales[1])):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape [{want[0]}, {want[1]}] (kv_heads, head_dim), "
                                 f"got {tuple(t.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{name} must be finite; a NaN or infinity would poison every row it touches")
        for name, t in (("k_scale", scales[0]), ("v_scale", scales[1])):
            mantissa, exponent = torch.frexp(t.float())  # 2^e = 0.5 * 2^(e + 1)
            if not (mantissa == 0.5).all() or (exponent - 1).abs().max() > MAX_SCALE_LOG2:
                raise ValueError(f"{name} must hold powers of two between 2^-{MAX_SCALE_LOG2} and "
                                 f"2^{MAX_SCALE_LOG2} (so that q / s and out / t stay exact in fp16/bf16); round "
                                 "log2 of each scale to an integer in that range")
        # In place: captured CUDA graphs keep reading these tensors.
        self.k_offset.copy_(offset)
        for stored, multiplier, t in ((self.k_scale, self.q_multiplier, scales[0]),
                                      (self.v_scale, self.out_multiplier, scales[1])):
            stored.copy_(t)
            multiplier.copy_(t.reciprocal()[:, None, :])
        self.scaled = not (self.k_scale.eq(1).all() and self.v_scale.eq(1).all())

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
            store_turbo_triton(k, v, slot_mapping, self.k, self.v, self.signs, self.inv_sqrt, self.k_offset,
                               *((self.k_scale, self.v_scale) if self.scaled else (None, None)))
            return
        keep = slot_mapping >= 0  # a negative slot marks a padding token
        slots = slot_mapping[keep].long()
        page, offset = slots // self.page_size, slots % self.page_size
        transformed = ((self.k, self.k_kind, (k.float() - self.k_offset) * self.k_scale),
                       (self.v, self.v_kind, v.float() * self.v_scale))
        for pages, kind, x in transformed:
            codes, norms = quantize_reference(x[keep], kind)
            pages.codes[page, :, offset] = codes
            pages.norms[page, :, offset] = norms

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dim() != 3 or q.shape[-1] != self.head_dim or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"q must be [tokens, a multiple of {self.num_kv_heads} heads, {self.head_dim}], "
                             f"got {tuple(q.shape)}")
        if not self.scaled:
            return self._attend_stored(q, meta, scale)
        # Two small elementwise launches per layer and step (the class docstring says why they are exact).
        by_kv_head = (q.shape[0], self.num_kv_heads, q.shape[1] // self.num_kv_heads, self.head_dim)
        q_stored = (q.reshape(by_kv_head) * self.q_multiplier.to(q.dtype)).reshape(q.shape)
        out = self._attend_stored(q_stored, meta, scale)
        return (out.reshape(by_kv_head) * self.out_multiplier.to(out.dtype)).reshape(q.shape)

    def _attend_stored(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the stored (transformed) keys and values, q already divided by s."""
        if use_triton(q) and meta.is_decode_only:
            return decode_attention_triton(q, self.k, self.v, meta, scale, self.signs, self.inv_sqrt)
        return attention_over_decoded_pages(q, self.k, self.v, self.k_kind, self.v_kind, meta, scale,
                                            page_dtype=self.out_dtype)
