"""GPU check of turbo KV through the whole engine: `python bench/turbo_engine_check.py [--model GGUF]` (prints,
records nothing).

CI runs the embedded SmolLM2 with turbo pages on the CPU reference path only. Here the same model runs on
the GPU in bf16, where the store kernel, the fused decode kernel (inside CUDA graphs) and the key offsets
calibrated on the device take over: for each KV cache dtype and key offset, greedy answers to a few chat
prompts, and how many leading tokens agree with the bf16 cache's. Needs the gguf package; ``--model`` takes
the GGUF file where the embedded model's package is not installed.
Exits non-zero when a request fails or a page leaks. Agreement is printed, not judged: the 135M model in bf16
meets near ties early (after "The answer" to "What is 2 + 2?", the float32 model gives " to" 43.4 % and " is"
40.7 %), where any KV error may take the other branch (docs/BENCHMARKS.md, 05:30 UTC block).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.config import EngineConfig  # noqa: E402
from server.runtime.engine import Engine  # noqa: E402
from server.runtime.models.loader import load_model  # noqa: E402
from server.runtime.sequence import SamplingParams  # noqa: E402

PAGE_RETURN_S = 5.0
PROMPTS = ["What is the capital of Japan?", "What is 2 + 2?", "Who wrote Hamlet?"]
KINDS = [("bf16", "bf16", "fixed"), ("turbo4", "turbo4", "fixed"), ("turbo4", "turbo4", "partial"),
         ("turbo4", "turbo4", "turned"), ("turbo3", "turbo3", "fixed"), ("turbo3", "turbo3", "partial"),
         ("turbo3", "turbo3", "turned"), ("turbo4", "turbo3", "partial"), ("turbo2", "turbo2", "turned")]
NEW_TOKENS = 24


def answers(loaded, k_kind: str, v_kind: str, key_offset: str) -> list[tuple[str, list[int]]]:
    config = EngineConfig(kv_cache_dtype_k=k_kind, kv_cache_dtype_v=v_kind, kv_key_offset=key_offset,
                          kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=4)
    engine = Engine(config, loaded=loaded)
    engine.start()
    try:
        out = []
        for text in PROMPTS:
            tok = engine.tokenizer
            prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
            result = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
            if result.error is not None:
                raise RuntimeError(f"{k_kind}/{v_kind}: {result.error}")
            out.append((result.text, result.token_ids))
        # A final output can go out while a step launched ahead (async scheduling) still holds the
        # sequence's pages; they return right after that step, so a leak is pages still held a while later.
        deadline = time.monotonic() + PAGE_RETURN_S
        while engine.kv_cache.num_free_pages != engine.kv_cache.num_pages and time.monotonic() < deadline:
            time.sleep(0.005)
        if engine.kv_cache.num_free_pages != engine.kv_cache.num_pages:
            held = engine.kv_cache.num_pages - engine.kv_cache.num_free_pages
            raise RuntimeError(f"{k_kind}/{v_kind}: {held} KV pages still held {PAGE_RETURN_S} s after the last output")
        return out
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    args = parser.parse_args()
    loaded = load_model(args.model, torch.device("cuda"), torch.bfloat16)
    reference = answers(loaded, "bf16", "bf16", "fixed")
    for k_kind, v_kind, key_offset in KINDS:
        got = reference if k_kind == "bf16" else answers(loaded, k_kind, v_kind, key_offset)
        for text, (answer, ids), (_, ref_ids) in zip(PROMPTS, got, reference):
            agree = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
            print(f"{k_kind}/{v_kind} {key_offset} | {text} | {agree} leading tokens as bf16 | {answer!r}", flush=True)
    return 0  # a failed request or a leaked page raised above


if __name__ == "__main__":
    raise SystemExit(main())
