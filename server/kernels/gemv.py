"""Skinny matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with M <= 16 rows, and the same
matmul with the layer's next elementwise op fused into its epilogue.

At decode the projections are weight streaming: every weight is read once per step and used by
at most 16 rows, so the kernel's only job is to read W at copy bandwidth. Each program owns a
slab of BLOCK_N output rows and walks K with [BLOCK_N, BLOCK_K] tiles of W (BLOCK_K contiguous,
16-byte cp.async loads, software-pipelined), accumulating in float32. BLOCK_N is chosen so the grid
has several programs per SM even for narrow N (qkv 6144, o/down 4096 rows): resident programs times
pipeline stages keep enough bytes in flight, and no split-K pass (a second launch per projection)
is needed. The sizes were reasoned from an offline sm_90 compile (registers, shared memory, PTX),
not tuned on the GPU: bench/dense_gpu_check.py times them next to F.linear and sweeps alternatives,
and MEASURED_M1 takes the ones measured faster. On sm_90 a launch is a programmatic dependent launch
(server/kernels/pdl.py): a one-row program loads up to PRE_WAIT_BYTES of its W (all of K for the 8B
qkv, o and gate_up) before it waits for the kernel that wrote x, so in a decode graph each projection
streams most of its weights during the previous kernel's tail instead of after it. On the H200 that
took the 8B batch-1 decode graph from 3757 to 3677 us a step (one K tile before the wait, same configs).

Two bodies share the loop: one row (M == 1) multiplies on the CUDA cores and reduces once at the
end; 2..16 rows pad to 16 and use the tensor cores with W as the wide operand (acc [BLOCK_N, 16]).

Fused epilogues (issue 2: every launch inside a decode graph costs a ramp and a tail). A program then
owns PAIRS of weight rows and walks K once for both, so an op that needs two outputs of the projection
at once finishes in registers and the projection's output is never written:
- "silu_and_mul": rows j (gate) and I + j (up) of the fused gate_up weight -> silu(gate) * up, [M, I];
- "rope": rows i and i + D/2 of every q and k head (the rotate-half pairs) -> rotated to each row's
  position; v rows are paired too (r with r + V/2) and pass unrotated, so one grid covers all of qkv.
  Given plain KV pages and the step's slot mapping, the same epilogue also stores the new k and v rows
  into their slots: the cache write is not a launch of its own (dense_attention.write_kv_pages is the
  same store, slot < 0 skipped, values rounded to the activation dtype and then to the pages').
The projection is rounded to the activation dtype before the fused op, where the unfused path stores
it, and the op then computes in float32 as server/kernels/swiglu.py and rotary.py do.

``linear``, ``linear_silu_and_mul`` and ``linear_rope`` dispatch: Triton on CUDA for fp16/bf16, cuBLAS
(plus the separate fused-op kernel) otherwise. A plain projection takes the kernel for one row only:
at 8 rows cuBLAS was faster on every 8B shape but the LM head (BENCHMARKS.md, skinny matmul), and the
tensor-core body pads 2..16 rows to 16, so its time hardly depends on M. The fused ones take it up
to MAX_ROWS rows: they save a launch and the projection's round trip through memory (not yet timed
against cuBLAS plus the separate op at 2..16 rows). Launches are CUDA-graph
safe: shapes decide the grid, outputs come from the caching allocator, nothing synchronizes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from server.kernels import pdl
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.backend import use_triton

log = logging.getLogger(__name__)

_unusable: str | None = None  # why the kernel cannot run on this GPU, once a build failed (then F.linear only)
MAX_ROWS = 16  # above this the matmul is no longer weight streaming: cuBLAS tiles win
NUM_WARPS = 4
PROGRAMS_TARGET = 4 * 132  # ~4 programs per H200 SM: enough loads in flight, a short tail
# BLOCK_N * BLOCK_K: 16 KiB of bf16 weights per program per iteration on the CUDA cores (64 fp32
# accumulators a thread at 4 warps, ~120 registers: 4 programs per SM, each with 2 tiles in flight);
# half that for tensor cores, whose W and padded x tiles both take shared memory in every stage.
# A paired program holds two tiles of half the size.
TILE_ELEMENTS = 8192
PRE_WAIT_BYTES = 32768  # of W a one-row program loads before it waits for x (pdl.py); _pre_tiles
# One-row configurations measured faster than the rule in _config, by shape:
# (N, K, fused epilogue) -> (BLOCK_N, BLOCK_K, STAGES). bench/dense_gpu_check.py sweeps and prints them.
# Llama-3-8B's projections on one H200 with the wide tile loaded before the wait (2026-11-30, docs/BENCHMARKS.md):
# BLOCK_K 1024 lets qkv, o and gate_up load all of K before it. Any valid configuration is correct on any GPU;
# only its speed was measured here.
MEASURED_M1: dict[tuple[int, int, bool], tuple[int, int, int]] = {
    (6144, 4096, True): (2, 1024, 3),  # qkv + RoPE
    (4096, 4096, False): (4, 1024, 3),  # o
    (28672, 4096, True): (2, 1024, 3),  # gate_up + SiLU*up
    (4096, 14336, False): (4, 1024, 3),  # down
}


@triton.jit
def _rope_pair_rows(j, N, ROTATED: tl.constexpr, HALF: tl.constexpr):
    """Weight rows (a, b) of pair j of a qkv projection: rotate-half partners of a q/k head for
    j < ROTATED (= rotated heads * HALF), else v rows r and r + V/2."""
    in_head = (j // HALF) * (2 * HALF) + j % HALF
    in_v = j + ROTATED  # = 2 * ROTATED + (j - ROTATED)
    v_half = (N - 2 * ROTATED) // 2
    rotated = j < ROTATED
    return tl.where(rotated, in_head, in_v), tl.where(rotated, in_head + HALF, in_v + v_half)


@triton.jit
def _store_kv_rows(k_pages_ptr, v_pages_ptr, rows, y, slot, keep, stride_slot, stride_head, q_rows,
                   KV_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows of a qkv projection that belong to k or v ([BLOCK_N] rows, y [BLOCK_N, BLOCK_M]) into the pages
    at each token's slot [BLOCK_M]; q rows and padding tokens (slot < 0) store nothing."""
    kv_row = rows - q_rows
    is_v = kv_row >= KV_ROWS
    r = tl.where(is_v, kv_row - KV_ROWS, kv_row)
    offs = slot[None, :] * stride_slot + ((r // HEAD_DIM) * stride_head + r % HEAD_DIM)[:, None]
    ok = keep & (kv_row >= 0)[:, None] & (slot >= 0)[None, :]
    tl.store(k_pages_ptr + offs, y.to(k_pages_ptr.dtype.element_ty), mask=ok & ~is_v[:, None])
    tl.store(v_pages_ptr + offs, y.to(v_pages_ptr.dtype.element_ty), mask=ok & is_v[:, None])


@triton.jit
def _load_w(ptrs, cols, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=(cols < K)[None, :], other=0.0)
    return w


@triton.jit
def _load_x(ptrs, m_mask, cols, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        x = tl.load(ptrs, mask=m_mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=m_mask[:, None] & (cols < K)[None, :], other=0.0)
    return x


@triton.jit
def _accumulate(acc, w, x, BLOCK_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    if BLOCK_M == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)  # x [1, BLOCK_K] broadcasts over the rows
    else:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _accumulate_wide(acc, w, x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TILES: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """_accumulate of a [BLOCK_N, TILES * BLOCK_K] tile of W (and x's matching columns)."""
    if BLOCK_M == 1 and TILES > 1:
        prod = w.to(tl.float32) * x.to(tl.float32)
        acc += tl.sum(tl.reshape(prod, (BLOCK_N, TILES, BLOCK_K)), axis=1)
    else:
        acc = _accumulate(acc, w, x, BLOCK_M, INPUT_PRECISION)  # the dot takes any K
    return acc


@triton.jit
def _reduced(acc, BLOCK_M: tl.constexpr):
    """[BLOCK_N, BLOCK_M] float32 results of an accumulator."""
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[:, None]
    else:
        out = acc
    return out


@triton.jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, inv_freq_ptr, rope_scaling, M, N, K, stride_xm, stride_wn, stride_ym,
    k_pages_ptr, v_pages_ptr, slot_ptr, stride_slot, stride_head,
    EPILOGUE: tl.constexpr, ROTATED: tl.constexpr, HALF: tl.constexpr, WRITE_KV: tl.constexpr, KV_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr,
    PRE_TILES: tl.constexpr,
):  # fmt: skip
    # j: this program's outputs (rows of W, or pairs of rows when an epilogue is fused).
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPILOGUE == "none":
        num_out = N
    else:
        num_out = N // 2
    # Outputs past the end re-read the last one instead of masking: the W loads stay unpredicated and
    # vectorized; those results are never stored.
    jc = tl.minimum(j, num_out - 1)
    if EPILOGUE == "rope":
        rows_a, rows_b = _rope_pair_rows(jc, N, ROTATED, HALF)
    else:  # silu_and_mul: gate row j, up row I + j (rows_b unused without an epilogue)
        rows_a, rows_b = jc, jc + num_out
    wa_rows = rows_a.to(tl.int64) * stride_wn
    wb_rows = rows_b.to(tl.int64) * stride_wn
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    if BLOCK_M == 1:
        acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_b = tl.zeros_like(acc_a)  # loop-carried but untouched without an epilogue: the compiler drops it
    # The first PRE_TILES K tiles of W depend on no earlier kernel: loaded as one wide tile, they stream
    # under PDL while that kernel finishes (the x they meet is loaded after the wait).
    if USE_PDL:
        gdc_launch_dependents()
    pre = tl.arange(0, PRE_TILES * BLOCK_K)
    wa_pre = _load_w(w_ptr + wa_rows[:, None] + pre[None, :], pre, K, EVEN_K)
    if EPILOGUE != "none":
        wb_pre = _load_w(w_ptr + wb_rows[:, None] + pre[None, :], pre, K, EVEN_K)
    if USE_PDL:
        gdc_wait()  # x is the previous kernel's output
    x_pre = _load_x(x_ptr + m[:, None] * stride_xm + pre[None, :], m_mask, pre, K, EVEN_K)
    acc_a = _accumulate_wide(acc_a, wa_pre, x_pre, BLOCK_M, BLOCK_N, BLOCK_K, PRE_TILES, INPUT_PRECISION)
    if EPILOGUE != "none":
        acc_b = _accumulate_wide(acc_b, wb_pre, x_pre, BLOCK_M, BLOCK_N, BLOCK_K, PRE_TILES, INPUT_PRECISION)
    # An explicit stage count: Triton pipelines (cp.async) loops without a tl.dot only when asked.
    for k0 in tl.range(PRE_TILES * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = _load_x(x_ptr + m[:, None] * stride_xm + cols[None, :], m_mask, cols, K, EVEN_K)
        wa = _load_w(w_ptr + wa_rows[:, None] + cols[None, :], cols, K, EVEN_K)
        acc_a = _accumulate(acc_a, wa, x, BLOCK_M, INPUT_PRECISION)
        if EPILOGUE != "none":
            wb = _load_w(w_ptr + wb_rows[:, None] + cols[None, :], cols, K, EVEN_K)
            acc_b = _accumulate(acc_b, wb, x, BLOCK_M, INPUT_PRECISION)
    out_ty = y_ptr.dtype.element_ty
    mask = (j < num_out)[:, None] & m_mask[None, :]
    a = _reduced(acc_a, BLOCK_M)
    if HAS_BIAS:
        a += tl.load(b_ptr + rows_a).to(tl.float32)[:, None]
    if EPILOGUE == "none":
        tl.store(y_ptr + m[None, :] * stride_ym + rows_a[:, None], a.to(out_ty), mask=mask)
    else:
        b = _reduced(acc_b, BLOCK_M)
        if HAS_BIAS:
            b += tl.load(b_ptr + rows_b).to(tl.float32)[:, None]
        # Rounded where the unfused path stores the projection, then the op in float32.
        a = a.to(out_ty).to(tl.float32)
        b = b.to(out_ty).to(tl.float32)
        if EPILOGUE == "silu_and_mul":
            y = a / (1.0 + tl.exp(-a)) * b
            tl.store(y_ptr + m[None, :] * stride_ym + jc[:, None], y.to(out_ty), mask=mask)
        else:
            position = tl.load(pos_ptr + m, mask=m_mask, other=0).to(tl.float32)
            angle = tl.load(inv_freq_ptr + jc % HALF)[:, None] * position[None, :]  # [BLOCK_N, BLOCK_M]
            cos = tl.cos(angle) * rope_scaling
            sin = tl.sin(angle) * rope_scaling
            rotated = (j < ROTATED)[:, None]
            ya = tl.where(rotated, a * cos - b * sin, a)
            yb = tl.where(rotated, b * cos + a * sin, b)
            ya = ya.to(out_ty)
            yb = yb.to(out_ty)
            tl.store(y_ptr + m[None, :] * stride_ym + rows_a[:, None], ya, mask=mask)
            tl.store(y_ptr + m[None, :] * stride_ym + rows_b[:, None], yb, mask=mask)
            if WRITE_KV:
                slot = tl.load(slot_ptr + m, mask=m_mask, other=-1).to(tl.int64)
                q_rows = N - 2 * KV_ROWS
                _store_kv_rows(k_pages_ptr, v_pages_ptr, rows_a, ya, slot, mask, stride_slot, stride_head,
                               q_rows, KV_ROWS, 2 * HALF)
                _store_kv_rows(k_pages_ptr, v_pages_ptr, rows_b, yb, slot, mask, stride_slot, stride_head,
                               q_rows, KV_ROWS, 2 * HALF)


def _config(rows: int, n: int, k: int, paired: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES) for a shape: BLOCK_N as large as keeps ~PROGRAMS_TARGET programs.
    Paired programs own BLOCK_N pairs: the same rows per program as unpaired, in two tiles."""
    if rows == 1 and (n, k, paired) in MEASURED_M1:
        return (1, *MEASURED_M1[(n, k, paired)])
    slab = triton.next_power_of_2(max(1, n // PROGRAMS_TARGET))
    if rows == 1:
        block_m, block_n = 1, min(max(slab, 4), 32)
    else:  # tl.dot needs every tile side >= 16
        block_m, block_n = 16, min(max(slab, 32 if paired else 16), 64)
    tile = TILE_ELEMENTS if rows == 1 else TILE_ELEMENTS // 2
    if paired:
        block_n //= 2
        tile //= 2
    block_k = max(16, min(tile // block_n, triton.next_power_of_2(k)))
    return block_m, block_n, block_k, 3 if rows == 1 else 4


def _pre_tiles(rows: int, block_n: int, block_k: int, k: int, elem_bytes: int, paired: bool) -> int:
    """K tiles loaded before the wait: a power of two (one wide tile) within PRE_WAIT_BYTES and K; one row only
    (the tensor-core body keeps one). The wide tile's K tiles must meet in the same threads, so that adding
    them up stays in registers: BLOCK_K a multiple of the columns one pass of 16-byte loads covers (else
    a shared-memory round trip made the kernel 2-5x slower on the H200, docs/BENCHMARKS.md)."""
    tile_bytes = block_n * block_k * elem_bytes * (2 if paired else 1)
    one_pass = 16 // elem_bytes * 32 * NUM_WARPS
    tiles = 1
    while (rows == 1 and block_k % one_pass == 0 and 2 * tiles * tile_bytes <= PRE_WAIT_BYTES
           and 2 * tiles * block_k <= k):
        tiles *= 2
    return tiles


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, what: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{what} expects x [M, K] and weight [N, K] with the same K, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    rows, n = x.shape[0], weight.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{what} handles 1..{MAX_ROWS} rows, got {rows}; use F.linear for more")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"{what} needs x and weight of one dtype and bias [N]; got {x.dtype}, {weight.dtype}, "
            f"bias {None if bias is None else tuple(bias.shape)} for N={n}"
        )
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"{what} needs x and weight contiguous along K (pass .contiguous() tensors)")


def _launch(x, weight, bias, out_width, epilogue="none", positions=None, inv_freq=None, scaling=1.0,
            rotated=0, half=1, kv_cache=None) -> torch.Tensor:  # fmt: skip
    rows, k = x.shape
    n = weight.shape[0]
    block_m, block_n, block_k, stages = _config(rows, n, k, paired=epilogue != "none")
    y = torch.empty((rows, out_width), dtype=x.dtype, device=x.device)
    unused = weight  # any pointer for arguments the epilogue does not read
    if kv_cache is None:
        k_pages = v_pages = slots = unused
        stride_slot = stride_head = kv_rows = 0
    else:
        k_pages, v_pages, slots = kv_cache
        stride_slot, stride_head = k_pages.stride(-3), k_pages.stride(-2)
        kv_rows = k_pages.shape[-2] * k_pages.shape[-1]  # the v rows (and the k rows before them)
    _skinny_matmul_kernel[(triton.cdiv(n if epilogue == "none" else n // 2, block_n),)](
        x, weight, unused if bias is None else bias.contiguous(), y,
        unused if positions is None else positions, unused if inv_freq is None else inv_freq, float(scaling),
        rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        k_pages, v_pages, slots, stride_slot, stride_head,
        EPILOGUE=epilogue, ROTATED=rotated, HALF=half, WRITE_KV=kv_cache is not None, KV_ROWS=kv_rows,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32 stays exact (no TF32)
        STAGES=stages, num_warps=NUM_WARPS, PRE_TILES=_pre_tiles(rows, block_n, block_k, k, x.element_size(), epilogue != "none"),
        **pdl.launch_options(x.device),
    )  # fmt: skip
    return y


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K], bias [N] or None -> x @ weight.T + bias, [M, N] in x's dtype."""
    _check_operands(x, weight, bias, "skinny_matmul")
    return _launch(x, weight, bias, weight.shape[0])


def skinny_matmul_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """x [M, K], gate_up_weight [2I, K] (gate rows, then up rows) -> silu(x @ gate.T) * (x @ up.T), [M, I]."""
    _check_operands(x, gate_up_weight, None, "skinny_matmul_silu_and_mul")
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"skinny_matmul_silu_and_mul needs [2 * width, K] gate_up rows, got {gate_up_weight.shape[0]}")
    return _launch(x, gate_up_weight, None, gate_up_weight.shape[0] // 2, "silu_and_mul")


def skinny_matmul_rope(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
    inv_freq: torch.Tensor, scaling: float, rotated_heads: int, head_dim: int,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """qkv = x @ weight.T + bias [M, N] with its first ``rotated_heads`` heads (q, then k) rotated to
    ``positions`` [M] (rotate-half pairs, angle position * inv_freq in float32, times ``scaling``).
    ``kv_cache`` = (k_pages, v_pages, slot_mapping [M]): pages [..., page_size, kv_heads, head_dim] whose
    kv_heads * head_dim are the v rows (and the k rows before them); k and v are also stored at the slots."""
    _check_operands(x, weight, bias, "skinny_matmul_rope")
    n = weight.shape[0]
    if head_dim % 2 or inv_freq.shape != (head_dim // 2,) or (n - rotated_heads * head_dim) % 2 or n < rotated_heads * head_dim:
        raise ValueError(
            f"skinny_matmul_rope: {n} rows must hold {rotated_heads} rotated heads of an even head_dim {head_dim} "
            f"and an even number of other rows, with head_dim / 2 frequencies (got {tuple(inv_freq.shape)})"
        )
    if positions.shape != (x.shape[0],):
        raise ValueError(f"skinny_matmul_rope: positions {tuple(positions.shape)} must give one per row of x {tuple(x.shape)}")
    if kv_cache is not None:
        _check_kv_cache(kv_cache, x.shape[0], n - rotated_heads * head_dim, head_dim)
    return _launch(x, weight, bias, n, "rope", positions, inv_freq.float(), scaling,
                   rotated_heads * head_dim // 2, head_dim // 2, kv_cache)  # fmt: skip


def _check_kv_cache(kv_cache, tokens: int, v_rows: int, head_dim: int) -> None:
    k_pages, v_pages, slots = kv_cache
    if (k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride() or not k_pages.is_contiguous()
            or k_pages.dim() < 3 or k_pages.shape[-1] != head_dim or k_pages.shape[-2] * head_dim != v_rows
            or slots.shape != (tokens,)):  # fmt: skip
        raise ValueError(
            f"skinny_matmul_rope: KV pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)} must be contiguous "
            f"[..., page_size, kv_heads, {head_dim}] with kv_heads * {head_dim} = {v_rows} v rows, and the slot "
            f"mapping {tuple(slots.shape)} one per token ({tokens})"
        )


def _skinny_rows(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> int:
    """Rows of x after flattening when the skinny kernel serves this call, else 0."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    fits = (
        _unusable is None
        and use_triton(x)
        and 1 <= rows <= max_rows
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
    )
    return rows if fits else 0


def _guarded(launch):
    """launch() or None when the kernel does not build on this GPU (said once, never silent)."""
    global _unusable
    try:
        return launch()
    except (CompilationError, OutOfResources) as exc:
        _unusable = f"{type(exc).__name__}: {exc}"
        log.warning("skinny matmul does not build on this GPU (%s); projections use F.linear", _unusable)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); one row (after flattening) takes skinny_matmul."""
    rows = _skinny_rows(x, weight, max_rows=1)
    if rows:
        y = _guarded(lambda: skinny_matmul(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias))
        if y is not None:
            return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of F.linear(x [T, K], gate_up_weight); one launch for decode-sized inputs."""
    if _skinny_rows(x, gate_up_weight):
        y = _guarded(lambda: skinny_matmul_silu_and_mul(x.contiguous(), gate_up_weight))
        if y is not None:
            return y
    from server.kernels.swiglu import silu_and_mul

    return silu_and_mul(F.linear(x, gate_up_weight))


def linear_rope(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
    inv_freq: torch.Tensor, scaling: float, num_heads: int, num_kv_heads: int, head_dim: int,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) of a fused qkv projection of x [T, K], q and k rotated
    to ``positions``; one launch for decode-sized inputs, else F.linear and server/kernels/rotary.py.
    With ``kv_cache`` = (k_pages, v_pages, slot_mapping) k and v are in their slots on return (the
    decode launch stores them from its epilogue; otherwise dense_attention.write_kv_pages)."""
    tokens = x.shape[0]
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if _skinny_rows(x, weight):
        qkv = _guarded(lambda: skinny_matmul_rope(
            x.contiguous(), weight, bias, positions, inv_freq, scaling, num_heads + num_kv_heads, head_dim,
            kv_cache))  # fmt: skip
        if qkv is not None:
            q, k, v = qkv.split(sizes, dim=-1)
            return q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim), v.view(
                tokens, num_kv_heads, head_dim)  # fmt: skip
    from server.kernels.rotary import apply_rotary

    q, k, v = F.linear(x, weight, bias).split(sizes, dim=-1)
    q, k = apply_rotary(positions, q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
                        inv_freq, scaling)  # fmt: skip
    v = v.view(tokens, num_kv_heads, head_dim)
    if kv_cache is not None:
        from server.kernels.dense_attention import write_kv_pages

        write_kv_pages(k, v, *kv_cache)
    return q, k, v
