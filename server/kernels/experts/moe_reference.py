"""The definition of the quantized MoE MLP, in float32 torch.

    y[t] = Σ_j  w[t, j] · down_e( silu(gate_e(x[t])) · up_e(x[t]) ),   e = ids[t, j]

with gate_up = [gate; up] stacked as [E, 2I, D] and down [E, D, I], each stored in the
rotated domain (weights.py): x is rotated once for gate/up, h once for down.

With ``int8_activations`` the rotated x and the rotated h are first rounded to int8 per group of 32 (q1_0/q2_0) or
256 (e8p/e8p3) values (int8_activations.fake_quantize), each where an integer body takes that projection's K
(int8_group): the op the integer decode bodies (moe_dp4a.py, moe_cuda.py) compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from server.kernels.experts.int8_activations import fake_quantize, int8_group
from server.kernels.experts.weights import ExpertWeights


def check_moe_args(x, topk_weights, topk_ids, gate_up: ExpertWeights, down: ExpertWeights) -> None:
    """Raise ValueError with what was expected when the shapes do not describe one MoE layer."""
    num_e, two_i, d = gate_up.shape
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x must be [tokens, {d}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids and topk_weights must both be [tokens={x.shape[0]}, top_k], "
            f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if down.shape != (num_e, d, two_i // 2) or two_i % 2:
        raise ValueError(f"down must be [{num_e}, {d}, {two_i // 2}] to match gate_up {gate_up.shape}, got {down.shape}")


def fused_moe_reference(x, topk_weights, topk_ids, gate_up: ExpertWeights, down: ExpertWeights,
                        int8_activations: bool = False) -> torch.Tensor:
    check_moe_args(x, topk_weights, topk_ids, gate_up, down)
    num_e, two_i, _ = gate_up.shape
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_e):
        raise ValueError(f"topk_ids must lie in [0, {num_e}), got values in [{int(topk_ids.min())}, {int(topk_ids.max())}]")
    xr = gate_up.rotate_input(x.float())
    x_group, h_group = (int8_group(w.format, w.shape[2]) if int8_activations else None for w in (gate_up, down))
    if x_group:
        xr = fake_quantize(xr, x_group)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gu = xr[tok] @ gate_up.dequantize(torch.tensor([e], device=x.device))[0].T
        h = F.silu(gu[:, : two_i // 2]) * gu[:, two_i // 2 :]
        hr = down.rotate_input(h)
        if h_group:
            hr = fake_quantize(hr, h_group)
        out = hr @ down.dequantize(torch.tensor([e], device=x.device))[0].T
        y.index_add_(0, tok, topk_weights[tok, slot].float()[:, None] * out)
    return y.to(x.dtype)
