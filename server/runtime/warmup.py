"""Start-up warm-up: run once, before the server listens, the kinds of step its first clients would meet.

CUDA graph capture compiles the decode kernels, but prompt chunks and mixed steps (chunks beside decode rows) run
eagerly, and their Triton kernels compile at first use, one specialization at a time. Measured on an H200 with a
fresh turbo3 server (docs/BENCHMARKS.md, "End-to-end serving over HTTP"), four steps of its first requests took
2.5-10 s each: its first clients waited up to 10 s for their first token, which also trips the TTFT alert of
deploy/alerts.yml. The warm-up's requests are the engine's own: the request metrics leave them out (the step
metrics count their steps, which ran).
"""

from __future__ import annotations

import logging
import random
import threading
import time

from server.runtime.sequence import SamplingParams

log = logging.getLogger(__name__)

LEAD_TOKENS = 64  # the first request decodes this long, so the arrivals' chunks run beside its decode row
ARRIVAL_TOKENS = 4
# Prompt lengths that arrive while the first request decodes: a chunk that is not a multiple of 16, one that is,
# and a single token, so the steps' integer arguments meet Triton's specializations (== 1, % 16 == 0, neither).
ARRIVAL_LENGTHS = (300, 16, 1)
BURST = (100, 100, 100, 100)  # several prompts in one step, nothing decoding
WAIT_S = 600.0


def warm_up(engine) -> float:
    """Run the warm-up requests through ``engine`` (its loop started) and return the seconds they took. A request
    that fails is logged, not raised: the server starts, and a client meeting the same fault gets its error."""
    started = time.perf_counter()
    rng = random.Random(0)
    vocab, chunk = engine.model_config.vocab_size, engine.config.max_num_batched_tokens
    # Two chunks where the model's length allows: the second attends over a cached prefix.
    longest = max(1, min(chunk + 37, engine.max_model_len - LEAD_TOKENS))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    lead = _submit(engine, "lead", prompt(longest), SamplingParams(max_tokens=LEAD_TOKENS, temperature=0.0,
                                                                   ignore_eos=True))  # fmt: skip
    _wait(engine, lead, until=lambda p: p.first_token)
    sampled = SamplingParams(max_tokens=ARRIVAL_TOKENS, temperature=0.8, top_p=0.9, top_k=50,
                             repetition_penalty=1.1, ignore_eos=True, seed=0)  # fmt: skip
    greedy = SamplingParams(max_tokens=ARRIVAL_TOKENS, temperature=0.0, ignore_eos=True)
    arrivals = [_submit(engine, f"arrival-{n}", prompt(min(n, longest)), sampled if i == 0 else greedy)
                for i, n in enumerate(ARRIVAL_LENGTHS)]  # fmt: skip
    _wait(engine, lead, *arrivals)
    _wait(engine, *(_submit(engine, f"burst-{i}", prompt(min(n, longest)), greedy) for i, n in enumerate(BURST)))
    return time.perf_counter() - started


class _Pending:
    def __init__(self, name: str):
        self.name = name
        self.first_token, self.done = threading.Event(), threading.Event()
        self.error: str | None = None

    def on_output(self, out) -> None:
        self.first_token.set()
        if out.finished:
            self.error = out.error if out.finish_reason == "error" else None
            self.done.set()


def _submit(engine, name: str, prompt: list[int], params: SamplingParams) -> _Pending:
    pending = _Pending(name)
    engine.submit(f"warm-up-{name}", prompt, params, pending.on_output, recorded=False)
    return pending


def _wait(engine, *pending: _Pending, until=lambda p: p.done) -> None:
    """Wait for each request's event (its end by default), as long as the engine loop lives and WAIT_S allows."""
    deadline = time.monotonic() + WAIT_S
    for p in pending:
        while not until(p).wait(1.0):
            if not engine.is_alive():
                return
            if time.monotonic() > deadline:
                log.warning("warm-up request %s did not finish within %.0f s", p.name, WAIT_S)
                return
        if p.error:
            log.warning("warm-up request %s failed: %s", p.name, p.error)
