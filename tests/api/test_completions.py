"""/v1/completions: string, token-list and batched prompts, echo, integer logprobs."""

from __future__ import annotations

import pytest

from live_server import MODEL


# Ids from transformers' tokenizer of the same GGUF file (AutoTokenizer, gguf_file=...), computed once
# outside turboserve; loading that tokenizer here would cost CI ~20 s.
TOKENIZED = {"The capital of France is": [504, 3575, 282, 4649, 314],
             "One, two, three,": [2705, 28, 827, 28, 1296, 28]}


def test_token_list_prompts_complete_like_their_text(client):
    texts = list(TOKENIZED)
    by_text = client.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0)
    ids = list(TOKENIZED.values())
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert all(c.text for c in by_ids.choices)
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    assert by_ids.usage.completion_tokens == 10
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=5, temperature=0)
    assert single.choices[0].text == by_ids.choices[1].text


def test_echo_with_logprobs_scores_the_prompt(client):
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      logprobs=2)
    choice = reply.choices[0]
    n_prompt = len(TOKENIZED[prompt])
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None  # nothing precedes the first token
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    for token, value, top in zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert token in top and top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)  # greedy
        assert 2 <= len(top) <= 3


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
