"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama stack with routed MLPs.

Routing, per token (checked against transformers' *TopKRouter / *SparseMoeBlock):
  probs = softmax(router(x)) over ALL experts, in float32; keep the top k;
  renormalize the k kept probabilities to sum to 1 -- always for Mixtral, iff ``norm_topk_prob`` for Qwen;
  y = sum_k weight_k * expert_k(x)
  Qwen2-MoE adds a shared expert: y += sigmoid(shared_expert_gate(x)) * shared_expert(x).

The routed experts are ONE call, ``experts(x, topk_weights, topk_ids) -> y``, on a module holding the
stacked weights of all experts. Quantized expert formats (server/kernels/experts) replace that module and
keep the call; nothing else here needs to change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from server.runtime.models.config import ModelConfig
from server.runtime.models.llama import CausalLM, DenseMLP


class Experts(nn.Module):
    """All experts' SwiGLU weights, stacked. Reference body: a loop over the experts that got tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        # Same layout as transformers 5 in memory: gate_up_proj[e] = [gate rows; up rows], as nn.Linear weights.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] (x's dtype), topk_ids [T, k] -> sum_k w * expert(x) [T, H]."""
        out = torch.zeros_like(x)
        for e in topk_ids.unique().tolist():
            tokens, slot = torch.where(topk_ids == e)
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, tokens, y * topk_weights[tokens, slot, None])
        return out


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert). Call: ``block(x [T, H]) -> [T, H]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] in x's dtype, topk_ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        y = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def build_moe_model(cfg: ModelConfig) -> CausalLM:
    """The decoder stack with a SparseMoeBlock in every sparse layer and a DenseMLP elsewhere."""

    def make_mlp(layer: int) -> nn.Module:
        if cfg.layer_is_sparse(layer):
            return SparseMoeBlock(cfg)
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    return CausalLM(cfg, make_mlp)
