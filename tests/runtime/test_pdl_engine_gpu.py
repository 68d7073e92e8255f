"""The engine under programmatic dependent launch (server/kernels/pdl.py) on the GPU: the same greedy tokens as the
same engine with PDL off.

Every kernel computes the same bits with PDL or without it; PDL only lets a kernel start before the one before it
has finished. A random-weight model's logits are nearly flat, so a kernel that read its input before the kernel
writing it was done would change greedy tokens. Requests run one at a time, so both engines take the same steps:
a short prompt, and prompts of several prefill chunks, then decode steps through the CUDA graphs of two context
buckets, for bf16 KV and for turbo3 KV with the recent window and the engine's default key offset.
Run with TURBOSERVE_GPU_TESTS=1 (tests/conftest.py).
"""

import gc

import pytest
import torch

from bench.e2e import build_random_model, make_engine, random_prompts
from server.config import DEFAULT_KV_KEY_OFFSET
from server.kernels import pdl
from server.runtime.models.config import ModelConfig
from server.runtime.sequence import SamplingParams

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig(
    architecture="llama", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
PROMPT_LENGTHS = (5, 300, 1500)  # one chunk; two chunks; six chunks of 256 (the longest decodes past 2048's bucket)


def greedy_runs(engine, lengths: tuple[int, ...], max_tokens: int) -> list[list[int]]:
    """A random prompt of each length (seeded by it), one after another through ``engine``, greedy."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [engine.generate(random_prompts(1, n, CONFIG.vocab_size, seed=n)[0], params).token_ids for n in lengths]


def greedy_tokens(kind: str) -> list[list[int]]:
    loaded = build_random_model(CONFIG, torch.device("cuda"), torch.bfloat16)
    engine = make_engine(loaded, max_seqs=4, max_model_len=4096, kv_cache_dtype=kind, budget_tokens=4096, chunk=256,
                         kv_key_offset=DEFAULT_KV_KEY_OFFSET)
    try:
        return greedy_runs(engine, PROMPT_LENGTHS, 600)
    finally:
        engine.shutdown()
        del engine, loaded
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["bf16", "turbo3"])
def test_greedy_tokens_under_pdl_equal_those_without_it(kind, monkeypatch):
    if not pdl.launch_options(torch.device("cuda")).get("USE_PDL"):
        pytest.skip("PDL is off on this device (pdl.py: sm_90+, Triton >= 3.4, TURBOSERVE_PDL unset)")
    with_pdl = greedy_tokens(kind)
    monkeypatch.setattr(pdl, "launch_options", lambda device: {"USE_PDL": False})
    without_pdl = greedy_tokens(kind)
    for n, got, want in zip(PROMPT_LENGTHS, with_pdl, without_pdl):
        assert len(got) == len(want) == 600
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
        assert got == want, f"{kind}, {n}-token prompt: greedy tokens part at token {same} of 600"
