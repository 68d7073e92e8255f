"""Key offset (TurboKVStore.k_offset): the store quantizes k - m, and attention is blind to m.

Every score of a query row moves by the same <q, m>, so softmax (causal mask included) gives the
same output. The oracle below adds m back to the float64-decoded keys and attends over those, so
it checks that claim for every attention path; the other tests check that the pages really hold
k - m (not k + m, not k) and that this is what makes keys with a shared direction cheaper.
"""

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.attention import attention_over_decoded_pages, decode_attention_triton
from server.kernels.turbo.format import dequantize_reference, quantize_reference, unpack_indices
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore
from test_attention import attention64, decode64

PAGE = 16


def shared_direction_keys(n, kv_heads, head_dim, direction, gen):
    """Keys like real ones: a large per-head direction every token shares, plus what differs per token."""
    return direction + torch.randn(n, kv_heads, head_dim, generator=gen)


def filled_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, offset, direction, seed):
    """A store (k_offset = ``offset``) holding each sequence in shuffled pages; also the keys written."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_needed) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    store.set_k_offset(offset)
    keys = []
    for s, n in enumerate(seq_lens):
        tables[s, : pages_needed[s]] = torch.tensor([order.pop() for _ in range(pages_needed[s])])
        slots = tables[s, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
        k = shared_direction_keys(n, kv_heads, head_dim, direction, gen)
        store.write(k, torch.randn(n, kv_heads, head_dim, generator=gen), slots)
        keys.append(k)
    return store, tables, keys


def step(tables, seq_lens, q_lens, q_heads, head_dim, seed):
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, torch.tensor(seq_lens, dtype=torch.int32),
                             starts, list(seq_lens), list(q_lens))
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return meta, q


def represented_keys(store):
    """What the store stands for: its decoded pages plus the offset, float64 [pages, page, heads, D]."""
    return decode64(store.k, store.head_dim) + store.k_offset.double()


def assert_close(got, want, tol, what):
    err = (got.double() - want).abs().max().item()
    assert err < tol, f"{what}: max abs error {err:.3g} >= {tol}"


@pytest.mark.parametrize("head_dim,gqa,k_kind,v_kind", [(64, 3, "turbo3", "turbo3"), (128, 1, "turbo4", "turbo2")])
def test_attention_is_blind_to_the_offset_on_every_path(head_dim, gqa, k_kind, v_kind):
    kv_heads = 2
    gen = torch.Generator().manual_seed(head_dim)
    direction = torch.randn(kv_heads, head_dim, generator=gen) * 3  # |m| ~ 3 sqrt(D): q.m moves scores by tens
    offset = direction + 0.5 * torch.randn(kv_heads, head_dim, generator=gen)  # calibrated, not exact
    seq_lens = [1, PAGE + 1, 45]
    store, tables, _ = filled_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, offset, direction, seed=1)
    scale = head_dim**-0.5
    v64 = decode64(store.v, head_dim)

    meta, q = step(tables, seq_lens, [1, 1, 1], kv_heads * gqa, head_dim, seed=2)
    want = attention64(q, represented_keys(store), v64, meta, scale)
    assert_close(store.attend(q, meta, scale), want, 2e-5, "reference decode step")
    fused = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt, num_splits=2)
    assert_close(fused, want, 2e-5, "fused Triton decode")

    meta, q = step(tables, seq_lens, [1, 7, 45], kv_heads * gqa, head_dim, seed=3)  # chunked and whole prefill
    want = attention64(q, represented_keys(store), v64, meta, scale)
    assert_close(store.attend(q, meta, scale), want, 2e-5, "reference prefill")
    dense = attention_over_decoded_pages(q, store.k, store.v, k_kind, v_kind, meta, scale, fast=True)
    assert_close(dense, want, 2e-5, "dense Triton prefill over decoded pages")


def test_pages_hold_the_key_minus_the_offset():
    """Decoded pages plus m give back the key within the quantizer's error on k - m (a sign slip would not)."""
    gen = torch.Generator().manual_seed(4)
    direction = torch.randn(2, 64, generator=gen) * 4
    store, tables, keys = filled_store([40], 2, 64, "turbo3", "turbo3", direction, direction, seed=5)
    slots = tables[0, torch.arange(40) // PAGE].long() * PAGE + torch.arange(40) % PAGE
    decoded = decode64(store.k, 64).reshape(-1, 2, 64)[slots]  # [40, heads, D]: pages are [page, slot, heads, D]
    k = keys[0].double()
    residual = k - direction.double()
    relative = ((decoded + direction.double() - k).pow(2).sum(-1) / residual.pow(2).sum(-1)).mean().item()
    assert relative < 0.05, f"turbo3 error relative to |k - m|^2 is {relative:.3f}; the pages do not hold k - m"


def test_offset_cuts_the_attention_error_for_keys_with_a_shared_direction():
    """The point of the offset: vs exact attention over the unquantized keys, the offset store is closer."""
    kv_heads, head_dim = 2, 64
    gen = torch.Generator().manual_seed(6)
    direction = torch.randn(kv_heads, head_dim, generator=gen) * 3
    errors = {}
    for name, offset in (("plain", torch.zeros(kv_heads, head_dim)), ("offset", direction)):
        store, tables, keys = filled_store([60], kv_heads, head_dim, "turbo3", "turbo3", offset, direction, seed=7)
        slots = tables[0, torch.arange(60) // PAGE].long() * PAGE + torch.arange(60) % PAGE
        exact_k = torch.zeros(store.k.codes.shape[0] * PAGE, kv_heads, head_dim, dtype=torch.float64)
        exact_k[slots] = keys[0].double()
        exact_k = exact_k.reshape(-1, PAGE, kv_heads, head_dim)
        meta, q = step(tables, [60], [60], kv_heads * 2, head_dim, seed=8)
        want = attention64(q, exact_k, decode64(store.v, head_dim), meta, 0.125)  # same V: only K error counts
        errors[name] = (store.attend(q, meta, 0.125).double() - want).pow(2).mean().item()
    assert errors["offset"] < errors["plain"] / 4, errors


@pytest.mark.parametrize("head_dim,k_kind,v_kind", [(64, "turbo3", "turbo4"), (128, "turbo4", "turbo2")])
def test_store_kernel_matches_the_reference_with_an_offset(head_dim, k_kind, v_kind):
    """Triton store (interpreter) through the store's own offset vs quantize_reference(k - m) and plain v."""
    gen = torch.Generator().manual_seed(head_dim + 1)
    heads, tokens = 3, 37
    store = TurboKVStore(4, PAGE, heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    offset = torch.randn(heads, head_dim, generator=gen) * 5
    store.set_k_offset(offset)
    k = offset + torch.randn(tokens, heads, head_dim, generator=gen)
    k[3] = offset  # k - m == 0: norm 0, index 0, like a zero key in the plain format
    v = torch.randn(tokens, heads, head_dim, generator=gen) + 2.0  # V never loses an offset
    slots = torch.randperm(4 * PAGE, generator=gen)[:tokens]
    store_turbo_triton(k, v, slots, store.k, store.v, store.signs, store.inv_sqrt, store.k_offset)
    for pages, kind, x in ((store.k, k_kind, k - offset), (store.v, v_kind, v)):
        codes, norms = quantize_reference(x, kind)
        got_codes = pages.codes[slots // PAGE, :, slots % PAGE]
        got_norms = pages.norms[slots // PAGE, :, slots % PAGE]
        assert torch.allclose(got_norms.float(), norms.float(), rtol=2e-3, atol=0)
        # Float sums in another order can move a value across a midpoint by an ulp; allow only that.
        mismatch = unpack_indices(got_codes, pages.bits, head_dim) != unpack_indices(codes, pages.bits, head_dim)
        assert mismatch.float().mean() < 1e-3, mismatch.float().mean()
    assert store.k.norms[slots[3] // PAGE, :, slots[3] % PAGE].eq(0).all()
    decoded = dequantize_reference(store.k.codes[slots // PAGE, :, slots % PAGE],
                                   store.k.norms[slots // PAGE, :, slots % PAGE], k_kind, head_dim)
    assert (decoded + offset - k).norm() < (k - offset).norm() / 5, "Triton pages plus m must give back k"


def test_default_offset_is_zero_and_bad_offsets_are_refused():
    store = TurboKVStore(2, PAGE, 2, 64, "turbo3", "turbo3", "cpu", torch.float32)
    assert store.k_offset.shape == (2, 64) and store.k_offset.eq(0).all(), "default must be the spec's plain format"
    with pytest.raises(ValueError, match=r"k_offset must have shape \[2, 64\]"):
        store.set_k_offset(torch.zeros(64))
    with pytest.raises(ValueError, match="finite"):
        store.set_k_offset(torch.full((2, 64), float("nan")))
    assert store.k_offset.eq(0).all(), "a refused offset must leave the old one in place"
