"""The fused write (store.py "Fused write"): a decode step's Triton decode stores the new token itself.

The unfused path (the store kernel, then the decode) is the reference: after a step the pages must be bit-identical
(codes and norms) and the outputs within the decode's tolerance, and the unfused output must match a float64
oracle over the pages. And every reader other than the fused decode must see the write stored.
CPU interpreter (CPU tensors), so skipped where a GPU is visible; test_fused_store_gpu.py runs there.
"""

import copy

import pytest
import torch
from test_attention import attention64, decode64
from test_key_offset import (
    PAGE,
    assert_close,
    inv_freq,
    random_offset,
    represented_keys,
)
from turbo_oracle import shuffled_tables, slots_of

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo import store as store_module
from server.kernels.turbo.attention import NewTokens, decode_attention_triton
from server.kernels.turbo.key_offset import KeyOffset
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors reach Triton through the "
                                "interpreter, which tests/conftest.py turns on only on machines without a GPU")


def make_offset(kind, kv_heads, head_dim, gen):
    """None, a fixed offset (o(p) = const) or a partial one (3 turned pairs per KV head, a constant elsewhere)."""
    if kind == "none":
        return None
    if kind == "fixed":
        return KeyOffset.fixed(torch.randn(kv_heads, head_dim, generator=gen) * 3, inv_freq(head_dim).float())
    return random_offset(kv_heads, head_dim, gen, turned_pairs=3)


