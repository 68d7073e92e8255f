"""Request state: what a client asked for (SamplingParams) and how far it has come (Sequence)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from server.runtime.block_table import BlockTable

# The sampler works in float32: logits divided by a temperature below ~1e-37 overflow to inf (NaN
# probabilities), so, as vLLM does, a temperature below 1e-5 samples greedily.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: until this many tokens, end-of-sequence and stop ids are never sampled
    temperature: float = 1.0  # 0 (anything below GREEDY_BELOW) -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 -> off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # same seed -> same tokens whatever else is batched
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob + top-k alternatives
    prompt_logprobs: bool = False  # logprob of each prompt token given its prefix
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Sampling depends on the tokens generated so far (their counts), not only on the logits."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first field outside its range (RequestRejected wraps it)."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens,
             f"must be in [0, max_tokens] (max_tokens is {self.max_tokens} here)"),
            ("temperature", self.temperature >= 0.0, "must be >= 0 (0 means greedy)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 or 0 (off) or a positive count"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be > 0 (1 means off)"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {why}", name)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first, len == params.logprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request inside the engine.

    ``num_computed_tokens`` counts the leading tokens of ``token_ids`` whose K/V sit in the
    sequence's pages. Preemption drops the pages and resets it to 0: the sequence recomputes
    prompt + generated tokens and then carries on. Sampling noise depends only on
    (seed, number of generated tokens), so the resumed sequence draws exactly what it
    would have drawn.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        on_output: Callable | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, appended as we go
        self.params = params
        self.seed = seed
        self.on_output = on_output
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable()
        self.recent_row: int | None = None  # its row of a turbo cache's recent window (kv_cache.py)
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None  # set when it ends; its final output may follow a step later
        self.final_output_sent = False
        self.error: str | None = None
        self.logprobs: list[TokenLogprob] = []  # not yet sent to the client
        self.prompt_logprobs: list[float | None] | None = [None] if params.prompt_logprobs else None
        self.prompt_logprobs_sent = False
        self.detokenizer = None  # set by the engine (it owns the tokenizer)
        self.stop_ids: frozenset[int] = frozenset()  # token ids that end it (the engine knows its EOS ids)
        self.timeline = None  # server.metrics RequestTimeline, set by the engine

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
