"""A GGUF's 4-bit weights multiplied as stored on a CPU (server/kernels/int4_cpu.py), not dequantized to float32.

The embedded SmolLM2 keeps its projections in Q4_1 blocks: 79 % of its weights, read once a decode step. As
float32 they stream 8x the bytes; on the 2-core CI machine its MLPs alone took ~11 ms of a ~30 ms step. An
attention's projections are taken only where no K / V channel balance is folded into them: the balance scales
o_proj's input columns, which a group's one scale and zero cannot follow.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from server.kernels.int4_cpu import KINDS, Int4Codes, Int4Weight
from server.runtime.models.gguf_loader import RawTensor
from server.runtime.models.llama import Attention, DenseMLP


def use_int4_weights(model: nn.Module, raw: dict[str, RawTensor], bf16_prompts: bool = False) -> tuple[int, int]:
    """Give every dense MLP and unbalanced attention whose projections are all Q4_0 / Q4_1 blocks in the file
    (``raw``: LoadedModel's raw_weights) those blocks as its weights, and drop its float copies. bf16_prompts:
    prompt chunks multiply them in bfloat16 (Int4Weight.pack). Returns how many (MLPs, attentions) changed."""
    mlps = attentions = 0
    for i, layer in enumerate(model.layers):
        mlp, attention = layer.mlp, layer.self_attn
        codes = _codes(raw, f"layers.{i}.mlp.", ("gate", "up", "down"))
        if isinstance(mlp, DenseMLP) and codes is not None:
            mlp.int4 = (Int4Weight.pack(Int4Codes.cat(codes[:2]), bf16_prompts),
                        Int4Weight.pack(codes[2], bf16_prompts))
            mlp.gate_up_proj = mlp.down_proj = None
            mlps += 1
        codes = _codes(raw, f"layers.{i}.self_attn.", ("q", "k", "v", "o"))
        if isinstance(attention, Attention) and attention.key_scale is None and attention.value_scale is None \
                and codes is not None:  # fmt: skip
            attention.int4 = (Int4Weight.pack(Int4Codes.cat(codes[:3]), bf16_prompts),
                              Int4Weight.pack(codes[3], bf16_prompts))
            attention.qkv_proj.weight = attention.o_proj.weight = None  # biases stay: added to the products
            attentions += 1
    return mlps, attentions


def _codes(raw: dict[str, RawTensor], prefix: str, projections: tuple[str, ...]) -> list[Int4Codes] | None:
    tensors = [raw.get(f"{prefix}{p}_proj.weight") for p in projections]
    if any(t is None or t.ggml_type.name not in KINDS for t in tensors):
        return None
    return [Int4Codes.from_ggml(torch.from_numpy(np.array(t.data)), t.ggml_type.name) for t in tensors]
