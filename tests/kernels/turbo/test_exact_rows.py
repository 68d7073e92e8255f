"""The recent window's exact rows of a prefill step (server/kernels/turbo/exact_rows.py): the Triton kernel, in the
interpreter, against its torch reference, and the reference against recent.py's rule read position by position.

Rings and rows are float32 here (the interpreter's bf16 is wrong, shared/ENVIRONMENT.md); the GPU test of the
engine's prefill path meets bf16."""

from __future__ import annotations

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.rotation import rotate_reference
from server.kernels.turbo.exact_rows import exact_rows_reference, exact_rows_triton
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at
from server.kernels.turbo.recent import RecentWindow, recent_values

# (cached tokens after the step, its queries): a chunk after a prefix longer than W, a chunk after a shorter one,
# a whole prompt, a decode row, an idle sequence, a chunk whose prefix ends exactly W - 1 back.
CASES = [(40, 9), (11, 7), (6, 6), (23, 1), (15, 0), (19, 12)]
WINDOW = 8


def make_step(head_dim, kv_heads, seed, cases=CASES):
    gen = torch.Generator().manual_seed(seed)
    seq_lens, query_lens = zip(*cases)
    rows = torch.randperm(len(cases) + 2, generator=gen)[: len(cases)].to(torch.int32)  # shuffled ring rows
    recent = RecentWindow.empty(len(cases) + 2, WINDOW, kv_heads, head_dim, torch.float32, "cpu")
    recent.k.normal_(generator=gen)
    recent.v.normal_(generator=gen)
    tokens = sum(query_lens)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen) + 1.5
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(torch.zeros(tokens, dtype=torch.long), torch.zeros(len(cases), 1, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), starts, list(seq_lens), list(query_lens),
                             recent_rows=rows)  # fmt: skip
    positions = torch.cat([torch.arange(n - m, n) for n, m in cases])
    return k, v, recent, meta, positions, gen


def offsets(kind, kv_heads, head_dim, gen):
    inv_freq = torch.rand(head_dim // 2, generator=gen)
    if kind == "none":
        return None
    if kind == "fixed":
        return KeyOffset.fixed(torch.randn(kv_heads, head_dim, generator=gen), inv_freq)
    mean = torch.randn(kv_heads, head_dim, generator=gen)
    return KeyOffset.turned(mean, torch.randn(kv_heads, head_dim, generator=gen), inv_freq)


def read_rows(near, meta):
    """Each sequence's rows some query reads, concatenated: [rows, kv_heads, D]."""
    used = [n - max(0, n - m - WINDOW + 1) if m else 0 for n, m in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]
    return torch.cat([near[s, :u] for s, u in enumerate(used)])


@pytest.mark.parametrize("head_dim,kv_heads,kind", [(64, 2, "none"), (64, 2, "fixed"), (64, 2, "turned"),
                                                    (128, 3, "turned")])  # the interpreter takes ~25 s at D = 128
def test_kernel_matches_reference(head_dim, kv_heads, kind):
    k, v, recent, meta, positions, gen = make_step(head_dim, kv_heads, seed=head_dim + len(kind))
    offset = offsets(kind, kv_heads, head_dim, gen)
    turns = kind == "turned"
    got = exact_rows_triton(k, v, recent, meta, offset, turns, torch.float32)
    want = exact_rows_reference(recent_values(k, positions, offset, torch.float32),
                                recent_values(v, positions, None, torch.float32), recent, meta,
                                offset if turns else None, torch.float32)  # fmt: skip
    assert got[0].shape == (len(CASES), meta.max_query_len + WINDOW - 1, kv_heads, head_dim)
    for name, a, b in zip("KV", got, want):
        torch.testing.assert_close(read_rows(a, meta), read_rows(b, meta), rtol=0, atol=2e-5, msg=f"{name} rows")


def test_reference_is_the_ring_before_the_chunk_and_the_steps_own_values_in_it():
    # float64, position by position: j < first reads the ring at p % W rotated back (+ o(j) where o turns),
    # j >= first the step's own k (its ring row rotated back is k - o(j) up to float32 rounding).
    k, v, recent, meta, positions, gen = make_step(64, 2, seed=5)
    offset = offsets("turned", 2, 64, gen)
    k_rows = recent_values(k, positions, offset, torch.float32)
    near_k, near_v = exact_rows_reference(k_rows, recent_values(v, positions, None, torch.float32), recent, meta,
                                          offset, torch.float64)  # fmt: skip
    start = 0
    for s, (n, m) in enumerate(CASES):
        first, ring = n - m, meta.recent_rows[s]
        for i, j in enumerate(range(max(0, first - WINDOW + 1) if m else n, n)):
            o = key_offset_at(offset, torch.tensor([j]))[0].double()
            if j < first:
                want_k = rotate_reference(recent.k[ring, j % WINDOW].double(), 64, inverse=True).double() + o
                want_v = rotate_reference(recent.v[ring, j % WINDOW].double(), 64, inverse=True).double()
            else:
                want_k, want_v = k[start + j - first].double(), v[start + j - first].double()
            torch.testing.assert_close(near_k[s, i], want_k, rtol=0, atol=1e-5)
            torch.testing.assert_close(near_v[s, i], want_v, rtol=0, atol=1e-5)
        start += m


def test_an_unread_ring_or_step_value_changes_nothing_a_read_one_changes_its_row():
    # Sequence 0 (40 tokens, 9 new) reads positions 24..39 exactly: 24..30 from the ring, 31..39 from the step.
    # Ring slot 30 % 8 also belongs to positions 22 (before the window) and 38 (the step's own): only row 30 - 24
    # may move. A step value moves its own row.
    k, v, recent, meta, positions, gen = make_step(64, 2, seed=9, cases=CASES[:1])
    before = exact_rows_triton(k, v, recent, meta, None, False, torch.float32)
    recent.v[int(meta.recent_rows[0]), 30 % WINDOW] += 1.0
    k[33 - 31] += 1.0  # sequence 0's token at position 33
    after = exact_rows_triton(k, v, recent, meta, None, False, torch.float32)
    moved = [((a[0, :16] - b[0, :16]).abs().amax(dim=(1, 2)) > 1e-3).nonzero().flatten().tolist()
             for a, b in zip(after, before)]
    assert moved == [[33 - 24], [30 - 24]]
