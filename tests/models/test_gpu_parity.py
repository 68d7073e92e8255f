"""On a CUDA device: the same parity with transformers, in float32 and in bfloat16."""

from __future__ import annotations

import pytest
import torch
from paged_batch import PagedBatch, assert_matches_reference, greedy
from tiny_checkpoints import PROMPTS, make_checkpoint

from server.runtime.models.loader import load_model

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("name", ["llama_llama3_rope", "qwen2_yarn", "qwen3_moe", "qwen2_moe"])
def test_float32_on_cuda_matches_transformers(name, tmp_path):
    hf_model = make_checkpoint(name, str(tmp_path))
    ours = load_model(str(tmp_path), CUDA, torch.float32).model
    assert ours.embed_tokens.weight.is_cuda and ours.layers[0].self_attn.rotary.inv_freq.is_cuda
    generated, logits = greedy(PagedBatch(ours), PROMPTS, 32)
    assert_matches_reference(hf_model, PROMPTS, generated, logits)


@pytest.mark.parametrize("name", ["llama_llama3_rope", "qwen3"])
def test_bfloat16_on_cuda_close_to_transformers_bfloat16(name, tmp_path):
    hf_model = make_checkpoint(name, str(tmp_path)).to(CUDA, torch.bfloat16)
    ours = load_model(str(tmp_path), CUDA, torch.bfloat16).model
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    _, logits = greedy(PagedBatch(ours, kv_dtype=torch.bfloat16), {"a": PROMPTS["a"]}, 1)
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPTS["a"]], device=CUDA)).logits[0].float().cpu()
    rel = ((logits["a"] - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, f"{name}: relative logit error vs transformers bf16 {rel:.3g}"
