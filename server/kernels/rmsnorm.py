"""Fused RMSNorm: one Triton launch per call instead of the reference's eight elementwise kernels.

The reference (server/runtime/models/llama.py RMSNorm) is the meaning: statistics in float32, the
normalized row rounded to the input dtype, then multiplied by the weight in that dtype. The kernel
rounds at the same two places, so bf16 results match the reference up to the summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.timing import timed


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, eps, DIM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DIM + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> same shape and dtype: weight * x / sqrt(mean(x^2) + eps)."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({dim},) for x {tuple(x.shape)}")
    rows = x.reshape(-1, dim)  # a view for contiguous rows, a copy for e.g. q heads split out of a fused qkv
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with timed("rms_norm", x.device):
            _rms_norm_kernel[(rows.shape[0],)](
                rows, weight, out, rows.stride(0), out.stride(0), eps,
                DIM=dim, BLOCK=triton.next_power_of_2(dim), num_warps=4 if dim <= 4096 else 8,
            )
    return out.view(x.shape)
