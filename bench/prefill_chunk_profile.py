"""Where one prefill chunk spends its time, one layer, bf16 KV against turbo (GPU only; prints, records nothing).

    python bench/prefill_chunk_profile.py [--prefix 65536] [--chunk 2048] [--kv-cache-dtype bf16,turbo3]

The engine's depth shape (bench/e2e.py depth-2048: 16 query / 8 KV heads, head_dim 128), one sequence whose chunk
of ``--chunk`` tokens ends at ``--prefix`` tokens, over shuffled pages of random codes (turbo: the engine's default
partial key offset and recent window). A chunk attends over its whole prefix; the turbo path decodes every page of it
back to bf16 (turbo/dense_pages.py) before the dense prefill kernel. Per KV dtype: the wall time of the layer's
write + attention (host included, ms), then a torch.profiler table of the device time per kernel and op.
`python bench/e2e.py --context-depth ... --depth-chunk ...` measures the same path through the engine (time to the
first token); this splits one chunk of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import require_gpu  # noqa: E402
from bench.kernels_turbo import engine_key_offset  # noqa: E402
from server.config import DEFAULT_KV_KEY_TURNED_PAIRS, DEFAULT_KV_RECENT_WINDOW  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 8, 16, 128
ROUNDS = 5


def chunk_step(prefix: int, chunk: int, device: torch.device, gen: torch.Generator):
    """Metadata of a chunk ending at ``prefix`` tokens over shuffled pages, and its q, k, v and positions."""
    pages = -(-prefix // PAGE)
    table = torch.randperm(pages + 8, generator=gen)[:pages].view(1, -1).to(device, torch.int32)
    positions = torch.arange(prefix - chunk, prefix, device=device)
    slots = table[0, positions // PAGE].long() * PAGE + positions % PAGE
    meta = AttentionMetadata(slots, table, torch.tensor([prefix], dtype=torch.int32, device=device),
                             torch.tensor([0, chunk], dtype=torch.int32, device=device), [prefix], [chunk],
                             torch.zeros(1, dtype=torch.int32, device=device))
    q, k, v = (torch.randn(chunk, h, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
               for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    return meta, q, k, v, positions, pages + 8


def make_store(kind: str, num_pages: int, device: torch.device, gen: torch.Generator, num_seqs: int = 1):
    """A store of random pages (turbo: random codes, the engine's default key offset and a random recent window)."""
    if kind == "bf16":
        store = DenseKVStore(num_pages, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
        store.k_pages.normal_()
        store.v_pages.normal_()
        return store
    store = TurboKVStore(num_pages, PAGE, KV_HEADS, HEAD_DIM, kind, kind, device, torch.bfloat16,
                         recent=(num_seqs, DEFAULT_KV_RECENT_WINDOW))
    store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, device, gen, 500000.0, DEFAULT_KV_KEY_TURNED_PAIRS))
    for pages in (store.k, store.v):
        pages.codes.random_(0, 256)
        pages.norms.uniform_(8.0, 12.0)
    store.recent.k.normal_()
    store.recent.v.normal_()
    return store


def print_profile(label: str, layer: Callable[[], object]) -> None:
    """The wall time of ``layer()`` (host included), then a torch.profiler table of its device time per kernel."""
    for _ in range(3):  # compiles
        layer()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        layer()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / ROUNDS * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ROUNDS):
            layer()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / ROUNDS / 1e3
    print(f"{label}, one layer: {wall:.2f} ms wall, {device_ms:.2f} ms of kernels", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60),
          flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=int, default=65536)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--kv-cache-dtype", default="bf16,turbo3", type=lambda s: s.split(","))
    args = p.parse_args()
    device = require_gpu()
    gen = torch.Generator().manual_seed(0)
    meta, q, k, v, positions, num_pages = chunk_step(args.prefix, args.chunk, device, gen)
    for kind in args.kv_cache_dtype:
        store = make_store(kind, num_pages, device, gen)

        def layer():
            store.write(k, v, meta.slot_mapping, positions)
            return store.attend(q, meta, HEAD_DIM**-0.5)

        print_profile(f"{kind}: a {args.chunk}-token chunk ending at {args.prefix} tokens", layer)
        del store
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
