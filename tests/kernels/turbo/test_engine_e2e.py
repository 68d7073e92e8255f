"""The embedded SmolLM2 (head_dim 64) served through the Engine with turbo KV pages (CPU reference path)."""

from __future__ import annotations

import pytest
import torch

from server.config import EngineConfig
from server.runtime.engine import Engine
from server.runtime.kv_calibration import balance_label
from server.runtime.models.loader import load_model
from server.runtime.sequence import SamplingParams

# Not "... of France?": the float32 model's first answer token there is a near tie ("The" 15.2 %, "L" 14.0 %),
# so any KV error, even an improvement, may flip it; here the greedy answer has clear margins.
QUESTION = "What is the capital of Japan?"
# Plain prose written for this test (not the calibration text): ~370 tokens to score.
PROSE = (
    'The old railway line that once connected the mountain villages to the coast was closed in the winter of 1962, '
    'when the last steam engine made its final journey through the tunnels. For years the tracks lay rusting under '
    'the snow, and the small stations slowly fell apart. Then a group of volunteers decided to turn the route into '
    'a path for walkers and cyclists. They cleared the fallen trees, rebuilt three wooden bridges and painted the '
    'signs by hand.\n\n'
    'Today the path is one of the most popular routes in the region. On a clear morning you can see the lake from '
    'the highest point, and in the afternoon the light turns the rocks a deep orange colour. Families stop for '
    'lunch at the former station of Santa Maria, where a café now serves soup, bread and cheese made by the farmers'
    ' in the valley. The owner keeps a collection of photographs from the time when the trains still ran: workers '
    'posing beside the locomotive, children waving from the platform, and a wedding party that travelled to the '
    'church by special carriage.\n\n'
    'Engineers who study the line today are surprised by how well it was built. The gradient never rises above '
    'three percent, the curves were measured with simple instruments, and the stone walls still hold back the '
    'hillside after more than a century. "They had no computers and very little money," one of them said, "but they'
    ' understood the mountain better than we do." Some of the original plans survive in the archive of the '
    'provincial library, drawn in ink on thick paper and signed by an engineer whose name nobody remembers.\n\n'
    'The volunteers are now raising money to restore the last tunnel, which has been closed since a small landslide'
    ' in 2009. They hope to open it next summer, so that walkers can follow the entire route from the mountains to '
    'the sea in two or three days.'
)


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.device("cpu"), torch.float32)


def greedy(loaded, kv_cache_dtype: str, max_tokens: int, **overrides) -> tuple[str, list[int], Engine]:
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=16 << 20, max_model_len=256,
                          max_num_batched_tokens=64, **overrides)
    engine = Engine(config, loaded=loaded)
    engine.start()
    try:
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
        out = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        assert out.error is None, out.error
        assert engine.kv_cache.num_free_pages == engine.kv_cache.num_pages, "turbo pages leaked"
        assert len(engine.kv_cache.free_recent_rows) == engine.kv_cache.recent_rows, "recent-window rows leaked"
        return out.text, out.token_ids, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("key_offset", ["fixed", "partial", "turned"])
def test_turbo4_greedy_matches_bf16_kv_for_the_first_tokens(loaded, key_offset):
    dense_text, dense_ids, _ = greedy(loaded, "bf16", 8)
    text, ids, _ = greedy(loaded, "turbo4", 8, kv_key_offset=key_offset)
    assert ids[:6] == dense_ids[:6], (text, dense_text)


def test_turbo3_answers_coherently_and_counts_its_real_bytes(loaded, caplog):
    text, _, engine = greedy(loaded, "turbo3", 16)
    assert "Tokyo" in text, text
    # SmolLM2: 30 layers, 3 KV heads of 64 dims; turbo3 stores 24 index bytes + one fp16 norm per head, K and V.
    assert engine.kv_cache.bytes_per_token == 30 * 3 * 2 * 26
    # On a CPU the start-up says what the format trades: 128 bf16 bytes a head against 26.
    assert f"turbo3 KV on a CPU runs the torch reference: it holds {128 / 26:.1f}x the tokens" in caplog.text


def test_mixed_turbo4_keys_turbo3_values(loaded):
    text, _, _ = greedy(loaded, "auto", 16, kv_cache_dtype_k="turbo4", kv_cache_dtype_v="turbo3")
    assert "Tokyo" in text, text


def prose_nlls(loaded, kv_cache_dtype: str, **overrides) -> tuple[torch.Tensor, str]:
    """Negative log-likelihood of each PROSE token after the first, and the engine's balance label. No recent
    window unless asked: it reads a third of PROSE's keys exactly, which would hide what the pages lose. Prompts
    attend in float32 even on a CPU with AMX: the f32 cache is the exact model the others are measured against."""
    overrides = {"kv_recent_window": 0, "max_num_batched_tokens": 512, "cpu_prompt_dtype": "float32", **overrides}
    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_cache_memory=64 << 20, max_model_len=1024, **overrides)
    engine = Engine(config, loaded=loaded)
    engine.start()
    try:
        out = engine.generate(engine.tokenizer.encode(PROSE), SamplingParams(max_tokens=1, prompt_logprobs=True,
                                                                                ignore_eos=True))
        assert out.error is None, out.error
        return -torch.tensor(out.prompt_logprobs[1:]), balance_label(loaded.model)
    finally:
        engine.shutdown()


def test_the_channel_balance_brings_turbo_closer_to_the_exact_model_and_a_dense_engine_takes_it_out(loaded):
    exact, label = prose_nlls(loaded, "f32")
    assert label == "off", "a dense engine takes out what an earlier test's turbo engine folded in"
    original = {n: p.clone() for n, p in loaded.model.named_parameters()}
    for kind in ("turbo3", "turbo4"):
        balanced, label = prose_nlls(loaded, kind)
        assert label == "on"
        plain, label = prose_nlls(loaded, kind, kv_balance=False)
        assert label == "off", "--no-kv-balance takes out the balance an earlier engine folded in"
        error, error_plain = (balanced - exact).abs().mean(), (plain - exact).abs().mean()
        assert error < 0.95 * error_plain, f"{kind}: mean |NLL error| {error:.4f} balanced, {error_plain:.4f} not"
    _, label = prose_nlls(loaded, "turbo3")
    _, label = prose_nlls(loaded, "bf16")
    assert label == "off", "a dense cache takes out the balance a turbo engine folded in"
    for name, p in loaded.model.named_parameters():
        assert torch.allclose(p, original[name], rtol=1e-5, atol=1e-7), f"{name}: the model as loaded is not back"


def test_the_recent_window_brings_turbo3_far_closer_to_the_exact_model(loaded):
    exact, _ = prose_nlls(loaded, "f32")
    paged, _ = prose_nlls(loaded, "turbo3")
    windowed, _ = prose_nlls(loaded, "turbo3", kv_recent_window=128, max_num_batched_tokens=96)  # chunks cut windows
    error, error_paged = (windowed - exact).abs().mean(), (paged - exact).abs().mean()
    assert error < 0.5 * error_paged, f"mean |NLL error| {error:.4f} with the window, {error_paged:.4f} without"
