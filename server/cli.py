"""`turboserve serve | perplexity | quantize | bench ...` (also `python -m server ...`).

Each subcommand that lives elsewhere is wired through a hook in its own module, so its owner
adds its flags in its own file:

    def register(subparsers) -> None:
        p = subparsers.add_parser("perplexity", help="...")
        add_engine_args(p)            # from server.cli: the model/device/KV flags shared with serve
        p.add_argument(...)
        p.set_defaults(func=main)     # main(args) -> int | None (exit code)

`bench` groups its own subcommands (`turboserve bench serve`); server.tools.bench_serve's
register() receives the bench group's subparsers. Every flag defined through `add_argument`
below also reads its default from the environment as TURBOSERVE_<FLAG> (deployment images
configure the server that way); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys

from server.config import (
    DEFAULT_KV_KEY_OFFSET, DEFAULT_KV_RECENT_WINDOW, KV_CACHE_DTYPES, KV_KEY_OFFSETS, MODEL_DTYPES, EngineConfig,
    ServerConfig,
)  # fmt: skip

# (subcommand, module that defines it, the parsers its register() receives)
EXTERNAL_COMMANDS = (
    ("perplexity", "server.tools.perplexity", "top"),
    ("quantize", "server.tools.quantize", "top"),
    ("serve", "server.tools.bench_serve", "bench"),
)

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5GB' or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and match.group(2).upper()
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number with an optional unit, e.g. 2GiB, 512MiB, 1GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}: expected 1/0, true/false, yes/no")


def env_name(flag: str) -> str:
    return "TURBOSERVE_" + flag.lstrip("-").upper().replace("-", "_")


def parse_origins(text: str) -> tuple[str, ...]:
    """'https://a.example, https://b.example' -> the origins; '*' alone allows any; '' none."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and "/" not in origin.split("://", 1)[1]):
            raise argparse.ArgumentTypeError(f"{origin!r} is not a web origin: expected scheme://host[:port] "
                                             "(e.g. https://chat.example.com) or *")
    if "*" in origins and len(origins) > 1:
        raise argparse.ArgumentTypeError("'*' allows every origin; give it alone")
    return origins


