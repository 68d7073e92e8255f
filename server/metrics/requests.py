"""Request families, named and bucketed like vLLM's so existing dashboards translate.

The engine keeps one ``RequestTimeline`` per request and calls it as the request moves
(scheduled, tokens produced, finished); the timeline turns those moments into TTFT, ITL,
queue/prefill/decode/e2e latencies. Nothing here keeps per-request state of its own.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

LABELS = ["model_name"]

# vLLM's bucket choices (vllm/v1/metrics/loggers.py), kept identical on purpose.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

# request_failure_total{reason}: the four ways a request ends without a result.
FAILURE_REASONS = ("bad_request", "aborted", "engine_error", "overloaded")
SUCCESS_REASONS = ("stop", "length")

num_requests_running = Gauge(
    "turboserve_num_requests_running", "Requests in the running batch (prefilling or decoding).", LABELS
)
num_requests_waiting = Gauge("turboserve_num_requests_waiting", "Requests queued, not yet scheduled.", LABELS)
time_to_first_token = Histogram(
    "turboserve_time_to_first_token_seconds", "Arrival to first generated token.", LABELS, buckets=TTFT_BUCKETS
)
inter_token_latency = Histogram(
    "turboserve_inter_token_latency_seconds", "Time between two consecutive tokens of one request.", LABELS,
    buckets=ITL_BUCKETS,
)  # fmt: skip
e2e_request_latency = Histogram(
    "turboserve_e2e_request_latency_seconds", "Arrival to finish of a request.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
request_queue_time = Histogram(
    "turboserve_request_queue_time_seconds", "Arrival to first scheduled step.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
request_prefill_time = Histogram(
    "turboserve_request_prefill_time_seconds", "First scheduled step to first generated token.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
request_decode_time = Histogram(
    "turboserve_request_decode_time_seconds", "First generated token to last generated token.", LABELS,
    buckets=REQUEST_LATENCY_BUCKETS,
)  # fmt: skip
prompt_tokens = Counter("turboserve_prompt_tokens", "Prompt tokens of requests whose prefill completed.", LABELS)
generation_tokens = Counter("turboserve_generation_tokens", "Tokens generated.", LABELS)
request_success = Counter(
    "turboserve_request_success", "Requests that finished normally.", LABELS + ["finished_reason"]
)
request_failure = Counter(
    "turboserve_request_failure", "Requests that ended without a normal finish.", LABELS + ["reason"]
)
num_preemptions = Counter("turboserve_num_preemptions", "Sequences preempted (pages freed, recomputed later).", LABELS)
iteration_tokens = Histogram(
    "turboserve_iteration_tokens", "Tokens (prompt + generated) processed by one engine step.", LABELS,
    buckets=ITERATION_TOKENS_BUCKETS,
)  # fmt: skip


class RequestMetrics:
    """The request families with the model_name label bound."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        # Children bound once: a labels() lookup per token costs more than the observation itself.
        # Binding also exports every family (at zero) before traffic.
        self.running = num_requests_running.labels(model_name)
        self.waiting = num_requests_waiting.labels(model_name)
        self.preemptions = num_preemptions.labels(model_name)
        self.iteration_tokens = iteration_tokens.labels(model_name)
        self.ttft = time_to_first_token.labels(model_name)
        self.itl = inter_token_latency.labels(model_name)
        self.e2e = e2e_request_latency.labels(model_name)
        self.queue_time = request_queue_time.labels(model_name)
        self.prefill_time = request_prefill_time.labels(model_name)
        self.decode_time = request_decode_time.labels(model_name)
        self.prompt_tokens = prompt_tokens.labels(model_name)
        self.generation_tokens = generation_tokens.labels(model_name)
        self.success = {reason: request_success.labels(model_name, reason) for reason in SUCCESS_REASONS}
        self.failure = {reason: request_failure.labels(model_name, reason) for reason in FAILURE_REASONS}

    def on_step(self, num_running: int, num_waiting: int, num_tokens: int, num_preempted: int = 0) -> None:
        """After every engine step: the batch state and how much work the step did."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
        if num_preempted:
            self.preemptions.inc(num_preempted)

    def on_failure(self, reason: str) -> None:
        """A request that never produced a normal finish (see FAILURE_REASONS)."""
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {reason!r}; expected one of {FAILURE_REASONS}")
        self.failure[reason].inc()

    def timeline(self, arrival: float | None = None) -> RequestTimeline:
        """Start following one request (arrival defaults to now, on time.monotonic)."""
        return RequestTimeline(self, time.monotonic() if arrival is None else arrival)


class UnrecordedTimeline:
    """The timeline of one of the engine's own requests (the start-up warm-up): it records nothing."""

    def on_scheduled(self, now: float | None = None) -> None:
        pass

    def on_tokens(self, num_tokens: int, num_prompt_tokens: int, now: float | None = None) -> None:
        pass

    def on_finished(self, finish_reason: str, now: float | None = None) -> None:
        pass


class RequestTimeline:
    """The moments of one request; observes each latency as soon as it is known."""

    def __init__(self, metrics: RequestMetrics, arrival: float):
        self._m = metrics
        self.arrival = arrival
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished = False

    def on_scheduled(self, now: float | None = None) -> None:
        """Call whenever the request is in a step's batch; only the first call counts (queue time)."""
        if self.scheduled_at is None:
            self.scheduled_at = time.monotonic() if now is None else now
            self._m.queue_time.observe(self.scheduled_at - self.arrival)

    def on_tokens(self, num_tokens: int, num_prompt_tokens: int, now: float | None = None) -> None:
        """A step produced ``num_tokens`` new tokens for this request."""
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        m = self._m
        if self.first_token_at is None:
            self.on_scheduled(now)
            self.first_token_at = now
            m.ttft.observe(now - self.arrival)
            m.prefill_time.observe(now - self.scheduled_at)
            m.prompt_tokens.inc(num_prompt_tokens)
        else:
            # Several tokens in one step (none today) would share the gap evenly.
            gap = (now - self.last_token_at) / num_tokens
            for _ in range(num_tokens):
                m.itl.observe(gap)
        self.last_token_at = now
        m.generation_tokens.inc(num_tokens)

    def on_finished(self, finish_reason: str, now: float | None = None) -> None:
        """The request ended: "stop"/"length" count as success, "abort"/"error" as failures."""
        if self.finished:
            return
        self.finished = True
        now = time.monotonic() if now is None else now
        m = self._m
        if finish_reason == "abort":
            m.on_failure("aborted")
        elif finish_reason == "error":
            m.on_failure("engine_error")
        else:
            m.success[finish_reason].inc()
        m.e2e.observe(now - self.arrival)
        if self.first_token_at is not None:
            m.decode_time.observe(self.last_token_at - self.first_token_at)
