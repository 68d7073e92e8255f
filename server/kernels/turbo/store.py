"""TurboKVStore: one layer's K and V pages in turbo2/3/4 (specs/turboquant.md), a KVLayerStore.

Pages: codes [num_pages, kv_heads, page_size, row_bytes] uint8 and norms
[num_pages, kv_heads, page_size, D / G] fp16, separately for K and V (format.py has the row
layout). A page's rows for one head are contiguous, so a decode program reads
page_size * row_bytes consecutive bytes per page.

Key offset: K pages hold k - o(p), with o the offset of key_offset.py (None by default: the spec's
plain format). server/runtime/kv_calibration.py measures it per layer at start-up and sets it before
anything is written. Attention adds it back only when it varies with p: a constant o shifts every
score of a query row alike, which softmax ignores (in exact arithmetic; in float32 the two differ
by rounding, docs/BENCHMARKS.md "Quality" measures how much that moves perplexity).

Fused write (TURBOSERVE_FUSED_TURBO_STORE=1; off by default, FUSED_STORE_ENV says why): on the fast path
``write`` only keeps the step's K and V pending; a decode step's ``attend`` hands them to the Triton decode,
whose program holding the new token quantizes it into its slot first (attention.py NewTokens), so a decode step
has no store launch on its critical path (bf16 KV writes inside the qkv projection, issue 4). Every other reader
stores them first: ``k`` and ``v`` are properties that flush, and every other attention path flushes before it
reads.
"""

from __future__ import annotations

import os

import torch

from server.kernels.backend import use_triton
from server.kernels.paged_kv import AttentionMetadata, decode_rows_apart
from server.kernels.rotation import SIGNS1, SIGNS2, inv_sqrt_group, rotate_dense, sign_words_tensor
from server.kernels.turbo.attention import NewTokens, attention_over_decoded_pages, decode_attention_triton
from server.kernels.turbo.attention_cuda import decode_attention_cuda
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.exact_rows import exact_rows_triton
from server.kernels.turbo.format import RowLayout, bits_per_value, group_size, quantize_reference
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at, pair_mask
from server.kernels.turbo.quantize import TurboPages, store_turbo
from server.kernels.turbo.recent import (
    RecentWindow,
    attention_with_recent_reference,
    recent_values,
    ring_rows_of_last_tokens,
    write_recent,
)

