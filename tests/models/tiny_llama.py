"""A small random Llama of our own model code, for tests that need the real forward (fused ops, CUDA-graph
plumbing, key calibration) at a size the CPU interpreter runs quickly."""

from __future__ import annotations

import torch

from server.runtime.models import llama
from server.runtime.models.config import ModelConfig

DEFAULTS = dict(
    architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip


def tiny_llama(seed: int = 0, **config) -> llama.CausalLM:
    """CausalLM in eval mode with torch's default init under ``seed``; ``config`` overrides DEFAULTS."""
    torch.manual_seed(seed)
    return llama.CausalLM(ModelConfig(**{**DEFAULTS, **config})).eval()
