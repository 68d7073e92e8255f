"""A second real server, started with an API key (from the environment), one running sequence and a
queue of one: auth on, and 503 + Retry-After once the queue is full."""

from __future__ import annotations

import httpx
import openai
import pytest

from live_server import MODEL, start_server, stop_server, wait_for_free_pages

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("strict") / "server.log", "--max-num-seqs", "1",
                          "--max-queue", "1", env={"TURBOSERVE_API_KEY": KEY})
    yield server
    stop_server(server)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_v1_refuses_requests_without_the_key(strict_server, headers):
    response = httpx.get(strict_server.v1 + "/models", headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "Bearer" in error["message"]


def test_the_key_opens_v1_and_health_stays_open(strict_server):
    assert httpx.get(strict_server.v1 + "/models", headers=AUTH).json()["data"][0]["id"] == MODEL
    assert httpx.get(strict_server.base_url + "/health").status_code == 200
    with openai.OpenAI(base_url=strict_server.v1, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    with openai.OpenAI(base_url=strict_server.v1, api_key=KEY, max_retries=0) as good:
        reply = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens >= 1


def test_auth_off_accepts_any_or_no_key(api_server):
    assert httpx.get(api_server.v1 + "/models").status_code == 200
    assert httpx.get(api_server.v1 + "/models", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_full_queue_answers_503_with_retry_after(strict_server):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Write an essay."}], "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=strict_server.v1, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/chat/completions", json=long) as running:
            lines = running.iter_lines()  # held: a closed line iterator would close the connection
            next(line for line in lines if '"content":"' in line and '"role"' not in line)
            with http.stream("POST", "/chat/completions", json=long) as waiting:  # fills the queue of one
                assert waiting.status_code == 200
                refused = http.post("/chat/completions", json={**long, "stream": False})
                assert refused.status_code == 503
                assert refused.headers["Retry-After"].isdigit()
                assert refused.json()["error"]["code"] == "queue_full"
    wait_for_free_pages(strict_server)