def add_argument(parser: argparse.ArgumentParser, flag: str, **kwargs) -> None:
    """parser.add_argument whose default may come from TURBOSERVE_<FLAG>."""
    env = os.environ.get(env_name(flag))
    if kwargs.get("action") in ("store_true", "store_false"):  # the env var, like the flag, says "on"
        on = parse_bool(env) if env is not None else False
        kwargs["default"] = on if kwargs["action"] == "store_true" else not on
    elif env is not None:
        if "choices" in kwargs and env not in kwargs["choices"]:
            parser.error(f"{env_name(flag)}={env!r}: expected one of {', '.join(kwargs['choices'])}")
        kwargs["default"] = env  # argparse applies `type` to string defaults
    kwargs["help"] = f"{kwargs.get('help', '')} [env {env_name(flag)}]".strip()
    parser.add_argument(flag, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that choose and size the model and its KV cache (serve, perplexity, ...)."""
    add_argument(parser, "--model", default=None,
                 help="GGUF file or Hugging Face model directory (default: the embedded SmolLM2)")
    add_argument(parser, "--served-model-name", default=None, help="name clients use (default: the model's)")
    add_argument(parser, "--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_argument(parser, "--dtype", default="auto", choices=MODEL_DTYPES, help="weights/activations dtype")
    add_argument(parser, "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV storage")
    add_argument(parser, "--kv-cache-dtype-k", default=None, choices=KV_CACHE_DTYPES,
                 help="K storage (default: --kv-cache-dtype)")
    add_argument(parser, "--kv-cache-dtype-v", default=None, choices=KV_CACHE_DTYPES,
                 help="V storage (default: --kv-cache-dtype)")
    add_argument(parser, "--kv-key-offset", default=DEFAULT_KV_KEY_OFFSET, choices=KV_KEY_OFFSETS,
                 help="what turbo K pages subtract: the mean key (fixed), the mean turned by RoPE to each key's "
                      "position (turned: better quality, slower decode attention), turned on only the "
                      "--kv-key-turned-pairs pairs that gain most and fixed on the rest (partial), nothing (none)")
    add_argument(parser, "--kv-key-turned-pairs", type=int, default=None,
                 help="with --kv-key-offset partial: RoPE pairs per KV head that turn, 1 .. head_dim / 2 "
                      "(default 8, or all of a smaller head's)")
    add_argument(parser, "--no-kv-balance", dest="kv_balance", action="store_false",
                 help="do not fold turbo K / V channel scales into the attention weights (they cut turbo's "
                      "quality loss at no cost per token; server/runtime/kv_balance.py)")
    add_argument(parser, "--kv-recent-window", type=int, default=DEFAULT_KV_RECENT_WINDOW,
                 help="turbo KV: each sequence's last N tokens are also kept unquantized and read exactly (a query "
                      "reads its N nearest keys exactly); 0 turns it off (server/kernels/turbo/recent.py)")
    add_argument(parser, "--kv-cache-memory", type=parse_size, default=None,
                 help="bytes for the KV page pool, e.g. 2GiB or 512MiB (default: a share of free memory)")
    add_argument(parser, "--page-size", type=int, default=16, help="tokens per KV page")
    add_argument(parser, "--max-model-len", type=int, default=None, help="prompt + completion tokens")
    add_argument(parser, "--max-num-seqs", type=int, default=64, help="sequences running at once")
    add_argument(parser, "--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    add_argument(parser, "--max-queue", type=int, default=256, help="waiting requests before 503")
    add_argument(parser, "--seed", type=int, default=0, help="base seed")
    add_argument(parser, "--enforce-eager", action="store_true", help="disable CUDA graphs")
    add_argument(parser, "--no-cpu-int4", dest="cpu_int4", action="store_false",
                 help="on a CPU, dequantize a GGUF's Q4_0/Q4_1 projections to the compute dtype instead of "
                      "multiplying the 4-bit blocks as stored (torch's int4 kernel, bf16 activations; prompt "
                      "chunks in bf16 where the CPU multiplies it natively)")
    add_argument(parser, "--cpu-prompt-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                 help="on a CPU, what prompt chunks' attention and 4-bit projections multiply in (inputs rounded, "
                      "float32 sums); auto: bfloat16 where the CPU multiplies it natively (AMX, AVX512-BF16)")
    add_argument(parser, "--cpu-logits-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                 help="on a CPU, what the LM head multiplies in; bfloat16 keeps a copy of the head (2 bytes a "
                      "weight) and halves what its GEMV reads a step; auto as --cpu-prompt-dtype")
    add_argument(parser, "--no-async-scheduling", dest="async_scheduling", action="store_false",
                 help="read each step's tokens back before launching the next (default: async on CUDA devices)")
    add_argument(parser, "--kernel-timing-sample-rate", type=float, default=0.01,
                 help="share of steps whose kernels are timed; 0 disables")
    add_argument(parser, "--log-level", default="info", choices=("debug", "info", "warning", "error"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=args.served_model_name, device=args.device, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, kv_cache_dtype_k=args.kv_cache_dtype_k,
        kv_cache_dtype_v=args.kv_cache_dtype_v, kv_cache_memory=args.kv_cache_memory, kv_key_offset=args.kv_key_offset,
        kv_key_turned_pairs=args.kv_key_turned_pairs, kv_balance=args.kv_balance,
        kv_recent_window=args.kv_recent_window,
        page_size=args.page_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_queue=args.max_queue, seed=args.seed,
        enforce_eager=args.enforce_eager, cpu_int4=args.cpu_int4,
        cpu_prompt_dtype=args.cpu_prompt_dtype, cpu_logits_dtype=args.cpu_logits_dtype,
        async_scheduling=None if args.async_scheduling else False,  # the flag only turns it off; default: by device
        kernel_timing_sample_rate=args.kernel_timing_sample_rate)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    add_engine_args(p)
    add_argument(p, "--host", default="127.0.0.1", help="address to listen on")
    add_argument(p, "--port", type=int, default=8000, help="port to listen on")
    add_argument(p, "--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    add_argument(p, "--max-body-bytes", type=parse_size, default=4 * 2**20, help="largest request body")
    add_argument(p, "--allowed-origins", type=parse_origins, default="",
                 help="comma-separated web origins whose pages may call the API (CORS), e.g. "
                      "https://chat.example.com, or * for any; default none")
    p.set_defaults(func=serve)


def _not_available(name: str, module: str, reason: str):
    def run(args: argparse.Namespace) -> int:
        print(f"turboserve: '{name}' is not available yet ({module}: {reason})", file=sys.stderr)
        return 2
    return run


def _register_external(name: str, module: str, subparsers) -> None:
    try:
        importlib.import_module(module).register(subparsers)
    except (ImportError, AttributeError) as exc:
        # Only a missing module or hook makes a placeholder; errors inside the owner's code surface.
        missing = getattr(exc, "name", None)
        if isinstance(exc, ImportError) and missing and not (module + ".").startswith(missing + "."):
            raise
        p = subparsers.add_parser(name, help="not available yet", add_help=False)
        p.set_defaults(func=_not_available(name, module, str(exc)), ignores_flags=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turboserve", description="OpenAI-compatible LLM server")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register_serve(commands)
    bench = commands.add_parser("bench", help="benchmarks against a running server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name, module, where in EXTERNAL_COMMANDS:
        _register_external(name, module, commands if where == "top" else bench_commands)
    return parser


def serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    from server.api.server import run_server  # heavy imports (torch) only for this command

    server_config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level,
                                 max_body_bytes=args.max_body_bytes, allowed_origins=args.allowed_origins)
    return run_server(engine_config_from_args(args), server_config)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "ignores_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args) or 0
