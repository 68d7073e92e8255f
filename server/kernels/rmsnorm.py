"""Fused RMSNorm: one Triton launch per call instead of the reference's eight elementwise kernels.

The reference (server/runtime/models/llama.py RMSNorm) is the meaning: statistics in float32, the
normalized row rounded to the input dtype, then multiplied by the weight in that dtype. The kernel
rounds at the same two places, so bf16 results match the reference up to the summation order.

``add_rms_norm`` also takes the residual add in front of every norm of the decoder (vLLM's
fused_add_rms_norm): one launch writes both the new residual stream and its normalized copy, where
the unfused layer spends a launch on the add (issue 2: launches inside a decode graph cost ramp and tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from server.kernels import pdl
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.timing import timed


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res, stride_out, stride_sum, eps,
    DIM: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    if USE_PDL:  # server/kernels/pdl.py: let the next projection start streaming its weights now
        gdc_launch_dependents()
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # the residual stream is stored in the activation dtype: round the sum as the add kernel would
        x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DIM + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> same shape and dtype: weight * x / sqrt(mean(x^2) + eps)."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({dim},) for x {tuple(x.shape)}")
    rows = _rows(x)
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with timed("rms_norm", x.device):
            _launch(rows, rows, weight, out, out, eps, add=False)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for x, residual [..., dim] of one dtype; the sum is rounded
    to that dtype before it is normalized, as a separate add would store it."""
    dim = x.shape[-1]
    if weight.shape != (dim,) or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} must "
            f"match, with a weight of shape ({dim},) (got {tuple(weight.shape)})"
        )
    rows, res_rows = _rows(x), _rows(residual)
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out)
    if rows.shape[0]:
        with timed("add_rms_norm", x.device):
            _launch(rows, res_rows, weight, out, summed, eps, add=True)
    return out.view(x.shape), summed.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, dim] with a contiguous last dimension: a view for contiguous rows, a copy for e.g. q heads
    split out of a fused qkv."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows, residual, weight, out, summed, eps: float, add: bool) -> None:
    dim = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](
        rows, residual, weight, out, summed, rows.stride(0), residual.stride(0), out.stride(0), summed.stride(0), eps,
        DIM=dim, BLOCK=triton.next_power_of_2(dim), ADD=add, num_warps=4 if dim <= 4096 else 8,
        **pdl.launch_options(rows.device),
    )  # fmt: skip
