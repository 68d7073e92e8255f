"""Fused rotary embedding: q and k of a step rotated in one launch.

The reference (server/runtime/models/rope.py RotaryEmbedding) builds cos/sin tables and applies
rotate_half with about twenty elementwise kernels per layer. Here each program rotates one head
of one token: angles position * inv_freq in float32 (exact positions up to 2**24, as the
reference), scaled by the rope variant's attention factor, output rounded once to q's dtype.
Same convention as the reference: pairs are (i, i + head_dim / 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.timing import timed


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, inv_freq_ptr, scaling,
    stride_qt, stride_qh, stride_kt, stride_kh,
    Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=mask, other=0.0)
    cos = tl.cos(angle) * scaling
    sin = tl.sin(angle) * scaling
    if head < Q_HEADS:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + (token * Q_HEADS + head) * (2 * HALF)
    else:
        src = k_ptr + token * stride_kt + (head - Q_HEADS) * stride_kh
        dst = k_out_ptr + (token * (tl.num_programs(1) - Q_HEADS) + head - Q_HEADS) * (2 * HALF)
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (any row strides, contiguous head_dim), positions [T] -> rotated copies."""
    tokens, q_heads, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2 or inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"apply_rotary: q {tuple(q.shape)}, k {tuple(k.shape)} and inv_freq {tuple(inv_freq.shape)} must share "
            "tokens and an even head_dim with head_dim / 2 frequencies"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or k.dtype != q.dtype:
        raise ValueError("apply_rotary needs q and k of one dtype with a contiguous head_dim")
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        with timed("rotary", q.device):
            _rope_kernel[(tokens, q_heads + k.shape[1])](
                q, k, q_out, k_out, positions, inv_freq.float(), float(scaling),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                Q_HEADS=q_heads, HALF=head_dim // 2, BLOCK=triton.next_power_of_2(head_dim // 2),
            )
    return q_out, k_out