# The decode takes the CUDA C kernel for calls with at least this much work ((sequence, KV head) rows times the
# planned context), the Triton kernel below it: there the CUDA kernel's fixed costs (per CTA the query's rotation
# and the split merge, ~20 us at batch 1 and 4K) outweigh its faster tiles. H200, 2026-11-30 10:49 UTC,
# bench/turbo_b1_sweep.py (batch 1, 8 KV heads, turbo3, partial key offset, microseconds a layer in a decode graph,
# each at its best split count): 4K Triton 13.3 vs CUDA C 19.6, 16K 24.5 vs 27.8, 64K 64.1 vs 53.5 (lines through
# the last two cross near 27K tokens; 2^18 = 8 rows x 32K).
CUDA_DECODE_MIN_WORK = 1 << 18
# "1": fused writes (module docstring). Off by default: faster at 16K, slower at 2K. H200, 2026-11-30 11:24 UTC, b1,
# depth-2048 shape, turbo3 partial key offset: bench/e2e.py 2K 776 tok/s fused vs 807 with the store launch, 16K 656
# vs 638 (bf16 870 and 653); bench/turbo_b1_sweep.py (us a layer) 2K 15.22 vs 14.04, 16K 24.84 vs 26.80. In the
# kernel the store costs its program ~3.5 us more than the decode alone at 2K (splits of 2 blocks, nothing to hide
# it behind), 0.6 us at 16K (4 blocks).
FUSED_STORE_ENV = "TURBOSERVE_FUSED_TURBO_STORE"


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
    # nothing and comes out zero (and, fused, stores nothing), and split ranges are computed on the
    # device from seq_lens (the host metadata only fixes the launch shape), so one captured decode
    # serves every length. A pending write holds the step's own tensors and is launched (fused or
    # flushed) in the same step, so a captured graph replays the write before the reads as before.
    cuda_graph_safe = True

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, k_kind: str,
                 v_kind: str, device: torch.device | str, out_dtype: torch.dtype, recent: tuple[int, int] = (0, 0)):
        """``recent``: (rows, W) of the recent window (recent.py), one row per sequence that may hold pages;
        (0, 0) keeps none."""
        group_size(head_dim)  # refuses head dims that are not a multiple of 64, with the fix in the message
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"need at least one page of at least one token, got {num_pages} pages of {page_size}")
        self.page_size = page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.k_kind, self.v_kind = k_kind, v_kind
        self.out_dtype = out_dtype  # what prefill decodes pages to on the fast path
        self._pending: NewTokens | None = None  # a fast write not stored yet (module docstring, "Fused write")
        self.fuse_store = os.environ.get(FUSED_STORE_ENV, "0") != "0"
        self._k = _empty_pages(num_pages, page_size, num_kv_heads, RowLayout(k_kind, head_dim), device)
        self._v = _empty_pages(num_pages, page_size, num_kv_heads, RowLayout(v_kind, head_dim), device)
        group = group_size(head_dim)
        self.signs = (sign_words_tensor(SIGNS1, device), sign_words_tensor(SIGNS2, device))
        self.inv_sqrt = inv_sqrt_group(group)
        self.key_offset: KeyOffset | None = None
        self.offset_turns = False  # whether o(p) varies with p (KeyOffset.turns: then attention adds it back)
        rows, size = recent
        self.recent = RecentWindow.empty(rows, size, num_kv_heads, head_dim, out_dtype, device) if rows and size else None

    @property
    def k(self) -> TurboPages:
        """The K pages with every write stored (a pending one is stored first)."""
        self._flush()
        return self._k

    @property
    def v(self) -> TurboPages:
        """The V pages with every write stored (a pending one is stored first)."""
        self._flush()
        return self._v

    def _flush(self) -> None:
        """Store the pending write's pages; a no-op without one."""
        new, self._pending = self._pending, None
        if new is not None:
            self._store(new)

    def _store(self, new: NewTokens, recent_rows: torch.Tensor | None = None) -> None:
        """Quantize a write into its pages; with ``recent_rows`` (each token's ring row or -1: a decode step's
        meta.recent_rows, a chunk's recent.ring_rows_of_last_tokens) the same launch also puts its rows into the
        recent window."""
        if use_triton(new.k):
            recent = {} if recent_rows is None else {"recent": self.recent, "recent_rows": recent_rows}
            store_turbo(new.k, new.v, new.slot_mapping, new.positions, self._k, self._v, self.signs, self.inv_sqrt,
                        new.key_offset, new.key_offset_turns, **recent)
            return
        if recent_rows is not None:
            raise ValueError("the reference store writes the recent window after attending (recent.write_recent)")
        keep = new.slot_mapping >= 0  # a negative slot marks a padding token
        slots = new.slot_mapping[keep].long()
        page, offset = slots // self.page_size, slots % self.page_size
        keys = new.k.float()
        if new.key_offset is not None:
            keys = keys - key_offset_at(new.key_offset, new.positions)
        if self.k_kind == self.v_kind:  # one quantization for both: a CPU decode step pays per torch op, not per value
            codes, norms = quantize_reference(torch.cat((keys[keep], new.v[keep].float()), dim=1), self.k_kind,
                                              rotate_dense)
            coded = zip(codes.chunk(2, dim=1), norms.chunk(2, dim=1))
        else:
            coded = (quantize_reference(keys[keep], self.k_kind, rotate_dense),
                     quantize_reference(new.v[keep], self.v_kind, rotate_dense))
        for pages, (codes, norms) in zip((self._k, self._v), coded):
            pages.codes[page, :, offset] = codes
            pages.norms[page, :, offset] = norms

    def _fusable(self, q: torch.Tensor, meta: AttentionMetadata) -> NewTokens | None:
        """The pending write for a decode step's Triton decode to store, if it is this step's: one new token per
        query row, the slots the metadata names; otherwise it is stored now and None returned."""
        new, self._pending = self._pending, None
        if new is not None and new.slot_mapping is meta.slot_mapping and new.k.shape[0] == q.shape[0]:
            return new
        self._pending = new
        self._flush()
        return None

    def set_key_offset(self, offset: KeyOffset) -> None:
        """Quantize k - o(p) from now on. Set it before the first write: pages written earlier hold k
        minus the old offset, and attention adds back only the current one."""
        self._flush()  # a pending write loses the offset it was written under
        h, d = self.num_kv_heads, self.head_dim
        pairs = offset.pairs
        if pairs.dim() != 2 or pairs.shape[0] != h or pairs.shape[1] > d // 2:
            raise ValueError(f"key offset pairs must have shape [{h}, P] with P <= {d // 2} (head_dim / 2), "
                             f"got {list(pairs.shape)}")
        shapes = {"const": (h, d), "mean": (h, d), "sink": (h, d), "inv_freq": (d // 2,), "pairs": tuple(pairs.shape)}
        for name, shape in shapes.items():
            t = getattr(offset, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"key offset {name} must have shape {list(shape)}, got {list(t.shape)}")
            if name != "pairs" and not torch.isfinite(t).all():
                raise ValueError(f"key offset {name} must be finite; a NaN or infinity would poison every key")
        if pairs.dtype != torch.int32 or pairs.numel() and (pairs.min() < 0 or pairs.max() >= d // 2):
            raise ValueError(f"key offset pairs must be int32 rotate-half pair indices in [0, {d // 2}), got "
                             f"{pairs.dtype} {pairs.tolist()}")
        if pairs.shape[1] > 1 and (pairs.sort(dim=1).values.diff(dim=1) == 0).any():
            raise ValueError(f"key offset pairs must not list a pair twice in one KV head, got {pairs.tolist()}")
        if offset.mean.masked_fill(pair_mask(pairs.to(offset.mean.device), d), 0).any():
            raise ValueError("key offset mean must be zero outside its pairs (only the listed pairs turn)")
        device = self.k.codes.device
        if self.key_offset is None or self.key_offset.pairs.shape != pairs.shape:
            self.key_offset = KeyOffset(*(torch.empty(shapes[n], dtype=torch.int32 if n == "pairs" else torch.float32,
                                                      device=device) for n in shapes))
        for name in shapes:  # in place: captured CUDA graphs keep reading these tensors
            getattr(self.key_offset, name).copy_(getattr(offset, name))
        self.offset_turns = offset.turns

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

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        self._check("k", k)
        self._check("v", v, k.shape[0])
        for name, t in (("slot_mapping", slot_mapping), ("positions", positions)):
            if t.shape != (k.shape[0],):
                raise ValueError(f"{name} must have one entry per token ({k.shape[0]}), got {tuple(t.shape)}")
        self._flush()  # writes land in order
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        new = NewTokens(k, v, slot_mapping, positions, self.key_offset, self.offset_turns)
        if self.recent is not None or (self.fuse_store and use_triton(k)):
            self._pending = new  # attend stores it (module docstring; recent.py says when the ring is written)
        else:
            self._store(new)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if q.dim() != 3 or q.shape[-1] != self.head_dim or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"q must be [tokens, a multiple of {self.num_kv_heads} heads, {self.head_dim}], "
                             f"got {tuple(q.shape)}")
        window_fast = self.recent is not None and use_triton(q)  # it takes mixed steps apart itself, one store
        if not meta.is_decode_only and 1 in meta.query_lens_cpu and not window_fast:
            return self._attend_mixed(q, meta, scale)
        key_offset = self.key_offset if self.offset_turns else None
        step = self._step_of_window(meta) if self.recent is not None else None
        if use_triton(q) and meta.is_decode_only:
            if step is not None:
                self._store(step, meta.recent_rows)  # the token's pages and window row first: the kernels read both
            return self._decode(q, meta, scale, key_offset)
        if step is not None:
            return self._attend_with_window(q, meta, scale, key_offset, step)
        return attention_over_decoded_pages(q, self.k, self.v, self.k_kind, self.v_kind, meta, scale, key_offset,
                                            page_dtype=self.out_dtype)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, scale: float, key_offset: KeyOffset | None
                ) -> torch.Tensor:  # fmt: skip
        """One query a sequence, through the decode kernels (fast path)."""
        if q.shape[0] * self.num_kv_heads * meta.max_seq_len >= CUDA_DECODE_MIN_WORK:  # where it runs (supports)
            out = decode_attention_cuda(q, self.k, self.v, meta, scale, self.signs, self.inv_sqrt, key_offset,
                                        recent=self.recent)
            if out is not None:
                return out
        new_tokens = self._fusable(q, meta)  # self._k / _v below: their pending token is the kernel's to store
        return decode_attention_triton(q, self._k, self._v, meta, scale, self.signs, self.inv_sqrt, key_offset,
                                       new_tokens=new_tokens, recent=self.recent)

    def _attend_mixed(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A step of decode rows beside longer chunks, without a recent window or on the reference path: each group
        through its own path. Taken together, the chunks' path would decode every page of the decode rows' contexts
        back to dense pages too (every running sequence's whole cache, each layer). The groups' sequences, and so
        their pages and window rows, are disjoint."""
        step, self._pending = self._pending, None  # the step's write, if attend is to store it: split with it
        if step is not None and step.k.shape[0] != q.shape[0]:  # an earlier step's: it lands first, whole
            self._pending = step
            self._flush()
            step = None
        out = torch.empty_like(q)
        for rows, group in decode_rows_apart(meta):
            self._pending = None if step is None else step.select(rows)
            out[rows] = self.attend(q[rows], group, scale)
        return out

    def _step_of_window(self, meta: AttentionMetadata) -> NewTokens:
        """The step's pending write, which a store with a recent window keeps for attend (recent.py says when the
        window is written)."""
        step, self._pending = self._pending, None
        if step is None or meta.recent_rows is None:
            raise ValueError("a turbo store with a recent window attends right after the step's write, and needs "
                             "meta.recent_rows (each sequence's window row)")
        return step

    def _attend_with_window(self, q: torch.Tensor, meta: AttentionMetadata, scale: float,
                            key_offset: KeyOffset | None, step: NewTokens) -> torch.Tensor:
        """Prefill, a mixed step or a reference decode with a recent window: the ring as the step found it, the
        step's own rows beside it; the ring is written after it is read."""
        if use_triton(q):
            # One store launch for the whole step, pages and ring: after the chunks' exact rows read the ring, before
            # the decode kernels read it (with a mixed step's decode rows, paged_kv.decode_rows_apart).
            if 1 in meta.query_lens_cpu:
                (rows, chunks), decode_group = decode_rows_apart(meta)
            else:
                (rows, chunks), decode_group = (slice(None), meta), None
            exact = exact_rows_triton(step.k[rows], step.v[rows], self.recent, chunks, step.key_offset,
                                      step.key_offset_turns, self.out_dtype)
            self._store(step, ring_rows_of_last_tokens(meta, self.recent.size))
            out = attention_over_decoded_pages(q[rows], self._k, self._v, self.k_kind, self.v_kind, chunks, scale,
                                               key_offset, page_dtype=self.out_dtype, exact=(*exact, self.recent.size))
            if decode_group is None:
                return out
            decode_rows, decodes = decode_group
            mixed = torch.empty_like(q)
            mixed[rows] = out
            mixed[decode_rows] = self._decode(q[decode_rows], decodes, scale, key_offset)
            return mixed
        self._store(step)
        dtype = self.recent.k.dtype
        k_rows = recent_values(step.k, step.positions, step.key_offset, dtype)
        v_rows = recent_values(step.v, step.positions, None, dtype)
        out = attention_with_recent_reference(q, self._k, self._v, self.k_kind, self.v_kind, self.recent, k_rows,
                                              v_rows, meta, scale, key_offset)
        write_recent(self.recent, k_rows, v_rows, step.positions, meta)
        return out
