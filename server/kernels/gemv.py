"""Skinny matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with M <= 16 rows.

At decode the projections are weight streaming: every weight is read once per step and used by
at most 16 rows, so the kernel's only job is to read W at copy bandwidth. Each program owns a
slab of BLOCK_N output rows and walks K with [BLOCK_N, BLOCK_K] tiles of W (BLOCK_K contiguous,
16-byte cp.async loads, software-pipelined), accumulating in float32. BLOCK_N is chosen so the grid
has several programs per SM even for narrow N (qkv 6144, o/down 4096 rows): resident programs times
pipeline stages keep enough bytes in flight, and no split-K pass (a second launch per projection)
is needed. The sizes were reasoned from an offline sm_90 compile (registers, shared memory, PTX),
not tuned on the GPU: bench/dense_gpu_check.py times them next to F.linear.

Two bodies share the loop: one row (M == 1) multiplies on the CUDA cores and reduces once at the
end; 2..16 rows pad to 16 and use the tensor cores with W as the wide operand (acc [BLOCK_N, 16]).
``linear`` dispatches: Triton on CUDA for fp16/bf16 with at most MAX_ROWS rows, F.linear otherwise.
The launch is CUDA-graph safe: shapes decide the grid, the output comes from the caching
allocator, nothing synchronizes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from server.kernels.backend import use_triton

log = logging.getLogger(__name__)

_unusable: str | None = None  # why the kernel cannot run on this GPU, once a build failed (then F.linear only)
MAX_ROWS = 16  # above this the matmul is no longer weight streaming: cuBLAS tiles win
PROGRAMS_TARGET = 4 * 132  # ~4 programs per H200 SM: enough loads in flight, a short tail
# BLOCK_N * BLOCK_K: 16 KiB of bf16 weights per program per iteration on the CUDA cores (64 fp32
# accumulators a thread at 4 warps, ~120 registers: 4 programs per SM, each with 2 tiles in flight);
# half that for tensor cores, whose W and padded x tiles both take shared memory in every stage.
TILE_ELEMENTS = 8192


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N re-read row N-1 instead of masking: the W loads stay unpredicated and vectorized;
    # those results are never stored.
    w_rows = tl.minimum(rows, N - 1).to(tl.int64) * stride_wn
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # An explicit stage count: Triton pipelines (cp.async) loops without a tl.dot only when asked.
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + w_rows[:, None] + cols[None, :]
        x_ptrs = x_ptr + m[:, None] * stride_xm + cols[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=(cols < K)[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += w.to(tl.float32) * x.to(tl.float32)  # x [1, BLOCK_K] broadcasts over the rows
        else:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        out = acc
    if HAS_BIAS:
        out += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)[:, None]
    y_ptrs = y_ptr + m[None, :] * stride_ym + rows[:, None]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(rows < N)[:, None] & m_mask[None, :])


def _config(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a shape: BLOCK_N as large as keeps ~PROGRAMS_TARGET programs."""
    slab = triton.next_power_of_2(max(1, n // PROGRAMS_TARGET))
    if rows == 1:
        block_m, block_n = 1, min(max(slab, 4), 32)
    else:  # tl.dot needs every tile side >= 16
        block_m, block_n = 16, min(max(slab, 16), 64)
    tile = TILE_ELEMENTS if rows == 1 else TILE_ELEMENTS // 2
    block_k = max(16, min(tile // block_n, triton.next_power_of_2(k)))
    return block_m, block_n, block_k


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> x @ weight.T + bias, [M, N] in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"skinny_matmul expects x [M, K] and weight [N, K] with the same K, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny_matmul handles 1..{MAX_ROWS} rows, got {rows}; use F.linear for more")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"skinny_matmul needs x and weight of one dtype and bias [N]; got {x.dtype}, {weight.dtype}, "
            f"bias {None if bias is None else tuple(bias.shape)} for N={n}"
        )
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("skinny_matmul needs x and weight contiguous along K (pass .contiguous() tensors)")
    block_m, block_n, block_k = _config(rows, n, k)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    bias_arg = bias.contiguous() if bias is not None else weight  # any pointer; unread without HAS_BIAS
    _skinny_matmul_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias_arg, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32 stays exact (no TF32)
        STAGES=3 if block_m == 1 else 4, num_warps=4,
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); decode-sized inputs (<= MAX_ROWS rows after flattening) take skinny_matmul."""
    global _unusable
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (
        _unusable is None
        and use_triton(x)
        and 1 <= rows <= MAX_ROWS
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
    ):
        try:
            y = skinny_matmul(x.reshape(rows, k).contiguous(), weight, bias)
        except (CompilationError, OutOfResources) as exc:  # slower but correct, said once, never silent
            _unusable = f"{type(exc).__name__}: {exc}"
            log.warning("skinny matmul does not build on this GPU (%s); projections use F.linear", _unusable)
        else:
            return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
