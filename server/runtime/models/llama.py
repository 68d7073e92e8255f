"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3), in reading order.

One token stream of T tokens from any number of sequences goes through the stack at once; the paged KV
store of each layer knows which tokens belong to which sequence (see server/kernels/paged_kv.py).
MoE models (moe.py) reuse this stack and swap the MLP of their sparse layers.

Parameter names follow the Hugging Face checkpoints minus the ``model.`` prefix, except that q/k/v are
fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (one matmul each; see weights.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from server.kernels.backend import use_triton
from server.kernels.int4_cpu import Int4Weight, int4_linear
from server.kernels.paged_kv import AttentionMetadata, KVLayerStore
from server.kernels.timing import timed
from server.runtime.models.config import ModelConfig
from server.runtime.models.rope import RotaryEmbedding


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; decode-sized inputs on the fast path stream the weight through server/kernels/gemv.py."""
    if use_triton(x):
        from server.kernels.gemv import linear as skinny_or_cublas  # Triton is imported only where it runs

        return skinny_or_cublas(x, weight, bias)
    return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 (bf16 squares overflow the mantissa); the weight multiplies in x's dtype,
        # as the checkpoints were trained.
        if use_triton(x):
            from server.kernels.rmsnorm import rms_norm  # one fused launch, same rounding points

            return rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add in front of a norm, one launch on the fast path."""
        if use_triton(x):
            from server.kernels.rmsnorm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self(summed), summed


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Call: ``mlp(x [T, H]) -> [T, H]``; a quantized MLP keeps that call."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # rows: gate, then up
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # (gate_up, down) as the file's 4-bit blocks, multiplied as they are on a CPU (int4_weights.py); the float
        # projections are then dropped
        self.int4: tuple[Int4Weight, Int4Weight] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from server.kernels.gemv import linear_silu_and_mul  # decode: SiLU * up in the matmul's epilogue

            with timed("gate_up_proj", x.device):
                act = linear_silu_and_mul(x, self.gate_up_proj.weight)
        else:
            with timed("gate_up_proj", x.device):
                gate_up = F.linear(x, self.gate_up_proj.weight) if self.int4 is None else int4_linear(x, self.int4[0])
                gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        with timed("down_proj", x.device):
            return linear(act, self.down_proj.weight) if self.int4 is None else int4_linear(act, self.int4[1])


def _scale_(weight: torch.Tensor, factor: torch.Tensor) -> None:
    """weight *= factor (broadcast), computed in float32 and rounded once to the weight's dtype."""
    weight.copy_(weight.float() * factor)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.attention_output_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = cfg.head_dim**-0.5
        self.key_scale: torch.Tensor | None = None  # the K / V channel balance folded in (set_kv_balance)
        self.value_scale: torch.Tensor | None = None
        # (qkv, o) as the file's 4-bit blocks, multiplied as they are on a CPU (int4_weights.py); the float weights
        # are then dropped
        self.int4: tuple[Int4Weight, Int4Weight] | None = None

    @property
    def key_scale_per_head(self) -> bool:
        """Whether K can be balanced per KV head: a q/k norm's weight is shared by all heads."""
        return self.q_norm is None

    def value_output_energy(self) -> torch.Tensor:
        """float32 [kv_heads, D]: per V channel, the squared norm of the o_proj columns that read it."""
        group = self.num_heads // self.num_kv_heads
        energy = self.o_proj.weight.detach().float().pow(2).sum(0).view(self.num_kv_heads, group, self.head_dim)
        return energy.sum(1) * self._folded(self.value_scale).pow(2)  # as if unbalanced

    @torch.no_grad()
    def set_kv_balance(self, key_scale: torch.Tensor | None, value_scale: torch.Tensor | None) -> None:
        """Fold K channel scales s and V channel scales t ([kv_heads, D] each, None for ones; runtime/kv_balance.py)
        into the weights in place of the ones folded before: k -> s k, q -> q / s, v -> t v, o_proj's input
        columns / t. Scores and outputs are unchanged; the KV cache sees s k and t v. K scales must be equal on
        each rotate-half pair (RoPE turns the two together), and on all heads without key_scale_per_head."""
        if key_scale is None and value_scale is None and self.key_scale is None and self.value_scale is None:
            return  # nothing folded, nothing to take out
        h, d, group = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        new_k, new_v = self._folded(key_scale), self._folded(value_scale)
        for name, s in (("key", new_k), ("value", new_v)):
            if s.shape != (h, d) or not torch.isfinite(s).all() or not (s > 0).all():
                raise ValueError(f"{name} scales must be positive and finite, shape [{h}, {d}], got {list(s.shape)}")
        if not torch.equal(new_k[:, : d // 2], new_k[:, d // 2 :]):
            raise ValueError("key scales must be equal on the two channels of each rotate-half pair")
        if not self.key_scale_per_head and not torch.equal(new_k, new_k[:1].expand_as(new_k)):
            raise ValueError("this model's q/k norm is shared by all heads: key scales must be too")
        k = (new_k / self._folded(self.key_scale)).flatten()  # what to fold on top of the current balance
        v = (new_v / self._folded(self.value_scale)).flatten()
        q = k.view(h, 1, d).expand(h, group, d).flatten()
        q_size, kv_size = self.num_heads * d, h * d
        if self.q_norm is not None:  # the norm comes after the projection: scale its weight instead
            _scale_(self.q_norm.weight, 1 / q[:d])
            _scale_(self.k_norm.weight, k[:d])
            rows = torch.cat([torch.ones(q_size + kv_size, device=v.device), v])
        else:
            rows = torch.cat([1 / q, k, v])
        _scale_(self.qkv_proj.weight, rows[:, None])
        if self.qkv_proj.bias is not None:
            _scale_(self.qkv_proj.bias, rows)
        _scale_(self.o_proj.weight, 1 / v.view(h, 1, d).expand(h, group, d).flatten()[None, :])
        self.key_scale = None if key_scale is None else new_k
        self.value_scale = None if value_scale is None else new_v

    def _folded(self, scale: torch.Tensor | None) -> torch.Tensor:
        """``scale`` as float32 on the weights' device, ones for None."""
        device = self.o_proj.weight.device
        if scale is None:
            return torch.ones(self.num_kv_heads, self.head_dim, device=device)
        return scale.to(device=device, dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv: KVLayerStore, meta: AttentionMetadata
    ) -> torch.Tensor:
        T = x.shape[0]
        written = False
        if self.q_norm is None and use_triton(x):
            from server.kernels.gemv import linear_rope  # decode: RoPE (and the cache write) in the matmul's epilogue

            # Stores that quantize or record what they are given (turbo, calibration) keep their own write.
            pages = kv.pages_for_fused_write() if hasattr(kv, "pages_for_fused_write") else None
            with timed("qkv_proj", x.device):
                q, k, v = linear_rope(
                    x, self.qkv_proj.weight, self.qkv_proj.bias, positions, self.rotary.inv_freq,
                    self.rotary.attention_scaling, self.num_heads, self.num_kv_heads, self.head_dim,
                    None if pages is None else (*pages, meta.slot_mapping),
                )  # fmt: skip
            written = pages is not None
        else:
            with timed("qkv_proj", x.device):
                qkv = self._project(x, self.qkv_proj, 0)
            q, k, v = qkv.split(
                [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
                dim=-1,
            )
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:  # Qwen3 normalizes each head before rotating it
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        if not written:
            kv.write(k, v, meta.slot_mapping, positions)
        out = kv.attend(q, meta, self.scale)
        with timed("o_proj", x.device):
            return self._project(out.reshape(T, self.num_heads * self.head_dim), self.o_proj, 1)

    def _project(self, x: torch.Tensor, proj: nn.Linear, which: int) -> torch.Tensor:
        """proj(x); from the file's 4-bit blocks (self.int4[which]) where int4_weights.py gave them."""
        if self.int4 is None:
            return linear(x, proj.weight, proj.bias)
        y = int4_linear(x, self.int4[which])
        return y if proj.bias is None else y + proj.bias


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, kv: KVLayerStore,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(this layer's MLP output, the residual stream before it). The residual stream after a layer is
        their sum; it is taken by the next norm's add (one launch: add_and_norm), never on its own."""
        if residual is None:  # the first layer: x is the embeddings
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(h, positions, kv, meta), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm, LM head. ``make_mlp(layer)`` builds each layer's MLP."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.config = cfg
        make_mlp = make_mlp or (lambda layer: DenseMLP(cfg.hidden_size, cfg.intermediate_size))
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, make_mlp(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logits_weight: torch.Tensor | None = None  # the LM head in another dtype (set_logits_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: list[KVLayerStore],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]."""
        if len(kv) != len(self.layers):
            raise ValueError(f"got {len(kv)} KV stores for a model of {len(self.layers)} layers; pass one per layer")
        x, residual = self.embed_tokens(input_ids), None
        for layer, store in zip(self.layers, kv):
            x, residual = layer(x, residual, positions, store, meta)
        return self.norm.add_and_norm(x, residual)[0]

    def attentions(self) -> list[Attention]:
        """Each layer's attention, in order (their K / V channel balance: runtime/kv_balance.py)."""
        return [layer.self_attn for layer in self.layers]

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's frequencies [head_dim / 2] (one rotary embedding serves every layer)."""
        return self.layers[0].self_attn.rotary.inv_freq

    def set_logits_dtype(self, dtype: torch.dtype) -> int:
        """Multiply the LM head in ``dtype``: through a copy of its weight where that is another dtype (a CPU that
        multiplies bf16 natively reads the 49152 x 576 head of SmolLM2 in 3.7 ms instead of 8.3 in float32, most
        of a decode step's GEMV bytes); the embeddings, tied to it or not, stay as they are. Returns the copy's
        bytes (0: none)."""
        weight = self._head_weight()
        self.logits_weight = None if dtype == weight.dtype else weight.detach().to(dtype)
        return 0 if self.logits_weight is None else self.logits_weight.nbytes

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only the rows that need logits) -> float32 logits [N, vocab]."""
        weight = self._head_weight() if self.logits_weight is None else self.logits_weight
        return linear(hidden.to(weight.dtype), weight).float()

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
