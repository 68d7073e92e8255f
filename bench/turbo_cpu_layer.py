"""One layer's turbo3 decode step (store + attend) on the CPU: `python bench/turbo_cpu_layer.py --context 32`.

The embedded model's shape (9 query heads, 3 KV heads, head_dim 64), pages of 16, a 128-token recent window and an
engine-like partial key offset (bench/kernels_turbo.engine_key_offset); the context is filled in chunks of up to
2048, then 40 decode steps of random q, k, v are timed one by one. Prints the median and the minimum; one thread
unless --threads. Records nothing.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.kernels_turbo import engine_key_offset  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, HEADS, KV_HEADS, HEAD_DIM, STEPS = 16, 9, 3, 64, 40


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    pages = -(-(args.context + STEPS) // PAGE)
    store = TurboKVStore(pages, PAGE, KV_HEADS, HEAD_DIM, "turbo3", "turbo3", "cpu", torch.float32, recent=(2, 128))
    store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, "cpu", gen, turned_pairs=8))
    table = torch.randperm(pages, generator=gen).to(torch.int32)[None]

    def step(first: int, n: int) -> None:
        pos = torch.arange(first, first + n)
        slots = (table[0, pos // PAGE] * PAGE + pos % PAGE).long()
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=table, seq_lens=torch.tensor([first + n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens_cpu=[first + n], query_lens_cpu=[n],
            recent_rows=torch.tensor([1], dtype=torch.int32),
        )  # fmt: skip
        store.write(torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM), slots, pos)
        store.attend(torch.randn(n, HEADS, HEAD_DIM), meta, HEAD_DIM**-0.5)

    filled = 0
    while filled < args.context - 1:
        n = min(2048, args.context - 1 - filled)
        step(filled, n)
        filled += n
    times = []
    for i in range(STEPS):
        start = time.perf_counter()
        step(args.context - 1 + i, 1)
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"context {args.context}: decode step (store + attend) median {times[STEPS // 2] * 1e3:.3f} ms, "
          f"min {times[0] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
