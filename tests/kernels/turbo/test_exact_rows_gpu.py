"""The turbo prefill with a recent window on the GPU (compiled, bf16): exact rows, ring write and attention of a
chunk after a prefix, against the float32 reference of recent.py, at the engine's sizes (W = 128, d128, the
partial key offset). The CPU tests run the same path in the interpreter at toy sizes and float32."""

from __future__ import annotations

import pytest
import torch

from bench.kernels_turbo import engine_key_offset
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.exact_rows import exact_rows_reference, exact_rows_triton
from server.kernels.turbo.recent import attention_with_recent_reference, recent_values
from server.kernels.turbo.store import TurboKVStore

PAGE, KV_HEADS, Q_HEADS, DIM, WINDOW = 16, 8, 32, 128, 128


def chunk_meta(tables, rows, seq_lens, query_lens, dev):
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    slots = torch.cat([tables[s, torch.arange(n - m, n) // PAGE].long() * PAGE + torch.arange(n - m, n) % PAGE
                       for s, (n, m) in enumerate(zip(seq_lens, query_lens))])  # fmt: skip
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(seq_lens, query_lens)])
    meta = AttentionMetadata(slots.to(dev), tables.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                             starts.to(dev, torch.int32), list(seq_lens), list(query_lens),
                             recent_rows=torch.tensor(rows, dtype=torch.int32, device=dev))  # fmt: skip
    return meta, positions.to(dev)


@pytest.mark.gpu
def test_on_the_gpu_a_chunk_after_a_prefix_matches_the_reference():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    prefix, chunk, pages = [1000, 37], [700, 1], 256  # a long chunk beside a decode row
    store = TurboKVStore(pages, PAGE, KV_HEADS, DIM, "turbo3", "turbo3", dev, torch.bfloat16, recent=(4, WINDOW))
    store.set_key_offset(engine_key_offset(KV_HEADS, DIM, dev, gen, 500000.0, 8))
    tables = torch.randperm(pages, generator=gen)[:2 * 120].view(2, 120).to(torch.int32)  # shuffled pages
    rows, total = [3, 1], [p + c for p, c in zip(prefix, chunk)]
    k = [(torch.randn(n, KV_HEADS, DIM, generator=gen) * 2 + 1).to(dev, torch.bfloat16) for n in total]
    v = [torch.randn(n, KV_HEADS, DIM, generator=gen).to(dev, torch.bfloat16) for n in total]
    q = torch.randn(sum(chunk), Q_HEADS, DIM, generator=gen).to(dev, torch.bfloat16)
    scale = DIM**-0.5

    meta, pos = chunk_meta(tables, rows, prefix, prefix, dev)  # the prefixes, whole
    store.write(torch.cat([x[:n] for x, n in zip(k, prefix)]), torch.cat([x[:n] for x, n in zip(v, prefix)]),
                meta.slot_mapping, pos)  # fmt: skip
    store.attend(torch.zeros(sum(prefix), Q_HEADS, DIM, device=dev, dtype=torch.bfloat16), meta, scale)

    meta, pos = chunk_meta(tables, rows, total, chunk, dev)
    ks = torch.cat([x[n:] for x, n in zip(k, prefix)])
    vs = torch.cat([x[n:] for x, n in zip(v, prefix)])
    ring_before = store.recent.k.clone(), store.recent.v.clone()
    k_rows = recent_values(ks, pos, store.key_offset, torch.bfloat16)
    v_rows = recent_values(vs, pos, None, torch.bfloat16)
    added = store.key_offset if store.offset_turns else None

    exact = exact_rows_triton(ks, vs, store.recent, meta, store.key_offset, store.offset_turns, torch.bfloat16)
    want_exact = exact_rows_reference(k_rows, v_rows, store.recent, meta, added, torch.float32)
    for got, want in zip(exact, want_exact):
        for s, (n, m) in enumerate(zip(total, chunk)):
            used = n - max(0, n - m - WINDOW + 1)
            g, w = got[s, :used].float(), want[s, :used]
            assert ((g - w).abs() <= w.abs() * 2**-7 + 1e-3 * w.abs().max()).all(), "exact rows vs reference"

    store.write(ks, vs, meta.slot_mapping, pos)
    out = store.attend(q, meta, scale).float()
    ring_after = store.recent.k.clone(), store.recent.v.clone()
    store.recent.k.copy_(ring_before[0])
    store.recent.v.copy_(ring_before[1])
    want = attention_with_recent_reference(q.float(), store.k, store.v, "turbo3", "turbo3", store.recent, k_rows,
                                           v_rows, meta, scale, added)  # fmt: skip
    err = ((out - want).norm() / want.norm()).item()
    assert err < 1e-2, f"prefill with the window: relative L2 error {err:.2e}"

    # The ring now holds the step's last W tokens of each sequence (the decode row's one token), as recent_values.
    for s, (n, m) in enumerate(zip(total, chunk)):
        last = torch.arange(max(n - m, n - WINDOW), n, device=dev)
        take = last - (n - m) + sum(chunk[:s])  # their rows of the step
        for ring, rows_of_step in zip(ring_after, (k_rows, v_rows)):
            got, want_rows = ring[rows[s], last % WINDOW].float(), rows_of_step[take].float()
            assert ((got - want_rows).abs() <= want_rows.abs() * 2**-7 + 1e-3).all(), "ring rows after the chunk"
