"""`turboserve perplexity`: perplexity of a text through the serving engine and its KV cache.

The text goes through ``Engine.generate`` with ``prompt_logprobs``, i.e. the very model, KV
store (bf16 or turbo) and attention kernels the server uses, so a compressed cache is measured,
not bypassed. The windowing and the error bar follow llama.cpp's ``llama-perplexity``, so our
numbers can be set beside theirs: the token stream is cut into non-overlapping windows of
``ctx`` tokens, and each window scores only the tokens of its second half (positions
``ctx//2 + 1 .. ctx-1``), which always see at least ``ctx/2`` tokens of context.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.runtime.engine import Engine


class PerplexityError(ValueError):
    """The run cannot be done as asked; the message says what to change."""


@dataclass
class PerplexityResult:
    ppl: float
    ppl_error: float  # llama.cpp's standard error of the mean NLL, carried through exp
    chunk_ppls: list[float]
    ctx: int
    n_chunks: int
    n_scored_tokens: int
    n_text_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def split_windows(token_ids: list[int], ctx: int, max_chunks: int | None, bos_token_id: int | None) -> list[list[int]]:
    """Non-overlapping windows of ``ctx`` tokens; the tail shorter than a window is dropped.

    A model that expects BOS gets it as the first token of every window (llama.cpp overwrites
    the window's first token the same way), so each window starts as a fresh document.
    """
    if ctx < 4:
        raise PerplexityError(f"--ctx must be at least 4 tokens (half of it is context, half scored); got {ctx}")
    if max_chunks is not None and max_chunks < 1:
        raise PerplexityError(f"--chunks must be a positive number of windows; got {max_chunks}")
    available = len(token_ids) // ctx
    if available == 0:
        raise PerplexityError(
            f"the text has {len(token_ids)} tokens, shorter than one window of --ctx {ctx} tokens; "
            f"give a longer file or a smaller --ctx"
        )
    n = available if max_chunks is None else min(available, max_chunks)
    windows = [list(token_ids[i * ctx : (i + 1) * ctx]) for i in range(n)]
    if bos_token_id is not None:
        for window in windows:
            window[0] = bos_token_id
    return windows


def text_windows(tokenizer, text: str, ctx: int, max_chunks: int | None) -> tuple[list[list[int]], int]:
    """(split_windows of the text's tokens, how many tokens the text has): a tokenizer that adds BOS gets it
    at the head of every window instead of once at the head of the text."""
    token_ids = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and len(token_ids) > 0 and token_ids[0] == bos
    stream = token_ids[1:] if adds_bos else token_ids
    return split_windows(stream, ctx, max_chunks, bos if adds_bos else None), len(stream)


def scored_nlls(prompt_logprobs: list[float | None], ctx: int) -> list[float]:
    """Negative log-likelihoods of the scored (second-half) tokens of one window."""
    if len(prompt_logprobs) != ctx:
        raise RuntimeError(f"engine returned {len(prompt_logprobs)} prompt logprobs for a window of {ctx} tokens")
    scored = prompt_logprobs[ctx // 2 + 1 :]
    if any(lp is None for lp in scored):
        raise RuntimeError("engine returned no logprob for a scored prompt position")
    return [-lp for lp in scored]


def summarize(chunk_nlls: list[list[float]], ctx: int, n_text_tokens: int) -> PerplexityResult:
    """Perplexity over all scored tokens with llama.cpp's uncertainty.

    With v the per-token NLLs (n of them): PPL = exp(mean v), and the error is
    PPL * sqrt(var(v) / (n - 1)) with var the population variance, i.e. the standard error of
    the mean NLL propagated through exp to first order (llama.cpp perplexity.cpp, final estimate).
    """
    values = [v for nlls in chunk_nlls for v in nlls]
    n = len(values)
    mean = math.fsum(values) / n
    variance = max(0.0, math.fsum(v * v for v in values) / n - mean * mean)
    ppl = math.exp(mean)
    error = ppl * math.sqrt(variance / (n - 1)) if n > 1 else float("nan")
    chunk_ppls = [math.exp(math.fsum(nlls) / len(nlls)) for nlls in chunk_nlls]
    return PerplexityResult(ppl, error, chunk_ppls, ctx, len(chunk_nlls), n, n_text_tokens)


def measure_perplexity(
    engine: Engine,
    text: str,
    ctx: int = 2048,
    max_chunks: int | None = None,
    verbose: bool = False,
) -> PerplexityResult:
    """Perplexity of ``text`` through ``engine``; ``verbose``: progress bar and one line per window."""
    from tqdm import tqdm

    from server.runtime.engine import RequestRejected
    from server.runtime.sequence import SamplingParams

    # A request must also generate one token, so a window may use all but one position.
    if ctx > engine.max_model_len - 1:
        raise PerplexityError(
            f"--ctx {ctx} is above the context the engine serves ({engine.max_model_len} tokens, one of them kept "
            f"for the generated token); use --ctx {engine.max_model_len - 1} or less"
        )
    windows, n_text_tokens = text_windows(engine.tokenizer, text, ctx, max_chunks)
    # One generated token is required by the API; prompt_logprobs are the point of the call.
    params = SamplingParams(max_tokens=1, prompt_logprobs=True, ignore_eos=True)
    chunk_nlls: list[list[float]] = []
    bar = tqdm(total=len(windows), unit="window", file=sys.stderr, dynamic_ncols=True, disable=not verbose)
    for i, window in enumerate(windows):
        try:
            out = engine.generate(window, params)
        except RequestRejected as exc:
            raise PerplexityError(f"the engine refused a window of {ctx} tokens: {exc}") from exc
        if out.error or out.prompt_logprobs is None:
            reason = out.error or "no prompt logprobs"
            raise RuntimeError(f"window {i + 1}: engine failed ({out.finish_reason}): {reason}")
        chunk_nlls.append(scored_nlls(out.prompt_logprobs, ctx))
        if verbose:
            running = summarize(chunk_nlls, ctx, n_text_tokens).ppl
            chunk_ppl = math.exp(math.fsum(chunk_nlls[-1]) / len(chunk_nlls[-1]))
            bar.update(1)
            bar.set_postfix(ppl=f"{running:.3f}")
            line = f"[{i + 1}/{len(windows)}] chunk PPL {chunk_ppl:.4f}  running PPL {running:.4f}"
            bar.write(line, file=sys.stdout)
    bar.close()
    return summarize(chunk_nlls, ctx, n_text_tokens)


def format_final_line(result: PerplexityResult) -> str:
    return f"PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}"


def register(subparsers) -> None:
    """`turboserve perplexity`, with the model/device/KV flags shared with `serve`."""
    from server.cli import add_engine_args

    parser = subparsers.add_parser(
        "perplexity", help="perplexity of a text file through the serving engine and KV cache",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_engine_args(parser)
    parser.add_argument("--file", required=True, help="UTF-8 text to score (e.g. `python -m server.tools.corpus`)")
    parser.add_argument("--ctx", type=int, default=2048, help="tokens per window; the second half is scored")
    parser.add_argument("--chunks", type=int, default=None, help="score at most this many windows (default: all)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the result and run settings as JSON")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from server.cli import configure_logging, engine_config_from_args

    configure_logging(args.log_level)
    path = Path(args.file)
    if not path.is_file():
        print(f"error: --file {path}: no such file", file=sys.stderr)
        return 2
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        print(f"error: --file {path} is not UTF-8 text ({exc})", file=sys.stderr)
        return 2
    from server.runtime.engine import build_engine

    config = engine_config_from_args(args)
    try:
        engine = build_engine(config)
    except (ValueError, FileNotFoundError) as exc:  # bad flags or model path, as `serve` reports them
        print(f"error: cannot start: {exc}", file=sys.stderr)
        return 2
    try:
        result = measure_perplexity(engine, text, args.ctx, args.chunks, verbose=True)
    except PerplexityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    print(format_final_line(result))
    if args.json:
        record = {**result.to_dict(), "file": str(path), "model": engine.model_name, "engine_config": asdict(config)}
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0
