"""store_turbo with a recent window: each stored token also writes its rotated, unquantized row to the ring.

A decode step's tokens (one per sequence, at any position, a padding token with slot -1 among them) are stored
twice, with and without the ring: the pages must be bit-identical, ring row recent_rows[t] at index p % W must hold
rotate(k - o(p)) (rotate(v) for values) as recent.recent_values and a float64 oracle (the spec's rotation matrix,
test_key_offset's complex RoPE) compute it, and every other ring entry, the padding token's and a token's without
a ring row (-1) included, must keep the sentinel it started with.
"""

import pytest
import torch

from server.kernels.turbo.format import group_size
from server.kernels.turbo.key_offset import KeyOffset
from server.kernels.turbo.quantize import store_turbo, store_turbo_triton
from server.kernels.turbo.recent import RecentWindow, recent_values
from server.kernels.turbo.store import TurboKVStore
from test_key_offset import PAGE, inv_freq, offset64, random_offset
from turbo_oracle import rotation_matrix64

POSITIONS = [0, 1, 4, 5, 16, 17, 299, 37]  # position 0 (the sink), page and window boundaries
PADDING = 3  # the token that is a padding row: slot -1
NO_RING = 5  # a token the ring does not keep (ring row -1, as a long chunk's earlier tokens): its pages only


def rotated64(x, head_dim):
    """rotate(x) per group in float64 (R x for each group's column vector)."""
    g = group_size(head_dim)
    return (x.double().reshape(*x.shape[:-1], head_dim // g, g) @ rotation_matrix64(g).T).reshape(x.shape)


def step_tokens(kv_heads, head_dim, window, ring_dtype, gen):
    """k, v [T, kv_heads, D], slots (distinct, the padding token's -1), positions, ring rows (distinct, so no two
    tokens share a ring slot) and a ring of sentinels with two spare rows."""
    num = len(POSITIONS)
    k = torch.randn(num, kv_heads, head_dim, generator=gen) * 2 + 1
    v = torch.randn(num, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(4 * PAGE, generator=gen)[:num]
    slots[PADDING] = -1
    rows = torch.randperm(num + 2, generator=gen)[:num].to(torch.int32)
    rows[NO_RING] = -1
    recent = RecentWindow.empty(num + 2, window, kv_heads, head_dim, ring_dtype, "cpu")
    recent.k.fill_(1234.0)
    recent.v.fill_(-1234.0)
    return k, v, slots, torch.tensor(POSITIONS), rows, recent


@pytest.mark.parametrize(
    "head_dim,k_kind,v_kind,offset_kind,window,ring_dtype",
    [(64, "turbo3", "turbo3", None, 5, torch.float32), (128, "turbo4", "turbo3", "partial", 16, torch.float32),
     (64, "turbo2", "turbo4", "fixed", 17, torch.float32), (128, "turbo3", "turbo3", "partial", 5, torch.float16),
     (256, "turbo3", "turbo2", "turned", 1, torch.float32)],
)
def test_store_writes_the_rotated_rows_to_the_ring_and_the_same_pages(head_dim, k_kind, v_kind, offset_kind, window,
                                                                      ring_dtype):
    kv_heads = 2
    gen = torch.Generator().manual_seed(head_dim + window)
    offset = None
    if offset_kind == "fixed":
        offset = KeyOffset.fixed(torch.randn(kv_heads, head_dim, generator=gen) * 3, inv_freq(head_dim).float())
    elif offset_kind is not None:
        offset = random_offset(kv_heads, head_dim, gen, turned_pairs=5 if offset_kind == "partial" else None)
    turns = offset is not None and offset.turns
    k, v, slots, positions, rows, recent = step_tokens(kv_heads, head_dim, window, ring_dtype, gen)
    plain, ringed = (TurboKVStore(4, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32) for _ in "ab")
    store_turbo_triton(k, v, slots, positions, plain.k, plain.v, plain.signs, plain.inv_sqrt, offset, turns)
    store_turbo(k, v, slots, positions, ringed.k, ringed.v, ringed.signs, ringed.inv_sqrt, offset, turns,
                recent=recent, recent_rows=rows)
    for name in ("k", "v"):
        for part in ("codes", "norms"):
            assert torch.equal(getattr(getattr(plain, name), part), getattr(getattr(ringed, name), part)), \
                f"{name} {part}: the ring must not change what the pages get"

    written = (slots >= 0) & (rows >= 0)
    row_of, index_of = rows[written].long(), positions[written] % window
    keys = k[written].double() - (0.0 if offset is None else offset64(offset, positions[written]))
    for name, x, oracle, exact in (
        ("k", k, rotated64(keys, head_dim), recent_values(k[written], positions[written], offset, ring_dtype)),
        ("v", v, rotated64(v[written], head_dim), recent_values(v[written], positions[written], None, ring_dtype)),
    ):
        ring = getattr(recent, name)
        got = ring[row_of, index_of]
        tol = 1e-5 if ring_dtype == torch.float32 else 2e-3  # fp16: an ulp where the two round a tie apart
        scale = oracle.abs().max().item()
        assert (got.double() - exact.double()).abs().max().item() <= tol * scale, f"ring {name} vs recent_values"
        assert (got.double() - oracle).abs().max().item() <= tol * scale, f"ring {name} vs float64"
        untouched = torch.ones(ring.shape[:2], dtype=torch.bool)
        untouched[row_of, index_of] = False
        sentinel = 1234.0 if name == "k" else -1234.0
        assert (ring[untouched] == sentinel).all(), f"ring {name}: only the stored tokens' slots change"


def test_recent_store_arguments_are_checked():
    gen = torch.Generator().manual_seed(1)
    k, v, slots, positions, rows, recent = step_tokens(1, 64, 4, torch.float32, gen)
    store = TurboKVStore(4, PAGE, 1, 64, "turbo3", "turbo3", "cpu", torch.float32)
    args = (k, v, slots, positions, store.k, store.v, store.signs, store.inv_sqrt)
    with pytest.raises(ValueError, match="recent_rows without recent"):
        store_turbo(*args, recent_rows=rows)
    with pytest.raises(ValueError, match="recent_rows: int32"):
        store_turbo(*args, recent=recent, recent_rows=rows.long())
    with pytest.raises(ValueError, match="recent_rows: int32"):
        store_turbo(*args, recent=recent)
    with pytest.raises(ValueError, match="recent.k must be"):
        store_turbo(*args, recent=RecentWindow.empty(4, 4, 2, 64, torch.float32, "cpu"), recent_rows=rows)
