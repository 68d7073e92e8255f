"""The fused decode kernel with a key offset: scores <q, decoded> + <q, o(p)> (layout_change.md "Fused decode").

The kernel never forms o(p): over the KV head's P turning pairs it turns A = q1 m1 + q2 m2,
B = q2 m1 - q1 m2 by each tile's start angle and takes one dot with a table of the in-tile angles,
drops <q, const> (the same for every key of a row), and adds <q, sink - const - mean> at position 0.
Checked in the interpreter against the decoded-pages path (which adds key_offset_at to decoded keys)
and a float64 oracle (test_key_offset.represented_keys: decoded pages + o(p) by complex numbers),
at page and split boundaries, position 0 in the first of one or several splits, shuffled block tables
and mixed lengths, with a mean as long as a key and a sink unlike it.
"""

import pytest
import torch

from server.kernels.turbo import store as store_module
from server.kernels.turbo.attention import attention_over_decoded_pages, decode_attention_triton
from server.kernels.turbo.key_offset import KeyOffset
from test_attention import attention64, decode64
from test_key_offset import PAGE, assert_close, filled_store, inv_freq, random_offset, represented_keys, step

LENGTHS = [1, 2, PAGE - 1, PAGE, PAGE + 1, 300]  # 300: five 64-token tiles, a split boundary at 2 splits


def offset_for(kv_heads, head_dim, theta, seed, turned_pairs=None):
    """random_offset (mean ~ 3 randn on ``turned_pairs`` random pairs per head, None: all; a constant as long on
    the others; an independent sink) with RoPE's frequencies for ``theta``."""
    offset = random_offset(kv_heads, head_dim, torch.Generator().manual_seed(seed), turned_pairs=turned_pairs)
    return KeyOffset(offset.const, offset.mean, offset.sink, inv_freq(head_dim, theta).float(), offset.pairs)


def decode_case(seq_lens, kv_heads, gqa, head_dim, k_kind, v_kind, theta=10000.0, seed=0, turned_pairs=None):
    """(store with the offset, decode metadata, queries, float64 oracle output)."""
    offset = offset_for(kv_heads, head_dim, theta, seed, turned_pairs)
    store, tables, _ = filled_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, offset, seed=seed + 1)
    meta, q = step(tables, seq_lens, [1] * len(seq_lens), kv_heads * gqa, head_dim, seed=seed + 2)
    scale = head_dim**-0.5
    want = attention64(q, represented_keys(store, tables, seq_lens), decode64(store.v, head_dim), meta, scale)
    return store, meta, q, want


def fused(store, meta, q, **launch):
    return decode_attention_triton(q, store.k, store.v, meta, store.head_dim**-0.5, store.signs, store.inv_sqrt,
                                   store.key_offset, **launch)


@pytest.mark.parametrize(
    "head_dim,gqa,k_kind,v_kind,theta,splits,turned_pairs",
    [(64, 1, "turbo3", "turbo3", 10000.0, 2, 1), (64, 3, "turbo4", "turbo2", 500000.0, 1, None),
     (128, 4, "turbo3", "turbo4", 500000.0, 3, 5), (128, 8, "turbo2", "turbo3", 10000.0, 2, None),
     (128, 1, "turbo3", "turbo3", 10000.0, 2, 16)],
)
def test_fused_decode_with_offset_matches_decoded_pages_and_float64(head_dim, gqa, k_kind, v_kind, theta, splits,
                                                                    turned_pairs):
    """One split holds position 0 and every tile, or position 0 sits in the first of 2-3 splits (300 tokens:
    chunks of 128 or 192) and the later splits must not get the sink's extra score. P = 1, 5 (padded to 8),
    16 or all D/2 turning pairs per KV head, different per head, a constant on the others."""
    store, meta, q, want = decode_case(LENGTHS, 2, gqa, head_dim, k_kind, v_kind, theta, seed=head_dim + gqa,
                                       turned_pairs=turned_pairs)
    scale = head_dim**-0.5
    pages = attention_over_decoded_pages(q, store.k, store.v, k_kind, v_kind, meta, scale, store.key_offset)
    assert_close(pages, want, 2e-5, "decoded pages + o(p) vs float64")
    got = fused(store, meta, q, num_splits=splits)
    assert_close(got, pages.double(), 2e-5, f"fused decode, {splits} splits, vs decoded pages")
    assert_close(got, want, 2e-5, f"fused decode, {splits} splits, vs float64")


