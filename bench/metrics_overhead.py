"""What kernel timing costs: engine throughput at --kernel-timing-sample-rate 0, 0.01 and 1.

    python bench/metrics_overhead.py [--shape smollm2-135m] [--batch-sizes 1,32] [--eager]

The same engine (random weights, bench/e2e.py's shapes and timing) runs decode and prefill with
the timing hook off, at the default rate and timing every step; the rates are interleaved and
repeated, and the median of each is compared with rate 0. With CUDA graphs, decode replays run
no Python, so only the ops outside the graph are timed; --eager measures the hook around every
launch. Sampling picks whole steps, so a measurement must span many steps for a fractional rate
to cost what it costs on average: every case runs at least --min-steps engine steps (prefill:
that many prompts, one prompt per step). Records into docs/BENCHMARKS.md under "Kernel timing
overhead".
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SHAPES, build_random_model, decode_tokens_per_s, random_prompts, run_requests  # noqa: E402
from bench.harness import BENCHMARKS_DOC, command_line, dated_heading, environment_line, record  # noqa: E402
from server.config import EngineConfig  # noqa: E402
from server.kernels import timing  # noqa: E402
from server.runtime.engine import Engine  # noqa: E402

SECTION = "## Kernel timing overhead"
RATES = (0.0, 0.01, 1.0)


def make_engine(loaded, args) -> Engine:
    cfg = loaded.config
    bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # f32 upper bound
    tokens = max(args.batch_sizes) * (args.prompt_len + args.new_tokens) + args.prefill_len
    config = EngineConfig(
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(args.prefill_len, 256),
        max_model_len=max(args.prefill_len, args.prompt_len + args.new_tokens) + 16,
        kv_cache_memory=bytes_per_token * (tokens + 1024), enforce_eager=args.eager,
    )  # fmt: skip
    engine = Engine(config, loaded=loaded)
    engine.start()
    return engine


def prefill_steps_tokens_per_s(engine: Engine, length: int, steps: int, vocab: int) -> float:
    """Prefill throughput over `steps` prompts of `length` tokens, one prompt per engine step."""
    t = run_requests(engine, random_prompts(steps, length, vocab, seed=steps), 1)
    return steps * length / (t["end"] - t["start"])


def median_by_rate(measure, repeats: int) -> dict[float, float]:
    """Interleave the rates so drift (clocks, other load) hits each the same way."""
    samples: dict[float, list[float]] = {rate: [] for rate in RATES}
    timing.set_sample_rate(0.0)
    measure()  # warm-up: allocator, caches and first-call costs would count against whichever rate runs first
    for _ in range(repeats):
        for rate in RATES:
            timing.set_sample_rate(rate)
            samples[rate].append(measure())
            timing.flush()
    timing.set_sample_rate(0.0)
    return {rate: statistics.median(values) for rate, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-steps", type=int, default=200, help="engine steps per measurement (rate 0.01: ~2 timed)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: every launch goes through the hook")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.new_tokens = max(args.new_tokens, args.min_steps)  # decode: one step per new token
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = SHAPES[args.shape]
    engine = make_engine(build_random_model(cfg, device, dtype), args)
    lines = ["| case | rate 0 | rate 0.01 | rate 1 | cost at 0.01 | cost at 1 |", "|---|---:|---:|---:|---:|---:|"]
    cases = [(f"decode b{b}, {args.new_tokens} steps", lambda b=b: decode_tokens_per_s(
        engine, b, args.prompt_len, args.new_tokens, cfg.vocab_size)) for b in args.batch_sizes]  # fmt: skip
    cases.append((f"prefill {args.prefill_len}, {args.min_steps} steps", lambda: prefill_steps_tokens_per_s(
        engine, args.prefill_len, args.min_steps, cfg.vocab_size)))  # fmt: skip
    try:
        for case, measure in cases:
            tps = median_by_rate(measure, args.repeats)
            base = tps[0.0]
            lines.append(f"| {case} | {base:,.0f} tok/s | {tps[0.01]:,.0f} | {tps[1.0]:,.0f} | "
                         f"{1 - tps[0.01] / base:+.1%} | {1 - tps[1.0] / base:+.1%} |")  # fmt: skip
            print(lines[-1], flush=True)
    finally:
        engine.shutdown()
    graphs = "eager" if engine.runner.graphs is None else "CUDA graphs for decode"
    title = f"Kernel timing overhead, {args.shape} random {str(dtype).removeprefix('torch.')} weights, {graphs}"
    block = (
        f"{dated_heading(title)}\n\n- Command: `{command_line('bench/metrics_overhead.py', argv)}`\n"
        f"- Hardware: {environment_line(device)}\n"
        f"- Median tokens/s of {args.repeats} interleaved runs per rate; cost = throughput lost against rate 0 "
        "(negative: faster, i.e. noise).\n\n" + "\n".join(lines) + "\n"
    )
    print(block)
    if not args.no_record:
        record(block, BENCHMARKS_DOC, SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
