"""Hugging Face directories: config.json + *.safetensors (single file, or shards listed by an index)."""

from __future__ import annotations

import glob
import json
import os
from contextlib import ExitStack

import torch
from safetensors import safe_open

from server.runtime.models.config import ModelConfig, model_config_from_hf


def read_hf_config(path: str) -> tuple[ModelConfig, dict]:
    """(ModelConfig, parsed generation_config.json or {})."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = model_config_from_hf(json.load(f))
    gen_file = os.path.join(path, "generation_config.json")
    generation = json.load(open(gen_file, encoding="utf-8")) if os.path.exists(gen_file) else {}
    return cfg, generation


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.exists(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{path}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights; convert .bin checkpoints with transformers' save_pretrained"
        )
    return files


class SafetensorsTensors:
    """Lazy access to every tensor of a checkpoint's safetensors files (memory-mapped, read on demand)."""

    def __init__(self, path: str):
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for file in _safetensors_files(path):
            handle = self._stack.enter_context(safe_open(file, framework="pt"))
            for name in handle.keys():
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()
