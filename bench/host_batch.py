"""Host time of a step's inputs: `python bench/host_batch.py` (CPU or GPU; prints).

ModelRunner.batch (the flat token, position and slot lists and the block tables) and ModelRunner.prepare (their
device tensors, eager steps only) for 32 decode rows at 2K / 16K / 64K of context, and for a mixed step of 32
decode rows at 3000 beside a 2048-token chunk. Decode steps build theirs while the step before runs (async
scheduling); prefill and mixed steps on the critical path, with the GPU idle.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SHAPES, build_random_model, make_engine  # noqa: E402
from bench.harness import host_seconds_per_call  # noqa: E402
from server.runtime.scheduler import ScheduledChunk  # noqa: E402
from server.runtime.sequence import SamplingParams, Sequence  # noqa: E402

ROWS = 32


def decode_rows(kv_cache, context: int) -> list[ScheduledChunk]:
    chunks = []
    for i in range(ROWS):
        seq = Sequence(f"d{i}", [1] * context, SamplingParams(max_tokens=1), 0, None)
        kv_cache.grow(seq, context + 1)
        seq.num_computed_tokens = context
        chunks.append(ScheduledChunk(seq, context, 1))
    return chunks


def per_call_ms(fn) -> float:
    return host_seconds_per_call(fn, calls=50) * 1e3


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = dataclasses.replace(SHAPES["tiny"], max_position_embeddings=131072)  # the runner's host work alone
    loaded = build_random_model(cfg, device, torch.float32)
    for context in (2048, 16384, 65536):
        budget = ROWS * (context + 1) + ROWS * 3001 + 4096  # the decode rows, then the mixed step's
        engine = make_engine(loaded, 2 * ROWS + 1, max(context, 4096) + 64, "auto", budget, 2048)
        runner = engine.runner
        chunks = decode_rows(engine.kv_cache, context)
        print(f"{ROWS} decode rows at {context}: batch {per_call_ms(lambda: runner.batch(chunks)):.3f} ms", flush=True)
        if context == 2048:
            prompt = Sequence("p", [1] * 4096, SamplingParams(max_tokens=1), 0, None)
            engine.kv_cache.grow(prompt, 4096)
            mixed = decode_rows(engine.kv_cache, 3000) + [ScheduledChunk(prompt, 2048, 2048)]
            built = runner.batch(mixed)
            print(f"{ROWS} decode rows at 3000 beside a 2048-token chunk: batch "
                  f"{per_call_ms(lambda: runner.batch(mixed)):.3f} ms, prepare "
                  f"{per_call_ms(lambda: runner.prepare(built)):.3f} ms", flush=True)  # fmt: skip
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
