"""Dispatch of the quantized MoE MLP: Triton on GPU, the float32 reference elsewhere.

`fused_moe(x, topk_weights, topk_ids, gate_up, down)` is the op (moe_reference.py defines
it); `QuantizedExperts` wraps it as the module the models call: `experts(x, w, ids) -> y`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
from triton.runtime.errors import OutOfResources

from server.kernels import pdl
from server.kernels.backend import inline_ptx, use_triton
from server.kernels.experts import e8p, moe_cuda, moe_cuda_int8
from server.kernels.experts.int8_activations import E8_GROUP as E8_INT8_GROUP
from server.kernels.experts.int8_activations import GROUP as INT8_GROUP
from server.kernels.experts.int8_activations import quantize_rows_triton
from server.kernels.experts.int8_activations import quantize_triton as quantize_int8
from server.kernels.experts.moe_dp4a import _expert_dp4a, sum_top_k_slots
from server.kernels.experts.moe_gemv import E8_FIELD_MASK, _expert_gemv
from server.kernels.experts.moe_mma import _expert_mma, tile_order
from server.kernels.experts.moe_reference import check_moe_args, fused_moe_reference
from server.kernels.experts.moe_triton import FORMAT_IDS, K_UNIT, _expert_gemm
from server.kernels.experts.routing import ExpertBlocks, align_pairs, single_pair_blocks
from server.kernels.experts.weights import ExpertWeights
from server.kernels.timing import timed

log = logging.getLogger(__name__)
DECODE_BLOCK_M = 16  # pairs per block when experts see a few tokens (tl.dot's smallest M)
PREFILL_BLOCK_M = 64
_FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
tile_override: tuple[int, int, int, int] | None = None  # (BLOCK_N, BLOCK_K, warps, stages): benchmark sweeps only


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return e8p.kernel_table().to(device), e8p.residual_table_packed().to(device)


@functools.cache
def _say_once(message: str) -> None:
    log.warning(message)


def fused_moe(x, topk_weights, topk_ids, gate_up: ExpertWeights, down: ExpertWeights) -> torch.Tensor:
    """x [T, D], topk_weights/topk_ids [T, top_k] -> y [T, D] in x's dtype."""
    check_moe_args(x, topk_weights, topk_ids, gate_up, down)
    if use_triton(x):
        if x.dtype not in _FAST_DTYPES:
            _say_once(f"quantized experts: no Triton body for activations of dtype {x.dtype}; using the reference")
        else:
            try:
                return fused_moe_triton(x, topk_weights, topk_ids, gate_up, down, int8_activations=int8_decode)
            except OutOfResources as exc:  # spec "Guards": slower but correct, said once, never silent
                _say_once(f"quantized experts: {gate_up.format} kernel does not fit this GPU ({exc}); using the reference")
    return fused_moe_reference(x, topk_weights, topk_ids, gate_up, down,
                               int8_activations=int8_reference)


# 8-bit activations for the integer decode bodies: q1_0/q2_0 per 32 (int8_activations.py, moe_dp4a.py), e8p/e8p3
# per 256 where K is whole groups (moe_cuda.py's integer body). H200, D=6144 I=2048 E=64 top-8, kernels only
# (docs/BENCHMARKS.md, dp4a block of 07:13 UTC): q2_0 one token 61.6 -> 34.7 us (32 -> 58 % of copy), 8 tokens
# 400 -> 180 us (40 -> 89 %); q1_0 63.3 -> 28.7 and 408 -> 136 us; the whole op, 19:40 UTC block: e8p 83.8 -> 64.3
# and 399.8 -> 345.9 us, e8p3 120.7 -> 88.4 and 684.1 -> 519.4 us. Quality (CPU, SmolLM2-135M, 4 x 2048 tokens):
# perplexity with q2_0 MLPs 2289.95 -> 2295.08 (+0.22 %), with unquantized bf16 MLPs (raw activations) 25.647 ->
# 25.693 (+0.18 %), with e8p3 MLPs (down rounded per 256; gate_up's K = 576 is not whole groups) 52.523 -> 52.548
# (+0.05 %, 19:40 block). So the GPU decode bodies take it by default; the reference (which the CPU runs, and the GPU for
# prefill-sized calls through the GEMM body) stays unrounded unless asked.
# TURBOSERVE_INT8_EXPERT_ACTIVATIONS: unset = that default; "0" = never; "1" = also the reference, so that CPU
# perplexity measures the rounding on every token.
def int8_settings(env: str | None) -> tuple[bool, bool]:
    """(GPU decode bodies, reference) take int8 activations, for a value of TURBOSERVE_INT8_EXPERT_ACTIVATIONS."""
    if env not in (None, "0", "1"):
        raise ValueError(f"TURBOSERVE_INT8_EXPERT_ACTIVATIONS must be unset, 0 or 1, got {env!r}")
    return env != "0", env == "1"


