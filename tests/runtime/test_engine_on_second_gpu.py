"""An engine on the second GPU gives the tokens the same engine gives on the first.

Triton and the NVRTC launcher launch on the calling thread's current device, and the engine builds in one thread and
loops in another: unless both make the engine's device current, an engine on cuda:1 launches its kernels on cuda:0.
Greedy tokens of a random model, prompts of several prefill chunks then decode through the CUDA graphs, bf16 and
turbo3 KV (Triton and CUDA C kernels). Needs two GPUs; run with TURBOSERVE_GPU_TESTS=1 (tests/conftest.py).
"""

import threading

import pytest
import torch

from bench.e2e import build_random_model, make_engine, random_prompts
from server.runtime.models.config import ModelConfig
from server.runtime.sequence import SamplingParams

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig(
    architecture="llama", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
PROMPT_LENGTHS = (7, 700)


def greedy_tokens(device: torch.device, kind: str) -> list[list[int]]:
    built: dict = {}

    def build() -> None:  # as serve does (runtime.engine.build_engine): not on the thread that asks for tokens
        loaded = build_random_model(CONFIG, device, torch.bfloat16)
        built["engine"] = make_engine(loaded, max_seqs=4, max_model_len=4096, kv_cache_dtype=kind, budget_tokens=4096,
                                      chunk=256)  # fmt: skip

    builder = threading.Thread(target=build)
    builder.start()
    builder.join()
    engine = built["engine"]
    try:
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        return [engine.generate(random_prompts(1, n, CONFIG.vocab_size, seed=n)[0], params).token_ids
                for n in PROMPT_LENGTHS]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["bf16", "turbo3"])
def test_an_engine_on_the_second_gpu_matches_the_first(kind):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    first = greedy_tokens(torch.device("cuda:0"), kind)
    second = greedy_tokens(torch.device("cuda:1"), kind)
    assert [len(t) for t in second] == [64, 64]
    assert second == first
    assert torch.cuda.current_device() == 0, "the engine changed the test thread's current device"
