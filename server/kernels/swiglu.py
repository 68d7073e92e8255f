"""Fused SwiGLU activation: silu(gate) * up in one launch (the reference is llama.DenseMLP's two ops).

Input rows are [gate | up] as the fused gate_up projection writes them; computed in float32 and
rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels.timing import timed

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] (gate columns first) -> silu(gate) * up [T, F]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_and_mul expects a row-contiguous [tokens, 2 * width] tensor, got {tuple(gate_up.shape)}")
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        with timed("silu_and_mul", gate_up.device):
            _silu_and_mul_kernel[(tokens, triton.cdiv(width, BLOCK))](
                gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=BLOCK
            )
    return out
