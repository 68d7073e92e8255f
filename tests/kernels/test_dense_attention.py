"""Triton paged attention (server/kernels/dense_attention.py) vs the torch reference vs a float64 oracle.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay tiny. Inputs are
fp16/fp32: the interpreter's bf16 arithmetic is wrong (shared/ENVIRONMENT.md); bf16 is checked on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from server.kernels import paged_kv
from server.kernels.dense_attention import (
    choose_num_splits,
    paged_attention,
    paged_decode,
    paged_prefill,
    write_kv_pages,
)
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore, paged_attention_reference

PAGE = 16
# Context lengths the spec calls out: one token, two, around a page boundary, and a long one.
EDGE_LENS = [1, 2, PAGE - 1, PAGE, PAGE + 1, 100]


def make_batch(seq_lens, query_lens, q_heads, kv_heads, head_dim, dtype, seed=0, extra_pages=3):
    """Random pages in a shuffled pool (sequences own scattered, out-of-order pages) and metadata."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_per_seq) + extra_pages
    order = torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_seq + [1]) + 2  # padding columns past each sequence's pages
    block_tables = torch.full((len(seq_lens), max_pages), num_pages - 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    shape = (num_pages, PAGE, kv_heads, head_dim)
    k_pages = torch.randn(shape, generator=gen).to(dtype)
    v_pages = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [
        int(block_tables[s, t // PAGE]) * PAGE + t % PAGE
        for s, (n, m) in enumerate(zip(seq_lens, query_lens))
        for t in range(n - m, n)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
    )
    return q, k_pages, v_pages, meta


def oracle(q, k_pages, v_pages, meta, scale):
    """float64, one query at a time, keys gathered token by token through the block table."""
    kv_heads = k_pages.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        slots = [(int(meta.block_tables[s, t // PAGE]), t % PAGE) for t in range(seq_len)]
        keys = torch.stack([k_pages[p, o] for p, o in slots]).double()  # [seq_len, kv_heads, D]
        values = torch.stack([v_pages[p, o] for p, o in slots]).double()
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            for h in range(q.shape[1]):
                logits = keys[:visible, h // group] @ q[row + i, h].double() * scale
                weights = torch.exp(logits - logits.max())
                out[row + i, h] = (weights / weights.sum()) @ values[:visible, h // group]
        row += q_len
    return out


def assert_close(actual, expected, atol, what):
    diff = (actual.double() - expected.double()).abs().max().item()
    assert diff <= atol, f"{what}: max abs difference {diff:.3g} exceeds {atol:.3g}"


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


@pytest.mark.parametrize(
    "head_dim,group",
    [(64, 1), (64, 8), (128, 2), (128, 4), (256, 8), (80, 3)],  # 80: a head_dim that is no power of two
)
def test_decode_matches_reference_and_oracle(head_dim, group):
    dtype = torch.float16
    q, k_pages, v_pages, meta = make_batch(EDGE_LENS, [1] * len(EDGE_LENS), 2 * group, 2, head_dim, dtype)
    scale = head_dim**-0.5
    expected = oracle(q, k_pages, v_pages, meta, scale)
    reference = paged_attention_reference(q, k_pages, v_pages, meta, scale)
    fast = paged_attention(q, k_pages, v_pages, meta, scale)
    assert fast.dtype == q.dtype and fast.shape == q.shape
    assert_close(reference, expected, tolerance(dtype), "reference vs float64 oracle")
    assert_close(fast, expected, tolerance(dtype), "Triton decode vs float64 oracle")
    assert_close(fast, reference, tolerance(dtype), "Triton decode vs reference")


@pytest.mark.parametrize("num_splits", [1, 2, 16])
def test_decode_any_split_count_gives_the_same_answer(num_splits):
    # 16 splits of a 1..100-token context leave most splits empty: they must weigh nothing.
    q, k_pages, v_pages, meta = make_batch(EDGE_LENS, [1] * len(EDGE_LENS), 4, 2, 64, torch.float32, seed=1)
    expected = oracle(q, k_pages, v_pages, meta, 0.125)
    fast = paged_decode(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, 0.125, num_splits)
    assert_close(fast, expected, 1e-5, f"decode with {num_splits} splits vs float64 oracle")


def test_decode_padding_row_with_no_context_outputs_zeros():
    # CUDA-graph replays pad the batch with rows of seq_len 0; they must not produce NaN.
    q, k_pages, v_pages, meta = make_batch([5, 1], [1, 1], 2, 1, 64, torch.float32, seed=2)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32)
    for splits in (1, 4):
        out = paged_decode(q, k_pages, v_pages, meta.block_tables, seq_lens, 0.125, splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])), f"padding row with {splits} splits: {out[1]}"
        assert_close(out[0], oracle(q, k_pages, v_pages, meta, 0.125)[0], 1e-5, "real row next to padding")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_mixed_batch_matches_reference_and_oracle(dtype):
    # (cached tokens after the write, queries this step): a whole one-token prompt, a whole prompt
    # crossing a page, a chunk after a prefix, a chunk ending on a page boundary, a decode row in
    # a mixed step, an idle sequence, and a chunk longer than one query tile.
    cases = [(1, 1), (17, 17), (40, 7), (32, 16), (100, 1), (9, 0), (90, 70)]
    seq_lens, query_lens = zip(*cases)
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 8, 2, 64, dtype, seed=3)
    expected = oracle(q, k_pages, v_pages, meta, 0.125)
    reference = paged_attention_reference(q, k_pages, v_pages, meta, 0.125)
    fast = paged_attention(q, k_pages, v_pages, meta, 0.125)
    assert_close(reference, expected, tolerance(dtype), "reference vs float64 oracle")
    assert_close(fast, expected, tolerance(dtype), "Triton prefill vs float64 oracle")


@pytest.mark.parametrize("head_dim,group", [(128, 1), (256, 2)])
def test_prefill_large_heads(head_dim, group):
    q, k_pages, v_pages, meta = make_batch([20, 35], [20, 3], 2 * group, 2, head_dim, torch.float16, seed=4)
    scale = head_dim**-0.5
    fast = paged_attention(q, k_pages, v_pages, meta, scale)
    assert_close(fast, oracle(q, k_pages, v_pages, meta, scale), 3e-3, f"prefill d{head_dim} vs oracle")


def test_chunked_prefill_equals_whole_prefill():
    # The same 50-token prompt attended in chunks 16 + 16 + 18 (each chunk after its prefix is cached)
    # must give the rows the whole-prompt prefill gives.
    q, k_pages, v_pages, meta = make_batch([50], [50], 4, 2, 64, torch.float32, seed=5)
    whole = paged_prefill(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, meta.query_start_loc, 50, 0.125)
    done = 0
    for chunk in (16, 16, 18):
        done += chunk
        part = paged_prefill(
            q[done - chunk : done], k_pages, v_pages, meta.block_tables,
            torch.tensor([done], dtype=torch.int32), torch.tensor([0, chunk], dtype=torch.int32), chunk, 0.125,
        )
        assert_close(part, whole[done - chunk : done], 1e-5, f"chunk ending at token {done} vs whole prefill")


def test_write_kv_pages_scatters_and_skips_padding_slots():
    k_pages = torch.zeros(3, PAGE, 2, 64)
    v_pages = torch.zeros(3, PAGE, 2, 64)
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    v = torch.randn(3, 2, 64, dtype=torch.float16)
    slots = torch.tensor([2 * PAGE + 5, -1, 0])
    write_kv_pages(k, v, k_pages, v_pages, slots)
    assert torch.equal(k_pages[2, 5], k[0].float()) and torch.equal(v_pages[2, 5], v[0].float())
    assert torch.equal(k_pages[0, 0], k[2].float()) and torch.equal(v_pages[0, 0], v[2].float())
    written = torch.zeros(3, PAGE, dtype=torch.bool)
    written[2, 5] = written[0, 0] = True
    assert not k_pages[~written].any() and not v_pages[~written].any(), "a padding slot (-1) wrote somewhere"


def test_dense_store_fast_path_matches_reference_path(monkeypatch):
    seq_lens, query_lens = [23, 4], [23, 1]
    q, _, _, meta = make_batch(seq_lens, query_lens, 4, 2, 64, torch.float16, seed=6)
    k = torch.randn(sum(query_lens), 2, 64, dtype=torch.float16)
    v = torch.randn(sum(query_lens), 2, 64, dtype=torch.float16)
    stores = {}
    for fast in (False, True):
        monkeypatch.setattr(paged_kv, "use_triton", lambda t, fast=fast: fast)
        store = DenseKVStore(int(meta.block_tables.max()) + 1, PAGE, 2, 64, torch.float16, "cpu")
        store.write(k, v, meta.slot_mapping, torch.tensor([*range(23), 3]))
        stores[fast] = (store, store.attend(q, meta, 0.125))
    assert torch.equal(stores[True][0].k_pages, stores[False][0].k_pages), "fast write stored different K"
    assert_close(stores[True][1], stores[False][1], 3e-3, "store.attend fast vs reference")


def test_mismatched_heads_are_refused_with_a_clear_message():
    q, k_pages, v_pages, meta = make_batch([3], [1], 3, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(q, k_pages, v_pages, meta, 0.125)


def test_split_count_fills_the_gpu_but_not_with_tiny_splits():
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 1, 10, cpu) == 1  # one tile of work: no split
    assert choose_num_splits(64, 8, 65536, cpu) == 1  # already more programs than the target
    splits = choose_num_splits(1, 1, 65536, cpu)
    assert splits > 1 and splits & (splits - 1) == 0 and math.ceil(65536 / splits) >= 256