def test_fused_decode_with_offset_turns_every_tile_start():
    """16-token tiles: 19 tile starts in 300 tokens, 7 splits of 48 tokens (splits start mid-page)."""
    store, meta, q, want = decode_case([300, 33], 1, 2, 64, "turbo4", "turbo4", seed=21, turned_pairs=8)
    for splits in (1, 7):
        got = fused(store, meta, q, num_splits=splits, block_n=16)
        assert_close(got, want, 2e-5, f"16-token tiles, {splits} splits")


def test_fused_decode_with_offset_and_half_queries_errs_far_below_the_quantization():
    """fp16 queries (the GPU case) run the bias dot with fp16 operands: its rounding must be far below what
    turbo3 costs. Quantization error = the oracle over decoded K/V vs float64 attention over the keys and
    values written; the fp16 error = the fp16 fused decode vs the oracle."""
    kv_heads, gqa, head_dim, lengths = 1, 4, 128, [45, 200]
    offset = offset_for(kv_heads, head_dim, 500000.0, seed=31, turned_pairs=8)
    store, tables, keys = filled_store(lengths, kv_heads, head_dim, "turbo3", "turbo3", offset, seed=32)
    meta, q = step(tables, lengths, [1, 1], kv_heads * gqa, head_dim, seed=33)
    scale = head_dim**-0.5
    k64 = represented_keys(store, tables, lengths)
    v64 = decode64(store.v, head_dim)
    want = attention64(q, k64, v64, meta, scale)
    exact_k = torch.zeros_like(k64)  # the keys written, in the same pages, with decoded V: isolates K's error
    for s, n in enumerate(lengths):
        positions = torch.arange(n)
        exact_k[tables[s, positions // PAGE].long(), positions % PAGE] = keys[s].double()
    quantization = (attention64(q, exact_k, v64, meta, scale) - want).abs().max().item()
    got = fused(store, meta, q.half(), num_splits=2)
    assert got.dtype == torch.float16
    fp16 = (got.double() - want).abs().max().item()
    assert fp16 < 0.02 * quantization, f"fp16 fused decode error {fp16:.3g} vs turbo3 K error {quantization:.3g}"
    assert fp16 < 2e-3 * want.abs().max().item(), f"fp16 fused decode error {fp16:.3g}"


def test_store_attend_takes_the_fused_decode_with_an_offset(monkeypatch):
    """A decode step through TurboKVStore.attend on the fast path is the fused kernel with the store's offset."""
    store, meta, q, want = decode_case([17, 70], 2, 2, 64, "turbo3", "turbo3", seed=41)
    monkeypatch.setattr(store_module, "use_triton", lambda t: True)
    calls = []
    monkeypatch.setattr(store_module, "decode_attention_triton",
                        lambda *args, **kw: calls.append(args) or decode_attention_triton(*args, **kw))
    assert_close(store.attend(q, meta, 64**-0.5), want, 2e-5, "store.attend decode step vs float64")
    assert len(calls) == 1 and calls[0][7] is store.key_offset, "the decode step did not run fused with the offset"


def test_a_fixed_offset_runs_the_plain_fused_decode_and_softmax_ignores_it(monkeypatch):
    """--kv-key-offset fixed: o(p) = c at every position (sink == const, no mean) shifts a query row's scores
    alike, so the store hands attention no offset, and the output is still attention over decoded + c."""
    const = torch.randn(2, 64, generator=torch.Generator().manual_seed(43)) * 3
    fixed = KeyOffset.fixed(const, inv_freq(64).float())
    seq_lens = [17, 70]
    store, tables, _ = filled_store(seq_lens, 2, 64, "turbo3", "turbo3", fixed, seed=44)
    assert not store.offset_turns
    meta, q = step(tables, seq_lens, [1, 1], 4, 64, seed=45)
    want = attention64(q, represented_keys(store, tables, seq_lens), decode64(store.v, 64), meta, 0.125)
    monkeypatch.setattr(store_module, "use_triton", lambda t: True)
    calls = []
    monkeypatch.setattr(store_module, "decode_attention_triton",
                        lambda *args, **kw: calls.append(args) or decode_attention_triton(*args, **kw))
    assert_close(store.attend(q, meta, 0.125), want, 2e-5, "fused decode without the fixed offset vs float64")
    assert len(calls) == 1 and calls[0][7] is None, "a fixed offset must not cost the fused decode anything"
    meta, q = step(tables, seq_lens, [5, 70], 4, 64, seed=47)  # prefill: the decoded pages, c not added either
    want = attention64(q, represented_keys(store, tables, seq_lens), decode64(store.v, 64), meta, 0.125)
    assert_close(store.attend(q, meta, 0.125), want, 2e-5, "prefill over decoded pages without the fixed offset")
    store.set_key_offset(offset_for(2, 64, 10000.0, seed=46))
    assert store.offset_turns, "a turned offset must reach the fused decode"
