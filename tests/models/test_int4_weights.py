"""The embedded SmolLM2's Q4_1 projections multiplied as stored on the CPU (runtime/models/int4_weights.py) against
the same model with them dequantized to float32."""

from __future__ import annotations

import pytest
import torch

from paged_batch import PagedBatch, greedy
from server.config import EngineConfig
from server.kernels import backend, int4_cpu
from server.runtime.engine import Engine
from server.runtime.models.int4_weights import use_int4_weights
from server.runtime.models.llama import DenseMLP
from server.runtime.models.loader import load_model
from server.runtime.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not int4_cpu.supported(), reason="this torch has no _weight_int4pack_mm_for_cpu")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def models():
    cpu = torch.device("cpu")
    dense, packed = load_model(None, cpu, torch.float32), load_model(None, cpu, torch.float32)
    assert use_int4_weights(packed.model, packed.raw_weights) == (30, 30)
    return dense, packed


def test_every_projection_takes_its_blocks_and_drops_its_float_copy(models):
    _, packed = models
    for layer in packed.model.layers:
        assert isinstance(layer.mlp, DenseMLP) and layer.mlp.int4 is not None
        assert layer.mlp.gate_up_proj is None and layer.mlp.down_proj is None
        assert layer.self_attn.int4 is not None
        assert layer.self_attn.qkv_proj.weight is None and layer.self_attn.o_proj.weight is None
    gate_up, down = packed.model.layers[0].mlp.int4
    assert (gate_up.out_features, gate_up.in_features, down.out_features, down.in_features) == (3072, 576, 576, 1536)
    qkv, o = packed.model.layers[0].self_attn.int4
    assert (qkv.out_features, qkv.in_features, o.out_features, o.in_features) == (576 + 2 * 192, 576, 576, 576)


def test_a_balanced_attention_keeps_its_float_weights():
    """A K / V channel balance scales o_proj's input columns, which a group's scale and zero cannot follow."""
    loaded = load_model(None, torch.device("cpu"), torch.float32)
    attention = loaded.model.layers[3].self_attn
    attention.set_kv_balance(None, torch.full((3, 64), 2.0))
    assert use_int4_weights(loaded.model, loaded.raw_weights) == (30, 29)
    assert attention.int4 is None and attention.o_proj.weight is not None


def test_an_mlp_matches_its_dequantized_weights(models):
    dense, packed = models
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    for i in (0, 17, 29):
        want, got = dense.model.layers[i].mlp(x), packed.model.layers[i].mlp(x)
        # bf16 activations, scales and zeros: about 2^-8 of the output's scale
        assert (got - want).abs().max() <= 2e-2 * want.abs().max(), i
        dense_attention, packed_attention = dense.model.layers[i].self_attn, packed.model.layers[i].self_attn
        for which, name in enumerate(("qkv_proj", "o_proj")):
            want = getattr(dense_attention, name)(x)
            got = packed_attention._project(x, getattr(packed_attention, name), which)
            assert (got - want).abs().max() <= 2e-2 * want.abs().max(), (i, name)


def test_the_model_answers_as_with_float_weights(models):
    dense, packed = models
    prompt = dense.tokenizer.encode(dense.tokenizer.apply_chat_template(QUESTION))
    want, want_logits = greedy(PagedBatch(dense.model, num_pages=32, page_size=16), {"q": prompt}, 12)
    got, got_logits = greedy(PagedBatch(packed.model, num_pages=32, page_size=16), {"q": prompt}, 12)
    assert packed.tokenizer.decode(got["q"]).startswith("The capital of France is Paris")
    assert got["q"] == want["q"]
    scale = want_logits["q"].abs().max()
    assert (got_logits["q"] - want_logits["q"]).abs().max() <= 0.05 * scale


@pytest.mark.parametrize("cpu_int4", [True, False])
def test_the_engine_flag_decides(cpu_int4):
    engine = Engine(EngineConfig(device="cpu", cpu_int4=cpu_int4, kv_cache_memory=1 << 24))
    assert all((layer.mlp.int4 is not None) == cpu_int4 for layer in engine.model.layers)
    assert all((layer.self_attn.int4 is not None) == cpu_int4 for layer in engine.model.layers)


@pytest.mark.parametrize("asked, native, want", [("bfloat16", False, torch.bfloat16), ("float32", True, torch.float32),
                                                 ("auto", True, torch.bfloat16), ("auto", False, torch.float32)])
def test_prompt_chunks_multiply_in_the_dtype_asked_or_bfloat16_where_the_cpu_has_it(monkeypatch, asked, native, want):
    monkeypatch.setattr(backend, "cpu_multiplies_bf16", lambda: native)
    engine = Engine(EngineConfig(device="cpu", cpu_prompt_dtype=asked, kv_cache_memory=1 << 24))
    assert engine.runner.prompt_dtype == want
    weights = [w for layer in engine.model.layers for w in layer.mlp.int4 + layer.self_attn.int4]
    assert all((w.dense is not None) == (want == torch.bfloat16) for w in weights)
    if want == torch.bfloat16:  # a prompt longer than INT4_ROWS goes through the bfloat16 copies
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(QUESTION))
        assert len(prompt) > int4_cpu.INT4_ROWS
        out = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
        engine.shutdown()
        assert out.text.startswith("The capital of France is Paris"), out.text


def test_a_model_handed_to_an_engine_keeps_its_float_weights():
    """Dropping the float copies cannot be undone: another engine on the same model may need them (a turbo cache
    folds its K / V balance into the attention weights)."""
    loaded = load_model(None, torch.device("cpu"), torch.float32)
    Engine(EngineConfig(device="cpu", kv_cache_memory=1 << 24), loaded)
    assert all(layer.mlp.int4 is None and layer.self_attn.int4 is None for layer in loaded.model.layers)
    Engine(EngineConfig(device="cpu", kv_cache_memory=1 << 24, kv_cache_dtype="turbo3"), loaded)  # needs o_proj
