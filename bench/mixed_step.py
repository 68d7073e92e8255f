"""One attention layer of a mixed step, its decode rows apart from its chunk (what the stores do) or together
with it (the path before: every sequence through the chunks' kernel). GPU only; prints, records nothing.

    python bench/mixed_step.py [--kv-cache-dtype bf16,turbo3] [--decode-rows 32] [--context 8192]
                               [--chunk 2048] [--prefix 2048] [--profile]

The engine's depth shape (16 query / 8 KV heads, d128, 16-token pages in shuffled order, random pages; turbo with
the default partial key offset and recent window): per KV kind and variant, the wall time of the layer's write +
attend (host included), the host's time to enqueue it, and the peak memory it allocates above the cache; then how
far the two outputs are apart. --profile first splits the stores' path into its kernels (torch.profiler).
Together, bf16's decode rows each take a 128-query tile of the prefill kernel and no split of their context;
turbo's also have every page of their context decoded back to bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import require_gpu  # noqa: E402
from bench.prefill_chunk_profile import HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, ROUNDS, make_store, print_profile  # noqa: E402
from server.kernels.dense_attention import paged_prefill  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore  # noqa: E402
from server.kernels.turbo.attention import attention_over_decoded_pages  # noqa: E402
from server.kernels.turbo.exact_rows import exact_rows_triton  # noqa: E402
from server.kernels.turbo.recent import ring_rows_of_last_tokens  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

SCALE = HEAD_DIM**-0.5


def together(store: DenseKVStore | TurboKVStore) -> Callable:
    """The step's attention the way it went before: every sequence through the chunks' path."""
    if isinstance(store, DenseKVStore):
        return lambda q, meta, scale: paged_prefill(q, store.k_pages, store.v_pages, meta.block_tables, meta.seq_lens,
                                                    meta.query_start_loc, meta.max_query_len, scale)  # fmt: skip

    def turbo_together(q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        step, window = store._step_of_window(meta), store.recent.size
        exact = exact_rows_triton(step.k, step.v, store.recent, meta, step.key_offset, step.key_offset_turns,
                                  store.out_dtype)  # fmt: skip
        store._store(step, ring_rows_of_last_tokens(meta, window))
        return attention_over_decoded_pages(q, store._k, store._v, store.k_kind, store.v_kind, meta, scale,
                                            store.key_offset if store.offset_turns else None,
                                            page_dtype=store.out_dtype, exact=(*exact, window))  # fmt: skip

    return turbo_together


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-dtype", default="bf16,turbo3", help="comma-separated: bf16, turbo2/3/4")
    p.add_argument("--profile", action="store_true", help="first, a torch.profiler table of the stores' path")
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
        store = make_store(kind, len(order), device, gen, num_seqs=len(seq_lens))
        meta = AttentionMetadata(slots, tables.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                 starts, seq_lens, q_lens,
                                 recent_rows=torch.arange(len(seq_lens), dtype=torch.int32, device=device))
        if args.profile:
            print_profile(f"{kind}, decode rows apart", lambda: store.write(k, v, slots, positions)
                          or store.attend(q, meta, SCALE))  # fmt: skip
        outs = {}
        for name, attend in [("apart", store.attend), ("together", together(store))] * 2:
            meta = dataclasses.replace(meta, _step_values={})  # each variant builds its own step values
            for rounds in (2, ROUNDS):  # the first compiles, and builds the step's index tensors
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start = time.perf_counter()
                for _ in range(rounds):
                    store.write(k, v, slots, positions)
                    outs[name] = attend(q, meta, SCALE).float()
                enqueued = time.perf_counter()
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / ROUNDS * 1e3
            host_ms = (enqueued - start) / ROUNDS * 1e3
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"  {kind} {name}: {ms:.2f} ms ({host_ms:.2f} ms of host time), peak {peak:,.0f} MiB above the "
                  f"cache", flush=True)  # fmt: skip
        err = ((outs["apart"] - outs["together"]).norm() / outs["together"].norm()).item()
        print(f"  {kind} apart vs together: relative L2 difference {err:.2e}", flush=True)
        del store
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
