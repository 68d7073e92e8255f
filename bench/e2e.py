"""End-to-end engine throughput on random-weight models: `python bench/e2e.py`.

Runs the real Engine (scheduler, paged KV, Triton attention, CUDA graphs, sampler) through its
public submit/on_output API on models built from a ModelConfig with random bf16 weights, so no
checkpoint, tokenizer file, gguf or fastapi is needed. Per shape it measures:
- decode tokens/s at each batch size: B greedy requests of a random prompt, timed from the step
  that sampled every request's first token to the last finish, so prefill is not counted;
- prefill tokens/s of one prompt of --prefill-len tokens (one engine step, max_tokens=1);
- at batch 1, the weight-streaming limit: weight bytes read per decode step over the measured
  copy bandwidth, and which fraction of it we reach;
- with --transformers, transformers' generate() with its compiled static cache on the same shape,
  timed the same way (compile time excluded by a warm-up run).
--context-depth adds decode at long contexts, and the prefill of those prompts (time to first token, in chunks of
--depth-chunk tokens), per --kv-cache-dtype (e.g. bf16,turbo4,turbo3) and for turbo dtypes per --kv-key-offset
(e.g. partial,fixed,turned), on the shape the TurboQuant issue names.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

# Run as a script from anywhere: make `bench.*` and `server.*` importable from the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    BENCHMARKS_DOC, command_line, copy_bandwidth_gbs, dated_heading, environment_line, record,
)
from server.config import DEFAULT_KV_KEY_OFFSET, DEFAULT_KV_RECENT_WINDOW, EngineConfig  # noqa: E402
from server.runtime.engine import Engine  # noqa: E402
from server.runtime.kv_cache import TURBO_KV_KINDS  # noqa: E402
from server.runtime.models.config import ModelConfig  # noqa: E402
from server.runtime.models.llama import CausalLM  # noqa: E402
from server.runtime.sequence import SamplingParams  # noqa: E402

SECTION = "## End to end"


def _shape(name, hidden, layers, heads, kv_heads, ffn, vocab, tied, theta=500000.0, max_pos=131072):
    return name, ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-5, rope_theta=theta,
        rope_scaling=None, max_position_embeddings=max_pos, tie_word_embeddings=tied,
    )  # fmt: skip


SHAPES = dict(
    [
        _shape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, tied=True, theta=100000.0, max_pos=8192),
        _shape("llama3-8b", 4096, 32, 32, 8, 14336, 128256, tied=False, max_pos=8192),
        _shape("depth-2048", 2048, 24, 16, 8, 6144, 32000, tied=False),  # the TurboQuant issue's long-context shape
        _shape("tiny", 64, 2, 4, 2, 128, 512, tied=False, max_pos=4096),  # CPU smoke test of this script
    ]
)
# transformers generate(), compiled static cache, H200, 128-token prompt + 128 new tokens, measured
# 2026-11-29 (issue 2); shown when --transformers is not given, labelled as quoted.
QUOTED_TRANSFORMERS = {("smollm2-135m", 1): 408, ("smollm2-135m", 32): 7388, ("llama3-8b", 1): 137, ("llama3-8b", 32): 3155}


DEPTH_NEW_TOKENS = 32  # decode tokens timed after each depth's prompt


class NullTokenizer:
    """Engines need a tokenizer for stop strings; benches send token ids and read token ids.

    Text (only the turbo K-offset calibration encodes any) becomes its UTF-8 bytes as ids,
    which every vocabulary of a random-weight model holds.
    """

    eos_token_ids = frozenset()
    bos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


@dataclasses.dataclass
class RandomModel:
    """What Engine(config, loaded=...) reads of a loaded model."""

    model: torch.nn.Module
    tokenizer: NullTokenizer
    config: ModelConfig
    name: str
    path: str = "<random weights>"
    raw_weights: dict = dataclasses.field(default_factory=dict)  # no quantized file behind random weights


def build_random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> RandomModel:
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the compute dtype: an 8B model in float32 would need 32 GB first
    try:
        with torch.device(device), torch.no_grad():
            model = CausalLM(cfg)
            for name, p in model.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0.0, 0.02)  # keeps activations finite through the random stack
    finally:
        torch.set_default_dtype(previous)
    model = model.to(device).eval()  # buffers made on the CPU on purpose (RoPE frequencies) follow the weights
    return RandomModel(model, NullTokenizer(cfg.vocab_size), cfg, "random-" + str(cfg.hidden_size))


def weight_bytes_per_decode_step(model: torch.nn.Module, cfg: ModelConfig) -> int:
    """Every parameter is read once per step, except an untied input embedding (one row per token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def run_requests(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit all prompts at once; wall times of each request's first token and of its finish."""
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    errors: list[str] = []
    done = threading.Event()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def on_output(out) -> None:
        now = time.perf_counter()
        if out.token_ids and out.request_id not in first:
            first[out.request_id] = now
        if out.finished:
            if out.finish_reason != "length":
                errors.append(f"{out.request_id}: {out.finish_reason} {out.error}")
            finish[out.request_id] = now
            if len(finish) == len(prompts):
                done.set()

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(f"bench-{i}-{time.monotonic_ns()}", prompt, params, on_output)
    if not done.wait(timeout=600):
        raise RuntimeError(f"benchmark requests did not finish in 600 s ({len(finish)}/{len(prompts)} done)")
    if errors:
        raise RuntimeError("benchmark requests failed: " + "; ".join(errors[:3]))
    return {"start": start, "first": max(first.values()), "end": max(finish.values())}


def graph_note(engine: Engine) -> str:
    return "" if engine.runner.graphs is not None else " (eager: no CUDA graphs)"


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def make_engine(loaded: RandomModel, max_seqs: int, max_model_len: int, kv_cache_dtype: str, budget_tokens: int,
                chunk: int, async_scheduling: bool = True, kv_key_offset: str = "fixed",
                kv_recent_window: int = DEFAULT_KV_RECENT_WINDOW) -> Engine:
    cfg = loaded.config
    layer_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K+V per token per layer at f32: an upper bound
    config = EngineConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=chunk,
        max_model_len=max_model_len,
        kv_cache_dtype=kv_cache_dtype,
        kv_key_offset=kv_key_offset,
        kv_recent_window=kv_recent_window,
        kv_cache_memory=cfg.num_layers * layer_bytes * (budget_tokens + 64 * max_seqs),
        kernel_timing_sample_rate=0.0,
        async_scheduling=async_scheduling,
    )
    engine = Engine(config, loaded=loaded)
    engine.start()
    return engine


def decode_and_first_token(engine: Engine, batch: int, prompt_len: int, new_tokens: int,
                           vocab: int) -> tuple[float, float]:
    """(decode tok/s, seconds to the last request's first token) of one round of B greedy requests."""
    # A warm-up prompt as long as the timed one: kernels compile (Triton specializes on the chunk's shapes and
    # strides) and graphs record outside the time to the first token.
    run_requests(engine, random_prompts(batch, prompt_len, vocab, seed=1), 4)
    t = run_requests(engine, random_prompts(batch, prompt_len, vocab, seed=2), new_tokens)
    return batch * (new_tokens - 1) / (t["end"] - t["first"]), t["first"] - t["start"]


def decode_tokens_per_s(engine: Engine, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> float:
    return decode_and_first_token(engine, batch, prompt_len, new_tokens, vocab)[0]


def prefill_tokens_per_s(engine: Engine, length: int, vocab: int) -> float:
    run_requests(engine, random_prompts(1, length, vocab, seed=3), 1)
    times = []
    for seed in (4, 5, 6):
        t = run_requests(engine, random_prompts(1, length, vocab, seed=seed), 1)
        times.append(t["end"] - t["start"])
    return length / sorted(times)[1]


def transformers_tokens_per_s(cfg: ModelConfig, device: torch.device, batch: int, prompt_len: int,
                              new_tokens: int) -> float:
    """Decode tok/s of transformers generate() with a static cache, timed like our engine. On CUDA generate() compiles its decode
    forward itself for a static cache (CUDA graphs, "reduce-overhead"); compiling model.forward on top of that
    replays graphs whose outputs the cache update has overwritten (transformers 5.17)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)

    def generate(n: int) -> float:
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                       pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        return time.perf_counter() - t0

    generate(new_tokens)  # warm-up: compilation and CUDA-graph recording are not counted
    generate(2)
    full, one = generate(new_tokens), generate(1)
    del model
    return batch * (new_tokens - 1) / (full - one)


def bench_shape(name: str, args, device: torch.device) -> dict:
    """Our decode tok/s per batch size and prefill tok/s for one shape."""
    cfg = SHAPES[name]
    loaded = build_random_model(cfg, device, args.dtype)
    max_len = max(args.prompt_len + args.new_tokens, args.prefill_len + 1)
    engine = make_engine(loaded, max(args.batch_sizes), cfg.max_position_embeddings, "auto",
                         max(args.batch_sizes) * max_len, args.prefill_len, args.async_scheduling)  # fmt: skip
    try:
        result = {"weight_bytes": weight_bytes_per_decode_step(loaded.model, cfg), "note": graph_note(engine)}
        for batch in args.batch_sizes:
            result[batch] = decode_tokens_per_s(engine, batch, args.prompt_len, args.new_tokens, cfg.vocab_size)
            print(f"{name} decode b{batch}: {result[batch]:,.0f} tok/s", flush=True)
        result["prefill"] = prefill_tokens_per_s(engine, args.prefill_len, cfg.vocab_size)
        return result
    finally:
        engine.shutdown()
        del engine, loaded
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None


def shape_rows(name: str, ours: dict, hf: dict[int, float], args, copy_gbs: float) -> list[str]:
    rows = []
    for batch in args.batch_sizes:
        row = f"| {name} | decode b{batch}{ours['note']} | {ours[batch]:,.0f} tok/s"
        if batch in hf:
            row += f" | {hf[batch]:,.0f} (measured here) | {ours[batch] / hf[batch]:.2f}x"
        elif (name, batch) in QUOTED_TRANSFORMERS:
            quoted = QUOTED_TRANSFORMERS[(name, batch)]
            row += f" | {quoted:,} (quoted, issue 2) | {ours[batch] / quoted:.2f}x"
        else:
            row += " | - | -"
        if batch == 1:
            limit = copy_gbs * 1e9 / ours["weight_bytes"]
            row += f" | {ours['weight_bytes'] / 1e9:.2f} GB/step, limit {limit:,.0f} tok/s, ours {ours[1] / limit:.0%}"
        rows.append(row + (" |" if batch == 1 else " | |"))
    return rows + [f"| {name} | prefill {args.prefill_len} | {ours['prefill']:,.0f} tok/s | - | - | |"]


def bench_depths(args, device: torch.device, lines: list[str]) -> None:
    """Decode tok/s at batch 1 after a prompt of each depth, per KV cache dtype (TurboQuant issue)."""
    name = "depth-2048" if device.type == "cuda" else "tiny"
    cfg = SHAPES[name]
    loaded = build_random_model(cfg, device, args.dtype)
    kinds = [(kv_dtype, offset, window) for kv_dtype in args.kv_cache_dtype
             for offset in (args.kv_key_offset if kv_dtype in TURBO_KV_KINDS else ["fixed"])
             for window in (args.kv_recent_window if kv_dtype in TURBO_KV_KINDS else [0])]
    for kv_dtype, offset, window in kinds:
        label = f"{kv_dtype}, {offset} key offset, recent {window}" if kv_dtype in TURBO_KV_KINDS else kv_dtype
        for depth in args.context_depth:
            prompt = max(depth, 1)
            length = prompt + DEPTH_NEW_TOKENS
            try:
                engine = make_engine(loaded, 1, max(length + 1, args.max_model_len), kv_dtype, length + 16,
                                     args.depth_chunk, args.async_scheduling, offset, window)
            except Exception as exc:  # e.g. the turbo store is not in this checkout yet
                lines.append(f"| {name} | decode b1 @ {depth} ({label}) | unavailable: {exc} | | | |")
                print(lines[-1], flush=True)
                break
            prefill = ""
            try:
                ours, first = decode_and_first_token(engine, 1, prompt, DEPTH_NEW_TOKENS, cfg.vocab_size)
                result = f"{graph_note(engine)} | {ours:,.0f} tok/s"
                prefill = f" | {prompt / first:,.0f} tok/s (first token after {first:.2f} s)"
            except Exception as exc:  # report and go on to the next configuration
                result = f" | failed: {exc!r}"
            finally:
                engine.shutdown()
                del engine
                gc.collect()
            lines.append(f"| {name} | decode b1 @ {depth} ({label}){result} | - | - | |")
            print(lines[-1], flush=True)
            if prefill and depth:
                lines.append(f"| {name} | prefill {depth} in chunks of {args.depth_chunk} ({label}){prefill} | - | - | |")
                print(lines[-1], flush=True)


ARRIVALS = 6  # prompts arriving one after another under the same load; the first compiles the chunks' kernels


def arrivals_under_load(engine: Engine, batch: int, depth: int, arrival_len: int, vocab: int) -> dict:
    """B greedy requests decode at ``depth`` while prompts of ``arrival_len`` tokens arrive one at a time: each
    prompt's chunks run in mixed steps beside their decode rows. Per timed arrival: its time to first token, and
    the running requests' longest wait for a token and their tokens/s from its arrival to its first token; the
    medians over the arrivals after the first."""
    tag = time.monotonic_ns()
    stamps: dict[str, list[float]] = {f"run-{i}-{tag}": [] for i in range(batch)}
    first_token = {f"arrival-{k}-{tag}": threading.Event() for k in range(ARRIVALS)}
    finished: set[str] = set()
    all_finished = threading.Event()
    errors: list[str] = []

    def on_output(out) -> None:
        if out.request_id in stamps:
            stamps[out.request_id].extend([time.perf_counter()] * len(out.token_ids))
        elif out.token_ids:
            first_token[out.request_id].set()
        if out.finished:
            finished.add(out.request_id)
            if len(finished) == batch + ARRIVALS:
                all_finished.set()
        if out.finish_reason == "error" or (out.finish_reason == "length" and out.request_id in stamps):
            errors.append(f"{out.request_id}: {out.finish_reason} {out.error}")

    running = SamplingParams(max_tokens=engine.config.max_model_len - depth, temperature=0.0, ignore_eos=True)
    for rid, prompt in zip(stamps, random_prompts(batch, depth, vocab, seed=7)):
        engine.submit(rid, prompt, running, on_output)
    deadline = time.perf_counter() + 600
    while min(len(t) for t in stamps.values()) < 8 and time.perf_counter() < deadline:  # all decoding, graphs warm
        time.sleep(0.01)
    windows = []
    for k, (rid, event) in enumerate(first_token.items()):
        start = time.perf_counter()
        engine.submit(rid, random_prompts(1, arrival_len, vocab, seed=8 + k)[0],
                      SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), on_output)  # fmt: skip
        if not event.wait(timeout=600) or errors:
            break
        windows.append((start, time.perf_counter()))
        time.sleep(0.05)  # a few decode-only steps between arrivals
    for rid in stamps:
        engine.abort(rid)
    all_finished.wait(timeout=60)
    if len(windows) < ARRIVALS or errors:
        raise RuntimeError(f"arrivals under load: {'; '.join(errors[:3]) or 'an arrival had no first token in 600 s'}")
    per_arrival = []
    for start, first in windows[1:]:
        waits, tokens = [], 0
        for times in stamps.values():
            inside = [t for t in times if start < t <= first]
            before = [t for t in times if t <= start][-1:]
            waits += [b - a for a, b in zip(before + inside, inside + [first])]
            tokens += len(inside)
        per_arrival.append((first - start, max(waits), tokens / (first - start)))
    return dict(zip(("ttft", "longest_wait", "tok_s"), (statistics.median(c) for c in zip(*per_arrival))))


def bench_arrivals(args, device: torch.device, lines: list[str]) -> None:
    """--arrivals B@D+L on the depth-2048 shape, per KV cache dtype."""
    name = "depth-2048" if device.type == "cuda" else "tiny"
    cfg = SHAPES[name]
    loaded = build_random_model(cfg, device, args.dtype)
    running, arrival_len = args.arrivals.split("+")
    batch, depth = map(int, running.split("@"))
    arrival_len = int(arrival_len)
    max_len = max(depth, arrival_len) + 512
    for kv_dtype in args.kv_cache_dtype:
        engine = make_engine(loaded, batch + 1, max_len, kv_dtype, batch * max_len + arrival_len, args.depth_chunk,
                             args.async_scheduling, args.kv_key_offset[0], args.kv_recent_window[0])  # fmt: skip
        try:
            r = arrivals_under_load(engine, batch, depth, arrival_len, cfg.vocab_size)
        finally:
            engine.shutdown()
            del engine
            gc.collect()
        lines.append(f"| {name} | {arrival_len}-token prompts arriving at b{batch} @ {depth} ({kv_dtype}) | first "
                     f"token after {r['ttft']:.3f} s; running requests: longest wait {r['longest_wait'] * 1e3:.0f} "
                     f"ms, {r['tok_s']:,.0f} tok/s meanwhile (medians) | - | - | |")  # fmt: skip
        print(lines[-1], flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="smollm2-135m,llama3-8b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--batch-sizes", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--transformers", action="store_true", help="also time transformers generate() here")
    p.add_argument("--context-depth", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                   help="e.g. 0,16384,65536: decode at these depths on the depth-2048 shape")  # fmt: skip
    p.add_argument("--depth-chunk", type=int, default=8192,
                   help="depth rows: the engine's max_num_batched_tokens, the prefill chunk (the engine's default is 2048)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="depth rows: the engine's max_model_len (its decode graphs plan for it; default depth + 33)")
    p.add_argument("--arrivals", default="", help="B@D+L, e.g. 32@8192+8192: B requests decode at depth D when a "
                   "prompt of L tokens arrives (mixed steps), per --kv-cache-dtype, in chunks of --depth-chunk")
    p.add_argument("--kv-cache-dtype", default="bf16", type=lambda s: s.split(","), help="e.g. bf16,turbo4,turbo3")
    p.add_argument("--kv-key-offset", default=DEFAULT_KV_KEY_OFFSET, type=lambda s: s.split(","),
                   help="turbo K offsets to compare, e.g. partial,fixed,turned (the engine's default pair count)")
    p.add_argument("--kv-recent-window", default=str(DEFAULT_KV_RECENT_WINDOW),
                   type=lambda s: [int(x) for x in s.split(",")], help="turbo recent windows to compare, e.g. 0,128 (kernels/turbo/recent.py)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--doc", type=Path, default=BENCHMARKS_DOC, help="markdown file to record into")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="the engine reads every step's tokens back before launching the next")
    p.add_argument("--gemv-configs", type=Path, help="JSON of one-row skinny-matmul configurations to use "
                   "(bench/dense_gpu_check.py --write-gemv-configs), added to server/kernels/gemv.py MEASURED_M1")
    args = p.parse_args(argv)
    if args.gemv_configs:
        from server.kernels import gemv

        for key, cfg in json.loads(args.gemv_configs.read_text()).items():  # "N,K,fused 0/1": [BLOCK_N, BLOCK_K, STAGES]
            n, k, fused = map(int, key.split(","))
            gemv.MEASURED_M1[(n, k, bool(fused))] = tuple(cfg)
        print(f"skinny matmul M=1 configurations: {gemv.MEASURED_M1}", flush=True)
    device = torch.device(args.device)
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 30 if device.type == "cuda" else 1 << 24)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    lines = [
        "| shape | case | turboserve | transformers generate (static cache, compiled) | ratio | weight streaming |",
        "|---|---|---:|---:|---:|---|",
    ]
    shapes = [s for s in args.shapes.split(",") if s]
    ours = {name: bench_shape(name, args, device) for name in shapes}
    # transformers only after every engine run: torch.compile leaves its compile workers and CUDA-graph pools
    # in this process (measured 2026-11-30: SmolLM2 b32 25,554 tok/s after the 8B's compiled generate, 29,849 without).
    hf = {name: {b: transformers_tokens_per_s(SHAPES[name], device, b, args.prompt_len, args.new_tokens)
                 for b in args.batch_sizes} if args.transformers else {} for name in shapes}  # fmt: skip
    for name in shapes:
        lines += shape_rows(name, ours[name], hf[name], args, copy_gbs)
    if args.context_depth:
        bench_depths(args, device, lines)
    if args.arrivals:
        bench_arrivals(args, device, lines)
    dtype_name = str(args.dtype).removeprefix("torch.")
    block = (
        f"{dated_heading(f'Engine throughput, random {dtype_name} weights')}\n\n"
        f"- Command: `{command_line('bench/e2e.py', argv)}`\n"
        f"- Hardware: {environment_line(device)}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)\n"
        + (f"- Decode: {args.prompt_len}-token prompts, {args.new_tokens} greedy tokens, timed after every first "
           f"token; prefill: one prompt in one step. Weight-streaming limit = weight bytes per step / copy "
           f"bandwidth.\n" if shapes else "")
        + (f"- Depth rows: batch 1, one prompt of the given depth, {DEPTH_NEW_TOKENS} greedy tokens timed after the "
           f"first; its prefill row: the prompt's tokens over the time to its first token (chunks of "
           f"{args.depth_chunk} tokens).\n" if args.context_depth else "")
        + (f"- Arrival rows: prompts arrive one at a time while the running requests decode; medians over "
           f"{ARRIVALS - 1} arrivals (after one that compiles) of the prompt's time to first token (chunks of "
           f"{args.depth_chunk} tokens), the running requests' longest wait between two tokens, and their tokens/s "
           f"meanwhile.\n" if args.arrivals else "")
        + f"- Async scheduling {'on' if args.async_scheduling else 'off (--no-async-scheduling)'}.\n"
        + (f"- One-row skinny-matmul configurations (N, K, fused) -> (BLOCK_N, BLOCK_K, STAGES) from "
           f"{args.gemv_configs.name}: {gemv.MEASURED_M1}\n" if args.gemv_configs else "")
        + "\n"
        + "\n".join(lines) + "\n"
    )  # fmt: skip
    print(block)
    if not args.no_record:
        record(block, args.doc, SECTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
