"""GPU timing of the CUDA C turbo decode with and without a recent window: `python bench/turbo_recent_decode.py [W]`.

Batch 1 and 8 at 4K, 16K and 64K tokens, 32 query / 8 KV heads, head_dim 128, turbo3 (random codes, shuffled
pages: kernels_turbo.random_decode_inputs), without a key offset and with the engine's partial one; each row
times the plain launch and the launch with a W-token ring (default 128; bf16 rows of random values) twice,
alternating, so the spread of a version against itself shows beside the difference. Correctness is the GPU
tests' (tests/kernels/turbo/test_attention_cuda.py: the window against a float64 oracle); this prints only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import kernels_turbo
from bench.harness import require_gpu, time_ms
from server.kernels.turbo import attention_cuda

SHAPES = ((1, 4096), (1, 16384), (1, 65536), (8, 4096), (8, 16384), (8, 65536))  # batch, context
Q_HEADS = 32


def _shape_rows(batch: int, ctx: int, size: int, offsets: dict, device) -> None:
    head_dim = kernels_turbo.HEAD_DIM
    store, metas, qs, ring = kernels_turbo.random_recent_decode_inputs(batch, ctx, Q_HEADS, size, device)
    for name, offset in offsets.items():
        def decode(i, recent, offset=offset):
            out = attention_cuda.decode_attention_cuda(qs[i], store.k, store.v, metas[i], head_dim**-0.5,
                                                       store.signs, store.inv_sqrt, offset, recent=recent)
            assert out is not None, "the CUDA kernel refused the call"
            return out

        times = [time_ms(lambda i, r=recent: decode(i, r), n_inputs=len(qs), device=device)
                 for recent in (None, ring, None, ring)]
        ratio = (times[1] + times[3]) / (times[0] + times[2])
        print(f"| b{batch} ctx{ctx // 1024}K | {name} | {times[0]:.4f} | {times[1]:.4f} | {times[2]:.4f} | "
              f"{times[3]:.4f} | {ratio:.3f} |", flush=True)


def main() -> int:
    device = require_gpu()
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    offsets = {"none": None, f"partial{kernels_turbo.ENGINE_TURNED_PAIRS}": kernels_turbo.engine_key_offset(
        kernels_turbo.KV_HEADS, kernels_turbo.HEAD_DIM, device, torch.Generator().manual_seed(2),
        turned_pairs=kernels_turbo.ENGINE_TURNED_PAIRS)}
    print(f"| case | offset | plain (ms) | W={size} (ms) | plain again | W={size} again | W/plain |", flush=True)
    print("|---|---|---:|---:|---:|---:|---:|", flush=True)
    for batch, ctx in SHAPES:
        _shape_rows(batch, ctx, size, offsets, device)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
