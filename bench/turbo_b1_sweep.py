"""Batch-1 turbo attention per layer as a decode graph runs it: store + decode launch settings against bf16 (GPU).

    python bench/turbo_b1_sweep.py [--contexts 4096,16384,65536] [--layers 24] [--batch 1] [--rules-only] [--plan N]

The engine's depth shape (bench/e2e.py depth-2048: 16 query / 8 KV heads, head_dim 128), turbo3 K and V with a
random key offset like the engine's default (partial on DEFAULT_KV_KEY_TURNED_PAIRS pairs per KV head), bf16
queries, ``--batch`` sequences of context + 16 tokens whose launch is planned for context + 33 (bench/e2e.py's
depth rows), or for ``--plan`` tokens where that is more (a server's max_model_len: its CUDA graphs plan every
decode for it). Each variant is timed as a CUDA graph of ``--layers`` layers, each with its own random pages and the
layer's neighbours in a decode step around the attention: the qkv projection before it (a programmatic
dependent launch that lets the next kernel start, server/kernels/pdl.py) and the output projection after it
(gemv.linear on random weights). Printed: microseconds per layer the attention adds to the projections alone
(median of replays / layers, minus the same graph without attention), for bf16 paged attention (the write is in
the qkv projection's epilogue in the engine, so none here), the engine's turbo path with its fused write (the
Triton decode stores the new token) and with a store launch (TURBOSERVE_FUSED_TURBO_STORE=0), and the store's
and both decodes' launch settings (``--rules-only``: the engine's paths and each decode at its split rule). Each decode variant is first checked against the float32 decode-then-attend reference on the
same pages (max error / max |reference|).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import require_gpu  # noqa: E402
from bench.kernels_turbo import engine_key_offset  # noqa: E402
from server.config import DEFAULT_KV_KEY_TURNED_PAIRS  # noqa: E402
from server.kernels.dense_attention import paged_attention  # noqa: E402
from server.kernels.gemv import linear  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata  # noqa: E402
from server.kernels.turbo import attention_cuda  # noqa: E402
from server.kernels.turbo.attention import (  # noqa: E402
    attention_over_decoded_pages,
    decode_attention_triton,
    whole_block_splits,
)
from server.kernels.turbo.quantize import StoreLaunch, store_turbo_triton  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, Q_HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 16, 16, 8, 128, 2048
KIND = "turbo3"
REPLAYS = 15
STORE_LAUNCHES = (StoreLaunch(), StoreLaunch(pdl=False), StoreLaunch(small_rows=32, pdl=False),
                  StoreLaunch(small_rows=32), StoreLaunch(num_warps=2, pdl=False))
CUDA_SPLITS = (8, 12, 16, 24, 33, 48, 66)
TRITON_SPLITS = (16, 33, 66, 132)


class Layers:
    """``layers`` layers of ``batch`` sequences: turbo and bf16 pages, block tables, q, the new tokens' k/v,
    weights."""

    def __init__(self, layers: int, ctx: int, batch: int, dev: torch.device, plan: int):
        gen = torch.Generator().manual_seed(ctx)
        self.seq_len = ctx + 16
        pages = -(-plan // PAGE)
        total = layers * batch * pages
        self.store = TurboKVStore(total, PAGE, KV_HEADS, HEAD_DIM, KIND, KIND, dev, torch.bfloat16)
        self.store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, dev, gen, 500000.0,
                                                    DEFAULT_KV_KEY_TURNED_PAIRS))
        for p in (self.store.k, self.store.v):
            p.codes.random_(0, 256)
            p.norms.uniform_(8.0, 12.0)
        self.dense_k = torch.randn(total, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        self.dense_v = torch.randn_like(self.dense_k)
        order = torch.randperm(total, generator=gen).to(dev, torch.int32).view(layers, batch, pages)
        self.metas = [AttentionMetadata(
            order[i, :, (self.seq_len - 1) // PAGE].long() * PAGE + (self.seq_len - 1) % PAGE,
            order[i].contiguous(), torch.full((batch,), self.seq_len, dtype=torch.int32, device=dev),
            torch.arange(batch + 1, dtype=torch.int32, device=dev), [plan] * batch, [1] * batch)
            for i in range(layers)]  # fmt: skip
        self.positions = torch.full((batch,), self.seq_len - 1, device=dev)
        self.qs = [torch.randn(batch, Q_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        self.ks = [torch.randn(batch, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) * 2 for _ in range(layers)]
        self.vs = [torch.randn(batch, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        self.x = torch.randn(batch, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.w_qkv = torch.randn((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
        self.w_o = torch.randn(HIDDEN, Q_HEADS * HEAD_DIM, device=dev, dtype=torch.bfloat16) * 0.02
        self.scale = HEAD_DIM**-0.5

    def store_new(self, i: int, launch: StoreLaunch) -> None:
        s = self.store
        store_turbo_triton(self.ks[i], self.vs[i], self.metas[i].slot_mapping, self.positions, s.k, s.v, s.signs,
                           s.inv_sqrt, s.key_offset, s.offset_turns, launch)

    def engine(self, i: int, fuse: bool = True) -> torch.Tensor:
        """The engine's write + attend; ``fuse`` False: TURBOSERVE_FUSED_TURBO_STORE=0 (a store launch)."""
        meta = self.metas[i]
        self.store.fuse_store = fuse
        self.store.write(self.ks[i], self.vs[i], meta.slot_mapping, self.positions)
        return self.store.attend(self.qs[i], meta, self.scale)

    def cuda(self, i: int, **kw):
        s = self.store
        return attention_cuda.decode_attention_cuda(self.qs[i], s.k, s.v, self.metas[i], self.scale, s.signs,
                                                    s.inv_sqrt, s.key_offset, **kw)

    def triton(self, i: int, **kw):
        s = self.store
        return decode_attention_triton(self.qs[i], s.k, s.v, self.metas[i], self.scale, s.signs, s.inv_sqrt,
                                       s.key_offset, **kw)

    def dense(self, i: int):
        return paged_attention(self.qs[i], self.dense_k, self.dense_v, self.metas[i], self.scale)

    def reference(self, i: int) -> torch.Tensor:
        s = self.store
        return attention_over_decoded_pages(self.qs[i].float(), s.k, s.v, KIND, KIND, self.metas[i], self.scale,
                                            s.key_offset).float()


