"""One attention layer of a mixed step, its decode rows apart from its chunk (what the stores do) or together
with it (the path before: every sequence through the chunks' kernel). GPU only; prints, records nothing.

    python bench/mixed_step.py [--kv-cache-dtype bf16,turbo3] [--decode-rows 32] [--context 8192]
                               [--chunk 2048] [--prefix 2048]

The engine's depth shape (16 query / 8 KV heads, d128, 16-token pages in shuffled order, random pages; turbo3
with the default partial key offset and recent window): per KV kind and variant, the wall time of the layer's
write + attend (host included) and the peak memory it allocates above the cache; then how far the two
outputs are apart. Together, bf16's decode rows each take a 128-query tile of the prefill kernel and no split of
their context; turbo3's also have every page of their context decoded back to bf16.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import require_gpu  # noqa: E402
from bench.kernels_turbo import engine_key_offset  # noqa: E402
from server.config import DEFAULT_KV_KEY_TURNED_PAIRS, DEFAULT_KV_RECENT_WINDOW  # noqa: E402
from server.kernels.dense_attention import paged_prefill  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 8, 16, 128
SCALE = HEAD_DIM**-0.5
ROUNDS = 5


def dense_variants(num_pages: int, device: torch.device) -> tuple[DenseKVStore, Callable]:
    store = DenseKVStore(num_pages, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    store.k_pages.normal_()
    store.v_pages.normal_()

    def together(q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_prefill(q, store.k_pages, store.v_pages, meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, meta.max_query_len, scale)  # fmt: skip

    return store, together


def turbo_variants(num_pages: int, num_seqs: int, device: torch.device, gen: torch.Generator
                   ) -> tuple[TurboKVStore, Callable]:  # fmt: skip
    store = TurboKVStore(num_pages, PAGE, KV_HEADS, HEAD_DIM, "turbo3", "turbo3", device, torch.bfloat16,
                         recent=(num_seqs, DEFAULT_KV_RECENT_WINDOW))  # fmt: skip
    store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, device, gen, 500000.0, DEFAULT_KV_KEY_TURNED_PAIRS))
    for pages in (store.k, store.v):
        pages.codes.random_(0, 256)
        pages.norms.uniform_(8.0, 12.0)
    store.recent.k.normal_()
    store.recent.v.normal_()

    def together(q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key_offset = store.key_offset if store.offset_turns else None
        return store._attend_with_window(q, meta, scale, key_offset, store._step_of_window(meta))

    return store, together


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-dtype", default="bf16,turbo3", help="comma-separated: bf16, turbo3")
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
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(seq_lens, q_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    slots = (tables[seq_of, positions // PAGE].long() * PAGE + positions % PAGE).to(device)
    positions = positions.to(device)
    k, v = (torch.randn(len(seq_of), KV_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16) for _ in "kv")
    q = torch.randn(len(seq_of), Q_HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    print(f"{args.decode_rows} decode rows at {args.context} tokens beside a {args.chunk}-token chunk after "
          f"{args.prefix}, one layer:", flush=True)  # fmt: skip
    for kind in args.kv_cache_dtype.split(","):
        if kind == "bf16":
            store, together = dense_variants(len(order), device)
        elif kind == "turbo3":
            store, together = turbo_variants(len(order), len(seq_lens), device, gen)
        else:
            raise SystemExit(f"--kv-cache-dtype: bf16 or turbo3, got {kind!r}")
        outs = {}
        for name, attend in [("apart", store.attend), ("together", together)] * 2:
            meta = AttentionMetadata(slots, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                     starts, seq_lens, q_lens,
                                     recent_rows=torch.arange(len(seq_lens), dtype=torch.int32, device=device))
            for rounds in (2, ROUNDS):  # the first compiles, and builds the step's index tensors
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start = time.perf_counter()
                for _ in range(rounds):
                    store.write(k, v, slots, positions)
                    outs[name] = attend(q, meta, SCALE).float()
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / ROUNDS * 1e3
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"  {kind} {name}: {ms:.2f} ms, peak {peak:,.0f} MiB above the cache", flush=True)
        err = ((outs["apart"] - outs["together"]).norm() / outs["together"].norm()).item()
        print(f"  {kind} apart vs together: relative L2 difference {err:.2e}", flush=True)
        del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
