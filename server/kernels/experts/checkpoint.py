"""A quantized-weights directory: `quantization.json` (format, base model, layout) + `experts.safetensors`.

Written by `turboserve quantize`; the model loader reads it back, loads the base model and
swaps in the quantized modules under the names recorded here. Only the quantized MLPs are
stored: every other tensor still comes from the base model.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from server.kernels.experts.modules import QuantizedExperts, QuantizedMLP
from server.kernels.experts.weights import ExpertWeights

META_FILE = "quantization.json"
TENSOR_FILE = "experts.safetensors"
LAYOUT_VERSION = 1


def is_quantized_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, META_FILE))


def save(path: str, fmt: str, base_model: str | None, name: str,
         modules: dict[str, tuple[str, ExpertWeights, ExpertWeights]]) -> None:
    """modules: submodule name -> ("experts" | "mlp", gate_up, down)."""
    os.makedirs(path, exist_ok=True)
    tensors, layout = {}, {}
    for module_name, (kind, gate_up, down) in modules.items():
        entry = {"kind": kind}
        for role, w in (("gate_up", gate_up), ("down", down)):
            entry[role] = {"format": w.format, "shape": list(w.shape), "group": w.group,
                           "signs": [list(s) for s in w.signs] if w.signs else None,
                           "tensors": sorted(w.tensors)}
            for tname, t in w.tensors.items():
                tensors[f"{module_name}.{role}.{tname}"] = t.contiguous().cpu()
        layout[module_name] = entry
    meta = {"layout_version": LAYOUT_VERSION, "format": fmt, "base_model": base_model, "name": name, "modules": layout}
    save_file(tensors, os.path.join(path, TENSOR_FILE))
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)


def load(path: str, device: torch.device) -> tuple[dict, dict[str, torch.nn.Module]]:
    """-> (metadata, submodule name -> QuantizedExperts | QuantizedMLP on ``device``)."""
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("layout_version") != LAYOUT_VERSION:
        raise ValueError(f"{path}: quantized layout version {meta.get('layout_version')} is not {LAYOUT_VERSION}; "
                         "re-run `turboserve quantize` with this version")
    tensors = load_file(os.path.join(path, TENSOR_FILE), device=str(device))
    modules = {}
    for module_name, entry in meta["modules"].items():
        parts = []
        for role in ("gate_up", "down"):
            r = entry[role]
            t = {n: tensors[f"{module_name}.{role}.{n}"] for n in r["tensors"]}
            signs = tuple(tuple(int(v) for v in s) for s in r["signs"]) if r["signs"] else None
            parts.append(ExpertWeights(r["format"], tuple(r["shape"]), t, signs, r["group"]))
        modules[module_name] = (QuantizedMLP if entry["kind"] == "mlp" else QuantizedExperts)(*parts)
    return meta, modules
