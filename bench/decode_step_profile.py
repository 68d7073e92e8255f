"""Where a decode step spends its time, per kernel, through the engine's captured CUDA graph (GPU only).

    python bench/decode_step_profile.py                      # 8B shape, bf16 KV, 300 tokens of context
    python bench/decode_step_profile.py --shape depth-2048 --kv-cache-dtype bf16,turbo3 --depth 16384,65536
    python bench/decode_step_profile.py --shape depth-2048 --kv-cache-dtype bf16,turbo3 --depth 512 --batch 32

Per (KV cache dtype, depth): --batch sequences of the same length (batch 1 by default), each on pages of its own,
through the shape's random-weight model over one KV store per layer (turbo kinds with a
random key offset like the engine's default, partial on DEFAULT_KV_KEY_TURNED_PAIRS pairs per KV head:
bench/kernels_turbo.engine_key_offset), every page filled with random data, the decode graph captured as the
engine captures it (DecodeGraphs, planned for max_model_len = depth + 33 like bench/e2e.py's depth rows) and
replayed at depth + 16 tokens. Prints the runner loop's wall time per step (inputs from the host, replay, LM
head, greedy argmax, token read back) and its host pieces, the device time of one replay (back-to-back replays,
device events), then a torch.profiler trace of STEPS replays: device time per kernel per step, and the device's
idle time between kernels. Under PDL (server/kernels/pdl.py) a kernel launched early counts its wait in its own
time, so every Triton kernel's row is an upper bound (the projections, the turbo store, the attention's decode
and merge kernels); only the CUDA C kernels, launched plainly, are not. The replay's device time is the measure.
Prints only; docs/BENCHMARKS.md records what it said.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.e2e import SHAPES, build_random_model  # noqa: E402
from bench.kernels_turbo import engine_key_offset  # noqa: E402
from server.config import DEFAULT_KV_KEY_TURNED_PAIRS, DEFAULT_KV_RECENT_WINDOW  # noqa: E402
from server.kernels.paged_kv import DenseKVStore  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402
from server.runtime.cuda_graphs import DecodeGraphs  # noqa: E402

PAGE = 16
STEPS = 8  # profiled replays
DEPTH_SLACK = 33  # bench/e2e.py's depth rows: max_model_len = depth + 32 timed tokens + 1


def make_stores(cfg, kind: str, num_pages: int, dev: torch.device, window: int, rows: int) -> list:
    """One store per layer, every page random (turbo: valid codes, norms around a key's size; a recent-window row
    of ``window`` tokens for each of ``rows`` sequences, random too, unless 0)."""
    stores = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(cfg.num_layers):
        if kind == "bf16":
            store = DenseKVStore(num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev)
            store.k_pages.normal_()
            store.v_pages.normal_()
        else:
            store = TurboKVStore(num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, kind, kind, dev, torch.bfloat16,
                                 recent=(rows, window) if window else (0, 0))
            if store.recent is not None:
                store.recent.k.normal_()
                store.recent.v.normal_()
            store.set_key_offset(engine_key_offset(cfg.num_kv_heads, cfg.head_dim, dev, gen, cfg.rope_theta,
                                                   DEFAULT_KV_KEY_TURNED_PAIRS))
            for pages in (store.k, store.v):
                pages.codes.random_(0, 256)
                pages.norms.uniform_(8.0, 12.0)
        stores.append(store)
    return stores


def kernel_table(prof, steps: int) -> int:
    """Prints the device time per kernel per step, the largest idle gaps between kernels and the device's busy
    share; returns the device activities seen."""
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)  # fmt: skip
    if not evs:
        return 0
    per_kernel: dict[str, list[float]] = {}
    for e in evs:
        per_kernel.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    busy, end = 0.0, evs[0].time_range.start
    for e in evs:  # union of the kernels' intervals (PDL overlaps them)
        busy += max(0.0, e.time_range.end - max(end, e.time_range.start))
        end = max(end, e.time_range.end)
    span = end - evs[0].time_range.start
    print(f"  profiled {steps} replays: {len(evs) / steps:.0f} device activities a step, busy {busy / steps:.1f} of "
          f"{span / steps:.1f} us a step")
    print(f"  {'us/step':>9} {'calls':>6} {'us/call':>8}  kernel")
    for name, times in sorted(per_kernel.items(), key=lambda x: -sum(x[1]))[:14]:
        print(f"  {sum(times) / steps:9.1f} {len(times) / steps:6.1f} {sum(times) / len(times):8.2f}  {name}")
    gaps = [(b.time_range.start - a.time_range.end, a.name[:40], b.name[:40]) for a, b in zip(evs, evs[1:])]
    for g, a, b in sorted((g for g in gaps if g[0] > 2), reverse=True)[:4]:
        print(f"  gap {g:6.1f} us after {a} before {b}")
    return len(evs)


def profile_case(loaded, kind: str, depth: int, dev: torch.device, window: int, batch: int = 1) -> None:
    cfg = loaded.config
    max_model_len = depth + DEPTH_SLACK
    seq_len = depth + 16
    max_pages = -(-max_model_len // PAGE)
    stores = make_stores(cfg, kind, batch * max_pages + 1, dev, window, batch)
    graphs = DecodeGraphs(loaded.model, stores, batch, max_pages, max_model_len, dev)
    graphs.capture()
    first_pages = torch.arange(batch, dtype=torch.int32)[:, None] * max_pages  # sequence b owns pages b * max_pages..
    table = (first_pages + torch.arange(-(-seq_len // PAGE), dtype=torch.int32)).numpy()
    last = seq_len - 1
    args = ([7] * batch, [last] * batch, [int(p) * PAGE + last for p in first_pages[:, 0]], [seq_len] * batch,
            list(range(batch)), table)  # fmt: skip
    model = loaded.model

    def step():
        return model.compute_logits(graphs.run_host(*args)).argmax(-1).tolist()

    ring = f", recent window {window}" if kind != "bf16" and window else ""
    print(f"{cfg.num_layers} layers, {kind} KV{ring}, batch {batch}, depth {depth} (seq_len {seq_len}, graph "
          f"planned for {max_model_len}):", flush=True)
    with torch.inference_mode():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            step()
        print(f"  runner loop {((time.perf_counter() - t) / 20) * 1e6:.0f} us/step")
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = graphs.run_host(*args)
        c0 = time.perf_counter() - t
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model.compute_logits(h)
        c1 = time.perf_counter() - t
        logits.argmax(-1)
        c2 = time.perf_counter() - t
        torch.cuda.synchronize()
        c3 = time.perf_counter() - t
        print(f"  host: run_host returns after {c0 * 1e6:.0f} us; compute_logits {c1 * 1e6:.0f} us, +argmax "
              f"{c2 * 1e6:.0f} us, done (gpu) {c3 * 1e6:.0f} us")
        graph = graphs.graphs[batch, graphs.context_bucket(seq_len)]  # the graph run_host replays
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(30):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        print(f"  replay (back to back): {e0.elapsed_time(e1) * 1e3 / 30:.1f} us device a step")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                graph.replay()
            torch.cuda.synchronize()
        if kernel_table(prof, STEPS) < cfg.num_layers * STEPS:  # the profiler did not see inside the graph
            print("  graph kernels not traced; eager steps instead (launch gaps larger than in the graph):")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(STEPS):
                    model.forward(graphs.input_ids[:batch], graphs.positions[:batch], stores, graphs._meta(batch))
                torch.cuda.synchronize()
            kernel_table(prof, STEPS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--kv-cache-dtype", default="bf16", type=lambda s: s.split(","), help="e.g. bf16,turbo3")
    p.add_argument("--depth", default="300", type=lambda s: [int(x) for x in s.split(",")], help="e.g. 16384,65536")
    p.add_argument("--kv-recent-window", default=str(DEFAULT_KV_RECENT_WINDOW),
                   type=lambda s: [int(x) for x in s.split(",")], help="turbo kinds: e.g. 0,128 (default: the engine's)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the decode step, all at the same depth")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    loaded = build_random_model(SHAPES[args.shape], dev, torch.bfloat16)
    for kind in args.kv_cache_dtype:
        for depth in args.depth:
            for window in args.kv_recent_window if kind != "bf16" else [0]:
                try:
                    profile_case(loaded, kind, depth, dev, window, args.batch)
                except Exception as exc:  # report and go on: one failing case must not cost the others
                    print(f"{kind} @ {depth}, window {window}: FAILED {exc!r}", flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
