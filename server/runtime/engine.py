"""The engine: requests in, tokens out, one step loop in its own thread.

``submit`` validates in the caller's thread (a request that can never be served is
rejected at once) and hands the sequence to the loop; everything else (scheduling, the
model, sampling, detokenization, the ``on_output`` callbacks) happens in the loop's
thread, so the scheduler and the KV pool need no locks.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from server.config import DEFAULT_KV_KEY_OFFSET, EngineConfig
from server.kernels import backend, timing
from server.metrics import EngineMetrics
from server.metrics.requests import UnrecordedTimeline
from server.runtime.detokenizer import IncrementalDetokenizer
from server.runtime.kv_cache import (
    TURBO_KV_KINDS, KVCache, KVLayout, bits_per_value, bytes_per_token, default_budget_bytes, resolve_kv_kinds,
)  # fmt: skip
from server.runtime.kv_calibration import balance_label, calibrate_turbo_kv, turned_pairs
from server.runtime.model_runner import ChunkResult, LaunchedStep, ModelRunner
from server.runtime.scheduler import ScheduledChunk, Scheduler
from server.runtime.sequence import SamplingParams, Sequence, TokenLogprob

if TYPE_CHECKING:
    from server.runtime.models.loader import LoadedModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Steps after one that found the host slower than the device (step()) before an eager step is launched ahead again.
EAGER_AHEAD_PAUSE_STEPS = 64


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # new tokens since the previous output of this request
    text: str  # new text since the previous output (see detokenizer.py for what is held back)
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[float | None] | None  # only on the first output, when asked
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    error: str | None
    num_prompt_tokens: int
    num_generated_tokens: int


class RequestRejected(ValueError):
    """The request can never be served as asked (too long, bad parameter); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (max_queue); try again later."""


class EngineNotRunning(RuntimeError):
    """The engine loop is not running (shut down, never started, or died): it takes no requests."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available here; use --device cpu or auto")
    return device


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device. Triton and the NVRTC launcher launch on the current
    device's stream, and the current device is per thread: without this, an engine on cuda:1 would launch its
    kernels on cuda:0's stream."""
    if device.type == "cuda" and device.index is not None:  # plain "cuda" is every thread's default, device 0
        torch.cuda.set_device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_cpu_dtype(name: str, field: str, device: torch.device) -> torch.dtype:
    """EngineConfig's ``field`` (cpu_prompt_dtype, cpu_logits_dtype) as a dtype; float32 on other devices, which
    run those products in the model's dtype. auto: bfloat16 where the CPU multiplies it natively."""
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name != "auto" and name not in choices:
        raise ValueError(f"unknown {field} {name!r}; expected auto, float32 or bfloat16")
    if device.type != "cpu":
        return torch.float32
    if name == "auto":
        return torch.bfloat16 if backend.cpu_multiplies_bf16() else torch.float32
    return choices[name]