int8_decode, int8_reference = int8_settings(os.environ.get("TURBOSERVE_INT8_EXPERT_ACTIVATIONS"))


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Decode shape while the average expert sees at most one block of pairs."""
    return DECODE_BLOCK_M if num_pairs <= DECODE_BLOCK_M * num_experts else PREFILL_BLOCK_M


def use_gemv(fmt: str, num_pairs: int, num_experts: int) -> bool:
    """One program per pair (moe_gemv.py) while experts see about one token each; tl.dot blocks beyond.

    A pair-per-program body streams an expert's weights once per pair, so it wins while pairs
    rarely share an expert (num_pairs <= num_experts: decode); bf16 weights keep the GEMM body.
    """
    return fmt in _GEMV_FORMATS and num_pairs <= num_experts


_GEMV_FORMATS = ("e8p", "e8p3", "q1_0", "q2_0")


def fused_moe_triton(x, topk_weights, topk_ids, gate_up: ExpertWeights, down: ExpertWeights,
                     block_m: int | None = None, gemv: bool | None = None,
                     int8_activations: bool = False) -> torch.Tensor:
    """``block_m`` forces the GEMM body with that block; ``gemv`` forces (True) or refuses (False) the GEMV
    regime (the GEMV body, or the tensor-core body where use_mma says so). ``int8_activations`` (q1_0/q2_0):
    the GEMV regime runs the integer-dot body on activations rounded to int8 (moe_dp4a.py); other regimes and
    formats ignore it."""
    num_tokens, top_k = topk_ids.shape
    num_e, two_i, d = gate_up.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if gemv is None:
        gemv = block_m is None and use_gemv(gate_up.format, num_pairs, num_e)
    if gemv and not (_gemv_can_read(gate_up) and _gemv_can_read(down)):
        _say_once("quantized experts: q codes not 4-byte aligned for the GEMV body; using the GEMM body")
        gemv = False
    h = torch.empty((num_pairs, two_i // 2), dtype=x.dtype, device=x.device)
    y_pairs = torch.empty((num_pairs, d), dtype=torch.float32, device=x.device)
    if gemv and int8_activations and gate_up.format in ("q1_0", "q2_0"):
        _say_once(f"quantized experts: {gate_up.format} decode on 8-bit activations through dp4a (moe_dp4a.py)")
        # Five launches, each scheduled early through PDL: rotate+quantize x, gate_up, rotate+quantize h, down, the
        # top-k sum. The kernels read the router's ids and weights in their own dtypes (no conversion launches).
        # Nine before (rotations, quantizations, ids to int32, torch's sum and cast apart). H200, D=6144 I=2048 E=64
        # top-8 (HW block, 10:55 UTC), the op in a CUDA graph: q2_0 46.1 -> 35.8 us at one token, 189.0 -> 181.2 at
        # 8; q1_0 40.8 -> 31.6 and 147.5 -> 137.7 us; the same bits at one token.
        expert_ids, routing = topk_ids.reshape(-1), topk_weights.reshape(-1)
        launch_expert_dp4a(quantize_int8(x, gate_up.format, gate_up.group, gate_up.signs), h, expert_ids, gate_up,
                           dual=True, a_row_div=top_k)
        launch_expert_dp4a(quantize_int8(h, down.format, down.group, down.signs), y_pairs, expert_ids, down,
                           routing=routing)
        return sum_top_k_slots(y_pairs, top_k, x.dtype)
    routing = topk_weights.reshape(-1).float().contiguous()
    if gemv and int8_activations and gate_up.format in moe_cuda.E8_FORMATS:
        kernels = moe_cuda_int8.expert_kernel(gate_up, True, x.dtype), moe_cuda_int8.expert_kernel(down, False, x.dtype)
        if kernels != (None, None):
            _say_once(f"quantized experts: {gate_up.format} decode on 8-bit activations through integer MMAs "
                      "(moe_cuda_int8.py)")
            # As the dp4a branch: rotate+quantize x, gate_up, rotate+quantize h, down, the top-k sum.
            expert_ids = topk_ids.reshape(-1).to(torch.int32)
            _e8_decode(x, h, expert_ids, gate_up, kernels[0], dual=True, a_row_div=top_k)
            _e8_decode(h, y_pairs, expert_ids, down, kernels[1], routing=routing)
            return sum_top_k_slots(y_pairs, top_k, x.dtype)
    xr = gate_up.rotate_input(x).contiguous()
    if gemv and use_mma(gate_up.format, x.dtype, num_pairs):
        blocks = single_pair_blocks(topk_ids, MMA_BLOCK_T)
        launch_expert_mma(xr, h, blocks, gate_up, dual=True, a_row_div=top_k)
        launch_expert_mma(down.rotate_input(h), y_pairs, blocks, down, routing=routing)
    elif gemv:
        expert_ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
        launch_expert_decode(xr, h, expert_ids, gate_up, dual=True, a_row_div=top_k)
        launch_expert_decode(down.rotate_input(h).contiguous(), y_pairs, expert_ids, down, routing=routing)
    else:
        blocks = align_pairs(topk_ids, num_e, block_m or choose_block_m(num_pairs, num_e))
        launch_expert_gemm(xr, h, blocks, gate_up, dual=True, a_row_div=top_k)
        launch_expert_gemm(down.rotate_input(h).contiguous(), y_pairs, blocks, down, routing=routing)
    # The top-k slots of a token are summed here, in slot order: no atomics, same bits every run.
    return y_pairs.view(num_tokens, top_k, d).sum(1).to(x.dtype)


def launch_expert_gemm(a: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, w: ExpertWeights,
                       dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """out[p, :N] for every pair p: rows of w (gate·up epilogue when ``dual``, × routing[p] when given)."""
    num_e, rows, k = w.shape
    n = rows // 2 if dual else rows
    fmt = w.format
    t = w.tensors
    main = t["weight"] if fmt == "bf16" else t["codes"]
    aux = t.get("residual", t.get("d", main))
    scale = t.get("scale", main)
    block_n, block_k, warps, stages = _tile_shape(fmt, blocks.block_m, n, k, num_e, blocks.num_pairs)
    table, rtable = _tables(a.device)
    a_sum = _activation_sums(a, fmt)
    grid = (blocks.num_blocks, triton.cdiv(n, block_n))
    name = f"experts_{fmt}_{'gate_up' if dual else 'down'}_{'decode' if blocks.block_m == DECODE_BLOCK_M else 'prefill'}"
    with timed(name, a.device):
        _expert_gemm[grid](
            a, a_sum, out, blocks.pair_ids, blocks.block_expert, routing if routing is not None else out,
            main, aux, scale, table, rtable,
            n, k, blocks.num_pairs, a.stride(0), a_sum.stride(0), out.stride(0),
            main.stride(0), main.stride(1), aux.stride(0), aux.stride(1) if aux.ndim > 1 else 0,
            scale.stride(0), scale.stride(1) if scale.ndim > 1 else 0,
            FORMAT=FORMAT_IDS[fmt], DUAL=dual, ROUTED=routing is not None, A_ROW_DIV=a_row_div,
            BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            MAGIC=_MAGIC[a.dtype], IEEE=a.dtype == torch.float32,
            num_warps=warps, num_stages=stages,
        )


def launch_expert_gemv(a: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights,
                       dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """As launch_expert_gemm, one program per (pair, row block); expert_ids [pairs] int32 (topk_ids flattened)."""
    num_e, rows, k = w.shape
    n = rows // 2 if dual else rows
    fmt = w.format
    t = w.tensors
    aux = t.get("residual", t.get("d", t["codes"]))
    scale = t.get("scale", t["codes"])
    a = a.contiguous()  # the kernel converts a's elements to float32 as it loads them and sums them itself
    block_k = _gemv_block_k(fmt, k, dual)
    block_n = GEMV_BLOCK_N if dual else gemv_down_block_n
    table, rtable = _tables(a.device)
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    with timed(f"experts_{fmt}_{'gate_up' if dual else 'down'}_gemv", a.device):
        _expert_gemv[grid](
            a, out, expert_ids, routing if routing is not None else out,
            t["codes"], aux, scale, table, rtable,
            n, k, E8_FIELD_MASK, a.stride(0), out.stride(0),
            t["codes"].stride(0), t["codes"].stride(1), aux.stride(0), aux.stride(1) if aux.ndim > 1 else 0,
            scale.stride(0), scale.stride(1) if scale.ndim > 1 else 0,
            FORMAT=FORMAT_IDS[fmt], DUAL=dual, ROUTED=routing is not None, A_ROW_DIV=a_row_div,
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, ASM=inline_ptx(a.device),
            **gemv_launch_options(fmt, dual),
        )


# Formats whose GEMV-regime launches take the tensor-core CUDA C body (moe_cuda.py) where it compiles and takes the
# shape (fp16/bf16 activations, K a multiple of 64); TURBOSERVE_CUDA_KERNELS=0 keeps the Triton body. H200, kernels
# only (HQ block, 08:50 UTC): D=6144 I=2048 top-8 e8p 102.6 -> 65.8 us at one token, 700 -> 382 us at 8; e8p3
# 156.5 -> 102.5 and 1100 -> 666 us; Mixtral D4096 I14336 top-2 one token e8p 126.2 -> 78.6, e8p3 187.8 -> 126.2 us.
CUDA_DECODE_FORMATS = ("e8p", "e8p3")


def launch_expert_decode(a: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights,
                         dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """As launch_expert_gemv, through the CUDA C tensor-core body where it serves (CUDA_DECODE_FORMATS)."""
    kernel = moe_cuda.expert_kernel(a, w, dual) if w.format in CUDA_DECODE_FORMATS else None
    if kernel is None:
        launch_expert_gemv(a, out, expert_ids, w, dual=dual, routing=routing, a_row_div=a_row_div)
    else:
        moe_cuda.launch_expert_cuda(kernel, a, out, expert_ids, w, dual=dual, routing=routing, a_row_div=a_row_div)


def _e8_decode(a: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights, int8_kernel,
               dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """One e8p/e8p3 projection in the GEMV regime on unrotated activations ``a``: the integer body on a's int8 rows
    where it takes w (``int8_kernel``, from moe_cuda_int8.expert_kernel), else the float body on the rotated a."""
    if int8_kernel is None:
        _say_once(f"quantized experts: {w.format} weights of {w.shape[2]} inputs stay on float activations "
                  f"(the integer body takes whole groups of {E8_INT8_GROUP} inputs and 16-byte aligned rows)")
        launch_expert_decode(w.rotate_input(a).contiguous(), out, expert_ids, w, dual=dual, routing=routing,
                             a_row_div=a_row_div)
    else:
        moe_cuda_int8.launch_expert_cuda(int8_kernel, quantize_rows_triton(a, w.group, w.signs), out, expert_ids, w,
                                         dual=dual, routing=routing, a_row_div=a_row_div)


def launch_expert_dp4a(act: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, w: ExpertWeights,
                       dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """As launch_expert_gemv for q1_0/q2_0 on activations from int8_activations.quantize_triton (act [rows,
    PLANES, K/32] int32) through integer dot products (moe_dp4a.py); expert_ids [pairs] of any integer dtype,
    routing [pairs] of any float dtype (the kernel converts them as it loads them)."""
    _, rows, k = w.shape
    n = rows // 2 if dual else rows
    codes, d = w.tensors["codes"], w.tensors["d"]
    block_k = max(K_UNIT[w.format], min(dp4a_block_k if dual else dp4a_down_block_k, triton.next_power_of_2(k)))
    block_n = GEMV_BLOCK_N if dual else gemv_down_block_n
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    with timed(f"experts_{w.format}_{'gate_up' if dual else 'down'}_dp4a", act.device):
        _expert_dp4a[grid](
            act, out, expert_ids, routing if routing is not None else out, codes, d,
            n, k, k // INT8_GROUP, act.stride(0), out.stride(0), codes.stride(0), codes.stride(1),
            d.stride(0), d.stride(1), FORMAT=FORMAT_IDS[w.format], DUAL=dual, ROUTED=routing is not None,
            A_ROW_DIV=a_row_div, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, ASM=inline_ptx(act.device),
            **(dp4a_gate_up_options if dual else dp4a_down_options), **pdl.launch_options(act.device),
        )


# Launch settings of the integer-dot body, module-level so benchmark sweeps set them (bench/kernels_experts.sweep_dp4a):
# inputs per K step (a program's bytes in flight: its next step's codes), and warps of the gate_up / down programs.
# H200 sweep (HN block, 07:13 UTC), kernels only, q2_0 / q1_0 at 1 and 8 tokens: a K step of 1024 beat 512 and 256
# everywhere (q2_0 34.7 / 37.5 / 46.7 us at one token, 180 / 193 / 295 us at 8; q1_0 28.7 / 34.1 / 39.5 and
# 136 / 166 / 196 us); 4-warp gate_up and 8-warp down programs lost (40.6 us, 195 us). The down launch has its own
# K step (its K, I = 2048, is two 1024 steps).
dp4a_block_k = 1024
dp4a_down_block_k = 1024
dp4a_gate_up_options = {"num_warps": 2}
dp4a_down_options = {"num_warps": 4}


def use_mma(fmt: str, dtype: torch.dtype, num_pairs: int) -> bool:
    """In the GEMV regime (use_gemv), q2_0 with fp16/bf16 activations (the MMA's operand types) and at
    least MMA_MIN_PAIRS pairs takes the tensor-core body (moe_mma.py)."""
    return fmt == "q2_0" and dtype in (torch.float16, torch.bfloat16) and num_pairs >= MMA_MIN_PAIRS


def launch_expert_mma(a: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks, w: ExpertWeights,
                      dual: bool = False, routing: torch.Tensor | None = None, a_row_div: int = 1) -> None:
    """As launch_expert_gemm for q2_0 on tensor cores (moe_mma.py); blocks of MMA_BLOCK_T pairs."""
    num_e, rows, k = w.shape
    n = rows // 2 if dual else rows
    codes, d = w.tensors["codes"], w.tensors["d"]
    tiles = tile_order(a)
    blocks_per_step = next(b for b in (mma_unroll, 2, 1) if k % (64 * b) == 0)
    grid = (blocks.num_blocks, triton.cdiv(n, mma_block_n))
    with timed(f"experts_{w.format}_{'gate_up' if dual else 'down'}_mma", a.device):
        _expert_mma[grid](
            tiles, out, blocks.pair_ids, blocks.block_expert, routing if routing is not None else out, codes, d,
            n, k, blocks.num_pairs, tiles.stride(0), out.stride(0), codes.stride(0), codes.stride(1),
            d.stride(0), d.stride(1), DUAL=dual, ROUTED=routing is not None, A_ROW_DIV=a_row_div,
            BLOCK_N=mma_block_n, BLOCK_T=blocks.block_m, ASM=inline_ptx(a.device),
            UNROLL=blocks_per_step, num_warps=mma_warps, num_stages=mma_stages,
        )


MMA_BLOCK_T = 16  # pairs per block: the MMA's N (Triton takes the warpgroup MMA at N = 16, mma.sync at 8)
# Tile of the tensor-core body, the fastest of the H200 sweep (bench/kernels_experts.sweep_mma,
# docs/BENCHMARKS.md 01:22 block): 128 rows, 2 q blocks per K step, 4 warps, 3 stages. Module-level
# so benchmark sweeps can set them.
mma_block_n, mma_unroll, mma_warps, mma_stages = 128, 2, 4, 3
# Fewest pairs in a step for the tensor-core body. H200, D=6144 I=2048 top-8, kernels only: at 8 pairs (1 token)
# it loses to the GEMV body, 99 vs 81 us (Mixtral's 2 pairs 157 vs 108 us): few experts give too few programs
# for its long K loops to hide memory latency; splitting K (03:05 UTC) only took it to 88.7 us. At 64 pairs (8
# tokens) it beat the GEMV body until 04:44 UTC (400 vs 451 us at 01:22), when the GEMV body's exact fp16 levels,
# loads a step ahead and 2-warp gate_up programs took it to 401 us against the MMA body's 415 (docs/BENCHMARKS.md
# 04:44 block; both read an expert's weights once per pair). So it runs only beyond 64 pairs, which the GEMV
# regime (use_gemv) reaches with more than 64 experts, where nothing was measured.
MMA_MIN_PAIRS = 65

GEMV_BLOCK_N = 16  # output rows per program (dual: 16 gate + 16 up): one-token decode launches pairs x N/16 programs
# GEMV launch settings, module-level so benchmark sweeps set them (bench/kernels_experts.sweep_gemv). H200, D=6144
# I=2048 top-8, kernels only (docs/BENCHMARKS.md 04:36 and 04:44 blocks): down programs of 32 rows beat 16 (q2_0
# one token 70.9 -> 68.5 us); gate_up programs of 2 warps beat 4 (q2_0 one token 69.9 -> 62.6 us, gate_up alone
# 45.8 -> 38.8; 8 tokens 440 -> 401 us; e8p 107 -> 103 and 725 -> 701 us; e8p3 is the exception at one token,
# 157 -> 165 us): a thread loads two 16-byte words of a step instead of one. Capping 4 warps at 64 registers (8
# programs an SM instead of 6) did not help (70.3 us). The loop is never a cp.async ring: a depth of 4 or 6 made
# the deep decode 2-4x slower (23:35 block).
gemv_down_block_n = 32
gemv_gate_up_options = {"num_warps": 2}
gemv_down_options = {"num_warps": 4}
# e8p3's gate_up keeps 4 warps: its 2-warp programs need 148 registers a thread and lose at one token (same
# sweep: 156.8 vs 164.9 us; 8 tokens 1101 vs 1097 us).
gemv_gate_up_options_by_format = {"e8p3": {"num_warps": 4}}


def gemv_launch_options(fmt: str, dual: bool) -> dict:
    """Launch options (warps) of the GEMV body's gate_up (``dual``) or down launch for weights in ``fmt``."""
    if dual:
        return gemv_gate_up_options_by_format.get(fmt, gemv_gate_up_options)
    return gemv_down_options


def _gemv_can_read(w: ExpertWeights) -> bool:
    """The GEMV body reads q codes as int32 words: base and expert/row strides must be 4-byte multiples."""
    if w.format not in ("q1_0", "q2_0"):
        return True
    codes = w.tensors["codes"]
    return codes.data_ptr() % 4 == 0 and codes.stride(0) % 4 == 0 and codes.stride(1) % 4 == 0 and codes.stride(2) == 1


def _gemv_block_k(fmt: str, k: int, dual: bool) -> int:
    """Inputs per K step: 256 (4 q2_0 / 2 q1_0 blocks, 32 E8 codes); 128 for dual E8, whose 32-row decode
    tile takes 102 registers a lane at 256 against 62 at 128 (sm_90 SASS): fewer programs per SM."""
    step = 128 if dual and fmt in ("e8p", "e8p3") else 256
    return max(K_UNIT[fmt], 32, min(step, triton.next_power_of_2(k)))


# Operand offset per activation dtype: MAGIC + n is exact with n in the low mantissa bits (moe_triton._dot).
_MAGIC = {torch.bfloat16: 128, torch.float16: 1024, torch.float32: 0}


def _activation_sums(a: torch.Tensor, fmt: str) -> torch.Tensor:
    """Σa per q block (q formats) or per row (E8 formats), in float32, of the very values the kernel multiplies."""
    if fmt in ("q1_0", "q2_0"):
        return a.float().view(a.shape[0], -1, K_UNIT[fmt]).sum(-1)
    return a.float().sum(-1, keepdim=True)


def _tile_shape(fmt: str, block_m: int, n: int, k: int, num_e: int, num_pairs: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages). q formats take one GGUF block per K step."""
    if tile_override is not None:
        bn, bk, warps, stages = tile_override
        return bn, (K_UNIT[fmt] if fmt in ("q1_0", "q2_0") else bk), warps, stages
    if fmt in ("q1_0", "q2_0"):
        block_k = K_UNIT[fmt]
    else:
        block_k = 128 if block_m == DECODE_BLOCK_M else 64
        block_k = max(32, min(block_k, triton.next_power_of_2(k)))
    block_n = 64
    # Decode: enough programs in flight to stream the weights (few experts x few row blocks starve the GPU).
    busy_experts = min(num_e, num_pairs)
    if block_m == DECODE_BLOCK_M and busy_experts * triton.cdiv(n, block_n) < 512:
        block_n = 32
    return block_n, block_k, 4, 3
