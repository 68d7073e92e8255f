"""Request and KV families record what the runtime tells them, with values worked out by hand."""

import uuid

import pytest
from prometheus_client import REGISTRY

from server.metrics import EngineMetrics


def value(name: str, model: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": model, **labels})


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(f"test-{uuid.uuid4().hex[:8]}")


def test_timeline_turns_moments_into_vllm_latencies(metrics):
    m = metrics.model_name
    t = metrics.requests.timeline(arrival=100.0)
    t.on_scheduled(now=100.5)
    t.on_scheduled(now=101.0)  # a later step (e.g. the next prefill chunk) does not move queue time
    t.on_tokens(1, num_prompt_tokens=7, now=102.0)
    t.on_tokens(1, num_prompt_tokens=7, now=102.25)
    t.on_tokens(1, num_prompt_tokens=7, now=103.0)
    t.on_finished("stop", now=103.5)

    assert value("turboserve_request_queue_time_seconds_sum", m) == 0.5
    assert value("turboserve_time_to_first_token_seconds_sum", m) == 2.0
    assert value("turboserve_request_prefill_time_seconds_sum", m) == 1.5
    assert value("turboserve_inter_token_latency_seconds_count", m) == 2
    assert value("turboserve_inter_token_latency_seconds_sum", m) == 1.0  # 0.25 + 0.75
    # 0.25 s falls in vLLM's (0.2, 0.3] bucket, 0.75 s in (0.5, 0.75].
    assert value("turboserve_inter_token_latency_seconds_bucket", m, le="0.2") == 0
    assert value("turboserve_inter_token_latency_seconds_bucket", m, le="0.3") == 1
    assert value("turboserve_inter_token_latency_seconds_bucket", m, le="0.75") == 2
    assert value("turboserve_request_decode_time_seconds_sum", m) == 1.0
    assert value("turboserve_e2e_request_latency_seconds_sum", m) == 3.5
    assert value("turboserve_prompt_tokens_total", m) == 7  # once, not per token
    assert value("turboserve_generation_tokens_total", m) == 3
    assert value("turboserve_request_success_total", m, finished_reason="stop") == 1
    assert value("turboserve_request_success_total", m, finished_reason="length") == 0


def test_finish_is_counted_once_and_abort_and_error_are_failures(metrics):
    m = metrics.model_name
    aborted = metrics.requests.timeline(arrival=0.0)
    aborted.on_finished("abort", now=1.0)
    aborted.on_finished("abort", now=2.0)
    failed = metrics.requests.timeline(arrival=0.0)
    failed.on_scheduled(now=0.1)
    failed.on_finished("error", now=0.2)
    metrics.requests.on_failure("overloaded")

    assert value("turboserve_request_failure_total", m, reason="aborted") == 1
    assert value("turboserve_request_failure_total", m, reason="engine_error") == 1
    assert value("turboserve_request_failure_total", m, reason="overloaded") == 1
    assert value("turboserve_request_failure_total", m, reason="bad_request") == 0
    assert value("turboserve_e2e_request_latency_seconds_count", m) == 2
    assert value("turboserve_time_to_first_token_seconds_count", m) == 0  # neither produced a token
    with pytest.raises(ValueError, match="unknown failure reason"):
        metrics.requests.on_failure("cosmic_ray")


def test_kv_pool_families_from_the_pool_shape(metrics):
    m = metrics.model_name
    # 30 layers x 3 KV heads x 64 dims, K and V: bf16 is 2 bytes a value -> 23040 bytes a token.
    # A pool of turbo3 K and V at 3.25 bits a value, say 4680 bytes a token.
    metrics.kv.on_pool(
        num_pages=50, page_size=16, bytes_per_token=4680, k_dtype="turbo3", v_dtype="turbo3",
        k_bits=3.25, v_bits=3.25, bf16_bytes_per_token=23040, recent_window=128, recent_window_bytes=7 << 20,
    )  # fmt: skip
    metrics.kv.on_pages_used(12)
    metrics.kv.on_request_freed(3)

    assert value("turboserve_kv_pool_pages", m) == 50
    assert value("turboserve_kv_pool_tokens", m) == 800
    assert value("turboserve_kv_pool_bytes", m) == 50 * 16 * 4680
    assert value("turboserve_kv_pages_used", m) == 12
    assert value("turboserve_kv_pages_free", m) == 38
    assert value("turboserve_kv_cache_usage_perc", m) == 12 / 50
    assert value("turboserve_kv_bytes_used", m) == 12 * 16 * 4680
    assert value("turboserve_kv_bytes_per_token", m) == 4680
    assert value("turboserve_kv_value_bitwidth", m, kind="k", dtype="turbo3") == 3.25
    assert value("turboserve_kv_compression_ratio", m) == pytest.approx(23040 / 4680)
    assert value("turboserve_kv_request_bytes_sum", m) == 3 * 16 * 4680
    assert value("turboserve_kv_recent_window_tokens", m) == 128
    assert value("turboserve_kv_recent_window_bytes", m) == 7 << 20


def test_engine_step_records_batch_state_and_only_busy_steps_take_time(metrics):
    m = metrics.model_name
    metrics.kv.on_pool(num_pages=10, page_size=4, bytes_per_token=100, k_dtype="bf16", v_dtype="bf16",
                       k_bits=16, v_bits=16, bf16_bytes_per_token=100)  # fmt: skip
    metrics.on_step(seconds=0.02, cuda_graph=True, num_running=3, num_waiting=2, num_tokens=40,
                    num_preempted=1, pages_used=7)  # fmt: skip
    metrics.on_step(seconds=0.0, cuda_graph=False, num_running=0, num_waiting=0, num_tokens=0,
                    num_preempted=0, pages_used=0)  # fmt: skip

    assert value("turboserve_engine_steps_total", m, cuda_graph="true") == 1
    assert value("turboserve_engine_steps_total", m, cuda_graph="false") == 0  # the idle pass is no step
    assert value("turboserve_engine_step_duration_seconds_sum", m) == 0.02
    assert value("turboserve_iteration_tokens_sum", m) == 40
    assert value("turboserve_num_preemptions_total", m) == 1
    assert value("turboserve_num_requests_running", m) == 0
    assert value("turboserve_kv_pages_used", m) == 0
    assert value("turboserve_kv_pages_free", m) == 10
    assert value("turboserve_kv_compression_ratio", m) == 1.0


def test_engine_alive_follows_the_callback(metrics):
    alive = [True]
    metrics.process.watch_engine(lambda: alive[0])
    assert value("turboserve_engine_alive", metrics.model_name) == 1
    alive[0] = False
    assert value("turboserve_engine_alive", metrics.model_name) == 0
