"""GGUF files: ModelConfig from metadata, tensors renamed to Hugging Face names and dequantized.

llama.cpp's converter permutes the rows of Llama's Q and K weights so that its "normal" RoPE can rotate
adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves of each head. We undo that permutation at
load (``_unpermute_rows``), so every model here uses the one "rotate half" RoPE of rope.py. Qwen2/Qwen3
GGUFs are written unpermuted (llama.cpp rotates them NEOX-style, i.e. rotate half) and are left as they are.

The quantized blocks themselves stay reachable as ``RawTensor``s (rows un-permuted the same way), for
kernels that multiply them directly.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable

import gguf
import numpy as np
import torch

from server.runtime.models.config import ModelConfig, unsupported_architecture

# general.architecture -> ours ("llama" with experts is Mixtral).
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}

_TOP_LEVEL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight", "output.weight": "lm_head.weight"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class RawTensor:
    """A tensor as stored in the GGUF file: rows of ggml blocks, in our (Hugging Face) row order."""

    data: np.ndarray  # uint8 [rows, bytes_per_row] for quantized types; the plain array for float types
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape, Hugging Face order ([out_features, in_features] for weights)


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values (the GGUF.* header fields excluded)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def model_config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise unsupported_architecture(str(gguf_arch))
    arch = _GGUF_ARCHITECTURES[gguf_arch]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{name}", default)

    num_experts = key("expert_count", 0) or 0
    if arch == "llama" and num_experts:
        arch = "mixtral"
    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    scaling = None
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        scaling = {"rope_type": scaling_type, "factor": key("rope.scaling.factor")}
        if key("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp renormalizes the top-k for Mixtral and Qwen3-MoE, not for Qwen2-MoE, unless the file says.
    norm_topk = key("expert_weights_norm", arch in ("mixtral", "qwen3_moe"))
    return ModelConfig(
        architecture=arch,
        vocab_size=key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length", 0),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv") or num_heads,
        head_dim=key("attention.key_length") or hidden // num_heads,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings=False,  # read_gguf_config looks for output.weight
        attention_bias=arch in ("qwen2", "qwen2_moe"),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        num_experts_per_tok=key("expert_used_count", 0) if num_experts else 0,
        moe_intermediate_size=(key("expert_feed_forward_length") or key("feed_forward_length", 0)) if num_experts else 0,
        shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0) if arch == "qwen2_moe" else 0,
        norm_topk_prob=bool(norm_topk) if num_experts else True,
        bos_token_id=bos,
        eos_token_ids=(eos,) if eos is not None else (),
    )


def read_gguf_config(reader: gguf.GGUFReader, meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from the metadata, completed by what only the tensor list tells."""
    cfg = model_config_from_gguf(meta)
    tensors = {t.name: t for t in reader.tensors}
    # No output.weight: the LM head is the embedding matrix.
    cfg = dataclasses.replace(cfg, tie_word_embeddings="output.weight" not in tensors)
    if "rope_freqs.weight" in tensors:  # Llama 3.1+ RoPE scaling, as per-frequency divisors
        factors = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        cfg = dataclasses.replace(cfg, rope_scaling={"rope_type": "freq_factors", "factors": factors.ravel().tolist()})
    return cfg


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation: per head, row 2j -> j and row 2j+1 -> j + d/2."""
    shape = rows.shape
    return rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(name: str) -> str | None:
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m.group(2) in _PER_LAYER:
        return f"layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
    return None


class GGUFTensors:
    """Lazy access to a GGUF file's tensors under Hugging Face names (see weights.model_parameters)."""

    def __init__(self, reader: gguf.GGUFReader, cfg: ModelConfig):
        self.cfg = cfg
        self.raw: dict[str, RawTensor] = {}
        self._getters: dict[str, Callable[[], np.ndarray]] = {}
        experts: dict[tuple[int, str], gguf.ReaderTensor] = {}
        for t in reader.tensors:
            m = _EXPERTS.fullmatch(t.name)
            if m:
                experts[(int(m.group(1)), m.group(2))] = t
                continue
            hf = _hf_name(t.name)
            if hf is None:
                continue  # e.g. rope_freqs.weight, already part of the config (read_gguf_config)
            self._add(hf, t, self._permute_heads(hf))
        for (layer, which), t in experts.items():
            self._add(f"layers.{layer}.mlp.experts.{which}_exps", t, None)
        for layer in {layer for layer, _ in experts}:
            self._fuse_experts(layer)

    def _permute_heads(self, hf_name: str) -> int | None:
        """Head count to un-permute by, for Llama-architecture Q/K (see the module docstring)."""
        if self.cfg.architecture not in ("llama", "mixtral"):
            return None
        if hf_name.endswith("self_attn.q_proj.weight") or hf_name.endswith("self_attn.q_proj.bias"):
            return self.cfg.num_heads
        if hf_name.endswith("self_attn.k_proj.weight") or hf_name.endswith("self_attn.k_proj.bias"):
            return self.cfg.num_kv_heads
        return None

    def _add(self, hf_name: str, t: gguf.ReaderTensor, n_head: int | None) -> None:
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
        data = t.data if n_head is None else _unpermute_rows(np.asarray(t.data), n_head)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            self.raw[hf_name] = RawTensor(data, t.tensor_type, shape)

        def get(data: np.ndarray = data, qtype: gguf.GGMLQuantizationType = t.tensor_type) -> np.ndarray:
            return gguf.quants.dequantize(data, qtype).reshape(shape)

        self._getters[hf_name] = get

    def _fuse_experts(self, layer: int) -> None:
        """ffn_{gate,up,down}_exps [E, rows, cols] -> experts.gate_up_proj [E, 2I, H] and experts.down_proj."""
        p = f"layers.{layer}.mlp.experts"
        gate, up, down = (self._getters.pop(f"{p}.{w}_exps") for w in ("gate", "up", "down"))
        self._getters[f"{p}.gate_up_proj"] = lambda: np.concatenate([gate(), up()], axis=1)
        self._getters[f"{p}.down_proj"] = down

    def names(self) -> list[str]:
        return list(self._getters)

    def get(self, name: str) -> torch.Tensor:
        array = self._getters[name]()
        if name.endswith("shared_expert_gate.weight") and array.ndim == 1:
            array = array[None, :]  # llama.cpp stores this [H]; it is a Linear(H, 1)
        array = np.ascontiguousarray(array, dtype=np.float32)
        # F32 tensors come straight from the read-only memory map; torch wants memory it may write.
        return torch.from_numpy(array if array.flags.writeable else array.copy())
