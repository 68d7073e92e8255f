"""nn.Modules over quantized weights, with the call of the models' bf16 modules.

`QuantizedExperts(x, topk_weights, topk_ids) -> y` replaces a MoE block's `experts`;
`QuantizedMLP(x) -> y` replaces a dense SwiGLU MLP as a one-expert MoE (every token routed
to expert 0 with weight 1). Packed tensors are buffers, so `module.to(device)` moves them.
"""

from __future__ import annotations

import torch
from torch import nn

from server.kernels.experts.moe import fused_moe
from server.kernels.experts.weights import ExpertWeights


class QuantizedExperts(nn.Module):
    def __init__(self, gate_up: ExpertWeights, down: ExpertWeights):
        super().__init__()
        self._meta = {}
        for role, w in (("gate_up", gate_up), ("down", down)):
            self._meta[role] = (w.format, w.shape, w.signs, w.group)
            for name, t in w.tensors.items():
                self.register_buffer(f"{role}_{name}", t)

    def weights(self, role: str) -> ExpertWeights:
        fmt, shape, signs, group = self._meta[role]
        prefix = role + "_"
        tensors = {n[len(prefix):]: b for n, b in self.named_buffers() if n.startswith(prefix)}
        return ExpertWeights(fmt, shape, tensors, signs, group)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, topk_weights, topk_ids, self.weights("gate_up"), self.weights("down"))

    def extra_repr(self) -> str:
        fmt, shape, _, group = self._meta["gate_up"]
        return f"format={fmt}, experts={shape[0]}, hidden={shape[2]}, intermediate={shape[1] // 2}, rotation_group={group}"


class QuantizedMLP(nn.Module):
    def __init__(self, gate_up: ExpertWeights, down: ExpertWeights):
        super().__init__()
        if gate_up.shape[0] != 1:
            raise ValueError(f"a dense MLP is one expert; got {gate_up.shape[0]}")
        self.experts = QuantizedExperts(gate_up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ones = torch.ones((flat.shape[0], 1), dtype=x.dtype, device=x.device)
        zeros = torch.zeros((flat.shape[0], 1), dtype=torch.int64, device=x.device)
        return self.experts(flat, ones, zeros).reshape(shape)
