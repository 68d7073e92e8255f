"""A GGUF's 4-bit MLP weights multiplied as stored on a CPU (server/kernels/int4_cpu.py), not dequantized to fp32.

The embedded SmolLM2 keeps its MLPs in Q4_1 blocks: 59 % of its weights, read once a decode step. As float32 they
stream 8x the bytes, and on the 2-core CI machine they took ~11 ms of a ~30 ms step.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from server.kernels.int4_cpu import KINDS, Int4Codes, Int4Weight
from server.runtime.models.gguf_loader import RawTensor
from server.runtime.models.llama import DenseMLP


def use_int4_mlps(model: nn.Module, raw: dict[str, RawTensor]) -> int:
    """Give every dense MLP whose gate, up and down are Q4_0 / Q4_1 blocks in the file (``raw``: LoadedModel's
    raw_weights) those blocks as its weights, and drop its float copies. Returns how many MLPs changed."""
    changed = 0
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        tensors = [raw.get(f"layers.{i}.mlp.{w}_proj.weight") for w in ("gate", "up", "down")]
        if not isinstance(mlp, DenseMLP) or any(t is None or t.ggml_type.name not in KINDS for t in tensors):
            continue
        gate, up, down = (Int4Codes.from_ggml(torch.from_numpy(np.array(t.data)), t.ggml_type.name) for t in tensors)
        mlp.int4 = (Int4Weight.pack(Int4Codes.cat([gate, up])), Int4Weight.pack(down))
        mlp.gate_up_proj = mlp.down_proj = None
        changed += 1
    return changed
