"""The key offset o(p) a turbo K store subtracts before quantizing, and attention accounts for.

Real keys share a large direction per KV head (on SmolLM2-135M about 80 % of a key's length),
and the quantizer's error is relative to the whole vector it is given: subtracting the shared
part leaves it only what tells tokens apart. One definition covers both kinds the engine uses
(server/runtime/kv_calibration.py measures them, ``--kv-key-offset``):

    o(p) = RoPE(p) mean   for p >= 1,        o(0) = sink,

with ``mean`` [kv_heads, D] and ``sink`` [kv_heads, D] float32, and RoPE the model's rotate-half
rotation with its ``inv_freq`` [D/2]: pairs (f, f + D/2) turn by the angle p * inv_freq[f], in
float32 as the model computes it.
  * turned: mean is the mean key before RoPE (the shared direction is fixed there, so after RoPE
    it turns with the key's position) and sink the attention sink's own key, unlike the others;
  * fixed: inv_freq all zero and sink == mean, so o(p) is one vector at every position.
Zero mean and sink give the spec's plain format.

The pages hold k - o(p), so attention scores <q, k> = <q, decoded> + <q, o(p)>. The decoded-pages
path adds o(p) back to the keys. A fixed o moves every score of a query row alike, which softmax
ignores, so the fused decode kernel skips it; a turned one it adds to its scores.
docs/BENCHMARKS.md "Quality" has the perplexity each buys. Plain torch: the engine imports it without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeyOffset:
    """o(p) of one layer's K store: float32 ``mean`` and ``sink`` [kv_heads, D], ``inv_freq`` [D/2]."""

    mean: torch.Tensor
    sink: torch.Tensor
    inv_freq: torch.Tensor


def rope_turn(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE(p) x: x [H, D] (or [T, H, D]) turned to each of ``positions`` [T] -> float32 [T, H, D]."""
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2], as the model computes it
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def key_offset_at(offset: KeyOffset, positions: torch.Tensor) -> torch.Tensor:
    """o(p) for every position [T] -> float32 [T, kv_heads, D] (the definition; kernels compute it in place)."""
    turned = rope_turn(offset.mean, positions, offset.inv_freq)
    return torch.where((positions == 0)[:, None, None], offset.sink.float()[None], turned)

