"""Our model forward vs transformers' on tiny random checkpoints loaded through our loader."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.runtime.models.loader import load_model
from paged_batch import PagedBatch, assert_matches_reference, greedy
from tiny_checkpoints import CONFIGS, PROMPTS, make_checkpoint

NEW_TOKENS = 32


def assert_matches_transformers(hf_model, path: str, chunk: int | None = None) -> None:
    ours = load_model(path, torch.device("cpu"), torch.float32).model
    generated, logits = greedy(PagedBatch(ours), PROMPTS, NEW_TOKENS, chunk=chunk)
    assert_matches_reference(hf_model, PROMPTS, generated, logits)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_match_transformers(name, tmp_path):
    hf_model = make_checkpoint(name, str(tmp_path))
    assert_matches_transformers(hf_model, str(tmp_path), chunk=4 if name == "llama_llama3_rope" else None)


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    hf_model = make_checkpoint("qwen3", str(tmp_path), max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_matches_transformers(hf_model, str(tmp_path))


@pytest.mark.parametrize("orientation", ["transformers", "transposed"])
def test_fused_expert_tensors_on_disk(tmp_path, orientation):
    """Rewrite Mixtral's per-expert w1/w2/w3 as fused experts.gate_up_proj / experts.down_proj."""
    hf_model = make_checkpoint("mixtral", str(tmp_path))
    tensors = load_file(tmp_path / "model.safetensors")
    fused = {}
    for layer in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        E = hf_model.config.num_local_experts
        gate_up = torch.stack([torch.cat([tensors.pop(f"{p}.{e}.w1.weight"), tensors.pop(f"{p}.{e}.w3.weight")]) for e in range(E)])
        down = torch.stack([tensors.pop(f"{p}.{e}.w2.weight") for e in range(E)])
        if orientation == "transposed":
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.contiguous()
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = down.contiguous()
    assert not any(".experts." in k and ".w" in k for k in tensors)
    save_file({**tensors, **fused}, tmp_path / "model.safetensors")
    assert_matches_transformers(hf_model, str(tmp_path))


def test_transformers4_config_spelling(tmp_path):
    """rope_theta + rope_scaling {"type": ...} and Qwen3-MoE's hub key num_experts load the same model."""
    hf_model = make_checkpoint("qwen3_moe", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts", None) or cfg["num_experts"]
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert_matches_transformers(hf_model, str(tmp_path))


def test_qwen_moe_decoder_sparse_step_mixes_dense_layers(tmp_path):
    """decoder_sparse_step=2: layer 0 has a dense MLP, layer 1 experts (transformers' Qwen-MoE rule)."""
    hf_model = make_checkpoint("qwen3_moe", str(tmp_path), decoder_sparse_step=2)
    assert not hasattr(hf_model.model.layers[0].mlp, "experts") and hasattr(hf_model.model.layers[1].mlp, "experts")
    assert_matches_transformers(hf_model, str(tmp_path))
