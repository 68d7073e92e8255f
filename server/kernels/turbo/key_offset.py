"""The key offset o(p) a turbo K store subtracts before quantizing, and attention accounts for.

Real keys share a large direction per KV head (on SmolLM2-135M about 80 % of a key's length),
and the quantizer's error is relative to the whole vector it is given: subtracting the shared
part leaves it only what tells tokens apart. One definition covers every kind the engine uses
(server/runtime/kv_calibration.py measures them, ``--kv-key-offset``):

    o(p) = const + RoPE(p) mean   for p >= 1,        o(0) = sink,

with ``const``, ``mean`` and ``sink`` [kv_heads, D] float32 and RoPE the model's rotate-half rotation
with its ``inv_freq`` [D/2]: pairs (f, f + D/2) turn by the angle p * inv_freq[f], in float32 as the
model computes it. ``mean`` is zero outside the rotate-half pairs listed per KV head in ``pairs``
[kv_heads, P] int32 (each in [0, D/2), none twice), so only those P pairs turn.
  * fixed: const = the mean key as written, mean = 0 (P = 0), sink = const: one vector everywhere;
  * turned: const = 0, mean = the mean key before RoPE on all D/2 pairs (the shared direction is
    fixed there, so after RoPE it turns with the key's position), sink = the attention sink's own key;
  * partial: turned on the P pairs where that removes most (kv_calibration.py), fixed on the rest.
All zero is the spec's plain format.

The pages hold k - o(p), so attention scores <q, k> = <q, decoded> + <q, o(p)>. The decoded-pages
path adds o(p) back to the keys. <q, const> moves every score of a query row alike, which softmax
ignores, so the fused decode kernel adds only <q, RoPE(p) mean> (a dot over the P pairs) and at
position 0 <q, sink - const - mean>; with a fixed offset it adds nothing.
docs/BENCHMARKS.md "Quality" has the perplexity each buys. Plain torch: the engine imports it without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeyOffset:
    """o(p) of one layer's K store: float32 ``const``, ``mean``, ``sink`` [kv_heads, D], ``inv_freq`` [D/2],
    and the int32 rotate-half ``pairs`` [kv_heads, P] outside which ``mean`` is zero."""

    const: torch.Tensor
    mean: torch.Tensor
    sink: torch.Tensor
    inv_freq: torch.Tensor
    pairs: torch.Tensor

    @staticmethod
    def fixed(const: torch.Tensor, inv_freq: torch.Tensor) -> KeyOffset:
        """o(p) = const at every position."""
        none = torch.zeros(const.shape[0], 0, dtype=torch.int32, device=const.device)
        return KeyOffset(const, torch.zeros_like(const), const.clone(), inv_freq, none)

    @staticmethod
    def turned(mean: torch.Tensor, sink: torch.Tensor, inv_freq: torch.Tensor) -> KeyOffset:
        """o(p) = RoPE(p) mean on all pairs, the sink at 0."""
        heads, half = mean.shape[0], mean.shape[1] // 2
        pairs = torch.arange(half, dtype=torch.int32, device=mean.device).expand(heads, half).contiguous()
        return KeyOffset(torch.zeros_like(mean), mean, sink, inv_freq, pairs)

    @property
    def turns(self) -> bool:
        """Whether o(p) depends on p (then the fused decode adds <q, o(p)> beyond the softmax-invariant const)."""
        return bool(self.mean.any()) or not torch.equal(self.sink, self.const)


def pair_mask(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[kv_heads, D] bool: the dims of the listed rotate-half pairs (f and f + D/2)."""
    half = torch.zeros(pairs.shape[0], head_dim // 2, dtype=torch.bool, device=pairs.device)
    half.scatter_(1, pairs.long(), True)
    return half.repeat(1, 2)


def rope_turn(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE(p) x: x [H, D] (or [T, H, D]) turned to each of ``positions`` [T] -> float32 [T, H, D]."""
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2], as the model computes it
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def key_offset_at(offset: KeyOffset, positions: torch.Tensor) -> torch.Tensor:
    """o(p) for every position [T] -> float32 [T, kv_heads, D] (the definition; kernels compute it in place)."""
    varying = rope_turn(offset.mean, positions, offset.inv_freq) + offset.const.float()[None]
    return torch.where((positions == 0)[:, None, None], offset.sink.float()[None], varying)


def pair_turns(offset: KeyOffset, positions: torch.Tensor) -> torch.Tensor:
    """float32 [J, kv_heads, 2P + 1]: cos and sin of each position's angle on each of the P pairs, then a one, the
    key side of offset_scores (computed once for all the queries that read these positions)."""
    angle = positions.float()[:, None, None] * offset.inv_freq.float()[offset.pairs.long()]  # as the model rounds it
    return torch.cat((angle.cos(), angle.sin(), angle.new_ones(*angle.shape[:-1], 1)), dim=-1)


def offset_scores(offset: KeyOffset, q: torch.Tensor, positions: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """<q, o(p)> without o(p): q float32 [T, kv_heads, group, D], ``positions`` [J] with their pair_turns ->
    [kv_heads, group, T, J].

    RoPE(p) mean is zero off the P pairs, and on pair f (dims f, f + D/2) <q, RoPE(p) m> = cos(p theta_f)
    (q_f m_f + q_f' m_f') + sin(p theta_f) (q_f' m_f - q_f m_f'), so a score is one dot of 2P + 1 terms (the last
    <q, const>), not of D (the torch decode over every cached key, recent.py, adds it this way)."""
    t, heads, group, d = q.shape
    pairs = offset.pairs.long()  # [H, P]
    at = lambda x, dims: x.gather(-1, dims)  # noqa: E731
    m1, m2 = (at(offset.mean.float(), pairs + half)[:, None] for half in (0, d // 2))  # [H, 1, P]
    dims = pairs[None, :, None].expand(t, heads, group, -1)
    q1, q2 = at(q, dims), at(q, dims + d // 2)  # [T, H, group, P]
    const, sink = (q @ torch.stack((offset.const.float(), offset.sink.float()), dim=-1)).split(1, dim=-1)  # [T, H, g, 1]
    terms = torch.cat((q1 * m1 + q2 * m2, q2 * m1 - q1 * m2, const), dim=-1).permute(1, 2, 0, 3)  # [H, g, T, 2P + 1]
    # one batched matmul per KV head (an einsum's path costs ~25 us more on a CPU, which runs this every layer)
    scores = (terms.reshape(heads, group * t, -1) @ turns.permute(1, 2, 0)).view(heads, group, t, -1)
    scores[..., positions == 0] = sink.permute(1, 2, 0, 3)
    return scores
