"""One turbo3 layer of a mixed step, its decode rows apart from its chunk (TurboKVStore) or together with it (the
path before: every sequence through the chunks' path, which decodes every page it references back to bf16).
GPU only; prints, records nothing.

    python bench/turbo_mixed_step.py [--decode-rows 32] [--context 8192] [--chunk 2048] [--prefix 2048]

The engine's depth shape (16 query / 8 KV heads, d128, 16-token pages in shuffled order, random codes, the
default partial key offset and recent window): per variant, the wall time of the layer's write + attend (host
included) and the peak memory it allocates above the cache; then how far the two outputs are apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import require_gpu  # noqa: E402
from bench.kernels_turbo import engine_key_offset  # noqa: E402
from server.config import DEFAULT_KV_KEY_TURNED_PAIRS, DEFAULT_KV_RECENT_WINDOW  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 8, 16, 128
ROUNDS = 5


def together(store: TurboKVStore, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The mixed step the way it went before: every sequence through the chunks' path."""
    key_offset = store.key_offset if store.offset_turns else None
    return store._attend_with_window(q, meta, scale, key_offset, store._step_of_window(meta))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-rows", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefix", type=int, default=2048)
    args = p.parse_args()
    device = require_gpu()
    gen = torch.Generator().manual_seed(0)
    seq_lens = [args.context] * args.decode_rows + [args.prefix + args.chunk]
    q_lens = [1] * args.decode_rows + [args.chunk]
    pages_per = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(pages_per) + 16, generator=gen)
    tables = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages_per):
        tables[s, :n] = order[used : used + n]
        used += n
    store = TurboKVStore(len(order), PAGE, KV_HEADS, HEAD_DIM, "turbo3", "turbo3", device, torch.bfloat16,
                         recent=(len(seq_lens), DEFAULT_KV_RECENT_WINDOW))  # fmt: skip
    store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, device, gen, 500000.0, DEFAULT_KV_KEY_TURNED_PAIRS))
    for pages in (store.k, store.v):
        pages.codes.random_(0, 256)
        pages.norms.uniform_(8.0, 12.0)
    store.recent.k.normal_()
    store.recent.v.normal_()
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(seq_lens, q_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    slots = (tables[seq_of, positions // PAGE].long() * PAGE + positions % PAGE).to(device)
    positions = positions.to(device)
    k, v = (torch.randn(len(seq_of), KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16) for _ in "kv")
    q = torch.randn(len(seq_of), Q_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    apart, outs = TurboKVStore._attend_mixed, {}
    print(f"{args.decode_rows} decode rows at {args.context} tokens beside a {args.chunk}-token chunk after "
          f"{args.prefix}, one turbo3 layer:", flush=True)  # fmt: skip
    try:
        for name, attend_mixed in [("apart", apart), ("together", together)] * 2:
            TurboKVStore._attend_mixed = attend_mixed
            meta = AttentionMetadata(slots, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                     starts, seq_lens, q_lens,
                                     recent_rows=torch.arange(len(seq_lens), dtype=torch.int32, device=device))
            for _ in range(2):  # compiles, and the step's index tensors
                store.write(k, v, slots, positions)
                store.attend(q, meta, HEAD_DIM**-0.5)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            for _ in range(ROUNDS):
                store.write(k, v, slots, positions)
                outs[name] = store.attend(q, meta, HEAD_DIM**-0.5).float()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / ROUNDS * 1e3
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"  {name}: {ms:.2f} ms, peak {peak:,.0f} MiB above the cache", flush=True)
    finally:
        TurboKVStore._attend_mixed = apart
    err = ((outs["apart"] - outs["together"]).norm() / outs["together"].norm()).item()
    print(f"  apart vs together: relative L2 difference {err:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
