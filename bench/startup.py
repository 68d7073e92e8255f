"""Engine start-up time per KV dtype, and the memory a shut-down engine still holds: `python bench/startup.py`.

    python bench/startup.py [--model GGUF_OR_DIR] [--kv-cache-dtype bf16,turbo3,turbo4] [--no-record]

Loads the model once (timed), then per KV dtype builds an Engine with the defaults a server starts with (KV pool a
share of free memory, CUDA graphs for every batch size and context bucket; a turbo cache first calibrates its key
offset and channel balance), times the build and the first 8-token greedy request, and reads the CUDA memory
allocated after ``shutdown()`` and after the engine is dropped. Each engine is dropped before the next is built, so
each sizes its pool from the same free memory.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SECTION  # noqa: E402
from bench.harness import BENCHMARKS_DOC, command_line, dated_heading, environment_line, record, require_gpu  # noqa: E402
from server.config import EngineConfig  # noqa: E402
from server.runtime.engine import Engine  # noqa: E402
from server.runtime.models.loader import load_model  # noqa: E402
from server.runtime.sequence import SamplingParams  # noqa: E402


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    p.add_argument("--kv-cache-dtype", default="bf16,turbo3,turbo4", type=lambda s: s.split(","))
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    device = require_gpu()
    start = time.perf_counter()
    loaded = load_model(args.model, device, torch.bfloat16)
    load_s = time.perf_counter() - start
    rows = []
    for kind in args.kv_cache_dtype:
        start = time.perf_counter()
        engine = Engine(EngineConfig(kv_cache_dtype=kind), loaded=loaded)
        build_s = time.perf_counter() - start
        engine.start()
        out = engine.generate(engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=8, temperature=0.0))
        first_s = time.perf_counter() - start - build_s
        graphs = len(engine.runner.graphs.graphs) if engine.runner.graphs else 0
        pool = engine.kv_cache.num_pages * engine.kv_cache.page_size * engine.kv_cache.bytes_per_token
        engine.shutdown()
        held = torch.cuda.memory_allocated(device)
        del engine, out
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(f"| {kind} | {build_s:.1f} | {graphs} | {first_s:.2f} | {gib(pool)} | {gib(held)} | "
                    f"{gib(torch.cuda.memory_allocated(device))} |")
        print(rows[-1], flush=True)
    block = (
        f"{dated_heading('Engine start-up per KV dtype, and memory after shutdown')}\n\n"
        f"- Command: `{command_line('bench/startup.py', None)}`\n"
        f"- Hardware: {environment_line(device)}\n"
        f"- Model {loaded.name} loaded in {load_s:.1f} s (bf16). Per engine: default config (KV pool a share of free"
        f" memory, max_model_len the model's, CUDA graphs on).\n\n"
        "| KV | Engine() (s) | CUDA graphs | first 8-token request (s) | KV pool (GiB) | allocated after shutdown()"
        " (GiB) | after the engine is dropped (GiB) |\n|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )  # fmt: skip
    print(block)
    if not args.no_record:
        record(block, BENCHMARKS_DOC, SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
