"""An engine on the second GPU gives the tokens the same engine gives on the first.

Triton and the NVRTC launcher launch on the calling thread's current device, and the engine builds in one thread and
loops in another: unless both make the engine's device current, an engine on cuda:1 launches its kernels on cuda:0.
Greedy tokens of a random model, prompts of several prefill chunks then decode through the CUDA graphs, bf16 and
turbo3 KV (Triton and CUDA C kernels). Needs two GPUs; run with TURBOSERVE_GPU_TESTS=1 (tests/conftest.py).
"""

import threading

import pytest
import torch

from test_pdl_engine_gpu import CONFIG, greedy_runs  # the same small random model

from bench.e2e import build_random_model, make_engine

pytestmark = pytest.mark.gpu

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
        return greedy_runs(engine, PROMPT_LENGTHS, 64)
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