def _int64_seed(seed: int) -> int:
    """Any Python int as a signed 64-bit value (the sampler hashes all 64 bits)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """Load the model (or take ``loaded``, already on its device) and size the KV pool."""
        self.config = config
        owns_model = loaded is None  # a model handed in is not transformed irreversibly (its float weights dropped)
        if loaded is None:
            from server.runtime.models.loader import load_model

            self.device = resolve_device(config.device)
            use_device(self.device)
            dtype = resolve_dtype(config.dtype, self.device)
            loaded = load_model(config.model, self.device, dtype)
        else:  # already on its device, in its compute dtype (quantized weights may be integers)
            weight = next(p for p in loaded.model.parameters() if p.is_floating_point())
            self.device, dtype = weight.device, weight.dtype
            use_device(self.device)
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.model_name = config.served_model_name or loaded.name
        self.max_model_len = self._resolve_max_model_len(config.max_model_len)
        mc = self.model_config
        k_kind, v_kind = resolve_kv_kinds(config, dtype)
        key_pairs = turned_pairs(config.kv_key_offset, config.kv_key_turned_pairs, mc.head_dim)  # bad values fail here
        budget = config.kv_cache_memory if config.kv_cache_memory is not None else default_budget_bytes(self.device)
        layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = KVCache(layout, k_kind, v_kind, budget, config.page_size, self.device, dtype,
                                min(config.kv_recent_window, self.max_model_len), config.max_num_seqs)
        turbo = k_kind in TURBO_KV_KINDS  # a turbo V needs a turbo K (kv_cache.py)
        offset = turbo and config.kv_key_offset != "none"  # keys lose their shared direction first
        calibrate_turbo_kv(self.model, self.tokenizer, self.kv_cache.stores, mc.num_kv_heads, mc.head_dim,
                           self.device, dtype, self.max_model_len, key_pairs if offset else None,
                           config.kv_balance and turbo)
        prompt_dtype = resolve_cpu_dtype(config.cpu_prompt_dtype, "cpu_prompt_dtype", self.device)
        logits_dtype = resolve_cpu_dtype(config.cpu_logits_dtype, "cpu_logits_dtype", self.device)
        if self.device.type == "cpu":
            if copied := self.model.set_logits_dtype(logits_dtype):
                log.info("CPU: the LM head multiplies in %s (a %.0f MiB copy); --cpu-logits-dtype float32 keeps it "
                         "float32", str(logits_dtype).removeprefix("torch."), copied / 2**20)  # fmt: skip
        if self.device.type == "cpu" and config.cpu_int4 and owns_model:  # after the balance is folded
            self._use_int4_weights(loaded, prompt_dtype == torch.bfloat16)
        if turbo and self.device.type == "cpu":
            log.warning("%s KV on a CPU runs the torch reference: it holds %.1fx the tokens of bf16 KV, but decodes "
                        "several times slower (docs/BENCHMARKS.md, \"End to end\")", k_kind,
                        bytes_per_token(layout, "bf16", "bf16") / self.kv_cache.bytes_per_token)
        if not turbo and config.kv_key_offset != DEFAULT_KV_KEY_OFFSET:
            log.warning("--kv-key-offset %s ignored: it applies to turbo K caches, and K is stored as %s",
                        config.kv_key_offset, k_kind)
        self.scheduler = Scheduler(config, self.kv_cache)
        graph_batch = 0 if config.enforce_eager else config.max_num_seqs
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, self.max_model_len, graph_batch,
                                  prompt_dtype)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        self._seed_source = random.Random(config.seed)
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._requests: dict[str, Sequence] = {}  # live requests, submit() until finished
        # (seq, token, whether the token ended it, when it arrived): published during the next step
        self._unpublished: list[tuple[Sequence, int, bool, float]] = []
        self._in_flight: set[Sequence] = set()  # sequences of the steps whose kernels are running
        self._deferred_release: list[Sequence] = []  # ended while in flight: pages return after it
        # (chunks, launched step, launch failure) of a step launched ahead (async scheduling)
        self._ahead: tuple[list[ScheduledChunk], LaunchedStep | None, Exception | None] | None = None
        self._async = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        self._steps = 0
        self._eager_ahead_from = 0  # the step count from which eager steps may be launched ahead again
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.metrics = EngineMetrics(self.model_name)
        self._report_setup(loaded, layout, key_pairs)
        timing.set_sample_rate(config.kernel_timing_sample_rate)
        log.info(
            "loaded %s (%s) on %s as %s; %s; %s; max_model_len %d",
            self.model_name, loaded.path, self.device, dtype, backend.describe(self.device),
            self.kv_cache.describe(), self.max_model_len,
        )  # fmt: skip

    @staticmethod
    def _use_int4_weights(loaded: LoadedModel, bf16_prompts: bool) -> None:
        from server.kernels import int4_cpu
        from server.runtime.models.int4_weights import use_int4_weights

        if not int4_cpu.supported():
            log.info("CPU: this torch has no int4 kernel (torch >= 2.6); 4-bit weights are dequantized")
            return
        mlps, attentions = use_int4_weights(loaded.model, loaded.raw_weights, bf16_prompts)
        if mlps or attentions:
            log.info("CPU: %d MLPs and %d attentions multiply their 4-bit blocks as stored (bf16 activations), "
                     "prompt chunks in %s; --no-cpu-int4 dequantizes them to the compute dtype", mlps, attentions,
                     "bf16" if bf16_prompts else "float32")  # fmt: skip

    def _report_setup(self, loaded: LoadedModel, layout: KVLayout, key_pairs: int) -> None:
        kv = self.kv_cache
        self.metrics.kv.on_pool(
            num_pages=kv.num_pages, page_size=kv.page_size, bytes_per_token=kv.bytes_per_token,
            k_dtype=kv.k_kind, v_dtype=kv.v_kind, k_bits=bits_per_value(kv.k_kind), v_bits=bits_per_value(kv.v_kind),
            bf16_bytes_per_token=bytes_per_token(layout, "bf16", "bf16"), recent_window=kv.recent_window,
            recent_window_bytes=kv.recent_bytes,
        )  # fmt: skip
        in_memory = {str(p.dtype).removeprefix("torch.") for p in self.model.parameters()}
        if any(getattr(m, "int4", None) is not None for m in self.model.modules()):
            in_memory.add("int4")  # 4-bit blocks multiplied as stored (int4_weights.py)
        in_file = {raw.ggml_type.name for raw in loaded.raw_weights.values()}
        turbo_k = kv.k_kind in TURBO_KV_KINDS
        self.metrics.process.on_start(
            device=str(self.device), kv_cache_dtype_k=kv.k_kind, kv_cache_dtype_v=kv.v_kind,
            kv_key_offset=self.config.kv_key_offset if turbo_k else "none",
            kv_key_turned_pairs=key_pairs if turbo_k else 0, kv_balance=balance_label(self.model),
            weight_formats=",".join(sorted(in_memory | in_file)), kernels=backend.describe(self.device),
        )  # fmt: skip
        self.metrics.process.watch_engine(self.is_alive)
        self.metrics.process.on_cuda_graphs(len(self.runner.graphs.graphs) if self.runner.graphs else 0)

    def _resolve_max_model_len(self, asked: int | None) -> int:
        limit = self.model_config.max_position_embeddings
        if asked is None:
            return limit
        if not 1 <= asked <= limit:
            raise ValueError(f"max_model_len={asked} must be between 1 and the model's context length {limit}")
        return asked

    # -- public API (any thread) ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="turboserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.metrics.process.on_shutdown()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        recorded: bool = True,
    ) -> None:
        """Queue a request; ``on_output`` gets its tokens (from the engine loop's thread). ``recorded=False``: the
        engine's own request (warmup.py), left out of the request metrics."""
        try:
            self._admit(request_id, prompt_token_ids, params, on_output, recorded)
        except RequestRejected:
            self.metrics.requests.on_failure("bad_request")
            raise
        except EngineOverloaded:
            self.metrics.requests.on_failure("overloaded")
            raise

    def _admit(self, request_id, prompt_token_ids, params, on_output, recorded) -> None:
        self._validate(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(request_id, prompt_token_ids, params, _int64_seed(seed), on_output)
        seq.timeline = self.metrics.requests.timeline() if recorded else UnrecordedTimeline()
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, params.stop, params.include_stop_str_in_output, params.min_tokens
        )
        with self._cond:
            if self._stopping or not self.is_alive():
                raise EngineNotRunning("the engine is not running (it was shut down, never started, or its loop died)")
            if request_id in self._requests:
                raise RequestRejected(f"request id {request_id!r} is already in use", param="request_id")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.config.max_queue:
                raise EngineOverloaded(
                    f"{self.config.max_queue} requests are already waiting (max_queue); retry shortly"
                )
            self._requests[request_id] = seq
            self._inbox.append(seq)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify()

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Run one request to completion (starting the loop if needed) and return all of it at once."""
        self.start()
        parts: list[RequestOutput] = []
        done = threading.Event()

        def collect(out: RequestOutput) -> None:
            parts.append(out)
            if out.finished:
                done.set()

        self.submit(f"generate-{uuid.uuid4().hex}", prompt_token_ids, params, collect)
        while not done.wait(timeout=1.0):
            if not self.is_alive():
                raise RuntimeError("the engine loop stopped before the request finished")
        last = parts[-1]
        return RequestOutput(
            request_id=last.request_id,
            token_ids=[t for p in parts for t in p.token_ids],
            text="".join(p.text for p in parts),
            logprobs=None if params.logprobs is None else [lp for p in parts for lp in p.logprobs or []],
            prompt_logprobs=parts[0].prompt_logprobs,
            finished=True,
            finish_reason=last.finish_reason,
            error=last.error,
            num_prompt_tokens=last.num_prompt_tokens,
            num_generated_tokens=last.num_generated_tokens,
        )

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise RequestRejected("the prompt is empty; send at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt")
        try:
            params.validate()
        except ValueError as exc:
            raise RequestRejected(exc.args[0], param=exc.args[1]) from None
        if params.logprobs is not None and params.logprobs > vocab:
            raise RequestRejected(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}", "logprobs")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, but {total} were requested "
                f"({len(prompt)} in the prompt, {params.max_tokens} to generate); "
                "shorten the prompt or lower max_tokens",
                param="max_tokens" if len(prompt) < self.max_model_len else "prompt",
                code="context_length_exceeded",
            )
        pages = self.kv_cache.pages_for(total)
        if pages > self.kv_cache.num_pages:
            raise RequestRejected(
                f"{total} tokens need {pages} KV pages but the whole pool has {self.kv_cache.num_pages} "
                f"({self.kv_cache.tokens_that_fit} tokens); lower max_tokens or start the server with more "
                "--kv-cache-memory",
                param="max_tokens",
                code="kv_cache_too_small",
            )

    # -- the loop (engine thread only) ------------------------------------------------------
    def _loop(self) -> None:
        use_device(self.device)
        while True:
            with self._cond:
                while not (
                    self._stopping or self._inbox or self._aborts or self._unpublished or self.scheduler.has_work()
                ):
                    self._cond.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for seq in inbox:
                self.scheduler.add(seq)
            if aborts:
                self._publish()  # tokens already produced go out before the abort
            for request_id in aborts:
                if request_id in self._requests:
                    self._finish(self._requests[request_id], "abort")
            try:
                self.step()
            except Exception as exc:  # a bug outside the model call: fail everyone rather than spin
                log.exception("engine step failed outside the model; failing all live requests")
                self._ahead = None
                self._release_deferred()
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(seq, "error", error=f"internal engine error: {exc!r}")
        self._publish()
        self._ahead = None  # never collected: nothing reuses its pages after the loop
        self._release_deferred()
        with self._cond:
            live = list(self._requests.values())
        for seq in live:
            self._finish(seq, "abort")

    def step(self) -> None:
        """One step: launch it (or take the one launched ahead), launch the next step ahead
        when the scheduler can tell it already (async scheduling: the device goes on while the
        host reads tokens back and schedules), publish the previous step's outputs while the
        device works (detokenization and callbacks are host work that would otherwise leave it
        idle), then take this step's tokens. Where no device runs behind the host (a CPU), the
        launch is the computation: the previous step's outputs go out before it."""
        timing.begin_step()
        if self.device.type != "cuda":
            self._publish()
        started, preemptions = time.monotonic(), self.scheduler.num_preemptions
        if self._ahead is not None:
            (chunks, launched, failure), self._ahead = self._ahead, None
        else:
            chunks = self.scheduler.schedule()
            launched, failure = self._launch(chunks, started)
        self._in_flight = {chunk.seq for chunk in chunks}
        self._steps += 1
        # Read without the lock: a request or abort arriving just now waits one step more, no harm.
        if launched is not None and self._async and not (self._inbox or self._aborts):
            self._launch_ahead(chunks, launched, started)
        self._publish()
        if chunks:
            results = self._collect(chunks, launched, failure)
            self._release_deferred(still_in_flight=[] if self._ahead is None else self._ahead[0])
            arrived = time.monotonic()
            for chunk, result in zip(chunks, results):
                try:
                    self._advance(chunk, result, arrived)
                except Exception as exc:
                    log.exception("taking the result of %s failed", chunk.seq.request_id)
                    self._finish(chunk.seq, "error", error=f"post-processing failed: {exc!r}")
        if not self.scheduler.has_work():
            self._publish()  # no step follows to hide it behind
        self.metrics.on_step(
            seconds=time.monotonic() - started, cuda_graph=self.runner.used_cuda_graph,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_tokens=sum(c.num_tokens for c in chunks), num_preempted=self.scheduler.num_preemptions - preemptions,
            pages_used=self.kv_cache.num_used_pages,
        )  # fmt: skip

    def _launch_ahead(self, chunks: list[ScheduledChunk], launched: LaunchedStep, now: float) -> None:
        """Launch the step after ``launched`` now, if the scheduler can tell it already. An eager one (prompt
        chunks, or a batch no CUDA graph takes) costs the host milliseconds to queue; if the step in flight is
        done by then, the host bounds these steps, and queueing ahead only held back that step's tokens: eager
        steps then wait for their tokens for a while (EAGER_AHEAD_PAUSE_STEPS)."""
        eager_allowed = self._steps >= self._eager_ahead_from
        ahead = self.scheduler.schedule_ahead(chunks, prompts=eager_allowed)
        if not ahead:
            return
        self._ahead = (ahead, *self._launch(ahead, now, after=launched))
        if eager_allowed and not self.runner.used_cuda_graph and launched.finished_already():
            self._eager_ahead_from = self._steps + EAGER_AHEAD_PAUSE_STEPS

    def _launch(
        self, chunks: list[ScheduledChunk], now: float, after: LaunchedStep | None = None
    ) -> tuple[LaunchedStep | None, Exception | None]:
        for chunk in chunks:
            chunk.seq.timeline.on_scheduled(now)
        if not chunks:
            return None, None
        try:
            return self.runner.launch(chunks, after), None
        except Exception as exc:
            return None, exc

    def _collect(
        self, chunks: list[ScheduledChunk], launched: LaunchedStep | None, failure: Exception | None
    ) -> list[ChunkResult | Exception]:
        if failure is None:
            try:
                return self.runner.collect(launched)
            except Exception as exc:
                failure = exc
        # A step launched ahead took this step's tokens as input: drop it. Its ahead chunks
        # only wrote K/V past every sequence's known tokens, which a later step overwrites.
        self._ahead = None
        log.warning("step of %d sequences failed (%r); retrying each alone to find the culprit", len(chunks), failure)
        return [self._execute_alone(chunk) for chunk in chunks]

    def _execute_alone(self, chunk: ScheduledChunk) -> ChunkResult | Exception:
        # Safe to redo: a chunk writes only its own sequence's slots, with the same values.
        try:
            return self.runner.execute([chunk])[0]
        except Exception as exc:
            log.exception("sequence %s fails on its own", chunk.seq.request_id)
            return exc

    def _advance(self, chunk: ScheduledChunk, result: ChunkResult | Exception, arrived: float) -> None:
        """Take one chunk's result: the cheap part, so the next step can be scheduled at once."""
        seq, params = chunk.seq, chunk.seq.params
        if seq.finish_reason is not None:  # ended (a stop string) while this step ran
            return
        if isinstance(result, Exception):
            self._finish(seq, "error", error=f"model step failed: {result!r}")
            return
        seq.num_computed_tokens += chunk.num_tokens
        if result.prompt_logprobs is not None:
            seq.prompt_logprobs.extend(result.prompt_logprobs)
        if result.token is None:
            return
        token = result.token
        seq.append_token(token)
        if result.logprob is not None:
            seq.logprobs.append(result.logprob)
        by_token = token in seq.stop_ids  # never before min_tokens: the sampler masks them until then
        if by_token or seq.num_generated_tokens >= params.max_tokens:
            self._end(seq, "stop" if by_token else "length")
        self._unpublished.append((seq, token, by_token, arrived))

    def _publish(self) -> None:
        """Text, stop strings and outputs of the tokens the last step produced."""
        items, self._unpublished = self._unpublished, []
        for seq, token, by_token, arrived in items:
            if seq.final_output_sent:  # aborted or failed since; its final output went out
                continue
            try:
                seq.timeline.on_tokens(1, seq.num_prompt_tokens, now=arrived)
                self._publish_token(seq, token, by_token)
            except Exception as exc:
                log.exception("post-processing %s failed", seq.request_id)
                self._finish(seq, "error", error=f"post-processing failed: {exc!r}")

    def _publish_token(self, seq: Sequence, token: int, by_token: bool) -> None:
        detok = seq.detokenizer
        if by_token:
            text = detok.finish()  # the stop token's own text is not output
        else:
            text = detok.add_token(token)
            if detok.stopped and seq.finish_reason is None:
                self._end(seq, "stop")
            elif detok.stopped:
                seq.finish_reason = "stop"  # a stop string beats max_tokens on the same token (vLLM)
            elif seq.finish_reason is not None:
                text += detok.finish()
        self._emit(seq, [token], text, finished=seq.finish_reason is not None)

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """No more steps for ``seq``. Its pages return now, or right after the step in flight
        that may still write them."""
        seq.finish_reason, seq.error = reason, error
        if seq in self._in_flight:
            self._deferred_release.append(seq)
        else:
            self._release(seq)
        with self._cond:
            self._requests.pop(seq.request_id, None)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.metrics.kv.on_request_freed(len(seq.block_table))
        self.scheduler.remove(seq)

    def _release_deferred(self, still_in_flight: list[ScheduledChunk] = ()) -> None:
        """Return the pages of sequences that ended while in flight, except those a step launched
        ahead still writes."""
        self._in_flight = {chunk.seq for chunk in still_in_flight}
        deferred, self._deferred_release = self._deferred_release, []
        for seq in deferred:
            if seq in self._in_flight:
                self._deferred_release.append(seq)
            else:
                self._release(seq)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End ``seq`` now (abort, error) and send its final output."""
        if seq.final_output_sent:
            return
        if seq.finish_reason is None:
            self._end(seq, reason, error)
        else:  # ended by a token whose output has not gone out yet; this reason replaces it
            seq.finish_reason, seq.error = reason, error
        self._emit(seq, [], "", finished=True)

    def _emit(self, seq: Sequence, token_ids: list[int], text: str, finished: bool) -> None:
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=None if seq.params.logprobs is None else seq.logprobs,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            error=seq.error,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generated_tokens=seq.num_generated_tokens,
        )
        seq.logprobs = []
        if finished:
            seq.final_output_sent = True
            seq.timeline.on_finished(seq.finish_reason)
        try:
            seq.on_output(out)
        except Exception:
            log.exception("on_output callback of %s raised; the request goes on", seq.request_id)


def build_engine(config: EngineConfig) -> Engine:
    """Engine(config), built in a thread that then exits, so that the calling (main) thread runs no parallel torch
    op. Once the main thread has run an OpenMP region, libgomp keeps its pool, and every region of another thread
    (the engine loop's) costs ~60-70 us more: on a 2-core CPU a 576 x 576 GEMV took 12-14 us from the main thread
    or a lone thread, 65-87 us from the loop's (bench/omp_threads.py), most of a CPU decode step."""
    with ThreadPoolExecutor(max_workers=1) as builder:
        return builder.submit(Engine, config).result()
