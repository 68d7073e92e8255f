"""Key offset (key_offset.py): K pages hold k - o(p), and attention adds o(p) back.

o(p) = const + RoPE(p) mean for p >= 1, o(0) = sink, the mean zero outside the listed pairs. The
oracle below turns the mean with complex numbers (an independent form of RoPE's rotate-half) on
the listed pairs only, adds o(p) to the float64-decoded keys and attends over those, so it checks
every attention path; the other tests check that the pages hold k - o(p) (not k, not k + o, not
the unturned mean) and that the turned offset is what makes RoPE keys with a shared direction cheaper.
"""

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.attention import attention_over_decoded_pages
from server.kernels.turbo.format import dequantize_reference, quantize_reference, unpack_indices
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at, offset_scores, pair_mask, pair_turns
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore
from test_attention import attention64, decode64
from turbo_oracle import shuffled_tables, slots_of

PAGE = 16


def inv_freq(head_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def offset64(offset, positions):
    """o(p) in float64 through complex numbers: on each listed pair f of a head, mean[f] + i mean[f + D/2] times
    e^(i p theta_f), plus const everywhere; the sink at p == 0. Pairs not listed are not read from the mean."""
    mean, half = offset.mean.double(), offset.mean.shape[-1] // 2
    turns = torch.zeros(mean.shape[0], half, dtype=torch.bool)
    for h, row in enumerate(offset.pairs.tolist()):
        turns[h, row] = True
    pairs = torch.complex(mean[..., :half], mean[..., half:]) * turns  # [H, D/2]
    turn = torch.polar(torch.ones(len(positions), half, dtype=torch.float64),
                       positions.double()[:, None] * offset.inv_freq.double()[None])  # [T, D/2]
    turned = pairs[None] * turn[:, None]  # [T, H, D/2]
    out = torch.cat([turned.real, turned.imag], dim=-1) + offset.const.double()[None]
    return torch.where((positions == 0)[:, None, None], offset.sink.double()[None], out)


def random_offset(kv_heads, head_dim, gen, scale=3.0, turned_pairs=None):
    """A mean as long as a key turning on ``turned_pairs`` random pairs per head (None: all, const 0), a constant
    as long on the other pairs, a sink unlike both, RoPE's frequencies (float32, as a store keeps them)."""
    half = head_dim // 2
    p = half if turned_pairs is None else turned_pairs
    pairs = torch.stack([torch.randperm(half, generator=gen)[:p] for _ in range(kv_heads)]).to(torch.int32)
    turn = pair_mask(pairs, head_dim)
    mean = torch.randn(kv_heads, head_dim, generator=gen) * scale * turn
    const = torch.randn(kv_heads, head_dim, generator=gen) * scale * ~turn
    sink = torch.randn(kv_heads, head_dim, generator=gen) * scale
    return KeyOffset(const, mean, sink, inv_freq(head_dim).float(), pairs)


def rope_keys(n, kv_heads, head_dim, offset, gen, first=0):
    """Keys like real ones: RoPE(p) (shared direction + what differs per token), the sink's own key at p == 0."""
    positions = torch.arange(first, first + n)
    noise = torch.randn(n, kv_heads, head_dim, generator=gen)
    return (key_offset_at(offset, positions) + noise).float(), positions


def filled_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, offset, seed, store_offset="same"):
    """A store holding each sequence's keys (shared direction ``offset``, rope_keys) in shuffled pages, written
    in two chunks; also the block tables and the keys written. The store subtracts ``offset`` unless
    ``store_offset`` names another (None: the plain format)."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = shuffled_tables(seq_lens, PAGE, gen, spare=2)
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    store_offset = offset if store_offset == "same" else store_offset
    if store_offset is not None:
        store.set_key_offset(store_offset)
    keys = []
    for s, n in enumerate(seq_lens):
        k, positions = rope_keys(n, kv_heads, head_dim, offset, gen)
        slots = slots_of(tables[s], positions, PAGE)
        v = torch.randn(n, kv_heads, head_dim, generator=gen)
        cut = n // 2  # chunked prefill: the second chunk's positions do not start at 0
        store.write(k[:cut], v[:cut], slots[:cut], positions[:cut])
        store.write(k[cut:], v[cut:], slots[cut:], positions[cut:])
        keys.append(k)
    return store, tables, keys


def represented_keys(store, tables, seq_lens):
    """What the store stands for: decoded pages plus o(p) of each row's position, float64 [pages, page, heads, D]."""
    k = decode64(store.k, store.head_dim).clone()
    o = store.key_offset
    for s, n in enumerate(seq_lens):
        positions = torch.arange(n)
        pages, rows = tables[s, positions // PAGE].long(), positions % PAGE
        k[pages, rows] += offset64(o, positions)
    return k


def step(tables, seq_lens, q_lens, q_heads, head_dim, seed):
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), tables, torch.tensor(seq_lens, dtype=torch.int32),
                             starts, list(seq_lens), list(q_lens))
    q = torch.randn(sum(q_lens), q_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return meta, q


def assert_close(got, want, tol, what):
    err = (got.double() - want).abs().max().item()
    assert err < tol, f"{what}: max abs error {err:.3g} >= {tol}"


@pytest.mark.parametrize("head_dim,turned_pairs", [(64, None), (64, 1), (128, 5), (256, None)])
def test_key_offset_at_is_const_plus_the_turned_mean_and_the_sink_at_zero(head_dim, turned_pairs):
    gen = torch.Generator().manual_seed(head_dim)
    offset = random_offset(3, head_dim, gen, turned_pairs=turned_pairs)
    positions = torch.tensor([0, 1, 2, 17, 1000, 65535])
    got = key_offset_at(offset, positions)
    want = offset64(offset, positions)
    assert got.dtype == torch.float32 and got.shape == (6, 3, head_dim)
    # float32 angles p * theta round by up to half an ulp of p (3.9e-3 rad at 65535): as the model's own RoPE
    assert_close(got[:5], want[:5], 1e-3, "o(p) up to position 1000")
    assert_close(got[5:], want[5:], 0.05, "o(65535)")
    assert torch.equal(got[0], offset.sink), "position 0 is the sink's own key"
    turned = got[1:, 0] - offset.const[0]
    assert torch.allclose(turned.norm(dim=-1), offset.mean[0].norm().expand(5), rtol=1e-5), "RoPE keeps |mean|"
    still = ~pair_mask(offset.pairs, head_dim)
    assert torch.equal(got[1:][:, still], offset.const[still].expand(5, -1)), "pairs not listed must not turn"


@pytest.mark.parametrize("head_dim,gqa,turned_pairs", [(64, 3, 8), (64, 1, None), (128, 4, 1), (256, 2, 0)])
def test_offset_scores_are_q_dot_the_offset(head_dim, gqa, turned_pairs):
    """offset_scores (2P + 1 terms a position) against <q, o(p)> with o(p) from the float64 oracle."""
    gen = torch.Generator().manual_seed(head_dim + gqa)
    offset = random_offset(3, head_dim, gen, turned_pairs=turned_pairs)
    q = torch.randn(5, 3, gqa, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 999, 1000])
    got = offset_scores(offset, q, positions, pair_turns(offset, positions))
    want = torch.einsum("thgd,jhd->hgtj", q.double(), offset64(offset, positions))
    assert got.dtype == torch.float32 and got.shape == (3, gqa, 5, len(positions))
    assert_close(got, want, 2e-3 * want.abs().max().item(), "scores")


