"""The embedded model served on this machine's CPU, by context length: `python bench/cpu_context.py`.

Per prompt length (--contexts, default 32,2048,6000): one request's time to its first token (the prompt's
prefill, in the engine's chunks) and its decode tokens/s after it (32 greedy tokens after the first). The engine
is the one `turboserve serve` builds (`build_engine`: off the main thread), with max_model_len 8192;
--no-cpu-int4, --cpu-prompt-dtype, --cpu-logits-dtype and --kv-cache-dtype as the server's flags. Prints;
records nothing.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.config import EngineConfig  # noqa: E402
from server.runtime.engine import build_engine  # noqa: E402
from server.runtime.sequence import SamplingParams  # noqa: E402

NEW_TOKENS = 32


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="32,2048,6000")
    p.add_argument("--no-cpu-int4", dest="cpu_int4", action="store_false")
    p.add_argument("--cpu-prompt-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--cpu-logits-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args()
    config = EngineConfig(device="cpu", max_model_len=8192, cpu_int4=args.cpu_int4,
                          cpu_prompt_dtype=args.cpu_prompt_dtype, cpu_logits_dtype=args.cpu_logits_dtype,
                          kv_cache_dtype=args.kv_cache_dtype)
    engine = build_engine(config)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    try:
        for n in (int(c) for c in args.contexts.split(",")):
            prompt = [(i * 7919) % 40000 + 100 for i in range(n)]  # token ids well inside the vocabulary
            engine.generate(prompt, greedy(4))  # warm-up: the same shapes, outside the timings
            first, done, finished = {}, {}, threading.Event()

            def on_output(out, first=first, done=done, finished=finished) -> None:
                now = time.perf_counter()
                if out.token_ids and "t" not in first:
                    first["t"] = now
                if out.finished:
                    done["t"] = now
                    finished.set()

            start = time.perf_counter()
            engine.submit(f"context-{n}", prompt, greedy(NEW_TOKENS + 1), on_output)
            finished.wait(3600)
            decode = NEW_TOKENS / (done["t"] - first["t"])
            print(f"context {n}: first token after {first['t'] - start:.2f} s, then {decode:.1f} tok/s", flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
