"""TurboKVStore's per-head transform: pages hold (k - m) * s and v * t, attention undoes it exactly.

The oracle knows nothing of the store's arithmetic: it decodes the pages in float64, turns them
back into the keys and values they stand for (decoded / s + m, decoded / t) and runs plain
softmax attention over those with the caller's q. Every path (reference and Triton store,
reference and fused Triton decode, reference and Triton prefill) must agree with it.
"""

import pytest
import torch
from test_attention import attention64, decode64
from test_key_offset import assert_close, step

import server.kernels.turbo.attention as turbo_attention
import server.kernels.turbo.store as turbo_store
from server.kernels.turbo.format import quantize_reference, unpack_indices
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore

PAGE = 16


def powers_of_two(shape, gen, low=-3, high=3):
    return torch.exp2(torch.randint(low, high + 1, shape, generator=gen).float())


def transformed_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, seed):
    """A store with a random offset and power-of-two scales, holding each sequence in shuffled pages.
    Keys have a shared direction and channels of very different spread, as real keys do."""
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(kv_heads, head_dim, generator=gen) * 3
    k_scale, v_scale = powers_of_two((kv_heads, head_dim), gen), powers_of_two((kv_heads, head_dim), gen)
    pages_needed = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_needed) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    store.set_transform(offset, k_scale, v_scale)
    spread = powers_of_two((head_dim,), gen, -2, 2)
    for s, n in enumerate(seq_lens):
        tables[s, : pages_needed[s]] = torch.tensor([order.pop() for _ in range(pages_needed[s])])
        slots = tables[s, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
        k = offset + torch.randn(n, kv_heads, head_dim, generator=gen) * spread
        store.write(k, torch.randn(n, kv_heads, head_dim, generator=gen) * spread + 1.0, slots)
    return store, tables


def represented(store):
    """The keys and values the pages stand for, float64 [pages, page, heads, D]."""
    k = decode64(store.k, store.head_dim) / store.k_scale.double() + store.k_offset.double()
    return k, decode64(store.v, store.head_dim) / store.v_scale.double()


@pytest.fixture
def path(request, monkeypatch):
    """'triton': the store's own dispatch sends writes, decode and prefill to the Triton bodies (interpreter)."""
    if request.param == "triton":
        monkeypatch.setattr(turbo_store, "use_triton", lambda t: True)
        monkeypatch.setattr(turbo_attention, "use_triton", lambda t: True)
    return request.param


@pytest.mark.parametrize("path,head_dim,gqa,k_kind,v_kind", [
    ("reference", 64, 3, "turbo3", "turbo3"), ("reference", 128, 2, "turbo4", "turbo2"),
    ("triton", 64, 3, "turbo3", "turbo3"),  # the interpreter is slow; test_key_offset covers G=128 there
], indirect=["path"])
def test_attention_through_the_transform_equals_the_oracle_over_the_keys_and_values_it_stands_for(
        path, head_dim, gqa, k_kind, v_kind):
    kv_heads, seq_lens = 2, [1, PAGE + 1, 45]
    store, tables = transformed_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, seed=head_dim)
    assert store.scaled
    k64, v64 = represented(store)
    scale = head_dim**-0.5
    for what, q_lens, seed in (("decode step", [1, 1, 1], 2), ("chunked and whole prefill", [1, 7, 45], 3)):
        meta, q = step(tables, seq_lens, q_lens, kv_heads * gqa, head_dim, seed)
        want = attention64(q, k64, v64, meta, scale)  # values reach ~10 here: float32 rounding, relative
        assert_close(store.attend(q, meta, scale), want, 1e-5 * want.abs().max().item(), f"{path} {what}")


def test_store_kernel_quantizes_the_transformed_rows():
    """Triton store (interpreter) vs quantize_reference of (k - m) * s and v * t, through the store's tensors."""
    gen = torch.Generator().manual_seed(11)
    heads, tokens, head_dim = 3, 37, 64
    store = TurboKVStore(4, PAGE, heads, head_dim, "turbo3", "turbo4", "cpu", torch.float32)
    offset = torch.randn(heads, head_dim, generator=gen) * 5
    k_scale, v_scale = powers_of_two((heads, head_dim), gen), powers_of_two((heads, head_dim), gen)
    store.set_transform(offset, k_scale, v_scale)
    k = offset + torch.randn(tokens, heads, head_dim, generator=gen)
    v = torch.randn(tokens, heads, head_dim, generator=gen) + 2.0
    slots = torch.randperm(4 * PAGE, generator=gen)[:tokens]
    store_turbo_triton(k, v, slots, store.k, store.v, store.signs, store.inv_sqrt, store.k_offset, store.k_scale,
                       store.v_scale)
    for pages, kind, x in ((store.k, "turbo3", (k - offset) * k_scale), (store.v, "turbo4", v * v_scale)):
        codes, norms = quantize_reference(x, kind)
        got_norms = pages.norms[slots // PAGE, :, slots % PAGE]
        assert torch.allclose(got_norms.float(), norms.float(), rtol=2e-3, atol=0), f"{kind} norms differ"
        got = unpack_indices(pages.codes[slots // PAGE, :, slots % PAGE], pages.bits, head_dim)
        # Float sums in another order can move a value across a midpoint by an ulp; allow only that.
        mismatch = (got != unpack_indices(codes, pages.bits, head_dim)).float().mean()
        assert mismatch < 1e-3, f"{kind}: {mismatch:.4f} of the indices differ from the reference"


def test_default_transform_is_the_identity_and_bad_ones_are_refused():
    store = TurboKVStore(2, PAGE, 2, 64, "turbo3", "turbo3", "cpu", torch.float16)
    assert not store.scaled and store.k_scale.eq(1).all() and store.v_scale.eq(1).all()
    good = torch.ones(2, 64)
    for bad, match in ((torch.full((2, 64), 3.0), "powers of two"), (-good, "powers of two"),
                       (torch.zeros(2, 64), "powers of two"), (torch.full((2, 64), 2.0**17), "powers of two"),
                       (torch.full((2, 64), 2.0**-17), "powers of two"),
                       (torch.ones(64), r"k_scale must have shape \[2, 64\]"),
                       (torch.full((2, 64), float("inf")), "finite")):
        with pytest.raises(ValueError, match=match):
            store.set_transform(None, bad, good)
    assert not store.scaled and store.k_scale.eq(1).all(), "a refused transform must leave the old one in place"
    store.set_transform(None, good * 2.0**16, good * 0.25)  # 2^16 is the largest accepted
    assert store.scaled and store.out_multiplier.eq(4).all() and store.out_multiplier.dtype == torch.float16
    assert store.q_multiplier.eq(2.0**-16).all(), "1 / s must be exact in the compute dtype"
