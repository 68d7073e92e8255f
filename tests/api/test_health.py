"""/health follows the engine loop: a stopped loop is 503 there and on /v1 (a stand-in engine,
since stopping the real one would take the shared server down)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from server.runtime.engine import EngineNotRunning


class StoppedEngine:
    """Test double: an engine whose step loop has died; like the real one, submit refuses under its lock
    (so a request racing shutdown, which saw it alive a moment before, is refused the same way)."""

    model_name = "stub"
    max_model_len = 64
    tokenizer = None
    config = EngineConfig()

    def is_alive(self) -> bool:
        return False

    def submit(self, request_id, prompt_token_ids, params, on_output) -> None:
        raise EngineNotRunning("the engine is not running")

    def abort(self, request_id: str) -> None:
        pass


def test_health_is_503_when_the_engine_loop_is_down():
    client = TestClient(create_app(StoppedEngine(), ServerConfig()))
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"
    refused = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"


class DyingEngine:
    """Test double: takes a request, then its loop dies without finishing it (a bug outside the
    step's error handling)."""

    model_name = "stub"
    max_model_len = 64
    tokenizer = None
    config = EngineConfig()

    def __init__(self):
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def submit(self, request_id, prompt_token_ids, params, on_output) -> None:
        self.alive = False

    def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_in_flight_fails_when_the_engine_loop_dies(stream):
    async def send():
        transport = httpx.ASGITransport(app=create_app(DyingEngine(), ServerConfig()))
        async with httpx.AsyncClient(transport=transport, base_url="http://stub") as http:
            body = {"prompt": [1, 2], "max_tokens": 1, "stream": stream}
            return await asyncio.wait_for(http.post("/v1/completions", json=body), timeout=10)

    response = asyncio.run(send())  # TimeoutError: the request waited for outputs that never come
    if stream:
        events = [line for line in response.text.splitlines() if line.startswith("data:")]
        assert '"engine_error"' in events[0] and events[-1] == "data: [DONE]"
    else:
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"


def test_health_version_and_models_when_alive(api_server):
    assert httpx.get(api_server.base_url + "/health").json() == {"status": "ok"}
    version = httpx.get(api_server.base_url + "/version").json()["version"]
    assert version and version[0].isdigit()
    models = httpx.get(api_server.v1 + "/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    assert httpx.get(api_server.v1 + "/models/SmolLM2-135M-Instruct").json() == models["data"][0]
    missing = httpx.get(api_server.v1 + "/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_head_answers_like_get_without_a_body(api_server):
    # Load balancers and uptime probes often check with HEAD.
    for url in (api_server.base_url + "/health", api_server.base_url + "/version", api_server.base_url + "/metrics",
                api_server.v1 + "/models"):
        response = httpx.head(url)
        assert response.status_code == 200 and response.content == b"", url
