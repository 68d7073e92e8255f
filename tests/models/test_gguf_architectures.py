"""GGUF files of every supported architecture, written from tiny transformers models the way llama.cpp's
converter lays them out (tensor names, metadata keys, Llama's permuted Q/K rows, stacked experts, Llama 3
RoPE as a rope_freqs tensor), load to the same logits and greedy tokens as the transformers model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from paged_batch import PagedBatch, assert_matches_reference, greedy
from server.runtime.models.loader import load_model
from tiny_checkpoints import PROMPTS, VOCAB, make_checkpoint

GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
PER_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: interleave each head's two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf_model, arch: str) -> dict[str, np.ndarray]:
    c = hf_model.config
    out = {}
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy()
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            out[{"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = a
            continue
        _, layer, rest = name.split(".", 2)
        if rest == "mlp.experts.gate_up_proj":  # transformers 5 in memory: [E, 2I, H], gate rows first
            gate, up = np.split(a, 2, axis=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
            continue
        if rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = a
            continue
        module, kind = rest.rsplit(".", 1)
        if GGUF_ARCH[arch] == "llama" and module == "self_attn.q_proj":
            a = llama_cpp_permute(a, c.num_attention_heads)
        if GGUF_ARCH[arch] == "llama" and module == "self_attn.k_proj":
            a = llama_cpp_permute(a, c.num_key_value_heads)
        if module == "mlp.shared_expert_gate":
            a = a.reshape(-1)  # llama.cpp stores this gate as a vector
        out[f"blk.{layer}.{PER_LAYER[module]}.{kind}"] = a
    return out


def write_gguf(hf_model, arch: str, path: str, add_tensor=None) -> None:
    """``add_tensor(writer, name, float32 array)`` writes one tensor; by default as F32."""
    c = hf_model.config
    g = GGUF_ARCH[arch]
    w = gguf.GGUFWriter(path, g)
    ints = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
            "attention.key_length": c.head_dim, "attention.value_length": c.head_dim, "vocab_size": VOCAB}
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
        ints["expert_count"] = getattr(c, "num_local_experts", None) or c.num_experts
        ints["expert_used_count"] = c.num_experts_per_tok
        ints["expert_feed_forward_length"] = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    if arch == "qwen2_moe":
        ints["expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    for k, v in ints.items():
        w.add_uint32(f"{g}.{k}", v)
    rope = c.rope_parameters
    w.add_float32(f"{g}.rope.freq_base", rope["rope_theta"])
    w.add_float32(f"{g}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    if rope["rope_type"] == "yarn":
        w.add_string(f"{g}.rope.scaling.type", "yarn")
        w.add_float32(f"{g}.rope.scaling.factor", rope["factor"])
        w.add_uint32(f"{g}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    tensors = gguf_tensors(hf_model, arch)
    if rope["rope_type"] == "llama3":  # llama.cpp keeps Llama 3's scaling as per-frequency divisors
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](c)
        tensors["rope_freqs.weight"] = (base / scaled).numpy().astype(np.float32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([3 if i < 3 else 1 for i in range(VOCAB)])
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    add_tensor = add_tensor or (lambda writer, name, a: writer.add_tensor(name, a))
    for name, a in tensors.items():
        add_tensor(w, name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CASES = {
    "llama_llama3_rope": {},
    "qwen2_yarn": {},
    "qwen3": {},
    "mixtral": {},
    "qwen2_moe": {"mlp_only_layers": []},  # llama.cpp's qwen2moe has experts in every layer
    "qwen3_moe": {},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_matches_transformers(name, tmp_path):
    hf_model = make_checkpoint(name, str(tmp_path / "hf"), **CASES[name])
    arch = hf_model.config.model_type
    path = str(tmp_path / "model.gguf")
    write_gguf(hf_model, arch, path)
    ours = load_model(path, torch.device("cpu"), torch.float32)
    assert ours.config.architecture == arch
    generated, logits = greedy(PagedBatch(ours.model), PROMPTS, 32)
    assert_matches_reference(hf_model, PROMPTS, generated, logits)
