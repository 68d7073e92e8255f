"""GPU check and timing of the Triton turbo decode and store with a recent window:
`python bench/turbo_recent_triton.py [--decode-only]` (--decode-only: neither the store's check nor its timing).

Check (bf16, head_dim 128, 32 query / 8 KV heads, turbo3, W = RECENT): one decode step over sequences of 100, 4K
and 64K tokens and a padding row, without a key offset and with the engine's partial one: real K/V in shuffled
pages (kernels_turbo._filled_store), the ring holding the W - 1 positions before the step (recent_values, garbage
elsewhere), the step's token stored by store_turbo(..., recent=) (pages and ring), then decode_attention_triton
with the ring against attention_with_recent_reference (float32), beside the plain decode's error against its own
reference (the fp16 operands' rounding). Also the ring rows a prefill-sized store_turbo writes (routed to Triton).
Timing: the decode at batch 1 and 8 over 4K / 16K / 64K tokens (kernels_turbo.random_decode_inputs), plain and
with the ring, twice each, alternating, so a version's spread against itself shows beside the difference; and the
decode step's store of batch 1 / 8 tokens with and without the ring.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import kernels_turbo
from bench.harness import require_gpu, time_ms
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.attention import attention_over_decoded_pages, choose_splits, decode_attention_triton
from server.kernels.turbo.quantize import store_turbo
from server.kernels.turbo.recent import RecentWindow, attention_with_recent_reference, recent_values
from server.kernels.turbo.store import TurboKVStore

RECENT = 128
KV_HEADS, HEAD_DIM, PAGE, Q_HEADS = kernels_turbo.KV_HEADS, kernels_turbo.HEAD_DIM, kernels_turbo.PAGE, 32
CHECK_LENGTHS = (100, 4096, 65536)
STORE_TOKENS = 4096  # the prefill-sized store call: enough for the CUDA C store without a ring
SHAPES = ((1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384), (8, 65536))  # batch, context


def _offsets(device) -> dict:
    return {"none": None, f"partial{kernels_turbo.ENGINE_TURNED_PAIRS}": kernels_turbo.engine_key_offset(
        KV_HEADS, HEAD_DIM, device, torch.Generator().manual_seed(2), turned_pairs=kernels_turbo.ENGINE_TURNED_PAIRS)}


def check_decode(device, name: str, offset) -> bool:
    gen = torch.Generator().manual_seed(1)
    lengths = list(CHECK_LENGTHS)
    store, tables, kv = kernels_turbo._filled_store(lengths + [1], KV_HEADS, HEAD_DIM, "turbo3", "turbo3", device,
                                                    gen, offset)
    num_seqs = len(lengths) + 1  # the last: a padding row (seq_len 0, slot -1)
    rows = torch.randperm(num_seqs + 3, generator=gen)[:num_seqs].int().to(device)
    ring = RecentWindow.empty(num_seqs + 3, RECENT, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    ring.k.normal_(3.0, 4.0)  # garbage wherever no position lives
    ring.v.normal_(-3.0, 4.0)
    for s, n in enumerate(lengths):
        k, v, _ = kv[s]
        near = torch.arange(max(0, n - RECENT), n - 1, device=device)
        ring.k[rows[s], near % RECENT] = recent_values(k[near], near, store.key_offset, torch.bfloat16)
        ring.v[rows[s], near % RECENT] = recent_values(v[near], near, None, torch.bfloat16)
    new_k = torch.stack([k[-1] for k, _, _ in kv])
    new_v = torch.stack([v[-1] for _, v, _ in kv])
    slots = torch.tensor([slots[-1].item() for _, _, slots in kv[:-1]] + [-1], device=device)
    positions = torch.tensor([n - 1 for n in lengths] + [0], device=device)
    store_turbo(new_k, new_v, slots, positions, store.k, store.v, store.signs, store.inv_sqrt, store.key_offset,
                store.offset_turns, recent=ring, recent_rows=rows)
    step_k = recent_values(new_k, positions, store.key_offset, torch.bfloat16)
    step_v = recent_values(new_v, positions, None, torch.bfloat16)
    live = torch.tensor([True] * len(lengths) + [False], device=device)
    at = (rows.long()[live], positions[live] % RECENT)
    ring_err = max((ring.k[at].float() - step_k[live].float()).abs().max().item(),
                   (ring.v[at].float() - step_v[live].float()).abs().max().item())

    seq_lens = lengths + [0]
    meta = AttentionMetadata(slots, tables, torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             torch.arange(num_seqs + 1, dtype=torch.int32, device=device), seq_lens, [1] * num_seqs,
                             recent_rows=rows)
    ref_meta = dataclasses.replace(meta, query_lens_cpu=[1] * len(lengths) + [0])
    q = torch.randn(num_seqs, Q_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    scale = HEAD_DIM**-0.5
    key_offset = store.key_offset if store.offset_turns else None
    got = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt, key_offset,
                                  recent=ring)
    want = attention_with_recent_reference(q.float(), store.k, store.v, "turbo3", "turbo3", ring, step_k, step_v,
                                           ref_meta, scale, store.key_offset)
    plain = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt, key_offset)
    plain_want = attention_over_decoded_pages(q.float(), store.k, store.v, "turbo3", "turbo3", ref_meta, scale,
                                              store.key_offset, fast=False)
    ok = True
    for s, n in enumerate(lengths):
        size = want[s].abs().max().item()
        err = (got[s].float() - want[s]).abs().max().item()
        plain_err = (plain[s].float() - plain_want[s]).abs().max().item()
        moved = (want[s] - plain_want[s]).abs().max().item()
        passed = err <= 2e-2 * size
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} decode W={RECENT} {name} ctx {n}: max |got - reference| {err:.3g} "
              f"(max |reference| {size:.3g}; plain decode vs its reference {plain_err:.3g}; the window moves the "
              f"reference by {moved:.3g})", flush=True)
    padding_zero = bool((got[~live] == 0).all())
    ring_ok = ring_err <= 1e-2 * step_k.float().abs().max().item()
    print(f"{'PASS' if padding_zero else 'FAIL'} padding row {name}: zeros", flush=True)
    print(f"{'PASS' if ring_ok else 'FAIL'} decode step's ring rows {name}: max |ring - recent_values| {ring_err:.3g}",
          flush=True)
    return ok and padding_zero and ring_ok


def check_prefill_sized_store(device, name: str, offset) -> bool:
    """A store call big enough for the CUDA C store goes to Triton with a ring: every row written, rows of W tokens."""
    tokens = STORE_TOKENS
    gen = torch.Generator().manual_seed(3)
    store = TurboKVStore(tokens // PAGE, PAGE, KV_HEADS, HEAD_DIM, "turbo3", "turbo3", device, torch.bfloat16)
    if offset is not None:
        store.set_key_offset(offset)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    positions = torch.arange(tokens, device=device)
    rows = (positions // RECENT).int()  # each row gets W consecutive positions: one per ring index
    ring = RecentWindow.empty(tokens // RECENT, RECENT, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    store_turbo(k, v, positions, positions, store.k, store.v, store.signs, store.inv_sqrt, store.key_offset,
                store.offset_turns, recent=ring, recent_rows=rows)
    want_k = recent_values(k, positions, store.key_offset, torch.bfloat16).reshape(ring.k.shape)
    want_v = recent_values(v, positions, None, torch.bfloat16).reshape(ring.v.shape)
    err = max((ring.k.float() - want_k.float()).abs().max().item(), (ring.v.float() - want_v.float()).abs().max().item())
    ok = err <= 1e-2 * want_k.float().abs().max().item()
    print(f"{'PASS' if ok else 'FAIL'} store_turbo of {tokens} tokens with a ring {name}: max |ring - recent_values| "
          f"{err:.3g}", flush=True)
    return ok


def time_decode(device, offsets: dict) -> None:
    print(f"| case | offset | splits | plain (ms) | W={RECENT} (ms) | plain again | W={RECENT} again | W/plain |",
          flush=True)
    print("|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    for batch, ctx in SHAPES:
        store, metas, qs, ring = kernels_turbo.random_recent_decode_inputs(batch, ctx, Q_HEADS, RECENT, device)
        splits = choose_splits(batch, KV_HEADS, ctx, device)
        for name, offset in offsets.items():
            def decode(i, recent, offset=offset, store=store, metas=metas, qs=qs):
                return decode_attention_triton(qs[i], store.k, store.v, metas[i], HEAD_DIM**-0.5, store.signs,
                                               store.inv_sqrt, offset, recent=recent)

            times = [time_ms(lambda i, r=recent: decode(i, r), n_inputs=len(qs), device=device)
                     for recent in (None, ring, None, ring)]
            ratio = (times[1] + times[3]) / (times[0] + times[2])
            print(f"| b{batch} ctx{ctx // 1024}K | {name} | {splits} | {times[0]:.4f} | {times[1]:.4f} | "
                  f"{times[2]:.4f} | {times[3]:.4f} | {ratio:.3f} |", flush=True)
        torch.cuda.empty_cache()


def time_store(device, offsets: dict) -> None:
    print(f"| store step | offset | plain (ms) | W={RECENT} (ms) | plain again | W={RECENT} again |", flush=True)
    print("|---|---|---:|---:|---:|---:|", flush=True)
    for batch in (1, 8):
        gen = torch.Generator().manual_seed(4)
        store = TurboKVStore(64, PAGE, KV_HEADS, HEAD_DIM, "turbo3", "turbo3", device, torch.bfloat16)
        ring = RecentWindow.empty(batch, RECENT, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
        k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
        v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
        slots = torch.randperm(64 * PAGE, generator=gen)[:batch].to(device)
        positions = torch.randint(0, 60000, (batch,), generator=gen).to(device)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        for name, offset in offsets.items():
            turns = offset is not None and offset.turns

            def step(_, recent, offset=offset, turns=turns, inputs=(k, v, slots, positions, store, rows)):
                k, v, slots, positions, store, rows = inputs
                store_turbo(k, v, slots, positions, store.k, store.v, store.signs, store.inv_sqrt, offset, turns,
                            recent=recent, recent_rows=None if recent is None else rows)

            times = [time_ms(lambda i, r=recent: step(i, r), device=device) for recent in (None, ring, None, ring)]
            print(f"| b{batch} | {name} | {times[0]:.4f} | {times[1]:.4f} | {times[2]:.4f} | {times[3]:.4f} |",
                  flush=True)


def main() -> int:
    device = require_gpu()
    offsets = _offsets(device)
    decode_only = "--decode-only" in sys.argv[1:]
    ok = True
    for name, offset in offsets.items():
        for check in (check_decode,) if decode_only else (check_decode, check_prefill_sized_store):
            try:
                ok &= check(device, name, offset)
            except Exception:  # one broken case must not hide the others' results
                traceback.print_exc()
                ok = False
            torch.cuda.empty_cache()
    for timing in (time_decode,) if decode_only else (time_decode, time_store):
        try:
            timing(device, offsets)
        except Exception:
            traceback.print_exc()
            ok = False
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
