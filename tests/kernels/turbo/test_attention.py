"""Turbo KV attention: fused decode (Triton, interpreter) and the decode-then-attend path vs a float64 oracle.

The oracle decodes the stored pages itself in float64 (indices, float64 centroids, the fp16
norms, an explicit rotation matrix) and runs plain softmax attention with causal offsets.
"""

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo import attention
from server.kernels.turbo.attention import attention_over_decoded_pages, choose_splits, decode_attention_triton
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.format import group_size, unpack_indices
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore
from turbo_oracle import rotation_matrix64, shuffled_tables, slots_of

PAGE = 16


def decode64(pages, head_dim):
    """[num_pages, page, heads, D] float64 in the original domain."""
    g = group_size(head_dim)
    c = torch.tensor(codebook(pages.bits, g).centroids, dtype=torch.float64)
    idx = unpack_indices(pages.codes, pages.bits, head_dim)
    rotated = c[idx].reshape(*idx.shape[:-1], head_dim // g, g) * pages.norms.double()[..., None]
    original = rotated @ rotation_matrix64(g)  # row vector times R is R^T applied to it
    return original.reshape(*idx.shape).transpose(1, 2)


def oracle(q, store, meta, scale):
    return attention64(q, decode64(store.k, store.head_dim), decode64(store.v, store.head_dim), meta, scale)


def attention64(q, k, v, meta, scale):
    """Causal softmax attention in float64 over k, v pages [num_pages, page, heads, D]."""
    kv_heads = k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for s, (n, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        pages = meta.block_tables[s, : -(-n // PAGE)].long()
        ks = k[pages].reshape(-1, kv_heads, k.shape[-1])[:n].repeat_interleave(q.shape[1] // kv_heads, 1)
        vs = v[pages].reshape(-1, kv_heads, v.shape[-1])[:n].repeat_interleave(q.shape[1] // kv_heads, 1)
        for i in range(q_len):
            pos = n - q_len + i
            scores = torch.einsum("hd,khd->hk", q[starts[s] + i].double(), ks[: pos + 1]) * scale
            out[starts[s] + i] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), vs[: pos + 1])
    return out


def scenario(seq_lens, q_lens, kv_heads, gqa, head_dim, k_kind, v_kind, seed=0):
    """A store holding every sequence's K/V in shuffled pages, and the step's metadata and queries."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = shuffled_tables(seq_lens, PAGE, gen, spare=3)
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    for s, n in enumerate(seq_lens):
        slots = slots_of(tables[s], torch.arange(n), PAGE)
        k = torch.randn(n, kv_heads, head_dim, generator=gen) * 2 + 0.5
        store.write(k, torch.randn(n, kv_heads, head_dim, generator=gen), slots, torch.arange(n))
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, torch.tensor(seq_lens, dtype=torch.int32),
                             starts, list(seq_lens), list(q_lens))
    q = torch.randn(sum(q_lens), kv_heads * gqa, head_dim, generator=gen)
    return store, meta, q


def assert_close(got, want, tol, what):
    err = (got.double() - want).abs().max().item()
    assert err < tol, f"{what}: max abs error {err:.3g} >= {tol}"


MIXED_LENGTHS = [1, 2, PAGE - 1, PAGE, PAGE + 1, 45]


@pytest.mark.parametrize(
    "head_dim,gqa,k_kind,v_kind",
    [(64, 1, "turbo3", "turbo3"), (64, 8, "turbo2", "turbo4"), (128, 2, "turbo4", "turbo3"),
     (128, 4, "turbo3", "turbo3"), (256, 4, "turbo4", "turbo2"), (256, 1, "turbo2", "turbo2"),
     (64, 3, "turbo2", "turbo3"), (64, 5, "turbo3", "turbo2"), (64, 16, "turbo3", "turbo4")],  # softmax rows: 4, 8, 16
)
def test_fused_decode_matches_reference_and_float64(head_dim, gqa, k_kind, v_kind):
    store, meta, q = scenario(MIXED_LENGTHS, [1] * len(MIXED_LENGTHS), 2, gqa, head_dim, k_kind, v_kind)
    scale = head_dim**-0.5
    want = oracle(q, store, meta, scale)
    reference = store.attend(q, meta, scale)  # CPU: the decode-then-attend path
    assert_close(reference, want, 1e-5, "reference vs float64")
    fused = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt, num_splits=2)
    assert_close(fused, want, 2e-5, "fused decode vs float64")


@pytest.mark.parametrize("head_dim,gqa,k_kind,v_kind", [(128, 4, "turbo3", "turbo4"), (256, 2, "turbo2", "turbo3")])
def test_fused_decode_with_half_queries_uses_fp16_operands_within_their_rounding(head_dim, gqa, k_kind, v_kind):
    """fp16/bf16 queries (the GPU case) decode centroids and run both dots in fp16, accumulating in fp32."""
    lengths = [1, PAGE + 1, 45]  # page boundaries are the fp32 test's job; the fp16 lookup model is slow to interpret
    store, meta, q = scenario(lengths, [1] * len(lengths), 2, gqa, head_dim, k_kind, v_kind, seed=5)
    q = q.half()
    want = oracle(q.double(), store, meta, head_dim**-0.5)
    fused = decode_attention_triton(q, store.k, store.v, meta, head_dim**-0.5, store.signs, store.inv_sqrt,
                                    num_splits=2)
    assert fused.dtype == torch.float16
    assert_close(fused, want, 2e-3 * want.abs().max().item(), "fp16 fused decode vs float64")


def test_fused_decode_long_context_any_split_count():
    store, meta, q = scenario([1000, 3], [1, 1], 1, 4, 128, "turbo3", "turbo3", seed=3)
    want = oracle(q, store, meta, 128**-0.5)
    for splits in (1, 5, None):
        fused = decode_attention_triton(q, store.k, store.v, meta, 128**-0.5, store.signs, store.inv_sqrt,
                                        num_splits=splits)
        assert_close(fused, want, 2e-5, f"fused decode, {splits} splits")


def test_decoded_tile_column_order_and_merge_tiles_do_not_change_the_result(monkeypatch):
    """Any chunk order of the decoded tiles (q follows K's, the output undoes V's) and a merge that reads
    the splits a few at a time give the natural order's answer."""
    store, meta, q = scenario([300, 45], [1, 1], 1, 2, 128, "turbo3", "turbo4", seed=11)
    args = (q, store.k, store.v, meta, 128**-0.5, store.signs, store.inv_sqrt)
    natural = decode_attention_triton(*args, num_splits=5, column_order={})
    reordered = {(3, 128): (3, 1, 0, 2), (4, 128): (1, 3, 2, 0)}
    # 1e-5: a reordered float32 dot rounds differently (the interpreter's tl.dot is numpy's BLAS, whose summation
    # order changes between builds); a wrong permutation errs by the output's scale, ~0.3.
    assert_close(decode_attention_triton(*args, num_splits=5, column_order=reordered), natural.double(), 1e-5,
                 "reordered columns vs natural order")
    assert_close(natural, oracle(q, store, meta, 128**-0.5), 2e-5, "natural order vs float64")
    monkeypatch.setattr(attention, "MERGE_SPLIT_TILE", 2)  # 5 splits: tiles of 2, 2 and 1
    assert_close(decode_attention_triton(*args, num_splits=5), natural.double(), 1e-5, "merge in tiles of 2")


@pytest.mark.parametrize("lengths,planned,splits", [([45, 3], 1000, None), ([1000, 3], 4096, 8)])
def test_fused_decode_serves_any_length_under_a_capture_time_hint(lengths, planned, splits):
    """CUDA-graph contract: launch planned for more tokens than the real lengths, a padding row of length 0.
    Splits are cut from each sequence's own length: 1000 tokens in 8 splits of 2 blocks, where the planned
    4096 would give splits of 8 blocks, 2 of them used."""
    store, meta, q = scenario(lengths, [1, 1], 2, 2, 64, "turbo3", "turbo3", seed=9)
    want = oracle(q, store, meta, 0.125)
    padded_q = torch.cat([q, torch.randn(1, *q.shape[1:])])
    tables = torch.cat([meta.block_tables, torch.full((1, meta.block_tables.shape[1]), 10**6, dtype=torch.int32)])
    hinted = AttentionMetadata(meta.slot_mapping, tables, torch.tensor([*lengths, 0], dtype=torch.int32),
                               torch.arange(4, dtype=torch.int32), [planned] * 3, [1] * 3)
    out = decode_attention_triton(padded_q, store.k, store.v, hinted, 0.125, store.signs, store.inv_sqrt,
                                  num_splits=splits)
    assert_close(out[:2], want, 2e-5, f"decode planned for {planned} tokens")
    assert out[2].eq(0).all(), "a seq_len-0 padding row must come out zero (and read no page)"


@pytest.mark.parametrize("batch,context", [(1, 65536), (8, 65536), (8, 16384), (1, 16384), (1, 4096), (32, 65536),
                                           (2, 100)])
def test_split_count_fills_the_gpu_without_needlessly_short_splits(monkeypatch, batch, context):
    """At most PROGRAMS_PER_SM programs per SM, splits of at least MIN_SPLIT_TOKENS unless they all fit one
    wave of RESIDENT_PROGRAMS per SM, never under MIN_SPLIT_BLOCKS blocks, whole blocks per split."""
    sms, kv_heads = 132, 8
    monkeypatch.setattr(attention, "multiprocessors", lambda device: sms)
    splits = choose_splits(batch, kv_heads, context, torch.device("cuda"))
    rows, blocks = batch * kv_heads, -(-context // attention.BLOCK_N)
    assert 1 <= splits <= -(-blocks // attention.MIN_SPLIT_BLOCKS)
    assert -(-blocks // -(-blocks // splits)) == splits, f"{splits} splits are not whole blocks each"
    assert splits == 1 or rows * splits <= attention.PROGRAMS_PER_SM * sms, f"{splits} splits overshoot the program target"
    short = context / splits < attention.MIN_SPLIT_TOKENS
    assert not short or rows * splits <= attention.RESIDENT_PROGRAMS * sms, f"{splits} splits of {context / splits:.0f} tokens"
    if batch == 1 and context in (4096, 16384):  # one wave of short splits: the measured best (bench/turbo_b1_sweep.py)
        assert splits == {4096: 32, 16384: 64}[context]
    if context == 65536 and batch == 1:
        assert splits == 64  # 512 programs of 1024 tokens: the measured best at b1/64K (docs/BENCHMARKS.md)
    if context == 65536 and batch == 8:
        assert splits == 16  # 1024 programs, two waves of 4 per SM: 17 splits measured slower (docs/BENCHMARKS.md)


def test_negative_slots_store_nothing():
    store = TurboKVStore(2, PAGE, 1, 64, "turbo4", "turbo4", "cpu", torch.float32)
    x = torch.randn(3, 1, 64)
    store_turbo_triton(x, x, torch.tensor([-1, 5, -1]), torch.arange(3), store.k, store.v, store.signs, store.inv_sqrt)
    written = store.k.norms.reshape(-1) != 0
    assert written.nonzero().flatten().tolist() == [5]


@pytest.mark.parametrize("head_dim,gqa", [(64, 3), (128, 8), (256, 2)])
def test_prefill_and_chunked_prefill_match_float64(head_dim, gqa):
    # whole prompts, a second chunk of a prompt, and a decode step in one batch
    store, meta, q = scenario([5, 40, 17, 1000], [5, 23, 1, 2], 2, gqa, head_dim, "turbo4", "turbo3", seed=5)
    want = oracle(q, store, meta, 0.1)
    assert_close(store.attend(q, meta, 0.1), want, 1e-5, "prefill vs float64")


def test_a_mixed_step_attends_its_decode_rows_apart_from_its_chunks(monkeypatch):
    # Taken together, the chunks' path would decode every page of the decode rows' contexts too.
    from server.kernels.turbo import store as store_module

    store, meta, q = scenario([5, 40, 17, 1000], [5, 23, 1, 2], 2, 2, 64, "turbo4", "turbo3", seed=5)
    seen = []
    original = store_module.attention_over_decoded_pages
    monkeypatch.setattr(store_module, "attention_over_decoded_pages",
                        lambda q, k, v, kk, vk, meta, *a, **kw: seen.append(meta.seq_lens_cpu)
                        or original(q, k, v, kk, vk, meta, *a, **kw))  # fmt: skip
    got = store.attend(q, meta, 0.1)
    assert seen == [[5, 40, 1000], [17]]  # the CPU's decode rows take the same function, on their own
    assert_close(got, oracle(q, store, meta, 0.1), 1e-5, "mixed step, groups apart, vs float64")


def test_prefill_through_the_dense_triton_kernel_matches_float64():
    """The GPU body of the prefill path (dense varlen Triton attention over decoded pages), interpreted."""
    store, meta, q = scenario([5, 40, 17, 33], [5, 23, 1, 2], 2, 4, 64, "turbo3", "turbo4", seed=6)
    want = oracle(q, store, meta, 0.125)
    got = attention_over_decoded_pages(q, store.k, store.v, "turbo3", "turbo4", meta, 0.125, fast=True)
    assert_close(got, want, 1e-5, "dense Triton prefill over decoded pages vs float64")


def test_store_write_then_attend_through_the_store_api():
    """Tokens written in two chunks attend like tokens written at once (chunk boundary at 13)."""
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(30, 2, 64, generator=gen), torch.randn(30, 2, 64, generator=gen)
    q = torch.randn(30, 4, 64, generator=gen)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    slots = table[0, torch.arange(30) // PAGE].long() * PAGE + torch.arange(30) % PAGE
    whole = TurboKVStore(3, PAGE, 2, 64, "turbo3", "turbo4", "cpu", torch.float32)
    whole.write(k, v, slots, torch.arange(30))
    out_whole = whole.attend(q, AttentionMetadata(slots, table, torch.tensor([30]), torch.tensor([0, 30]), [30], [30]), 0.125)
    chunked = TurboKVStore(3, PAGE, 2, 64, "turbo3", "turbo4", "cpu", torch.float32)
    chunked.write(k[:13], v[:13], slots[:13], torch.arange(13))
    first = chunked.attend(q[:13], AttentionMetadata(slots[:13], table, torch.tensor([13]), torch.tensor([0, 13]), [13], [13]), 0.125)
    chunked.write(k[13:], v[13:], slots[13:], torch.arange(13, 30))
    second = chunked.attend(q[13:], AttentionMetadata(slots[13:], table, torch.tensor([30]), torch.tensor([0, 17]), [30], [17]), 0.125)
    assert_close(torch.cat([first, second]), out_whole.double(), 1e-6, "chunked vs whole prefill")


def test_bad_shapes_are_explained():
    store = TurboKVStore(2, PAGE, 2, 64, "turbo3", "turbo3", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"k must have shape \[tokens, 2, 64\]"):
        store.write(torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), torch.arange(3), torch.arange(3))
    with pytest.raises(ValueError, match=r"slot_mapping must have one entry per token \(3\)"):
        store.write(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), torch.arange(4), torch.arange(3))
    with pytest.raises(ValueError, match=r"positions must have one entry per token \(3\)"):
        store.write(torch.zeros(3, 2, 64), torch.zeros(3, 2, 64), torch.arange(3), torch.arange(2))
