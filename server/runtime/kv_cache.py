"""The KV page pool: one store per layer, per-sequence block tables, capacity in bytes.

A page holds ``page_size`` tokens of K and V for every KV head of one layer; page i of
every layer belongs to the same sequence, so one block table serves all layers. The
storage dtype is fixed here, once (DESIGN.md "KV cache").
"""

from __future__ import annotations

import heapq
import importlib
import logging
import os
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from server.config import EngineConfig
from server.kernels.paged_kv import DenseKVStore, KVLayerStore
from server.runtime.sequence import Sequence

log = logging.getLogger(__name__)

DENSE_KV_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
TURBO_KV_KINDS = ("turbo2", "turbo3", "turbo4")
CUDA_FREE_MEMORY_FRACTION = 0.85  # of what is free after the weights; the rest is activations/graphs
CPU_BUDGET_CAP = 1 << 30


@dataclass(frozen=True)
class KVLayout:
    """What one layer's store looks like; the model decides heads and head_dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def resolve_kv_kinds(config: EngineConfig, model_dtype: torch.dtype) -> tuple[str, str]:
    """(k_kind, v_kind): a dense name (bf16/f16/f32) or a turbo kind, after resolving 'auto'."""
    auto = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[model_dtype]
    base = auto if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    kinds = []
    for override in (config.kv_cache_dtype_k, config.kv_cache_dtype_v):
        kind = base if override in (None, "auto") else override
        kind = auto if kind == "auto" else kind
        if kind not in DENSE_KV_DTYPES and kind not in TURBO_KV_KINDS:
            raise ValueError(
                f"unknown KV cache dtype {kind!r}; expected one of auto, "
                f"{', '.join(DENSE_KV_DTYPES)}, {', '.join(TURBO_KV_KINDS)}"
            )
        kinds.append(kind)
    k_kind, v_kind = kinds
    if (k_kind in DENSE_KV_DTYPES) != (v_kind in DENSE_KV_DTYPES) or (
        k_kind in DENSE_KV_DTYPES and k_kind != v_kind
    ):
        raise ValueError(
            f"KV cache dtypes K={k_kind} V={v_kind} cannot be mixed: a dense K needs the same dense V; "
            "turbo kinds mix freely with each other (e.g. --kv-cache-dtype-k turbo4 --kv-cache-dtype-v turbo3)"
        )
    return k_kind, v_kind


def _turbo_store_class():
    # Imported only when asked for, so a broken turbo module never breaks dense serving.
    return importlib.import_module("server.kernels.turbo.store").TurboKVStore


def bytes_per_token(layout: KVLayout, k_kind: str, v_kind: str) -> int:
    """Bytes of K plus V for one token across all layers."""
    if k_kind in DENSE_KV_DTYPES:
        one = DenseKVStore.bytes_per_token(layout.num_kv_heads, layout.head_dim, DENSE_KV_DTYPES[k_kind])
    else:
        one = _turbo_store_class().bytes_per_token(layout.num_kv_heads, layout.head_dim, k_kind, v_kind)
    return layout.num_layers * one


def _recent_bytes_per_row(window: int, layout: KVLayout, dtype: torch.dtype) -> int:
    if not window:
        return 0
    recent = importlib.import_module("server.kernels.turbo.recent").RecentWindow
    return recent.bytes_per_row(window, layout.num_kv_heads, layout.head_dim, dtype)


def bits_per_value(kind: str) -> float:
    """Storage bits of one cached K or V element (turbo kinds include their norms)."""
    if kind in DENSE_KV_DTYPES:
        return float(torch.finfo(DENSE_KV_DTYPES[kind]).bits)
    return float(_turbo_store_class().bits_per_value(kind))


def default_budget_bytes(device: torch.device) -> int:
    """Bytes for the pool when --kv-cache-memory is not given. Call after the weights are loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_MEMORY_FRACTION)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(CPU_BUDGET_CAP, ram // 10)


class KVCache:
    """Page pool shared by all layers, and the block tables that hand pages to sequences."""

    def __init__(
        self,
        layout: KVLayout,
        k_kind: str,
        v_kind: str,
        budget_bytes: int,
        page_size: int,
        device: torch.device,
        compute_dtype: torch.dtype,
        recent_window: int = 0,
        max_num_seqs: int = 1,
    ):
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be at least 1 token")
        if recent_window < 0:
            raise ValueError(f"recent window {recent_window} must be 0 (off) or a number of tokens")
        self.layout, self.k_kind, self.v_kind = layout, k_kind, v_kind
        self.page_size = page_size
        self.bytes_per_token = bytes_per_token(layout, k_kind, v_kind)
        self.bytes_per_page = self.bytes_per_token * page_size
        # Turbo stores keep each running sequence's last recent_window tokens unquantized too (kernels/turbo/
        # recent.py): a row per sequence that may hold pages, paid for out of the same budget. Rows take at most
        # half of it: a small budget gets fewer rows, and fewer sequences run at once (can_grow).
        self.recent_window = recent_window if k_kind in TURBO_KV_KINDS else 0
        row_bytes = layout.num_layers * _recent_bytes_per_row(self.recent_window, layout, compute_dtype)
        self.recent_rows = min(max_num_seqs, budget_bytes // 2 // row_bytes) if row_bytes else 0
        self.recent_bytes = self.recent_rows * row_bytes
        self.num_pages = (budget_bytes - self.recent_bytes) // self.bytes_per_page
        if self.num_pages < 1 or (row_bytes and not self.recent_rows):
            ring = f" and a {row_bytes}-byte recent-window row (--kv-recent-window 0 needs none)" if row_bytes else ""
            raise ValueError(
                f"KV cache budget of {budget_bytes} bytes holds no page{ring}: one page of {page_size} tokens "
                f"needs {self.bytes_per_page} bytes ({k_kind}/{v_kind}); raise --kv-cache-memory"
            )
        self.stores: list[KVLayerStore] = [self._make_store(device, compute_dtype) for _ in range(layout.num_layers)]
        # A min-heap: a sequence that grows alone gets consecutive pages, which the CPU's reference attention
        # reads as a view instead of a gather (paged_kv.paged_attention_reference); first-in-first-out reuse
        # scattered them once the pool had turned over. The embedded model decoding at 6K tokens on the 2-core
        # CPU: 17.7 tok/s with the view, 12.1 with the gather (bench/cpu_context.py).
        self.free_pages: list[int] = list(range(self.num_pages))
        self.free_recent_rows: deque[int] = deque(range(self.recent_rows))

    def _make_store(self, device: torch.device, compute_dtype: torch.dtype) -> KVLayerStore:
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        if self.k_kind in DENSE_KV_DTYPES:
            return DenseKVStore(self.num_pages, self.page_size, heads, dim, DENSE_KV_DTYPES[self.k_kind], device)
        store_cls = _turbo_store_class()
        return store_cls(self.num_pages, self.page_size, heads, dim, self.k_kind, self.v_kind, device, compute_dtype,
                         recent=(self.recent_rows, self.recent_window))

    # -- page accounting -------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens with the pages (and recent row) that are free now."""
        if self.recent_rows and seq.recent_row is None and not self.free_recent_rows:
            return False  # a finished sequence still in flight holds its row until that step ends
        return self.pages_for(num_tokens) - len(seq.block_table) <= len(self.free_pages)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.pages_for(num_tokens) - len(seq.block_table)
        if missing > len(self.free_pages):
            free = len(self.free_pages)
            raise RuntimeError(f"KV pool exhausted: {seq.request_id} needs {missing} pages, {free} free")
        if self.recent_rows and seq.recent_row is None:
            if not self.free_recent_rows:
                raise RuntimeError(f"no recent-window row free for {seq.request_id}: check can_grow first")
            seq.recent_row = self.free_recent_rows.popleft()
        for _ in range(missing):
            seq.block_table.append(heapq.heappop(self.free_pages))

    def free(self, seq: Sequence) -> None:
        for page in seq.block_table.tolist():
            heapq.heappush(self.free_pages, page)
        seq.block_table.clear()
        if seq.recent_row is not None:
            self.free_recent_rows.append(seq.recent_row)
            seq.recent_row = None

    def slots(self, seq: Sequence, start: int, n: int) -> list[int]:
        """Pool slots (page * page_size + offset) of positions start .. start + n - 1."""
        table, size = seq.block_table.array, self.page_size
        if n == 1:  # a decode row: numpy's per-call cost would outweigh the work
            return [int(table[start // size]) * size + start % size]
        positions = np.arange(start, start + n)
        return (table[positions // size].astype(np.int64) * size + positions % size).tolist()

    # -- capacity, for metrics and the start-up log ----------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    @property
    def bytes_total(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def bytes_used(self) -> int:
        return self.num_used_pages * self.bytes_per_page

    @property
    def tokens_that_fit(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> str:
        recent = (f", last {self.recent_window} tokens of {self.recent_rows} sequences unquantized "
                  f"({self.recent_bytes / 2**20:.1f} MiB)" if self.recent_rows else "")
        return (
            f"KV cache: {self.num_pages} pages x {self.page_size} tokens = {self.tokens_that_fit} tokens, "
            f"K={self.k_kind} V={self.v_kind}, {self.bytes_per_token} bytes/token, "
            f"{self.bytes_total / 2**20:.1f} MiB{recent}"
        )
