"""Every client mistake: a 4xx with OpenAI's error body naming the field; never a 500, a dead engine
loop or a leaked page."""

from __future__ import annotations

import json

import httpx
import pytest

from live_server import MAX_MODEL_LEN, MODEL, metric, wait_for_free_pages

CHAT = "/chat/completions"
COMPLETIONS = "/completions"
HI = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def completion(**fields):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


# (case id, endpoint, body: dict or raw bytes, status, param the error must name, code or None)
CASES = [
    ("malformed-json", CHAT, b'{"messages": [', 400, None, "invalid_json"),
    ("body-not-an-object", CHAT, b"[1, 2]", 400, None, "invalid_type"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("messages-not-a-list", CHAT, chat(messages="hi"), 400, "messages", "invalid_value"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages", "invalid_value"),
    ("unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role",
     "invalid_value"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages[0].content", "invalid_value"),
    ("text-part-without-text", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content", "invalid_value"),
    ("user-a-number", CHAT, chat(user=5), 400, "user", "invalid_value"),
    ("content-a-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
     "invalid_value"),
    ("temperature-a-string", CHAT, chat(temperature="hot"), 400, "temperature", "invalid_value"),
    ("max-tokens-a-string", CHAT, chat(max_tokens="10"), 400, "max_tokens", "invalid_value"),
    ("stream-a-string", CHAT, chat(stream="yes"), 400, "stream", "invalid_value"),
    ("n-zero", CHAT, chat(n=0), 400, "n", "invalid_value"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens",
     "invalid_value"),
    ("temperature-infinite", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
     400, "temperature", "invalid_value"),
    ("lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None, "invalid_json"),
    ("temperature-negative", CHAT, chat(temperature=-0.5), 400, "temperature", "invalid_value"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", "invalid_value"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, "top_p", "invalid_value"),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "invalid_value"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "invalid_value"),
    ("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop", "invalid_value"),
    ("stop-65-strings", CHAT, chat(stop=[f"stop{i}" for i in range(65)]), 400, "stop", "invalid_value"),
    ("continue-a-user-message", CHAT, chat(continue_final_message=True), 400, "continue_final_message",
     "invalid_value"),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options", "invalid_value"),
    ("beyond-context", CHAT, chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", None),
    ("wrong-model", CHAT, chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ("completion-logprobs-21", COMPLETIONS, completion(logprobs=21), 400, "logprobs", "invalid_value"),
    ("completion-logprobs-true", COMPLETIONS, completion(logprobs=True), 400, "logprobs", "invalid_value"),
    ("completion-prompt-missing", COMPLETIONS, {"model": MODEL}, 400, "prompt", "missing_required_parameter"),
    ("completion-prompt-empty-list", COMPLETIONS, completion(prompt=[]), 400, "prompt", "invalid_value"),
    ("completion-second-prompt-empty", COMPLETIONS, completion(prompt=["hi", ""]), 400, "prompt[1]", "invalid_value"),
    ("completion-prompt-mixed", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt", "invalid_value"),
    ("completion-token-outside-vocab", COMPLETIONS, completion(prompt=[1, 10**9]), 400, "prompt", None),
    ("completion-prompt-too-long", COMPLETIONS, completion(prompt=[28] * (MAX_MODEL_LEN + 1)), 400, "prompt",
     None),
    ("completion-beyond-context", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", None),
    ("completion-n-zero", COMPLETIONS, completion(n=0), 400, "n", "invalid_value"),
    ("completion-wrong-model", COMPLETIONS, completion(model="davinci"), 404, "model", "model_not_found"),
    ("completion-sequences-beyond-the-queue", COMPLETIONS, completion(prompt=[[28]] * 3, n=128), 400, "n",
     "invalid_value"),  # 384 sequences > --max-queue 256: refused at once, not "overloaded, retry" forever
    ("completion-prompts-beyond-the-queue", COMPLETIONS, completion(prompt=[[28]] * 257), 400, "prompt",
     "invalid_value"),
    # Features the server lacks are refused, not silently dropped (the reply would not be what was asked).
    ("logit-bias", CHAT, chat(logit_bias={"28": 100}), 400, "logit_bias", "unsupported_parameter"),
    ("json-mode", CHAT, chat(response_format={"type": "json_object"}), 400, "response_format",
     "unsupported_parameter"),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tools",
     "unsupported_parameter"),
    ("tool-choice-required", CHAT, chat(tool_choice="required"), 400, "tool_choice", "unsupported_parameter"),
    ("vllm-guided-json", CHAT, chat(guided_json={"type": "object"}), 400, "guided_json", "unsupported_parameter"),
    ("min-tokens-above-max-tokens", COMPLETIONS, completion(min_tokens=3), 400, "min_tokens", None),
    ("min-tokens-negative", CHAT, chat(min_tokens=-1), 400, "min_tokens", "invalid_value"),
    ("stop-token-ids-65", CHAT, chat(stop_token_ids=list(range(65))), 400, "stop_token_ids", "invalid_value"),
    ("stop-token-id-a-string", CHAT, chat(stop_token_ids=["2"]), 400, "stop_token_ids[0]", "invalid_value"),
    ("completion-suffix", COMPLETIONS, completion(suffix="end"), 400, "suffix", "unsupported_parameter"),
    ("completion-best-of-above-n", COMPLETIONS, completion(best_of=3), 400, "best_of", "unsupported_parameter"),
    ("completion-best-of-below-n", COMPLETIONS, completion(best_of=1, n=2), 400, "best_of", "invalid_value"),
    ("oversized-body", CHAT, chat(messages=[{"role": "user", "content": "x" * (5 * 2**20)}]), 413, None,
     "request_too_large"),
]


@pytest.mark.parametrize("endpoint, body, status, param, code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_4xx_naming_the_field(api_server, endpoint, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(api_server.v1 + endpoint, content=content, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert code is None or error["code"] == code
    assert len(error["message"]) > 10


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_declared_json_is_refused(api_server, content_type):
    # Browsers send these types cross-site without a CORS preflight; JSON must say it is JSON.
    response = httpx.post(api_server.v1 + CHAT, content=json.dumps(chat()), headers={"Content-Type": content_type})
    assert response.status_code == 415, response.text
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_json(api_server):
    response = httpx.post(api_server.v1 + CHAT, content=json.dumps(chat(temperature=0)), timeout=60,
                          headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body, status", [(chat(model="gpt-4o"), 404), (chat(logit_bias={"1": 1}), 400),
                                          (chat(max_tokens=MAX_MODEL_LEN), 400), (b"{", 400)],
                         ids=["wrong-model", "unsupported", "refused-by-the-engine", "malformed"])
def test_every_refusal_counts_once_as_a_bad_request(api_server, body, status):
    def bad_requests() -> float:
        return metric(api_server, "turboserve_request_failure_total", reason="bad_request")

    before = bad_requests()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(api_server.v1 + CHAT, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert bad_requests() == before + 1


def test_chunked_oversized_body_is_refused_without_a_length(api_server):
    def chunks():  # no Content-Length: the limit must hold while the body streams in
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(5):
            yield b"x" * 2**20
        yield b'"}]}'

    response = httpx.post(api_server.v1 + CHAT, content=chunks(), timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_unknown_fields_are_ignored(api_server):
    response = httpx.post(api_server.v1 + CHAT, json=chat(frobnicate=True, user="me", temperature=0), timeout=60)
    assert response.status_code == 200, response.text


def test_unsupported_features_in_their_off_position_are_accepted(api_server):
    # What SDKs send by default ("no tools", plain text): these ask for nothing the server lacks.
    off = dict(tools=[], tool_choice="none", response_format={"type": "text"}, logit_bias={}, best_of=1,
               modalities=["text"], temperature=0)
    response = httpx.post(api_server.v1 + CHAT, json=chat(**off), timeout=60)
    assert response.status_code == 200, response.text


def test_unknown_route_and_method_use_the_error_body(api_server):
    assert httpx.get(api_server.v1 + "/nothing").json()["error"]["code"] == "not_found"
    response = httpx.get(api_server.v1 + CHAT)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_after_every_mistake_the_engine_serves_and_no_page_is_held(api_server):
    assert httpx.get(api_server.base_url + "/health").status_code == 200
    wait_for_free_pages(api_server)
    response = httpx.post(api_server.v1 + CHAT, json=chat(temperature=0), timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
