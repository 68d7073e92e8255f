"""ModelConfig: the shape of a model, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DENSE_ARCHITECTURES = ("llama", "qwen2", "qwen3")
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES

# config.json "model_type" (or "architectures" class name) -> our architecture name.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}
_HF_CLASS_NAMES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this server cannot run."""


def unsupported_architecture(name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"Unsupported model architecture {name!r}. Supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pass --model with a checkpoint of one of these."
    )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # transformers' rope parameters ("rope_type", "factor", ...); None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # MoE (0 / None for dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Extensions of the agreed contract (defaults keep the contract's meaning).
    attention_output_bias: bool = False  # bias on o_proj (Llama with attention_bias=True)
    decoder_sparse_step: int = 1  # Qwen-MoE: layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` routes through experts (Qwen-MoE can mix in dense layers)."""
        return self.is_moe and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


def hf_architecture(hf: dict[str, Any]) -> str:
    """Our architecture name for a config.json, or a clear error naming what it says."""
    model_type = hf.get("model_type")
    if model_type in _HF_MODEL_TYPES:
        return _HF_MODEL_TYPES[model_type]
    for cls in hf.get("architectures") or ():
        if cls in _HF_CLASS_NAMES:
            return _HF_CLASS_NAMES[cls]
    raise unsupported_architecture(model_type or ",".join(hf.get("architectures") or ()) or "<missing model_type>")


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    scaling = {**legacy, **params}
    if "type" in scaling and "rope_type" not in scaling:  # transformers 4's older spelling
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    # Same default as transformers (standardize_rope_params): the pre-training context length.
    if scaling["rope_type"] in ("llama3", "yarn"):
        scaling.setdefault(
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"),
        )
    return float(theta), scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json (transformers 4 or 5 spelling)."""
    arch = hf_architecture(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu' SwiGLU MLPs).")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported (no supported architecture uses MLP biases).")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError(
            "use_sliding_window=true is not supported: sliding-window attention would need windowed KV pages."
        )
    num_heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    max_pos = hf.get("max_position_embeddings", 4096)
    if arch == "mixtral" and hf.get("sliding_window"):
        # Mixtral attends over a window; within the window that equals full attention, so cap the context.
        max_pos = min(max_pos, hf["sliding_window"])
    qkv_bias = {"qwen2": True, "qwen2_moe": hf.get("qkv_bias", True), "mixtral": False}.get(
        arch, hf.get("attention_bias", False)
    )
    out_bias = arch in ("llama", "qwen3", "qwen3_moe") and bool(hf.get("attention_bias", False))
    num_experts = 0
    if arch in MOE_ARCHITECTURES:
        num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    return ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size", 0),
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(qkv_bias),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 0) if num_experts else 0,
        # Mixtral's experts are intermediate_size wide; Qwen-MoE names theirs separately.
        moe_intermediate_size=(hf.get("moe_intermediate_size") or hf.get("intermediate_size", 0)) if num_experts else 0,
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0,
        # Mixtral always renormalizes the top-k (transformers' MixtralTopKRouter); Qwen-MoE follows its config.
        norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        attention_output_bias=out_bias,
        decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    )
