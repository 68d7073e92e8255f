"""Concurrent streams and clients that leave early: every page comes back to the pool."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
from openai import AsyncOpenAI

from live_server import MODEL, metric, wait_for_free_pages

PROMPTS = ["Name a colour.", "Name a fruit.", "Name a planet.", "Name a river."]


def test_eight_concurrent_streams_match_their_solo_replies(api_server, client):
    async def stream(aclient, prompt):
        chunks = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in chunks])

    async def run_all():
        async with AsyncOpenAI(base_url=api_server.v1, api_key="unused", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(stream(aclient, p) for p in PROMPTS * 2))

    replies = asyncio.run(run_all())
    solo = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=6, temperature=0).choices[0].message.content
    assert replies[:4] == replies[4:], "the same prompt gave different greedy replies in one batch"
    assert replies[0] == solo, "batched greedy reply differs from the same request alone"
    assert all(replies)
    wait_for_free_pages(api_server)


def _long_request(stream: bool) -> dict:
    # ignore_eos + many tokens: seconds of work on CPU, so pages freed quickly prove the abort.
    return {"model": MODEL, "messages": [{"role": "user", "content": "Write a long essay."}],
            "max_tokens": 400, "ignore_eos": True, "stream": stream}


def test_disconnect_mid_stream_frees_every_page(api_server):
    with httpx.Client(base_url=api_server.v1, timeout=60) as http:
        with http.stream("POST", "/chat/completions", json=_long_request(stream=True)) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: a closed line iterator would close the connection
            events = 0
            for line in lines:
                events += line.startswith("data:")
                if events == 4:  # the role chunk and three tokens
                    break
            assert metric(api_server, "turboserve_kv_pages_used") > 0
        # leaving the block closes the connection mid-stream
    assert wait_for_free_pages(api_server, timeout_s=5) < 5
    assert httpx.get(api_server.base_url + "/health").status_code == 200


def test_client_timeout_on_a_non_streamed_request_frees_every_page(api_server):
    started = time.monotonic()
    try:
        httpx.post(api_server.v1 + "/chat/completions", json=_long_request(stream=False), timeout=1.5)
        raise AssertionError("400 tokens finished within 1.5 s; make the request longer")
    except httpx.ReadTimeout:
        pass
    wait_for_free_pages(api_server, timeout_s=5)
    assert time.monotonic() - started < 8


def test_a_huge_prompt_being_tokenized_does_not_stall_other_requests(api_server):
    # ~1 MB of text is seconds of tokenizer work; it runs in a worker thread, which helps only if the
    # tokenizer lets go of the GIL meanwhile (else /health and every stream wait for it).
    words = random.Random(7).choices(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"], k=160_000)
    body = {"model": MODEL, "prompt": " ".join(words), "max_tokens": 1}
    outcome = {}

    def send_huge_prompt():
        started = time.monotonic()
        outcome["status"] = httpx.post(api_server.v1 + "/completions", json=body, timeout=120).status_code
        outcome["seconds"] = time.monotonic() - started

    sender = threading.Thread(target=send_huge_prompt)
    sender.start()
    waits = []
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(api_server.base_url + "/health", timeout=120).status_code == 200
        waits.append(time.monotonic() - started)
        time.sleep(0.02)
    sender.join()
    assert outcome["status"] == 400  # far beyond the context, which is known only once tokenized
    assert max(waits) < 0.5 * outcome["seconds"], f"/health waited {max(waits):.2f} s of {outcome['seconds']:.2f} s"
