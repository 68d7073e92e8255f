"""Rotary position embedding (RoPE) in the "rotate half" layout, with the scaling variants our configs use.

Frequencies follow transformers' ``modeling_rope_utils`` definitions exactly, so a checkpoint gives the
same positions here as there: "default", "linear" (positions stretched by ``factor``), "llama3"
(Llama 3.1+: low frequencies divided by ``factor``, a smooth ramp between ``low_freq_factor`` and
``high_freq_factor``) and "yarn" (Qwen2.5/Qwen3 long context: per-dimension blend of interpolation and
extrapolation, plus an attention factor that scales cos and sin). "freq_factors" is llama.cpp's spelling of
the same idea: GGUF files of Llama 3.1+ carry a ``rope_freqs`` tensor that divides each base frequency.

"dynamic" NTK is refused: its frequencies depend on each sequence's current length, which a batch mixing
sequences of different lengths cannot share.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from server.kernels.backend import use_triton
from server.runtime.models.config import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(theta: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = _yarn_mscale(factor, s["mscale"]) / _yarn_mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_scaling) for a config's RoPE."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if scaling and scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported (RoPE over the whole head only).")
    inv_freq = _base_inv_freq(theta, head_dim)
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(theta, head_dim, scaling, max_position_embeddings)
    return inv_freq, 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int):
        super().__init__()
        with torch.device("cpu"):  # real values even when the model is being built on the meta device
            inv_freq, self.attention_scaling = rope_frequencies(head_dim, theta, scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] to their token positions [T]."""
        if use_triton(q):
            from server.kernels.rotary import apply_rotary  # one launch instead of ~20 elementwise kernels

            return apply_rotary(positions, q, k, self.inv_freq, self.attention_scaling)
        # float32 angles: positions up to 2**24 are exact, and bf16 angles would drift within a few hundred tokens.
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D], broadcast over heads
        cos = (emb.cos() * self.attention_scaling).to(q.dtype)
        sin = (emb.sin() * self.attention_scaling).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
