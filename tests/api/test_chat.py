"""Chat completions through the official openai client against the real server."""

from __future__ import annotations

import math

import pytest

from live_server import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# transformers' greedy reply from the same GGUF file (shared/ENVIRONMENT.md), an independent reference.
REFERENCE_REPLY = "The capital of France is Paris."


@pytest.fixture(scope="module")
def greedy_reply(client):
    return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)


def test_greedy_chat_matches_the_transformers_reference(greedy_reply):
    reply = greedy_reply
    assert reply.choices[0].message.content == REFERENCE_REPLY
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"  # stopped at <|im_end|>, before 16 tokens
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.id.startswith("chatcmpl-") and reply.system_fingerprint and reply.created > 0
    usage = reply.usage
    assert 0 < usage.completion_tokens < 16 and usage.prompt_tokens > 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_text_parts_render_like_a_plain_string(client, greedy_reply):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                          {"type": "text", "text": "of France?"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == greedy_reply.choices[0].message.content
    assert reply.usage == greedy_reply.usage


def test_developer_role_is_the_system_role(client):
    def reply(role):
        messages = [{"role": role, "content": "Answer in French."}, *QUESTION]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)

    as_developer, as_system = reply("developer"), reply("system")
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage == as_system.usage


@pytest.mark.parametrize("extreme", [dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-300, seed=3)])
def test_vanishing_temperature_or_top_p_picks_the_best_token(client, extreme):
    # Past float32's range these made NaN probabilities in the sampler, which then emitted token 0.
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **extreme)
    assert reply.choices[0].message.content == "The capital of France"


@pytest.mark.parametrize("penalty", [1e-20, 1e20])
def test_a_repetition_penalty_beyond_float32_acts_like_the_largest_finite_one(client, penalty):
    def reply(repetition_penalty):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0.7, seed=5,
                                              extra_body={"repetition_penalty": repetition_penalty})

    extreme = reply(penalty * penalty).choices[0]
    assert extreme.message.content and extreme.message.content == reply(penalty).choices[0].message.content


def test_continue_final_message_writes_the_assistant_turn_on(client):
    prefix = "The capital of France is"
    reply = client.chat.completions.create(
        model=MODEL, messages=[*QUESTION, {"role": "assistant", "content": prefix}], max_tokens=16, temperature=0,
        extra_body={"continue_final_message": True})
    assert prefix + reply.choices[0].message.content == REFERENCE_REPLY
    assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_cuts_with_finish_reason_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    assert REFERENCE_REPLY.startswith(reply.choices[0].message.content)


def test_stream_carries_role_first_then_the_same_text(client, greedy_reply):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy_reply.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks), "usage chunk sent without stream_options.include_usage"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stream_usage_chunk_only_when_asked(client, greedy_reply):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage == greedy_reply.usage
    assert all(c.usage is None and len(c.choices) == 1 for c in body)


def test_n_two_returns_two_choices_and_counts_both(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                           max_tokens=6, n=2, temperature=1.0, seed=11)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 12  # both ran to max_tokens (6 + 6)
    assert all(c.finish_reason == "length" for c in reply.choices)


def test_n_two_streaming_delivers_both_indices(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, n=2, temperature=0, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts[0] == texts[1] == "The capital of France"  # greedy: both samples agree


def test_stop_string_is_cut_from_the_reply(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                           stop=[" Paris", "never"])
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                              stop=" Paris", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "The capital of France is"


def test_vllm_stop_token_ids_and_include_stop_str_in_output(client):
    france = 4649  # " France" in transformers' tokenizer of the same file (test_completions.TOKENIZED)
    by_id = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                           extra_body={"stop_token_ids": [france]})
    assert by_id.choices[0].message.content == "The capital of"  # the stop token's text is not output
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == 4
    kept = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                          stop=" Paris", extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The capital of France is Paris"


def test_vllm_min_tokens_holds_off_the_end_of_turn(client):
    free = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 12
    held = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                          extra_body={"min_tokens": 12})
    assert held.usage.completion_tokens == 12 and held.choices[0].finish_reason == "length"
    assert held.choices[0].message.content.startswith(free.choices[0].message.content)


def test_same_seed_same_text_other_seed_other_text(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a name for a cat."}], max_tokens=8,
            temperature=1.3, seed=seed).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2)), "two other seeds gave the same sample"


def test_logprobs_have_openai_shape_and_agree_with_greedy_choice(client, greedy_reply):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == greedy_reply.choices[0].message.content
    # Every generated token is scored, the end-of-turn token that stopped the reply included.
    assert "".join(e.token for e in content) == reply.choices[0].message.content + "<|im_end|>"
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely token
        assert entry.logprob == pytest.approx(values[0]) and entry.logprob <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
        assert entry.bytes == list(entry.token.encode())


JAPANESE = dict(model=MODEL, messages=[{"role": "user", "content": "Translate to Japanese: Japan"}], max_tokens=8,
                temperature=0)


def test_logprob_bytes_rebuild_characters_split_across_tokens(client):
    reply = client.chat.completions.create(**JAPANESE, logprobs=True)
    content = reply.choices[0].logprobs.content
    raw = b"".join(bytes(e.bytes) for e in content)
    # max_tokens cuts the last character: its bytes are in the logprobs, the text drops it (no U+FFFD).
    assert raw.decode("utf-8", errors="ignore") == reply.choices[0].message.content
    assert raw.decode("utf-8", errors="replace").endswith("\ufffd"), "max_tokens no longer cuts a character"
    assert not reply.choices[0].message.content.isascii()
    assert any(not bytes(e.bytes).decode("utf-8", errors="ignore") == e.token for e in content), \
        "no token split a character: the prompt no longer exercises partial-UTF-8 bytes"


def test_stream_never_sends_half_a_character(client):
    whole = client.chat.completions.create(**JAPANESE).choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**JAPANESE, stream=True)]
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == whole and not whole.isascii()


def test_no_logprobs_unless_asked(greedy_reply):
    assert greedy_reply.choices[0].logprobs is None


def test_streamed_logprobs_match_the_whole_ones(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True)
                if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in whole]