def graph_us(layers: Layers, n: int, attention) -> float:
    """Median device microseconds of a graph of n layers (qkv projection, attention(i), output projection)."""

    def run():
        for i in range(n):
            linear(layers.x, layers.w_qkv)
            if attention is not None:
                attention(i)
            linear(layers.x, layers.w_o)

    run()  # compiles, sizes caches and counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        times.append((e0, e1))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times) * 1e3


def sweep_context(ctx: int, n: int, batch: int, dev: torch.device, store_sweep: bool, rules_only: bool,
                  plan: int) -> None:
    layers = Layers(n, ctx, batch, dev, plan)
    for i in range(n):  # the new token in every layer's pages, as the reference will see it
        layers.store_new(i, StoreLaunch())
    torch.cuda.synchronize()
    ref = layers.reference(0)
    base = graph_us(layers, n, None)
    print(f"b{batch} ctx {ctx} (seq_len {layers.seq_len}, planned for {plan}): projections alone "
          f"{base / n:.1f} us a layer", flush=True)
    rows = []

    def case(name: str, attention, check=None) -> None:
        try:
            err = ""
            if check is not None:
                out = check().float()
                err = f"{(out - ref).abs().max().item() / ref.abs().max().item():.1e}"
            us = (graph_us(layers, n, attention) - base) / n
            rows.append((us, name, err))
            print(f"  {us:7.2f} us/layer  {name}  {err}", flush=True)
        except Exception as exc:  # report and go on
            print(f"  FAILED {name}: {exc!r}", flush=True)

    case("bf16 paged attention (engine)", layers.dense)
    case("turbo engine: TurboKVStore.write + attend (the engine's dispatch, fused write)", layers.engine,
         lambda: layers.engine(0))
    case("turbo engine: TurboKVStore.write + attend (the engine's dispatch, store launch)",
         lambda i: layers.engine(i, fuse=False), lambda: layers.engine(0, fuse=False))
    case("turbo CUDA C decode alone (rule)", lambda i: layers.cuda(i))
    case("turbo Triton decode alone (rule)", lambda i: layers.triton(i), lambda: layers.triton(0))
    if rules_only:
        return
    if store_sweep:
        for launch in STORE_LAUNCHES:
            case(f"store alone rows={launch.rows} small_rows={launch.small_rows} warps={launch.num_warps} "
                 f"pdl={launch.pdl}", lambda i, launch=launch: layers.store_new(i, launch))
    seen = set()
    for warps in (8, 4):
        for splits in CUDA_SPLITS:
            eff = whole_block_splits(plan, 16 * warps, splits)
            if (warps, eff) in seen:
                continue
            seen.add((warps, eff))
            case(f"CUDA C decode alone, {warps} warps, {eff} splits",
                 lambda i, w=warps, s=eff: layers.cuda(i, warps=w, num_splits=s),
                 lambda w=warps, s=eff: layers.cuda(0, warps=w, num_splits=s))
    seen = set()
    for splits in TRITON_SPLITS:
        eff = whole_block_splits(plan, 64, splits)
        if eff in seen:
            continue
        seen.add(eff)
        case(f"Triton decode alone, {eff} splits", lambda i, s=eff: layers.triton(i, num_splits=s),
             lambda s=eff: layers.triton(0, num_splits=s))
    print(f"ctx {ctx} sorted:")
    for us, name, err in sorted(rows):
        print(f"  {us:7.2f}  {name}  {err}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4096,16384,65536", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rules-only", action="store_true")
    p.add_argument("--plan", type=int, default=0, help="plan the launches for this many tokens (default: context + 33)")
    args = p.parse_args(argv)
    dev = require_gpu()
    for j, ctx in enumerate(args.contexts):
        sweep_context(ctx, args.layers, args.batch, dev, j == 0, args.rules_only, max(ctx + 33, args.plan))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
