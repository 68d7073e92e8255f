"""Where an 8B-shaped batch-1 decode step spends its time outside the CUDA graph (GPU only).

    python bench/decode_step_profile.py

Drives DecodeGraphs the way the runner does (inputs from the host, replay, LM head, greedy argmax,
token read back) and prints: wall time per step of that loop, the host time of each piece, the
device time of one replay after an idle device, then a torch.profiler trace of 4 steps: the largest
gaps between device activities (under the profiler, host work is slower than without it) and the
device time per kernel per step. Prints only; docs/BENCHMARKS.md records what it said.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.e2e import SHAPES, build_random_model  # noqa: E402
from server.kernels.paged_kv import DenseKVStore  # noqa: E402
from server.runtime.cuda_graphs import DecodeGraphs  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    cfg = SHAPES["llama3-8b"]
    loaded = build_random_model(cfg, dev, torch.bfloat16)
    stores = [DenseKVStore(32, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, dev) for _ in range(cfg.num_layers)]
    seq_len = 300
    table = torch.arange(32, dtype=torch.int32, device=dev)[None]
    graphs = DecodeGraphs(loaded.model, stores, 1, 32, 8192, dev)
    graphs.capture()
    args = ([7], [seq_len - 1], [seq_len - 1], [seq_len], table.cpu().numpy())
    model = loaded.model

    def step():
        return model.compute_logits(graphs.run_host(*args)).argmax(-1).tolist()

    with torch.inference_mode():
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(30):
            step()
        print(f"loop {((time.perf_counter() - t) / 30) * 1e6:.0f} us/step")
        torch.cuda.synchronize()
        t = time.perf_counter()
        graphs.run_host(*args)
        print(f"run_host (returns): cpu {(time.perf_counter() - t) * 1e6:.0f} us")
        torch.cuda.synchronize()
        h = graphs.run_host(*args)
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = model.compute_logits(h)
        c1 = time.perf_counter() - t
        logits.argmax(-1)
        c2 = time.perf_counter() - t
        torch.cuda.synchronize()
        c3 = time.perf_counter() - t
        print(f"compute_logits cpu {c1 * 1e6:.0f} us, +argmax {c2 * 1e6:.0f} us, done (gpu) {c3 * 1e6:.0f} us")
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graphs.graphs[1].replay()
        e1.record()
        torch.cuda.synchronize()
        print(f"single replay after idle: {e0.elapsed_time(e1) * 1e3:.0f} us device")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                step()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)  # fmt: skip
    gaps = [(b.time_range.start - a.time_range.end, a.name[:60], b.name[:60]) for a, b in zip(evs, evs[1:])]
    for g, a, b in sorted((g for g in gaps if g[0] > 4), reverse=True)[:12]:
        print(f"gap {g:8.1f} us after {a} before {b}")
    per_kernel: dict[str, float] = {}
    for e in evs:
        per_kernel[e.name[:50]] = per_kernel.get(e.name[:50], 0.0) + e.time_range.end - e.time_range.start
    for name, total in sorted(per_kernel.items(), key=lambda x: -x[1])[:10]:
        print(f"{total / 4:9.1f} us/step  {name}")


if __name__ == "__main__":
    main()
