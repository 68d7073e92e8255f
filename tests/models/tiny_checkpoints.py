"""Tiny random Hugging Face checkpoints, written to disk the way transformers saves them."""

from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 97  # odd on purpose
# Two prompts of odd lengths (11 and 6 tokens: page boundaries at page_size 4 fall mid-prompt).
PROMPTS = {
    "a": [int(x) for x in torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(1))],
    "b": [int(x) for x in torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(2))],
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers zero-initializes Qwen routers and uses std 0.02 elsewhere: near-ties everywhere, which
    would make greedy and top-k comparisons meaningless. Larger random weights give clear decisions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            else:
                std = 1.0 if "embed" in name else 0.15
                p.copy_(torch.randn(p.shape, generator=g) * std)


def write_tokenizer(path: str, chat_template: str | None = None) -> None:
    """A word-level tokenizer over VOCAB tokens 't0'..'t96' (the models only need ids)."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "t1", "eos_token": "t2"}, f)
    if chat_template is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(chat_template)


CONFIGS = {
    # name: (config class, kwargs). head_dim 64 and 128, GQA ratios 1..4, RoPE scalings, tied embeddings.
    "llama_llama3_rope": (
        transformers.LlamaConfig,
        dict(hidden_size=96, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    ),
    "llama_linear_rope_tied_bias": (
        transformers.LlamaConfig,
        dict(hidden_size=96, intermediate_size=80, num_attention_heads=3, num_key_value_heads=3, head_dim=64,
             attention_bias=True, tie_word_embeddings=True,
             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
    ),
    "qwen2_yarn": (
        transformers.Qwen2Config,
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
             rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16}),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             tie_word_embeddings=True),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        dict(hidden_size=64, intermediate_size=80, moe_intermediate_size=40, shared_expert_intermediate_size=56,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=6, num_experts_per_tok=2,
             norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        dict(hidden_size=64, intermediate_size=80, moe_intermediate_size=40, num_attention_heads=4,
             num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
    ),
}


def make_checkpoint(name: str, path: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a random checkpoint of CONFIGS[name] (with ``overrides``) to ``path``; return the float32
    transformers model."""
    cls, kwargs = CONFIGS[name]
    kwargs = {**kwargs, **overrides}
    cfg = cls(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _randomize(model, seed)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    write_tokenizer(path)
    return model