def step_case(seq_lens, kv_heads, gqa, head_dim, k_kind, v_kind, offset_kind, seed):
    """A store holding every position but the last of each sequence (shuffled pages), and the decode step that
    adds the last: (store, meta, q, k, v, positions). seq_len 0 is a padding row (slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = shuffled_tables([max(n, 1) for n in seq_lens], PAGE, gen, spare=2)
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    offset = make_offset(offset_kind, kv_heads, head_dim, gen)
    if offset is not None:
        store.set_key_offset(offset)
    for s, n in enumerate(seq_lens):
        if n > 1:  # the context, through the reference quantizer (CPU tensors)
            positions = torch.arange(n - 1)
            store.write(torch.randn(n - 1, kv_heads, head_dim, generator=gen) * 2 + 0.5,
                        torch.randn(n - 1, kv_heads, head_dim, generator=gen), slots_of(tables[s], positions, PAGE),
                        positions)
    positions = torch.tensor([max(n - 1, 0) for n in seq_lens])
    slots = torch.tensor([slots_of(tables[s], positions[s : s + 1], PAGE).item() if n else -1
                          for s, n in enumerate(seq_lens)])
    num = len(seq_lens)
    meta = AttentionMetadata(slots, tables, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.arange(num + 1, dtype=torch.int32), list(seq_lens), [1] * num)
    k = torch.randn(num, kv_heads, head_dim, generator=gen) * 2 + 0.5
    v = torch.randn(num, kv_heads, head_dim, generator=gen)
    q = torch.randn(num, kv_heads * gqa, head_dim, generator=gen)
    return store, meta, q, k, v, positions


def assert_same_pages(got, want, what):
    for name in ("k", "v"):
        a, b = getattr(got, name), getattr(want, name)
        assert torch.equal(a.codes, b.codes), f"{what}: {name} codes differ"
        assert torch.equal(a.norms, b.norms), f"{what}: {name} norms differ"


# Page 16. 17 and 33: position seq_len - 1 is offset 0 of its page and the first token of the last split (2 splits
# of 16- or 32-token chunks with 16-token blocks: the boundary right before it); 16 and 48: offset page_size - 1;
# 1: the only token (the sink with an offset); 0: a padding row (slot -1, seq_len 0).
@pytest.mark.parametrize(
    "lengths,head_dim,gqa,k_kind,v_kind,offset_kind,splits,block_n",
    [([17, 33, 16, 48, 1, 0], 64, 1, "turbo3", "turbo3", "turned", 2, 16),
     ([17, 33, 16, 48, 1, 0], 64, 4, "turbo2", "turbo4", "fixed", 2, 16),
     ([33, 16, 1], 128, 4, "turbo4", "turbo3", "none", 3, 16),
     ([48, 17, 0], 128, 1, "turbo3", "turbo2", "turned", 1, 64),
     ([100, 65, 33], 64, 4, "turbo4", "turbo4", "turned", 5, 16)],
)
def test_the_fused_decode_stores_the_pages_bit_identically_and_attends_as_the_unfused(
        lengths, head_dim, gqa, k_kind, v_kind, offset_kind, splits, block_n):
    store, meta, q, k, v, positions = step_case(lengths, 2, gqa, head_dim, k_kind, v_kind, offset_kind,
                                                seed=head_dim + gqa + splits)
    fused, plain = copy.deepcopy(store), store
    decode_offset = plain.key_offset if plain.offset_turns else None
    store_turbo_triton(k, v, meta.slot_mapping, positions, plain.k, plain.v, plain.signs, plain.inv_sqrt,
                       plain.key_offset, plain.offset_turns)
    scale = head_dim**-0.5
    want = decode_attention_triton(q, plain.k, plain.v, meta, scale, plain.signs, plain.inv_sqrt, decode_offset,
                                   num_splits=splits, block_n=block_n)
    fused_offset = fused.key_offset if fused.offset_turns else None
    new = NewTokens(k, v, meta.slot_mapping, positions, fused.key_offset, fused.offset_turns)
    got = decode_attention_triton(q, fused.k, fused.v, meta, scale, fused.signs, fused.inv_sqrt, fused_offset,
                                  num_splits=splits, block_n=block_n, new_tokens=new)
    assert_same_pages(fused, plain, "fused vs unfused store")
    assert_close(got, want.double(), 2e-5, f"fused vs unfused decode, {splits} splits")
    keys = decode64(plain.k, head_dim) if plain.key_offset is None else represented_keys(plain, meta.block_tables,
                                                                                         lengths)
    assert_close(want, attention64(q, keys, decode64(plain.v, head_dim), meta, scale), 2e-5, "unfused vs float64")
    if 0 in lengths:
        assert not got[lengths.index(0)].any(), "a padding row comes out zero"


def spied_store(monkeypatch, store):
    """Force the fast path on CPU tensors; count store kernel launches and the fused decodes."""
    monkeypatch.setattr(store_module, "use_triton", lambda t: True)
    calls = {"store": 0, "fused": 0}

    def store_turbo(*args, **kw):
        calls["store"] += 1
        store_turbo_triton(*args, **kw)

    def decode(*args, **kw):
        calls["fused"] += kw.get("new_tokens") is not None
        return decode_attention_triton(*args, **kw)

    monkeypatch.setattr(store_module, "store_turbo", store_turbo)
    monkeypatch.setattr(store_module, "decode_attention_triton", decode)
    return calls


def test_a_decode_step_through_the_store_is_fused_and_lands_like_the_unfused_store(monkeypatch):
    store, meta, q, k, v, positions = step_case([17, 48, 0], 2, 2, 64, "turbo3", "turbo4", "turned", seed=5)
    plain = copy.deepcopy(store)
    store.fuse_store, plain.fuse_store = True, False
    calls = spied_store(monkeypatch, store)
    plain.write(k, v, meta.slot_mapping, positions)
    assert calls["store"] == 1, "the switch off stores at write"
    want = plain.attend(q, meta, 0.125)
    store.write(k, v, meta.slot_mapping, positions)
    assert calls["store"] == 1, "a fast write must stay pending"
    got = store.attend(q, meta, 0.125)
    assert calls == {"store": 1, "fused": 1}, calls
    assert_close(got, want.double(), 2e-5, "store.attend fused vs unfused")
    assert_same_pages(store, plain, "store.attend fused vs unfused")


def pending_store(monkeypatch, seed):
    """A store with a decode step's write pending, the unfused store after the same write, the step's tensors."""
    store, meta, q, k, v, positions = step_case([33, 16], 2, 2, 64, "turbo3", "turbo3", "turned", seed=seed)
    plain = copy.deepcopy(store)
    store_turbo_triton(k, v, meta.slot_mapping, positions, plain.k, plain.v, plain.signs, plain.inv_sqrt,
                       plain.key_offset, plain.offset_turns)
    calls = spied_store(monkeypatch, store)
    store.fuse_store = True
    store.write(k, v, meta.slot_mapping, positions)
    assert store._pending is not None
    return store, plain, meta, q, k, v, positions, calls


def test_reading_the_pages_stores_the_pending_write(monkeypatch):
    store, plain, *_, calls = pending_store(monkeypatch, seed=7)
    assert_same_pages(store, plain, "store.k / store.v")
    assert calls["store"] == 1 and store._pending is None


def test_a_prefill_a_foreign_decode_and_the_cuda_decode_store_the_pending_write_first(monkeypatch):
    store, plain, meta, q, *_, calls = pending_store(monkeypatch, seed=8)
    prefill = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens, torch.tensor([0, 2, 3]),
                                meta.seq_lens_cpu, [2, 1])
    q3 = torch.randn(3, 4, 64)
    want = plain.attend(q3, prefill, 0.125)
    assert_close(store.attend(q3, prefill, 0.125), want.double(), 1e-6, "prefill after a pending write")
    assert calls == {"store": 1, "fused": 0}, calls

    monkeypatch.undo()  # the next case's context is written through the reference quantizer
    store, plain, meta, q, *_, calls = pending_store(monkeypatch, seed=8)
    foreign = AttentionMetadata(meta.slot_mapping.clone(), *list(vars(meta).values())[1:])  # not this step's slots
    want = plain.attend(q, meta, 0.125)
    assert_close(store.attend(q, foreign, 0.125), want.double(), 2e-5, "decode of other slots")
    assert calls == {"store": 1, "fused": 0}, calls

    monkeypatch.undo()
    store, plain, meta, q, *_, calls = pending_store(monkeypatch, seed=8)
    seen = []
    monkeypatch.setattr(store_module, "CUDA_DECODE_MIN_WORK", 1)
    monkeypatch.setattr(store_module, "decode_attention_cuda",
                        lambda *args, **kwargs: seen.append(store._pending is None
                                                            and torch.equal(args[1].codes, plain.k.codes)))
    store.attend(q, meta, 0.125)
    assert seen == [True] and calls == {"store": 1, "fused": 0}, "the CUDA C decode must see the pages written"


def test_writes_and_key_offsets_land_in_order(monkeypatch):
    store, plain, meta, _, k, v, positions, calls = pending_store(monkeypatch, seed=9)
    store.write(k * 0, v, meta.slot_mapping, positions)  # a second write stores the first
    assert calls["store"] == 1 and store._pending is not None
    monkeypatch.undo()
    store, plain, *_, calls = pending_store(monkeypatch, seed=9)
    store.set_key_offset(random_offset(2, 64, torch.Generator().manual_seed(1), turned_pairs=2))
    assert calls["store"] == 1 and store._pending is None, "set_key_offset must store under the old offset"
    plain.set_key_offset(store.key_offset)
    assert_same_pages(store, plain, "the write pending across set_key_offset")


def test_the_switch_turns_the_fused_write_off(monkeypatch):
    monkeypatch.setenv("TURBOSERVE_FUSED_TURBO_STORE", "0")
    store = TurboKVStore(2, PAGE, 1, 64, "turbo3", "turbo3", "cpu", torch.float32)
    assert not store.fuse_store
    monkeypatch.setenv("TURBOSERVE_FUSED_TURBO_STORE", "1")
    assert TurboKVStore(2, PAGE, 1, 64, "turbo3", "turbo3", "cpu", torch.float32).fuse_store
    monkeypatch.delenv("TURBOSERVE_FUSED_TURBO_STORE")
    assert not TurboKVStore(2, PAGE, 1, 64, "turbo3", "turbo3", "cpu", torch.float32).fuse_store, "default: off"
