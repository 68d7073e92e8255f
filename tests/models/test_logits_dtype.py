"""The LM head multiplied in another dtype than the model's (CausalLM.set_logits_dtype; on a CPU,
EngineConfig.cpu_logits_dtype): a bf16 copy of the head, logits against a float64 oracle."""

from __future__ import annotations

import logging

import pytest
import torch

from server.config import EngineConfig
from server.kernels import backend
from server.runtime.engine import Engine
from server.runtime.sequence import SamplingParams
from tiny_llama import tiny_llama

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_head_matches_the_float64_logits_to_bf16_rounding(tied):
    model = tiny_llama(seed=3, tie_word_embeddings=tied, vocab_size=1001, hidden_size=96)
    head = model.embed_tokens.weight if tied else model.lm_head.weight
    hidden = torch.randn(5, 96)
    oracle = hidden.double() @ head.detach().double().T
    exact = model.compute_logits(hidden)
    assert model.set_logits_dtype(torch.bfloat16) == head.numel() * 2
    assert model.logits_weight.dtype == torch.bfloat16 and head.dtype == torch.float32  # a copy: the head stays
    rounded = model.compute_logits(hidden)
    assert rounded.dtype == torch.float32 and rounded.shape == (5, 1001)
    # Worst case: each factor rounds to 8 significant bits (products move by up to 2^-8 of |x w|, summed in float32)
    # and the bf16 GEMM rounds its result (2^-9 of |logit|); float32 all along stays a thousand times closer.
    bound = 2**-8 * (hidden.abs().double() @ head.detach().abs().double().T) + 2**-9 * oracle.abs()
    assert ((rounded.double() - oracle).abs() <= bound).all()
    assert ((exact.double() - oracle).abs() <= 1e-3 * bound).all()
    assert (rounded - exact).abs().max() > 0
    assert model.set_logits_dtype(torch.float32) == 0
    assert model.logits_weight is None and torch.equal(model.compute_logits(hidden), exact)


def test_the_embeddings_tied_to_a_bf16_head_stay_float32():
    model = tiny_llama(seed=4, tie_word_embeddings=True)
    model.set_logits_dtype(torch.bfloat16)
    ids = torch.tensor([0, 5, 96])
    assert torch.equal(model.embed_tokens(ids), model.embed_tokens.weight[ids])
    assert model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("asked, native, want", [("bfloat16", False, torch.bfloat16), ("float32", True, None),
                                                 ("auto", True, torch.bfloat16), ("auto", False, None)])
def test_the_engine_multiplies_the_head_in_the_dtype_asked_or_bfloat16_where_the_cpu_has_it(
    monkeypatch, caplog, asked, native, want
):
    monkeypatch.setattr(backend, "cpu_multiplies_bf16", lambda: native)
    with caplog.at_level(logging.INFO, logger="server.runtime.engine"):
        engine = Engine(EngineConfig(device="cpu", cpu_logits_dtype=asked, kv_cache_memory=1 << 24))
    weight = engine.model.logits_weight
    assert (weight is None) if want is None else (weight.dtype == want)
    said = [r.getMessage() for r in caplog.records if "LM head" in r.getMessage()]
    assert said == ([] if want is None else ["CPU: the LM head multiplies in bfloat16 (a 54 MiB copy); "
                                             "--cpu-logits-dtype float32 keeps it float32"])
    if want == torch.bfloat16:  # the embedded model still answers through the bf16 head
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(QUESTION))
        out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
        engine.shutdown()
        assert out.text.startswith("The capital of France is Paris"), out.text


@pytest.mark.parametrize("field", ["cpu_prompt_dtype", "cpu_logits_dtype"])
def test_an_unknown_cpu_dtype_is_refused(field):
    with pytest.raises(ValueError, match=f"unknown {field} 'float16'"):
        Engine(EngineConfig(device="cpu", kv_cache_memory=1 << 24, **{field: "float16"}))
