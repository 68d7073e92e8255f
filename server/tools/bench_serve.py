"""`turboserve bench serve`: a streaming load generator for any OpenAI-compatible endpoint.

Definitions follow vLLM's serving benchmark so numbers compare across servers:
TTFT is request start to first content chunk; ITL the gaps between consecutive content
chunks; TPOT (E2E - TTFT) / (output tokens - 1); E2E request start to the end of the stream.
Output tokens come from the server's streamed ``usage`` when it reports one, else one per
content chunk. Random prompts are token-id arrays (``prompt: [ids]``, part of the OpenAI
completions API), so ``--input-len`` is exact whatever the tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Random prompt ids avoid the low ids where tokenizers keep special and byte tokens, and stay
# below the smallest vocabulary we expect to meet (32k, Llama 2).
RANDOM_TOKEN_RANGE = (1000, 30000)
PERCENTILES = (50, 90, 99)


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    concurrency: int | None = None  # None: no cap
    request_rate: float = float("inf")  # requests/s, Poisson arrivals; inf: all at once
    input_len: int = 128
    output_len: int = 128
    prompts_file: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    progress: bool = True


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int | None = None  # from the server's usage, when reported
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    error: str | None = None


def build_prompts(cfg: BenchConfig) -> list[str | list[int]]:
    """``num_prompts`` prompts: lines of --prompts-file (shuffled, cycled) or random token ids."""
    rng = random.Random(cfg.seed)
    if cfg.prompts_file:
        path = Path(cfg.prompts_file)
        if not path.is_file():
            raise ValueError(f"--prompts-file {path}: no such file")
        pool = _read_prompts(path)
        if not pool:
            raise ValueError(f"--prompts-file {path}: contains no prompts (one per line, or JSONL with 'prompt')")
        rng.shuffle(pool)
        return [pool[i % len(pool)] for i in range(cfg.num_prompts)]
    lo, hi = RANDOM_TOKEN_RANGE
    return [[rng.randrange(lo, hi) for _ in range(cfg.input_len)] for _ in range(cfg.num_prompts)]


def _read_prompts(path: Path) -> list[str]:
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for n, line in enumerate(lines, 1):
        try:
            prompts.append(json.loads(line)["prompt"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' string ({exc})") from None
    return prompts


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps make a Poisson process of ``rate``."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]


async def _one_request(client, url: str, headers: dict, payload: dict) -> RequestResult:
    import httpx

    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {_error_message(body)}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {_error_message(data)}"
                    return result
                if event.get("usage"):
                    result.prompt_tokens = event["usage"].get("prompt_tokens")
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                if any(choice.get("text") for choice in event.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itls_s.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:300]


async def run_benchmark(cfg: BenchConfig) -> dict:
    """Send the prompts, wait for every stream, return the summary (also the --json content)."""
    import httpx
    from tqdm import tqdm

    prompts = build_prompts(cfg)
    delays = arrival_delays(len(prompts), cfg.request_rate, cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    url = cfg.base_url.rstrip("/") + "/completions"
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        model = cfg.model or await _first_model(client, cfg.base_url, headers)
        limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        bar = tqdm(total=len(prompts), unit="req", file=sys.stderr, disable=not cfg.progress)

        async def send(prompt) -> RequestResult:
            payload = {
                "model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True,  # vLLM-compatible extension: every request makes output_len tokens
            }  # fmt: skip
            if limit is None:
                result = await _one_request(client, url, headers, payload)
            else:
                async with limit:
                    result = await _one_request(client, url, headers, payload)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for prompt, delay in zip(prompts, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(cfg, model, results, duration)


async def _first_model(client, base_url: str, headers: dict) -> str:
    import httpx

    try:
        resp = await client.get(base_url.rstrip("/") + "/models", headers=headers)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {base_url} ({type(exc).__name__}: {exc}); is the server running?") from None
    if resp.status_code != 200 or not resp.json().get("data"):
        raise ValueError(f"--model not given and {base_url}/models did not list one (HTTP {resp.status_code})")
    return resp.json()["data"][0]["id"]


def _stats_ms(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values) * 1e3
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration_s: float) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.ttft_s]
    rate = cfg.request_rate if cfg.request_rate < float("inf") else "inf"  # JSON has no infinity
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "config": {**asdict(cfg), "model": model, "request_rate": rate},
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": _stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([x for r in done for x in r.itls_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in done]),
        "requests": [asdict(r) for r in results],
    }


def format_summary(summary: dict) -> str:
    def row(name: str, stats: dict) -> str:
        cells = [stats["mean"], *(stats[f"p{p}"] for p in PERCENTILES)]
        return f"{name:<10}" + "".join("         -" if c is None else f"{c:10.2f}" for c in cells)

    lines = [
        f"model {summary['config']['model']} at {summary['config']['base_url']}",
        f"requests: {summary['completed']} completed, {summary['failed']} failed in {summary['duration_s']:.2f} s",
        f"request throughput:      {summary['request_throughput']:.2f} req/s",
        f"output token throughput: {summary['output_token_throughput']:.2f} tok/s",
        f"total token throughput:  {summary['total_token_throughput']:.2f} tok/s",
        f"{'(ms)':<10}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES),
        row("TTFT", summary["ttft_ms"]),
        row("TPOT", summary["tpot_ms"]),
        row("ITL", summary["itl_ms"]),
        row("E2E", summary["e2e_ms"]),
    ]
    lines += [f"error x{count}: {message}" for message, count in summary["errors"].items()]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API root, ending in /v1")
    parser.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=_positive_int, default=100)
    parser.add_argument("--concurrency", type=_positive_int, help="most requests in flight (default: no cap)")
    parser.add_argument("--request-rate", type=_positive_float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: inf, all at once)")  # fmt: skip
    parser.add_argument("--input-len", type=_positive_int, default=128, help="tokens per random prompt")
    parser.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens of every request")
    parser.add_argument("--prompts-file", help="one prompt per line (.jsonl: objects with 'prompt') instead of random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=_positive_float, default=600.0,
                        help="seconds to wait for the server (to connect, or between response bytes)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the full result (summary and per-request data)")
    parser.add_argument("--no-progress", action="store_true")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def main(args: argparse.Namespace) -> int:
    cfg = BenchConfig(
        base_url=args.base_url, model=args.model, api_key=args.api_key, num_prompts=args.num_prompts,
        concurrency=args.concurrency, request_rate=args.request_rate, input_len=args.input_len,
        output_len=args.output_len, prompts_file=args.prompts_file, seed=args.seed, timeout_s=args.timeout,
        progress=not args.no_progress,
    )  # fmt: skip
    try:
        summary = asyncio.run(run_benchmark(cfg))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 1 if summary["completed"] == 0 else 0


def register(subparsers) -> None:
    """`turboserve bench serve`: server.cli hands us the `bench` group's subparsers."""
    parser = subparsers.add_parser("serve", help="load-test an OpenAI-compatible endpoint", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=main)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
