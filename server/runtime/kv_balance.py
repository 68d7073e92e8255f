"""Channel balance for turbo KV caches: per-channel scales folded into the attention weights at start-up.

A turbo page spreads its error evenly over the channels of a group (the rotation mixes them), so a channel
whose values are large but hardly move the result takes error budget from the channels that do. Scaling K
channel f by s_f and Q's by 1/s_f leaves every score unchanged, <q / s, s k> = <q, k>; scaling V channel i by
t_i and the output projection's input column by 1/t_i leaves every output unchanged. Folded into W_q, W_k,
W_v and W_o the model computes the same function (up to the weights' rounding) at no cost per token, while
the cache quantizes balanced channels.

With an error spread evenly, a score's squared error goes as (sum_f a_f / s_f^2)(sum_f b_f s_f^2), a = E q^2
(over the query heads reading the KV head), b = E r^2 (r = k - o(p), what a page stores); it is smallest at
s^4 = a / b. An output's goes as (sum_i w_i / t_i^2)(sum_i c_i t_i^2), w = the squared norm of W_o's columns
that read V channel i, c = E v^2: t^4 = w / c. Keys are balanced only halfway, s^8 = a / b: on the embedded
model that measured as well as the full exponent (docs/BENCHMARKS.md "Quality") while leaning less on the
even-error model; any exponent up to the optimum's lowers the product above, which is log-convex in it.

RoPE turns channel f together with f + D/2, so a pair shares one K scale (the mean energies of its two
channels): scaling then commutes with RoPE and folds into the rows of W_q and W_k. A model whose q/k norm
weight is shared by all heads (Qwen3) takes one K scale per channel for all KV heads.
Scales are float32 [kv_heads, D] with geometric mean 1 per head, so the weights keep their magnitude.
"""

from __future__ import annotations

import torch

KEY_EXPONENT = 1 / 8  # s = (a / b) ** KEY_EXPONENT
VALUE_EXPONENT = 1 / 4  # t = (w / c) ** VALUE_EXPONENT
ENERGY_FLOOR = 1e-4  # a channel's energy counts as at least this share of its head's mean (dead channels)


def _balanced(numerator: torch.Tensor, denominator: torch.Tensor, exponent: float) -> torch.Tensor:
    """(numerator / denominator) ** exponent per channel [H, D], energies floored, geometric mean 1 per row."""

    def floored(e: torch.Tensor) -> torch.Tensor:
        e = e.double()
        return e.clamp_min(ENERGY_FLOOR * e.mean(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny))

    log_scale = exponent * (floored(numerator).log() - floored(denominator).log())
    return (log_scale - log_scale.mean(-1, keepdim=True)).exp().float()


def key_scales(query_energy: torch.Tensor, residual_energy: torch.Tensor, per_head: bool,
               exponent: float = KEY_EXPONENT) -> torch.Tensor:
    """K channel scales [kv_heads, D] from E q^2 and E (k - o)^2 per channel [kv_heads, D]; equal on the two
    channels of each rotate-half pair, and on all heads unless ``per_head``."""

    def paired(e: torch.Tensor) -> torch.Tensor:
        e = e.unflatten(-1, (2, -1)).mean(-2).repeat(1, 2)
        return e if per_head else e.mean(0, keepdim=True).expand_as(e)

    return _balanced(paired(query_energy), paired(residual_energy), exponent)


def value_scales(output_weight_energy: torch.Tensor, value_energy: torch.Tensor,
                 exponent: float = VALUE_EXPONENT) -> torch.Tensor:
    """V channel scales [kv_heads, D] from the squared column norms of W_o per V channel and E v^2."""
    return _balanced(output_weight_energy, value_energy, exponent)