@pytest.mark.parametrize("head_dim,gqa,k_kind,v_kind", [(64, 3, "turbo3", "turbo3"), (128, 1, "turbo4", "turbo2")])
def test_attention_adds_the_offset_back_on_every_path(head_dim, gqa, k_kind, v_kind):
    kv_heads = 2
    offset = random_offset(kv_heads, head_dim, torch.Generator().manual_seed(head_dim))
    seq_lens = [1, PAGE + 1, 45]
    store, tables, _ = filled_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, offset, seed=1)
    scale = head_dim**-0.5
    k64, v64 = represented_keys(store, tables, seq_lens), decode64(store.v, head_dim)

    meta, q = step(tables, seq_lens, [1, 1, 1], kv_heads * gqa, head_dim, seed=2)
    assert_close(store.attend(q, meta, scale), attention64(q, k64, v64, meta, scale), 2e-5, "reference decode step")

    meta, q = step(tables, seq_lens, [1, 7, 45], kv_heads * gqa, head_dim, seed=3)  # chunked and whole prefill
    want = attention64(q, k64, v64, meta, scale)
    assert_close(store.attend(q, meta, scale), want, 2e-5, "reference prefill")
    dense = attention_over_decoded_pages(q, store.k, store.v, k_kind, v_kind, meta, scale, store.key_offset, fast=True)
    assert_close(dense, want, 2e-5, "dense Triton prefill over decoded pages")


