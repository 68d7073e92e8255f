"""The KV page pool: capacity from bytes, page accounting, storage dtype selection."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from server.config import EngineConfig
from server.kernels.paged_kv import DenseKVStore
from server.runtime.kv_cache import KVCache, KVLayout, default_budget_bytes, resolve_kv_kinds
from server.runtime.sequence import SamplingParams, Sequence

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64)
CPU = torch.device("cpu")


def pool(budget: int, kind: str = "f16", page_size: int = 16, v_kind: str | None = None) -> KVCache:
    return KVCache(LAYOUT, kind, v_kind or kind, budget, page_size, CPU, torch.float32)


def test_page_count_follows_the_byte_budget():
    # f16: 3 layers * (K + V) * 2 heads * 64 dims * 2 bytes = 1536 bytes per token; 16-token pages.
    kv = pool(100_000)
    assert kv.bytes_per_token == 1536 and kv.bytes_per_page == 24_576
    assert kv.num_pages == 4 and kv.tokens_that_fit == 64 and kv.bytes_total == 98_304
    assert len(kv.stores) == 3 and all(isinstance(s, DenseKVStore) for s in kv.stores)
    assert kv.stores[0].k_pages.shape == (4, 16, 2, 64) and kv.stores[0].k_pages.dtype == torch.float16


def test_block_tables_grow_by_pages_and_free_returns_them():
    kv = pool(10 * 24_576)
    a, b = (Sequence(r, [1], SamplingParams(), seed=0) for r in "ab")
    kv.grow(a, 1)
    assert len(a.block_table) == 1
    kv.grow(a, 16)
    assert len(a.block_table) == 1
    kv.grow(a, 17)
    assert len(a.block_table) == 2
    kv.grow(b, 8 * 16)
    assert kv.num_used_pages == 10 and kv.num_free_pages == 0 and kv.bytes_used == kv.bytes_total
    assert not set(a.block_table) & set(b.block_table)
    assert not kv.can_grow(a, 33) and kv.can_grow(a, 32)
    with pytest.raises(RuntimeError, match="exhausted"):
        kv.grow(a, 33)
    assert kv.slots(b, 15, 3) == [b.block_table[0] * 16 + 15, b.block_table[1] * 16, b.block_table[1] * 16 + 1]
    assert kv.slots(b, 16, 1) == [b.block_table[1] * 16] and kv.slots(b, 127, 1) == [b.block_table[7] * 16 + 15]
    kv.free(b)
    assert b.block_table == [] and kv.num_free_pages == 8


def test_a_sequence_growing_alone_gets_consecutive_pages_after_the_pool_turned_over():
    """The lowest free page first: a lone sequence's pages are one run of the pool whatever ran before it (the
    CPU attention reads a run as a view). First-in-first-out reuse handed out the end of the pool, then its start."""
    kv = pool(30 * 24_576)
    for round in range(3):
        before = Sequence(f"before{round}", [1], SamplingParams(), seed=0)
        kv.grow(before, 16 * 20)
        kv.free(before)
        lone = Sequence(f"lone{round}", [1], SamplingParams(), seed=0)
        for n in range(1, 15 * 16, 16):  # a page at a time, as decoding grows it
            kv.grow(lone, n)
        assert list(lone.block_table) == list(range(15))
        kv.free(lone)
    assert kv.num_free_pages == kv.num_pages


def test_slots_follow_a_shuffled_block_table_across_many_pages():
    kv = pool(300 * 24_576, page_size=16)
    seq = Sequence("s", [1], SamplingParams(), seed=0)
    shuffled = random.Random(0).sample(range(300), 71)  # as a table looks after pages come free in any order
    for page in shuffled:  # past the table's first growth (16 entries)
        seq.block_table.append(page)
    pages = list(seq.block_table)
    assert pages == shuffled
    assert seq.block_table.array.dtype.name == "int32" and seq.block_table.array.tolist() == pages
    for start, n in ((0, 1), (15, 2), (3, 1000), (1100, 25)):
        assert kv.slots(seq, start, n) == [pages[p // 16] * 16 + p % 16 for p in range(start, start + n)]


def test_a_budget_below_one_page_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        pool(24_575)


def test_kv_dtype_resolution():
    config = EngineConfig()
    assert resolve_kv_kinds(config, torch.bfloat16) == ("bf16", "bf16")
    assert resolve_kv_kinds(config, torch.float32) == ("f32", "f32")
    assert resolve_kv_kinds(dataclasses.replace(config, kv_cache_dtype="f16"), torch.float32) == ("f16", "f16")
    mixed = dataclasses.replace(config, kv_cache_dtype="turbo3", kv_cache_dtype_k="turbo4")
    assert resolve_kv_kinds(mixed, torch.bfloat16) == ("turbo4", "turbo3")
    with pytest.raises(ValueError, match="cannot be mixed"):
        resolve_kv_kinds(dataclasses.replace(config, kv_cache_dtype_v="turbo3"), torch.bfloat16)
    with pytest.raises(ValueError, match="cannot be mixed"):
        resolve_kv_kinds(dataclasses.replace(config, kv_cache_dtype_k="f16"), torch.bfloat16)
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        resolve_kv_kinds(dataclasses.replace(config, kv_cache_dtype="fp8"), torch.bfloat16)


def test_turbo_pool_holds_more_tokens_in_the_same_bytes():
    from server.kernels.turbo.store import TurboKVStore

    budget = 64 << 20
    d128 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128)  # the spec's bit table assumes 128-value norms
    bf16, turbo3 = (KVCache(d128, kind, kind, budget, 16, CPU, torch.float32) for kind in ("bf16", "turbo3"))
    assert all(isinstance(s, TurboKVStore) for s in turbo3.stores)
    expected_ratio = 16 / TurboKVStore.bits_per_value("turbo3")  # same bytes, fewer bits per value
    assert turbo3.tokens_that_fit / bf16.tokens_that_fit == pytest.approx(expected_ratio, rel=0.01)
    mixed = pool(budget, "turbo4", v_kind="turbo2")
    assert (mixed.stores[0].k_kind, mixed.stores[0].v_kind) == ("turbo4", "turbo2")


def test_default_cpu_budget_is_modest():
    assert 0 < default_budget_bytes(CPU) <= 1 << 30


def test_turbo_pools_pay_for_a_recent_window_row_per_sequence_and_hand_rows_out_like_pages():
    # turbo3, head_dim 64: 3 layers * (K + V) * 2 heads * (24 code + 2 norm bytes) = 312 bytes per token.
    # A row: 3 layers * (K + V) * 8 tokens * 2 heads * 64 dims * 4 bytes (float32 model) = 24,576 bytes.
    kv = KVCache(LAYOUT, "turbo3", "turbo3", 4 * 24_576 + 10 * 16 * 312, 16, CPU, torch.float32,
                 recent_window=8, max_num_seqs=2)  # fmt: skip
    assert kv.bytes_per_token == 312 and kv.recent_rows == 2 and kv.recent_bytes == 2 * 24_576
    assert kv.num_pages == (2 * 24_576 + 10 * 16 * 312) // (16 * 312)
    assert kv.stores[0].recent.k.shape == (2, 8, 2, 64)
    a, b, c = (Sequence(r, [1], SamplingParams(), seed=0) for r in "abc")
    kv.grow(a, 1)
    kv.grow(b, 1)
    assert {a.recent_row, b.recent_row} == {0, 1}
    assert not kv.can_grow(c, 1)  # pages are free, rows are not
    with pytest.raises(RuntimeError, match="recent-window row"):
        kv.grow(c, 1)
    row = a.recent_row
    kv.free(a)
    assert a.recent_row is None and kv.can_grow(c, 1)
    kv.grow(c, 1)
    assert c.recent_row == row
    assert "last 8 tokens of 2 sequences unquantized" in kv.describe()


def test_a_small_budget_gets_fewer_recent_rows_and_dense_pools_none():
    budget = 3 * 24_576  # rows take at most half: one row, and pages in the rest
    kv = KVCache(LAYOUT, "turbo3", "turbo3", budget, 16, CPU, torch.float32, recent_window=8, max_num_seqs=64)
    assert kv.recent_rows == 1 and kv.num_pages == 2 * 24_576 // (16 * 312)
    with pytest.raises(ValueError, match="--kv-recent-window 0"):
        KVCache(LAYOUT, "turbo3", "turbo3", 2 * 24_000, 16, CPU, torch.float32, recent_window=8, max_num_seqs=64)
    dense = KVCache(LAYOUT, "f16", "f16", budget, 16, CPU, torch.float32, recent_window=8, max_num_seqs=64)
    assert dense.recent_rows == 0 and dense.recent_bytes == 0
    assert KVCache(LAYOUT, "turbo3", "turbo3", budget, 16, CPU, torch.float32).stores[0].recent is None
