"""GGUF files: ModelConfig from metadata, tensors renamed to Hugging Face names and dequantized.

llama.cpp's converter permutes the rows of Llama's Q and K weights so that its "normal" RoPE can rotate
adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves of each head. We undo that permutation at
load (``_unpermute_rows``), so every model here uses the one "rotate half" RoPE of rope.py. Qwen2/Qwen3
GGUFs are written unpermuted (llama.cpp rotates them NEOX-style, i.e. rotate half) and are left as they are.

The quantized blocks themselves stay reachable as ``RawTensor``s (rows un-permuted the same way), for
kernels that multiply them directly. MLPs stored in llama.cpp's 1- and 2-bit block types (q1_0 = 41,
q2_0 = 42; specs/expert-formats.md) are not dequantized at all: ``GGUFTensors.block_mlps`` builds the
quantized expert modules straight from their blocks. The installed gguf package may not know these
types (it cannot dequantize q1_0 and has no type 42), so ``GGUFReader`` locates their bytes itself and
only server/kernels/experts/qblocks.py ever decodes them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable

import gguf
import numpy as np
import torch
from torch import nn

from server.kernels.experts import qblocks  # block geometry and decoder of q1_0/q2_0 (plain torch)
from server.runtime.models.config import ModelConfig, unsupported_architecture

log = logging.getLogger(__name__)

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
# One projection of an MLP, under our names: routed experts, a dense MLP, Qwen2-MoE's shared expert.
_MLP_PROJECTION = re.compile(r"(.+)\.(gate|up|down)(_exps|_proj\.weight)")


class BlockGGMLType(IntEnum):
    """The block types of qblocks.py, for gguf versions that lack them (same names and ids as ggml)."""

    Q1_0 = qblocks.GGML_TYPE["q1_0"]
    Q2_0 = qblocks.GGML_TYPE["q2_0"]


# GGML type id -> our block format, for the types turboserve decodes itself.
_BLOCK_FORMATS = {qblocks.GGML_TYPE[name]: fmt for name, fmt in qblocks.BLOCK_FORMATS.items()}
_GGUF_READS = {t.value for t in gguf.GGMLQuantizationType if t in gguf.GGML_QUANT_SIZES}


class GGUFReader(gguf.GGUFReader):
    """gguf's reader, plus tensors of the block types it does not know (q2_0, type 42, in gguf 0.19).

    Their bytes are located from the tensor info alone: the data offset, and a size from the block
    geometry (18 bytes per block, qblocks.py). ``data`` is then uint8 [..., rows, bytes per row], the
    layout gguf gives every quantized type.
    """

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        def type_id(field) -> int:
            return int(field.parts[4][0])  # parts: name length, name, n_dims, dims, type, offset

        super()._build_tensors(start_offs, [f for f in fields if type_id(f) in _GGUF_READS])
        self.tensors += [self._block_tensor(start_offs, f) for f in fields if type_id(f) not in _GGUF_READS]

    def _block_tensor(self, start_offs: int, field) -> gguf.ReaderTensor:
        _, name_data, _, dims, raw_type, offset = field.parts
        name, type_id = str(bytes(name_data), encoding="utf-8"), int(raw_type[0])
        fmt = _BLOCK_FORMATS.get(type_id)
        if fmt is None:
            raise ValueError(
                f"tensor {name} has GGML type {type_id}, which neither the installed gguf package nor turboserve "
                "can read; re-convert the model with a supported quantization (e.g. Q8_0, Q4_K, F16)"
            )
        shape = tuple(int(d) for d in reversed(dims.tolist()))  # ggml lists the fastest dimension first
        if shape[-1] % fmt.block:
            raise ValueError(f"tensor {name}: {fmt.name} rows must be whole blocks of {fmt.block}, got {shape[-1]}")
        row_bytes = shape[-1] // fmt.block * (2 + fmt.code_bytes)
        n_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        data_offs = int(start_offs + offset[0])
        return gguf.ReaderTensor(
            name=name, tensor_type=BlockGGMLType(type_id), shape=dims, n_elements=int(np.prod(shape, dtype=np.int64)),
            n_bytes=n_bytes, data_offset=data_offs,
            data=self._get(data_offs, np.uint8, n_bytes).reshape(*shape[:-1], row_bytes), field=field,
        )  # fmt: skip


@dataclass
class RawTensor:
    """A tensor as stored in the GGUF file: rows of ggml blocks, in our (Hugging Face) row order."""

    data: np.ndarray  # uint8 [rows, bytes_per_row] for quantized types; the plain array for float types
    ggml_type: gguf.GGMLQuantizationType | BlockGGMLType
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

        fmt = _BLOCK_FORMATS.get(int(t.tensor_type))

        def get(data: np.ndarray = data, qtype: gguf.GGMLQuantizationType = t.tensor_type) -> np.ndarray:
            if fmt is not None:  # gguf cannot decode these; exact in float32 (fp16 scale times a small integer)
                d, codes = qblocks.from_gguf_blocks(fmt, torch.from_numpy(np.array(data)), shape[-1])
                return qblocks.dequantize(fmt, d, codes).numpy().reshape(shape)
            return gguf.quants.dequantize(data, qtype).reshape(shape)

        self._getters[hf_name] = get

    def _fuse_experts(self, layer: int) -> None:
        """ffn_{gate,up,down}_exps [E, rows, cols] -> experts.gate_up_proj [E, 2I, H] and experts.down_proj."""
        p = f"layers.{layer}.mlp.experts"
        gate, up, down = (self._getters.pop(f"{p}.{w}_exps") for w in ("gate", "up", "down"))
        self._getters[f"{p}.gate_up_proj"] = lambda: np.concatenate([gate(), up()], axis=1)
        self._getters[f"{p}.down_proj"] = down

    def block_mlps(self) -> dict[str, nn.Module]:
        """Quantized modules for the MLPs stored in q1_0/q2_0 blocks, by submodule name, built from the raw
        blocks without re-quantizing (their weights are the file's, bit for bit; GGUF blocks are not rotated,
        so the modules multiply the activations as they are).

        An MLP qualifies when its gate, up and down are all block types and gate and up share one (they are
        stored as one [gate; up] matrix); down may use the other type. Anything else is dequantized.
        """
        groups: dict[str, dict[str, RawTensor]] = {}
        for name, raw in self.raw.items():
            m = _MLP_PROJECTION.fullmatch(name)
            if m:
                groups.setdefault(m.group(1), {})[m.group(2)] = raw
        usable = {}
        for prefix, parts in groups.items():
            fmts = {which: _BLOCK_FORMATS.get(int(raw.ggml_type)) for which, raw in parts.items()}
            if len(parts) == 3 and None not in fmts.values() and fmts["gate"] == fmts["up"]:
                usable[prefix] = parts
            elif any(fmts.values()):
                types = ", ".join(f"{w} {parts[w].ggml_type.name}" for w in sorted(parts))
                log.info("%s: %s; blocks are used as is only when gate, up and down all are q1_0/q2_0 (gate and up "
                         "of one type), so this MLP is dequantized", prefix, types)
        if not usable:
            return {}
        # Lazily: a file without such MLPs never needs the expert kernels.
        from server.kernels.experts.modules import QuantizedExperts, QuantizedMLP
        from server.kernels.experts.weights import from_gguf

        def weights(fmt: qblocks.BlockFormat, data: np.ndarray, shape: tuple[int, ...]):
            return from_gguf(fmt.name, torch.from_numpy(np.array(data)), shape[-2], shape[-1])

        modules = {}
        for prefix, p in usable.items():
            gate, up, down = p["gate"], p["up"], p["down"]
            fmt = _BLOCK_FORMATS[int(gate.ggml_type)]
            rows = gate.shape[-2] + up.shape[-2]
            gate_up = weights(fmt, np.concatenate([gate.data, up.data], axis=-2), (rows, gate.shape[-1]))
            down_w = weights(_BLOCK_FORMATS[int(down.ggml_type)], down.data, down.shape)
            is_experts = prefix.endswith(".experts")
            modules[prefix] = (QuantizedExperts if is_experts else QuantizedMLP)(gate_up, down_w)
        log.info("%d MLP(s) use their GGUF q1_0/q2_0 blocks as is (no dequantized copy)", len(modules))
        return modules

    def names(self) -> list[str]:
        return list(self._getters)

    def get(self, name: str) -> torch.Tensor:
        array = self._getters[name]()
        if name.endswith("shared_expert_gate.weight") and array.ndim == 1:
            array = array[None, :]  # llama.cpp stores this [H]; it is a Linear(H, 1)
        array = np.ascontiguousarray(array, dtype=np.float32)
        # F32 tensors come straight from the read-only memory map; torch wants memory it may write.
        return torch.from_numpy(array if array.flags.writeable else array.copy())