def test_pages_hold_the_key_minus_its_turned_offset():
    """Decoded pages plus o(p) give back the key within the quantizer's error on k - o(p)."""
    offset = random_offset(2, 64, torch.Generator().manual_seed(4), scale=4.0)
    store, tables, keys = filled_store([40], 2, 64, "turbo3", "turbo3", offset, seed=5)
    positions = torch.arange(40)
    slots = tables[0, positions // PAGE].long() * PAGE + positions % PAGE
    decoded = decode64(store.k, 64).reshape(-1, 2, 64)[slots]  # [40, heads, D]: pages are [page, slot, heads, D]
    k = keys[0].double()
    o = offset64(offset, positions)
    relative = ((decoded + o - k).pow(2).sum(-1) / (k - o).pow(2).sum(-1)).mean().item()
    assert relative < 0.05, f"turbo3 error relative to |k - o(p)|^2 is {relative:.3f}; the pages do not hold k - o(p)"


def test_turned_offset_cuts_the_attention_error_for_rope_keys():
    """The point of the offset: against exact attention over the unquantized keys, a store with the turned
    offset is closer than the plain format and than the same mean left unturned."""
    kv_heads, head_dim, n = 2, 64, 60
    offset = random_offset(kv_heads, head_dim, torch.Generator().manual_seed(6))
    unturned = KeyOffset(offset.const, offset.mean, offset.sink, torch.zeros_like(offset.inv_freq), offset.pairs)
    errors = {}
    for name, store_offset in (("plain", None), ("unturned", unturned), ("turned", offset)):
        store, tables, keys = filled_store([n], kv_heads, head_dim, "turbo3", "turbo3", offset, 7, store_offset)
        positions = torch.arange(n)
        slots = tables[0, positions // PAGE].long() * PAGE + positions % PAGE
        exact_k = torch.zeros(store.k.codes.shape[0] * PAGE, kv_heads, head_dim, dtype=torch.float64)
        exact_k[slots] = keys[0].double()
        meta, q = step(tables, [n], [n], kv_heads * 2, head_dim, seed=8)
        want = attention64(q, exact_k.reshape(-1, PAGE, kv_heads, head_dim), decode64(store.v, head_dim), meta, 0.125)
        errors[name] = (store.attend(q, meta, 0.125).double() - want).pow(2).mean().item()
    assert errors["turned"] < errors["unturned"] / 2 and errors["turned"] < errors["plain"] / 4, errors


@pytest.mark.parametrize("head_dim,k_kind,v_kind,turned_pairs", [
    (64, "turbo3", "turbo4", None), (128, "turbo4", "turbo2", None), (256, "turbo3", "turbo3", None),
    (64, "turbo4", "turbo3", 1), (128, "turbo3", "turbo3", 8), (128, "turbo3", "turbo3", 0),
])
def test_store_kernel_matches_the_reference_with_an_offset(head_dim, k_kind, v_kind, turned_pairs):
    """Triton store (interpreter) with the store's offset vs quantize_reference(k - o(p)) and plain v: positions
    0 (the sink), small and large, in shuffled order, one padding token; turned (all pairs or some, the
    others constant) and fixed offsets (0 pairs: the kernel skips the angles)."""
    gen = torch.Generator().manual_seed(head_dim + 1)
    heads, tokens = 3, 37
    store = TurboKVStore(4, PAGE, heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    offset = random_offset(heads, head_dim, gen, scale=5.0, turned_pairs=turned_pairs)
    store.set_key_offset(offset if turned_pairs != 0 else KeyOffset.fixed(offset.const, offset.inv_freq))
    assert store.offset_turns == (turned_pairs != 0)
    positions = torch.cat([torch.tensor([0, 1, 5000]), torch.randperm(300, generator=gen)[: tokens - 3] + 2])
    k = key_offset_at(store.key_offset, positions) + torch.randn(tokens, heads, head_dim, generator=gen)
    k[3] = key_offset_at(store.key_offset, positions[3:4])[0]  # k - o(p) == 0: norm 0, index 0
    v = torch.randn(tokens, heads, head_dim, generator=gen) + 2.0  # V never loses an offset
    slots = torch.randperm(4 * PAGE, generator=gen)[:tokens]
    slots[9] = -1  # a padding token stores nothing
    store_turbo_triton(k, v, slots, positions, store.k, store.v, store.signs, store.inv_sqrt, store.key_offset,
                       store.offset_turns)
    keep = slots >= 0
    s = slots[keep]
    exact = torch.ones(tokens, dtype=torch.bool)
    exact[3] = False  # k - o(p) is float dust there: its indices are noise on either side
    for pages, kind, x in ((store.k, k_kind, k - key_offset_at(store.key_offset, positions)), (store.v, v_kind, v)):
        codes, norms = quantize_reference(x[keep], kind)
        got_codes, got_norms = pages.codes[s // PAGE, :, s % PAGE], pages.norms[s // PAGE, :, s % PAGE]
        rows = exact[keep]
        assert torch.allclose(got_norms[rows].float(), norms[rows].float(), rtol=2e-3, atol=0)
        # Float sums in another order can move a value across a midpoint by an ulp; allow only that.
        mismatch = unpack_indices(got_codes, pages.bits, head_dim) != unpack_indices(codes, pages.bits, head_dim)
        assert mismatch[rows].float().mean() < 1e-3, mismatch[rows].float().mean()
    assert store.k.norms[slots[3] // PAGE, :, slots[3] % PAGE].abs().max() < 1e-3, "k == o(p) must store ~norm 0"
    written = torch.zeros(4 * PAGE, dtype=torch.bool)
    written[s] = True
    assert store.k.norms.transpose(1, 2).reshape(4 * PAGE, -1)[~written].eq(0).all(), "padding stored something"
    decoded = dequantize_reference(store.k.codes[s // PAGE, :, s % PAGE], store.k.norms[s // PAGE, :, s % PAGE],
                                   k_kind, head_dim)
    o = offset64(store.key_offset, positions[keep]).float()  # the float64 oracle, not the reference above
    assert (decoded + o - k[keep]).norm() < (k[keep] - o).norm() / 5, "Triton pages plus o(p) must give back k"


def test_plain_format_by_default_and_bad_offsets_are_refused():
    store = TurboKVStore(2, PAGE, 2, 64, "turbo3", "turbo3", "cpu", torch.float32)
    assert store.key_offset is None, "default must be the spec's plain format"
    good = random_offset(2, 64, torch.Generator().manual_seed(9), turned_pairs=4)
    c, m, s, f, p = good.const, good.mean, good.sink, good.inv_freq, good.pairs
    with pytest.raises(ValueError, match=r"key offset mean must have shape \[2, 64\]"):
        store.set_key_offset(KeyOffset(c, m[0], s, f, p))
    with pytest.raises(ValueError, match=r"key offset inv_freq must have shape \[32\]"):
        store.set_key_offset(KeyOffset(c, m, s, f[:16], p))
    with pytest.raises(ValueError, match="key offset sink must be finite"):
        store.set_key_offset(KeyOffset(c, m, torch.full((2, 64), float("nan")), f, p))
    with pytest.raises(ValueError, match=r"pairs must have shape \[2, P\] with P <= 32"):
        store.set_key_offset(KeyOffset(c, m, s, f, torch.zeros(2, 33, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"pair indices in \[0, 32\)"):
        store.set_key_offset(KeyOffset(c, m, s, f, p + 32))
    with pytest.raises(ValueError, match="must not list a pair twice"):
        store.set_key_offset(KeyOffset(c, m, s, f, p[:, :1].repeat(1, 4)))
    with pytest.raises(ValueError, match="mean must be zero outside its pairs"):
        store.set_key_offset(KeyOffset(c, m + 1, s, f, p))
    assert store.key_offset is None, "a refused offset must leave the store as it was"
    store.set_key_offset(good)
    kept = store.key_offset.mean
    store.set_key_offset(KeyOffset(c, m * 2, s, f, p))
    assert store.key_offset.mean is kept and torch.equal(kept, m * 2), "offsets are replaced in place"
