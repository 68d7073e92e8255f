"""/metrics of a real server after real traffic: values add up, promtool accepts it, Prometheus scrapes it.

One server (the embedded SmolLM2 on CPU, every kernel call timed) for the module; a real
Prometheus (Debian package `prometheus`) on 127.0.0.1 scrapes it.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]


def _live_server_module():
    # The API tests' helper that starts `python -m server serve`; loaded by path so this
    # directory does not depend on tests/api being collected first.
    if "live_server" in sys.modules:
        return sys.modules["live_server"]
    spec = importlib.util.spec_from_file_location("live_server", REPO / "tests" / "api" / "live_server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["live_server"] = module
    spec.loader.exec_module(module)
    return module


live = _live_server_module()


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: apt-get install -y --no-install-recommends prometheus "
                    "(scripts/system-packages.txt lists it; scripts/setup.sh installs it)")
    return path


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def total(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = live.start_server(tmp_path_factory.mktemp("metrics") / "server.log", "--kernel-timing-sample-rate", "1")
    yield running
    live.stop_server(running)


@pytest.fixture(scope="module")
def traffic(server):
    """Three good requests (two chat, one streamed completion) and two bad ones; what usage reported."""
    from openai import BadRequestError, OpenAI

    usage = {"prompt": 0, "completion": 0}
    with OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120) as client:
        for question in ("Name a colour.", "Say hi."):
            reply = client.chat.completions.create(
                model=live.MODEL, messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0
            )
            usage["prompt"] += reply.usage.prompt_tokens
            usage["completion"] += reply.usage.completion_tokens
        stream = client.completions.create(model=live.MODEL, prompt="Once upon a time", max_tokens=5, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage["prompt"] += chunk.usage.prompt_tokens
                usage["completion"] += chunk.usage.completion_tokens
        with pytest.raises(BadRequestError):  # refused by the API's body validation
            client.completions.create(model=live.MODEL, prompt="x", max_tokens=-1)
        with pytest.raises(BadRequestError):  # prompt + max_tokens beyond the context
            client.completions.create(model=live.MODEL, prompt="x", max_tokens=live.MAX_MODEL_LEN + 1)
    return usage


@pytest.fixture(scope="module")
def idle_samples(server, traffic):
    """The scrape once the server is idle again (pages are freed within a step of the last finish)."""
    deadline = time.monotonic() + 20
    while True:
        samples = scrape(server.base_url)
        idle = total(samples, "turboserve_num_requests_running") == 0 and total(samples, "turboserve_kv_pages_used") == 0
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_request_counters_match_the_traffic(idle_samples, traffic):
    s = idle_samples
    assert total(s, "turboserve_request_success_total") == 3
    assert total(s, "turboserve_request_failure_total", reason="bad_request") == 2
    assert total(s, "turboserve_request_failure_total", reason="engine_error") == 0
    assert total(s, "turboserve_generation_tokens_total") == traffic["completion"]
    assert total(s, "turboserve_prompt_tokens_total") == traffic["prompt"]
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds"):  # fmt: skip
        assert total(s, f"turboserve_{histogram}_count") == 3, histogram
    # Every good request produced 4-5 tokens: the gaps between them are inter-token latencies.
    assert total(s, "turboserve_inter_token_latency_seconds_count") == traffic["completion"] - 3
    assert total(s, "turboserve_iteration_tokens_sum") >= traffic["prompt"] + traffic["completion"] - 3
    assert total(s, "turboserve_kv_request_bytes_count") == 3


def test_kv_pool_is_idle_and_consistent(idle_samples):
    s = idle_samples
    pool = total(s, "turboserve_kv_pool_pages")
    assert pool > 0
    assert total(s, "turboserve_kv_pages_used") == 0
    assert total(s, "turboserve_kv_pages_free") == pool
    assert total(s, "turboserve_kv_bytes_used") == 0
    assert total(s, "turboserve_kv_cache_usage_perc") == 0
    assert total(s, "turboserve_num_requests_waiting") == 0
    per_token = total(s, "turboserve_kv_bytes_per_token")
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K + V); CPU runs float32 by default (4 bytes).
    assert per_token == 30 * 3 * 64 * 2 * 4
    assert total(s, "turboserve_kv_pool_bytes") == pool * 16 * per_token
    assert total(s, "turboserve_kv_pool_tokens") == pool * 16
    assert total(s, "turboserve_kv_compression_ratio") == 0.5  # float32 is twice bf16
    assert total(s, "turboserve_kv_value_bitwidth", kind="k", dtype="f32") == 32


def test_kernel_timings_present_when_sampling_every_step(idle_samples):
    s = idle_samples
    kernels = {dict(ls)["kernel"] for (n, ls), v in s.items() if n == "turboserve_kernel_duration_seconds_count" and v}
    assert {"lm_head", "sampling", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= kernels, kernels
    for kernel in kernels:
        timed = total(s, "turboserve_kernel_duration_seconds_count", kernel=kernel)
        assert total(s, "turboserve_kernel_calls_total", kernel=kernel) == timed, "rate 1: every call is timed"
        assert 0 < total(s, "turboserve_kernel_duration_seconds_sum", kernel=kernel) < 60


def test_process_families(idle_samples):
    s = idle_samples
    info = [dict(ls) for (n, ls), v in s.items() if n == "turboserve_build_info"]
    assert len(info) == 1 and info[0]["device"] == "cpu" and info[0]["kv_cache_dtype_k"] == "f32"
    assert info[0]["kv_key_offset"] == "none", "a dense K cache subtracts no offset"
    assert info[0]["kv_key_turned_pairs"] == "0", "and turns no pair of it"
    assert "Q4_1" in info[0]["weight_formats"], info[0]
    assert "int4" in info[0]["weight_formats"].split(","), "the CPU multiplies the Q4_1 blocks as stored"
    assert total(s, "turboserve_engine_alive") == 1
    assert total(s, "turboserve_engine_steps_total", cuda_graph="true") == 0  # CPU: no graphs
    assert total(s, "turboserve_engine_steps_total") == total(s, "turboserve_engine_step_duration_seconds_count") > 0


def test_every_documented_family_is_served(idle_samples, documented_families):
    names = {n for n, _ in idle_samples}
    missing = {f for f in documented_families if not ({f, f + "_count"} & names)}
    assert missing == set(), "documented in docs/metrics.md but absent from the live /metrics"


def test_promtool_accepts_the_exposition(server, traffic):
    promtool = need_tool("promtool")
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, f"promtool check metrics:\n{check.stdout}{check.stderr}"


def test_prometheus_scrapes_turboserve_and_answers_promql(server, idle_samples, tmp_path):
    binary = need_tool("prometheus")
    target = server.base_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: turboserve\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path / "prometheus.log", "w")
    prometheus = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    expected = total(idle_samples, "turboserve_generation_tokens_total")
    answer = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/api/v1/query",
                                  params={"query": f'turboserve_generation_tokens_total{{model_name="{live.MODEL}"}}'})  # fmt: skip
                answer = reply.json()
                if answer.get("status") == "success" and answer["data"]["result"]:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
    assert answer and answer["data"]["result"], (
        f"Prometheus never returned the series: {answer}\n{(tmp_path / 'prometheus.log').read_text()[-3000:]}"
    )
    series = answer["data"]["result"][0]
    assert series["metric"]["job"] == "turboserve"
    assert float(series["value"][1]) == expected
