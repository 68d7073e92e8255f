"""Checkpoint tensors (Hugging Face names, any on-disk variant) -> our model's parameters.

Both loaders hand over tensors under Hugging Face names (the GGUF loader renames its own first). Names are
first made canonical:
  ``model.`` prefix dropped; Mixtral's ``block_sparse_moe`` -> ``mlp``;
  per-expert ``experts.N.w1 / w3 / w2`` (Mixtral: gate / up / down) -> ``experts.N.gate_proj / up_proj / down_proj``.
Then the parameters are built: q/k/v concatenated into ``qkv_proj``, gate/up into ``gate_up_proj``, per-expert
tensors stacked into ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` -- or taken as-is
when the checkpoint already has them fused (transformers 5's in-memory layout).
"""

from __future__ import annotations

import re
from typing import Callable, Collection, Iterator

import torch

from server.runtime.models.config import ModelConfig

_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class CheckpointError(ValueError):
    """A checkpoint lacks a tensor the model needs, or has one of the wrong shape."""


def canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])\.", lambda m: m.group(1) + _MIXTRAL_EXPERT[m.group(2)] + ".", name)


class _Checkpoint:
    """Tensor lookup by canonical name, with errors that say which tensor is missing."""

    def __init__(self, names: list[str], get: Callable[[str], torch.Tensor]):
        self._by_canonical = {canonical_name(n): n for n in names}
        self._get = get

    def has(self, name: str) -> bool:
        return name in self._by_canonical

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._by_canonical:
            raise CheckpointError(f"checkpoint has no tensor {name!r} (needed by the model); is the file complete?")
        return self._get(self._by_canonical[name])

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self(n) for n in names], dim=0)


def _experts(ck: _Checkpoint, prefix: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if ck.has(f"{prefix}.gate_up_proj"):
        # Fused on disk. transformers 5 stores [E, 2I, H] / [E, H, I]; some exporters store the transpose.
        # When H == 2I the orientation is ambiguous and transformers' own layout is assumed.
        gate_up, down = ck(f"{prefix}.gate_up_proj"), ck(f"{prefix}.down_proj")
        if gate_up.shape != (E, 2 * I, H) and gate_up.shape == (E, H, 2 * I):
            gate_up = gate_up.transpose(1, 2)
        if down.shape != (E, H, I) and down.shape == (E, I, H):
            down = down.transpose(1, 2)
    else:
        gate_up = torch.stack([ck.cat(f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight") for e in range(E)])
        down = torch.stack([ck(f"{prefix}.{e}.down_proj.weight") for e in range(E)])
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.down_proj", down


def _dense_mlp(ck: _Checkpoint, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield f"{prefix}.gate_up_proj.weight", ck.cat(f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")
    yield f"{prefix}.down_proj.weight", ck(f"{prefix}.down_proj.weight")


def _layer(ck: _Checkpoint, i: int, cfg: ModelConfig, skip: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
    p = f"layers.{i}"
    a = f"{p}.self_attn"
    yield f"{a}.qkv_proj.weight", ck.cat(f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight")
    if cfg.attention_bias:
        yield f"{a}.qkv_proj.bias", ck.cat(f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias")
    yield f"{a}.o_proj.weight", ck(f"{a}.o_proj.weight")
    if cfg.attention_output_bias:
        yield f"{a}.o_proj.bias", ck(f"{a}.o_proj.bias")
    if cfg.qk_norm:
        yield f"{a}.q_norm.weight", ck(f"{a}.q_norm.weight")
        yield f"{a}.k_norm.weight", ck(f"{a}.k_norm.weight")
    yield f"{p}.input_layernorm.weight", ck(f"{p}.input_layernorm.weight")
    yield f"{p}.post_attention_layernorm.weight", ck(f"{p}.post_attention_layernorm.weight")
    m = f"{p}.mlp"
    if not cfg.layer_is_sparse(i):
        if m not in skip:
            yield from _dense_mlp(ck, m)
        return
    yield f"{m}.gate.weight", ck(f"{m}.gate.weight")
    if f"{m}.experts" not in skip:
        yield from _experts(ck, f"{m}.experts", cfg)
    if cfg.shared_expert_intermediate_size:
        if f"{m}.shared_expert" not in skip:
            yield from _dense_mlp(ck, f"{m}.shared_expert")
        yield f"{m}.shared_expert_gate.weight", ck(f"{m}.shared_expert_gate.weight")


def model_parameters(
    cfg: ModelConfig, names: list[str], get: Callable[[str], torch.Tensor], skip: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (parameter name, tensor) for every parameter of the model, one layer at a time.

    ``names`` lists the checkpoint's tensors; ``get(name)`` reads one (lazily, so a big checkpoint never
    sits in memory twice). MLP submodules named in ``skip`` (``layers.N.mlp``, ``layers.N.mlp.experts``,
    ``layers.N.mlp.shared_expert``) are built elsewhere, e.g. quantized from a GGUF's blocks: their
    tensors are never read.
    """
    ck = _Checkpoint(names, get)
    yield "embed_tokens.weight", ck("embed_tokens.weight")
    for i in range(cfg.num_layers):
        yield from _layer(ck, i, cfg, skip)
    yield "norm.weight", ck("norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ck("lm_head.weight")
