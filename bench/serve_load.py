"""The whole server under load over HTTP, per KV dtype side by side: `python bench/serve_load.py`.

    python bench/serve_load.py [--shape depth-2048] [--layers N] [--kv-cache-dtype bf16,turbo3]
        [--kv-cache-memory 4GiB] [--scenario NAME:CONCURRENCY:PROMPTS:INPUT:OUTPUT ...] [--device cuda] [--no-record]

bench/e2e.py times the Engine; this times what a client sees. It writes a random-weight Llama checkpoint of one of
e2e.py's shapes (safetensors and a word-level tokenizer, as a Hugging Face directory) to a temporary directory, then
per KV dtype starts `turboserve serve` on it with the same --kv-cache-memory, runs each scenario with `turboserve
bench serve`'s client (random token-id prompts, greedy, ignore_eos, streamed), and reads /metrics after each:
the preemptions the scenario caused, and the pages still owned once every request has finished (a leak shows
as a non-zero count, and fails the run). A KV budget smaller than the scenario's tokens is the point of the
"long" scenario: a compressed cache holds more sequences at once, so fewer are preempted and recomputed.
Records into docs/BENCHMARKS.md under "End-to-end serving over HTTP".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SHAPES  # noqa: E402
from bench.harness import BENCHMARKS_DOC, command_line, dated_heading, environment_line, record  # noqa: E402
from server.runtime.models.config import ModelConfig  # noqa: E402
from server.tools.bench_serve import RANDOM_TOKEN_RANGE, BenchConfig, run_benchmark  # noqa: E402

SECTION = "## End-to-end serving over HTTP"
SERVER_START_TIMEOUT_S = 900  # loading, the turbo calibration and CUDA graph capture


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    prompts: int
    input_len: int
    output_len: int

    @classmethod
    def parse(cls, text: str) -> Scenario:
        name, *numbers = text.split(":")
        if len(numbers) != 4 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise argparse.ArgumentTypeError(f"scenario must be NAME:CONCURRENCY:PROMPTS:INPUT:OUTPUT, got {text!r}")
        return cls(name, *map(int, numbers))


DEFAULT_SCENARIOS = (
    Scenario("one stream", 1, 8, 512, 256),
    Scenario("32 streams", 32, 64, 512, 256),
    Scenario("long", 32, 32, 4096, 256),
)


def write_random_checkpoint(path: str, cfg: ModelConfig, seed: int = 0) -> None:
    """A Hugging Face Llama directory of ``cfg``'s shape: random bf16 weights (std 0.02, as bench/e2e.py's models),
    config.json, and a word-level tokenizer whose token i reads 't<i>' (the bench sends ids, so text is only read
    back)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    g = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    h, d, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    tensors = {"model.embed_tokens.weight": weight(cfg.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = weight(cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": weight(cfg.num_heads * d, h),
            p + "self_attn.k_proj.weight": weight(cfg.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": weight(cfg.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": weight(h, cfg.num_heads * d),
            p + "mlp.gate_proj.weight": weight(ffn, h), p + "mlp.up_proj.weight": weight(ffn, h),
            p + "mlp.down_proj.weight": weight(h, ffn),
        }  # fmt: skip
    os.makedirs(path, exist_ok=True)
    bf16 = {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}
    save_file(bf16, os.path.join(path, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": d,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip
    Path(path, "config.json").write_text(json.dumps(config, indent=2))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    Path(path, "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def metric_total(exposition: str, name: str) -> float:
    """The sum over label sets of one sample name in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(exposition) for s in family.samples
               if s.name == name)  # fmt: skip


class Server:
    """`turboserve serve` in a child process, its log in ``log_path``; a context manager that waits for /health."""

    def __init__(self, model_dir: str, kv_dtype: str, args: argparse.Namespace, log_path: Path):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = [
            sys.executable, "-m", "server", "serve", "--model", model_dir, "--port", str(self.port),
            "--device", args.device, "--kv-cache-dtype", kv_dtype, "--kv-cache-memory", args.kv_cache_memory,
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), *args.serve_args,
        ]  # fmt: skip

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if _get(self.base + "/health")[0] == 200:
                    return self
            except OSError:
                pass  # not listening yet
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"the server did not answer /health within {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def metrics(self) -> str:
        status, body = _get(self.base + "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body

    def pool_line(self) -> str:
        """The start-up log's line describing the KV pool."""
        lines = self.log_path.read_text().splitlines()
        pool = (line[line.index("KV cache:"):].split("; max_model_len")[0] for line in lines if "KV cache:" in line)
        return next(pool, "(none logged)")


def run_scenario(server: Server, scenario: Scenario, seed: int) -> dict:
    """One scenario's summary from the client, plus the server's preemptions over it and its pages afterwards."""
    before = metric_total(server.metrics(), "turboserve_num_preemptions_total")
    cfg = BenchConfig(base_url=server.base + "/v1", num_prompts=scenario.prompts, concurrency=scenario.concurrency,
                      input_len=scenario.input_len, output_len=scenario.output_len, seed=seed, progress=False)
    summary = asyncio.run(run_benchmark(cfg))
    after = server.metrics()
    summary["preemptions"] = metric_total(after, "turboserve_num_preemptions_total") - before
    summary["pages_used_after"] = metric_total(after, "turboserve_kv_pages_used")
    summary["engine_alive"] = metric_total(after, "turboserve_engine_alive")
    return summary


def _ms(stats: dict, key: str) -> str:
    value = stats[key]
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table(results: list[tuple[str, Scenario, dict]]) -> str:
    lines = [
        "| KV | scenario | concurrency | prompts x in / out | req/s | out tok/s | TTFT mean / p99 (ms) "
        "| TPOT mean / p99 (ms) | E2E p50 / p99 (ms) | preemptions | pages owned after | failed |",
        "|---|---|---:|---|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for kv, sc, s in results:
        lines.append(
            f"| {kv} | {sc.name} | {sc.concurrency} | {sc.prompts} x {sc.input_len} / {sc.output_len} "
            f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:,.0f} "
            f"| {_ms(s['ttft_ms'], 'mean')} / {_ms(s['ttft_ms'], 'p99')} "
            f"| {_ms(s['tpot_ms'], 'mean')} / {_ms(s['tpot_ms'], 'p99')} "
            f"| {_ms(s['e2e_ms'], 'p50')} / {_ms(s['e2e_ms'], 'p99')} "
            f"| {s['preemptions']:.0f} | {s['pages_used_after']:.0f} | {s['failed']} |"
        )
    return "\n".join(lines)


def measure(args: argparse.Namespace, cfg: ModelConfig, scenarios: list[Scenario]
            ) -> tuple[list[tuple[str, Scenario, dict]], dict[str, str]]:  # fmt: skip
    """Every (KV dtype, scenario) summary, and each server's KV pool line; stops at the first leak or dead engine."""
    results, pools = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, f"random-{args.shape}")
        started = time.perf_counter()
        write_random_checkpoint(model_dir, cfg, args.seed)
        print(f"wrote {model_dir} in {time.perf_counter() - started:.1f} s", flush=True)
        for kv in args.kv_cache_dtype.split(","):
            started = time.perf_counter()
            with Server(model_dir, kv, args, Path(tmp, f"server-{kv}.log")) as server:
                pools[kv] = f"{server.pool_line()} (ready in {time.perf_counter() - started:.0f} s)"
                print(f"{kv}: {pools[kv]}", flush=True)
                for scenario in scenarios:
                    summary = run_scenario(server, scenario, args.seed)
                    results.append((kv, scenario, summary))
                    print(table(results[-1:]).splitlines()[-1], flush=True)
                    if summary["errors"]:
                        print(f"  errors: {summary['errors']}", flush=True)
                    if summary["pages_used_after"] or not summary["engine_alive"]:
                        raise RuntimeError(f"pages still owned {summary['pages_used_after']:.0f}, engine alive "
                                           f"{summary['engine_alive']:.0f}\n{server.log_tail()}")  # fmt: skip
                if args.keep_dir:  # the server's own view: step and kernel time histograms, its log
                    os.makedirs(args.keep_dir, exist_ok=True)
                    Path(args.keep_dir, f"metrics-{kv}.txt").write_text(server.metrics())
                    shutil.copy(server.log_path, Path(args.keep_dir, f"server-{kv}.log"))
    return results, pools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="depth-2048", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="fewer layers than the shape has (a quick run on a CPU)")
    parser.add_argument("--kv-cache-dtype", default="bf16,turbo3", help="comma-separated, one server each")
    parser.add_argument("--kv-cache-memory", default="4GiB", help="the same KV budget for every server")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--scenario", action="append", type=Scenario.parse,
                        help="NAME:CONCURRENCY:PROMPTS:INPUT:OUTPUT, repeatable (default: DEFAULT_SCENARIOS)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--serve-args", default="", help="more `turboserve serve` flags, one string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-dir", help="write each server's final /metrics and its log here")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    args.serve_args = args.serve_args.split()
    scenarios = args.scenario or list(DEFAULT_SCENARIOS)
    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    if cfg.vocab_size <= RANDOM_TOKEN_RANGE[1]:
        parser.error(f"shape {args.shape} has {cfg.vocab_size} tokens; the client's random prompts use ids up to "
                     f"{RANDOM_TOKEN_RANGE[1]}")  # fmt: skip
    results, pools = measure(args, cfg, scenarios)
    device = torch.device(args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu")
    flags = " ".join([f"--max-model-len {args.max_model_len} --max-num-seqs {args.max_num_seqs}", *args.serve_args])
    block = "\n".join([
        dated_heading(f"Serving over HTTP, random-weight {args.shape} Llama, KV {args.kv_cache_dtype} at "
                      f"{args.kv_cache_memory}"),
        "",
        f"- Command: `{command_line('bench/serve_load.py', argv)}`",
        f"- Hardware: {environment_line(device)}",
        f"- Model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV "
        f"heads (head_dim {cfg.head_dim}), FFN {cfg.intermediate_size}, vocab {cfg.vocab_size}; server flags `{flags}`",
        *(f"- {kv} pool: {line}" for kv, line in pools.items()),
        "- Client: `turboserve bench serve`'s (random token-id prompts, greedy, ignore_eos, streamed with usage); "
        "preemptions and pages owned after each scenario from the server's /metrics.",
        "",
        table(results),
        "",
    ])  # fmt: skip
    print(block)
    if not args.no_record:
        record(block, BENCHMARKS_DOC, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
