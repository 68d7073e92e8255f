"""The real embedded model through the whole engine (loaded once; CPU float32)."""

from __future__ import annotations

import pytest
import torch
from runtime_toy import assert_pages_return, run_all

from server.config import EngineConfig
from server.runtime.engine import Engine
from server.runtime.models.loader import load_model
from server.runtime.sequence import SamplingParams


@pytest.fixture(scope="module")
def engine():
    loaded = load_model(None, torch.device("cpu"), torch.float32)
    engine = Engine(
        EngineConfig(kv_cache_memory=64 << 20, max_num_batched_tokens=16, max_model_len=512), loaded=loaded
    )
    engine.start()
    yield engine
    engine.shutdown()


def chat(engine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return engine.tokenizer.encode(text)


def test_smollm2_answers_and_stops_at_its_end_of_turn(engine):
    question = chat(engine, "What is the capital of France?")
    out = engine.generate(question, SamplingParams(max_tokens=24, temperature=0.0))
    assert out.text == "The capital of France is Paris.", out.text  # transformers' own reply (ENVIRONMENT.md)
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.tokenizer.eos_token_ids


def test_smollm2_greedy_is_the_same_alone_and_batched_with_chunked_prefill(engine):
    questions = ["What is the capital of France?", "Name three colors.", "Hi"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = {q: engine.generate(chat(engine, q), params).token_ids for q in questions}
    batched = run_all(engine, {q: (chat(engine, q), params) for q in questions})
    assert {q: r.token_ids for q, r in batched.items()} == alone
    assert_pages_return(engine)
