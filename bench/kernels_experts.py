"""Quantized-expert MoE kernels vs a bf16 `torch.bmm` MoE over the same experts (`python bench/kernels.py experts`).

Shapes (issue 5): D=6144, I=2048, 64 experts, top-8 (decode at 1, 4, 8, 32 tokens; prefill at 512
and 4096 tokens) and Mixtral-like D=4096, I=14336, 8 experts, top-2 (decode). Weights are random
valid codes (any code decodes to a codebook point), so no quantizer runs on the GPU; a correctness
check compares the Triton op with the float32 reference on bf16 inputs before anything is timed.

Routing puts each case's tokens on experts [g·m, (g+1)·m) for input set g, so the bf16 baseline can
`bmm` a contiguous slice of the expert stack (no gather copy) and consecutive timed calls read
different experts (nothing left in L2). "ours" is the full op (routing, rotations, two fused
kernels, top-k sum); the "kernels only" rows time the two fused launches alone, whose packed
weight bytes are the bandwidth numerator; at decode sizes (moe.use_gemv) rows for the other decode
bodies (GEMV, GEMM, and for q2_0 the tensor-core MMA body; moe.use_mma picks between MMA and GEMV)
time them on the same inputs.

The full run also prints two sweeps that inform the launch choices: GEMM-body decode tiles
(moe._tile_shape) and GEMV rows per program and warps (moe.GEMV_BLOCK_N, moe.gemv_down_block_n,
moe.gemv_gate_up_options; EXPERTS_SWEEP_GEMV=1 adds it to any run); EXPERTS_SWEEP_MMA=1 adds the q2_0
tensor-core body's tiles (moe.mma_*) to any run. Both lists start with
routing.align_pairs: the device kernel against the torch version (element-for-element check, then device time
per call and host time per call).

EXPERTS_BENCH_QUICK=1 python bench/kernels.py experts: a reduced list (under a minute plus
compilation): the same correctness check, deep T=1 and T=8 and mixtral T=1 for e8p, e8p3,
q2_0 and q1_0, no tile sweep, no prefill.

EXPERTS_CUDA=1 python bench/kernels.py experts: e8p/e8p3 on the CUDA C tensor-core bodies only (moe_cuda.py): their
checks (check_cuda, check_cuda_int8), the float body's warps sweep (sweep_cuda), and deep T=1 / T=8 and Mixtral T=1
rows of the dispatched integer body ("ours", on int8 activations), the float CUDA body and the Triton GEMV body
(the A/B), about a minute on a warm H200.

EXPERTS_DP4A=1 python bench/kernels.py experts: q1_0/q2_0 on 8-bit activations only (moe_dp4a.py): its checks
(check_dp4a), the A/B of the one-launch rotation and rounding against the two-step chain before it (deep T=1/4/8,
full op eager and in a CUDA graph, kernels only, each launch alone at T=1), and the sweep of its launch settings
(sweep_dp4a; EXPERTS_DP4A_SWEEP=0 leaves it out).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
import traceback

import torch
import torch.nn.functional as F

from bench.harness import Row, time_ms
from server.kernels import rotation
from server.kernels.experts import int8_activations, moe, moe_cuda, moe_cuda_int8
from server.kernels.experts.moe_dp4a import sum_top_k_slots
from server.kernels.experts.moe_reference import fused_moe_reference
from server.kernels.experts.routing import (
    align_pairs,
    align_pairs_reference,
    align_pairs_triton,
    single_pair_blocks,
)
from server.kernels.experts.weights import ExpertWeights, random_signs, rotation_group

FORMATS = ("e8p", "e8p3", "q2_0", "q1_0")
QUICK = os.environ.get("EXPERTS_BENCH_QUICK") == "1"
DEEP = dict(d=6144, i=2048, experts=64, top_k=8)
MIXTRAL = dict(d=4096, i=14336, experts=8, top_k=2)


def random_weights(fmt: str, e: int, n: int, k: int, device, gen: torch.Generator) -> ExpertWeights:
    """Random valid codes with realistic scales (rows of unit-variance outputs for unit inputs)."""
    def rint(high, shape, dtype):
        return torch.randint(0, high, shape, generator=gen, device=device, dtype=torch.int32).to(dtype)

    scale = torch.full((e, n), 1.0 / k**0.5, dtype=torch.float16, device=device)
    if fmt == "bf16":
        w = torch.randn((e, n, k), generator=gen, device=device, dtype=torch.bfloat16) / k**0.5
        return ExpertWeights(fmt, (e, n, k), {"weight": w})
    if fmt in ("e8p", "e8p3"):
        t = {"codes": rint(1 << 16, (e, n, k // 8), torch.int32).to(torch.int16), "scale": scale}
        if fmt == "e8p3":
            t["residual"] = rint(256, (e, n, k // 8), torch.uint8)
    else:
        block, bits = (128, 1) if fmt == "q1_0" else (64, 2)
        t = {"codes": rint(256, (e, n, k * bits // 8), torch.uint8),
             "d": torch.full((e, n, k // block), 1.0 / k**0.5, dtype=torch.float16, device=device)}
    group = rotation_group(k)
    return ExpertWeights(fmt, (e, n, k), t, random_signs(group, seed=n + k), group)


def routing_for(tokens: int, shape: dict, group: int, device, gen) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(ids, weights, first expert, experts used): distinct experts per token from input set ``group``.

    While tokens·top_k <= experts every routed expert gets exactly one token and the sets use
    disjoint experts; beyond that tokens pick top_k of all experts at random.
    """
    e, k = shape["experts"], shape["top_k"]
    if tokens * k <= e:
        m = tokens * k
        first = (group % (e // m)) * m
        ids = (torch.randperm(m, generator=gen, device=device) + first).view(tokens, k)
    else:
        m, first = e, 0
        ids = torch.rand((tokens, e), generator=gen, device=device).topk(k, dim=1).indices
    w = torch.softmax(torch.randn((tokens, k), generator=gen, device=device), -1)
    return ids, w, first, m


def bf16_bmm_moe(x, ids, w, gate_up: torch.Tensor, down: torch.Tensor, first: int, m: int) -> torch.Tensor:
    """Baseline: tokens padded per expert, bmm over the contiguous experts [first, first + m)."""
    top_k = ids.shape[1]
    local = (ids - first).reshape(-1)
    order = torch.argsort(local)
    counts = torch.bincount(local, minlength=m)
    cmax = int(counts.max())  # pad every expert to the busiest one
    slot = torch.arange(local.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[local[order]]
    xp = torch.zeros((m, cmax, x.shape[1]), dtype=x.dtype, device=x.device)
    xp[local[order], slot] = x[order // top_k]
    gu = torch.bmm(xp, gate_up[first:first + m].transpose(1, 2))
    i = gu.shape[-1] // 2
    h = F.silu(gu[..., :i]) * gu[..., i:]
    out = torch.bmm(h, down[first:first + m].transpose(1, 2))
    y = torch.zeros((x.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    y.index_add_(0, order // top_k, out[local[order], slot].float() * w.reshape(-1)[order, None])
    return y.to(x.dtype)


# (D, I, experts, top_k, tokens): 3 tokens x 8 over 32 experts take the GEMV body (moe.use_gemv), 300 tokens the
# GEMM body; at the first shape the GEMM body (decode launch shape) is checked too.
CORRECTNESS_SHAPES = ((6144, 2048, 32, 8, 3), (4096, 1408, 8, 2, 300))


def check_correctness(device) -> list[str]:
    """Fast vs reference on bf16 inputs at real widths (decode and prefill shapes); raises on mismatch."""
    gen = torch.Generator(device=device).manual_seed(0)
    lines = []
    for fmt in ("bf16", *FORMATS):
        for d, i, e, top_k, tokens in CORRECTNESS_SHAPES:
            gu = random_weights(fmt, e, 2 * i, d, device, gen)
            dn = random_weights(fmt, e, d, i, device, gen)
            x = torch.randn((tokens, d), generator=gen, device=device, dtype=torch.bfloat16)
            ids = torch.rand((tokens, e), generator=gen, device=device).topk(top_k, 1).indices
            ids[0, 1] = ids[0, 0]  # one token routed twice to one expert
            w = torch.rand((tokens, top_k), generator=gen, device=device)
            ref = fused_moe_reference(x.float(), w, ids, gu, dn)
            body = _decode_body(fmt, ids.numel(), e)
            for gemv in (True, False) if body != "gemm" else (False,):
                fast = moe.fused_moe_triton(x, w, ids, gu, dn, gemv=gemv).float()
                err = ((fast - ref).norm() / ref.norm()).item()
                lines.append(f"{fmt} D={d} I={i} T={tokens} {body.upper() if gemv else 'GEMM'} body: rel err {err:.2e}")
                if not err < 2e-2:  # bf16 activations and bf16 h between the kernels
                    raise AssertionError(f"fast experts kernel disagrees with the reference: {lines[-1]}")
    return lines


def _decode_inputs(shape: dict, tokens: int, device, gen) -> tuple[list, int, int]:
    """(8 input sets (x, weights, ids, first expert), how many to rotate through, experts per set)."""
    sets = []
    for g in range(8):
        ids, w, first, m = routing_for(tokens, shape, g, device, gen)
        x = torch.randn((tokens, shape["d"]), generator=gen, device=device, dtype=torch.bfloat16)
        sets.append((x, w, ids, first))
    return sets, min(8, shape["experts"] // m), m


def _decode_rows(shape: dict, label: str, token_counts, copy_gbs, device, formats=FORMATS,
                 other_bodies=("mma", "gemv", "gemm", "dp4a")) -> list[Row]:
    """Full op and kernels-only rows of the dispatched decode body, then the ``other_bodies`` on the same inputs
    (q formats also "dp4a": 8-bit activations, its two quantization launches included, or "gemv" where dp4a is
    the dispatched body)."""
    gen = torch.Generator(device=device).manual_seed(1)
    d, i, e = shape["d"], shape["i"], shape["experts"]
    base_gu = torch.randn((e, 2 * i, d), generator=gen, device=device, dtype=torch.bfloat16) / d**0.5
    base_dn = torch.randn((e, d, i), generator=gen, device=device, dtype=torch.bfloat16) / i**0.5
    rows = []
    for fmt in formats:
        gu = random_weights(fmt, e, 2 * i, d, device, gen)
        dn = random_weights(fmt, e, d, i, device, gen)
        for tokens in token_counts:
            sets, n_sets, m = _decode_inputs(shape, tokens, device, gen)
            used = sets[0][2].unique().numel()
            int8 = moe.int8_decode  # as moe.fused_moe dispatches
            ours = time_ms(lambda j: moe.fused_moe_triton(*sets[j][:3], gu, dn, int8_activations=int8),
                           n_inputs=n_sets, device=device)
            base = time_ms(lambda j: bf16_bmm_moe(sets[j][0], sets[j][2], sets[j][1], base_gu, base_dn, sets[j][3], m),
                           n_inputs=n_sets, device=device)
            body = _decode_body(gu, dn, tokens * shape["top_k"])
            kernels = [_prepared_kernels(s, gu, dn, body) for s in sets[:n_sets]]
            k_ms = time_ms(lambda j: kernels[j](), n_inputs=n_sets, device=device)
            nbytes = gu.packed_bytes(used) + dn.packed_bytes(used)
            case = f"{label} {fmt} decode T={tokens} ({used} experts)"
            rows.append(Row(case, ours, base, nbytes, "bf16 bmm", "full op (routing + rotations + "
                            + ("int8 quantization + " if int8 else "") + "kernels)"))
            rows.append(Row(case + " kernels only", k_ms, base, nbytes, "bf16 bmm",
                            f"two fused launches, {body.upper()} body" + (" (+ 2 rotate+quantize launches)"
                                                                          if body in ("dp4a", "cuda_int8") else "")))
            # the other decode bodies on the same inputs, for comparison
            decode_bodies = {"q2_0": ("mma", "gemv", "gemm", "dp4a"), "q1_0": ("gemv", "gemm", "dp4a")}.get(
                fmt, ("cuda_int8", "cuda", "gemv", "gemm"))
            for other in [b for b in decode_bodies if b != body and b in other_bodies] if body != "gemm" else ():
                kernels = [_prepared_kernels(s, gu, dn, other) for s in sets[:n_sets]]
                o_ms = time_ms(lambda j: kernels[j](), n_inputs=n_sets, device=device)
                rows.append(Row(case + f" kernels only, {other.upper()} body", o_ms, base, nbytes, "bf16 bmm",
                                "two fused launches"))
    return rows


def _decode_body(gu: ExpertWeights, dn: ExpertWeights, num_pairs: int) -> str:
    """Which body moe.fused_moe runs for bf16 activations: "dp4a", "cuda_int8", "cuda", "mma", "gemv" or "gemm"."""
    fmt = gu.format
    if not moe.use_gemv(fmt, num_pairs, gu.shape[0]):
        return "gemm"
    if moe.int8_decode:
        if fmt in ("q1_0", "q2_0"):
            return "dp4a"
        if None not in (moe_cuda_int8.expert_kernel(gu, True, torch.bfloat16),
                         moe_cuda_int8.expert_kernel(dn, False, torch.bfloat16)):
            return "cuda_int8"  # both projections on the integer body, as at the deep shapes
    if fmt in moe.CUDA_DECODE_FORMATS and _cuda_body_available(fmt):
        return "cuda"
    return "mma" if moe.use_mma(fmt, torch.bfloat16, num_pairs) else "gemv"


def _cuda_body_available(fmt: str) -> bool:
    """Whether moe.launch_expert_decode takes the CUDA C body (moe_cuda.py) for bf16 activations of deep widths."""
    a = torch.empty((1, 6144), dtype=torch.bfloat16, device="cuda")
    w = ExpertWeights(fmt, (1, 16, 6144), {"codes": torch.empty((1, 16, 768), dtype=torch.int16, device="cuda"),
                                           "residual": torch.empty((1, 16, 768), dtype=torch.uint8, device="cuda")})
    return moe_cuda.expert_kernel(a, w, dual=False) is not None


def _prepared_kernels(s, gu: ExpertWeights, dn: ExpertWeights, body: str):
    """The two fused launches of moe.fused_moe_triton on prepared inputs (``body``: "cuda" (moe_cuda.py), "mma",
    "gemv" (the Triton body), "gemm", or "dp4a": the two integer-dot launches each after its activations'
    rotate+quantize launch; "dp4a_two_step": the same with the quantization launches of the chain before 6fa2189,
    which had rotated x in a launch of its own (not timed here) and timed h's quantization without h's rotation);
    "cuda_int8": e8p/e8p3 on moe_cuda.py's integer body, each launch after its activations' rotate+quantize launch)."""
    x, w, ids, _ = s
    top_k = ids.shape[1]
    xr = gu.rotate_input(x).contiguous()
    h = torch.empty((ids.numel(), gu.shape[1] // 2), dtype=x.dtype, device=x.device)
    y = torch.empty((ids.numel(), gu.shape[2]), dtype=torch.float32, device=x.device)
    routing = w.reshape(-1).float().contiguous()
    if body in ("gemv", "cuda"):
        expert_ids = ids.reshape(-1).to(torch.int32).contiguous()
        launch = moe.launch_expert_gemv if body == "gemv" else moe.launch_expert_decode

        def run():
            launch(xr, h, expert_ids, gu, dual=True, a_row_div=top_k)
            launch(h, y, expert_ids, dn, routing=routing)
    elif body == "dp4a":  # as moe.fused_moe_triton: rotation and rounding in one launch, ids and weights as given
        expert_ids, weights = ids.reshape(-1), w.reshape(-1)

        def run():
            moe.launch_expert_dp4a(int8_activations.quantize_triton(x, gu.format, gu.group, gu.signs), h, expert_ids,
                                   gu, dual=True, a_row_div=top_k)
            moe.launch_expert_dp4a(int8_activations.quantize_triton(h, dn.format, dn.group, dn.signs), y, expert_ids,
                                   dn, routing=weights)
    elif body == "cuda_int8":  # as moe.fused_moe_triton's integer E8 branch
        expert_ids = ids.reshape(-1).to(torch.int32)
        kernels = moe_cuda_int8.expert_kernel(gu, True, x.dtype), moe_cuda_int8.expert_kernel(dn, False, x.dtype)

        def run():
            moe_cuda_int8.launch_expert_cuda(kernels[0], int8_activations.quantize_rows_triton(x, gu.group, gu.signs),
                                             h, expert_ids, gu, dual=True, a_row_div=top_k)
            moe_cuda_int8.launch_expert_cuda(kernels[1], int8_activations.quantize_rows_triton(h, dn.group, dn.signs),
                                             y, expert_ids, dn, routing=routing)
    elif body == "dp4a_two_step":  # the chain before 6fa2189: x rotated beforehand (not timed), h not rotated
        expert_ids = ids.reshape(-1).to(torch.int32).contiguous()

        def run():
            moe.launch_expert_dp4a(int8_activations.quantize_triton(xr, gu.format), h, expert_ids, gu, dual=True,
                                   a_row_div=top_k)
            moe.launch_expert_dp4a(int8_activations.quantize_triton(h, dn.format), y, expert_ids, dn, routing=routing)
    else:
        if body == "mma":
            launch, blocks = moe.launch_expert_mma, single_pair_blocks(ids, moe.MMA_BLOCK_T)
        else:
            launch = moe.launch_expert_gemm
            blocks = align_pairs(ids, gu.shape[0], moe.choose_block_m(ids.numel(), gu.shape[0]))

        def run():
            launch(xr, h, blocks, gu, dual=True, a_row_div=top_k)
            launch(h, y, blocks, dn, routing=routing)

    return run


def _prefill_rows(copy_gbs, device) -> list[Row]:
    gen = torch.Generator(device=device).manual_seed(2)
    d, i, e, top_k = DEEP["d"], DEEP["i"], DEEP["experts"], DEEP["top_k"]
    base_gu = torch.randn((e, 2 * i, d), generator=gen, device=device, dtype=torch.bfloat16) / d**0.5
    base_dn = torch.randn((e, d, i), generator=gen, device=device, dtype=torch.bfloat16) / i**0.5
    rows = []
    for tokens in (512, 4096):
        x = torch.randn((tokens, d), generator=gen, device=device, dtype=torch.bfloat16)
        ids = torch.rand((tokens, e), generator=gen, device=device).topk(top_k, 1).indices
        w = torch.softmax(torch.randn((tokens, top_k), generator=gen, device=device), -1)
        base = time_ms(lambda _: bf16_bmm_moe(x, ids, w, base_gu, base_dn, 0, e), warmup=3, iters=10, device=device)
        flops = 2 * tokens * top_k * 3 * d * i
        for fmt in FORMATS:
            gu = random_weights(fmt, e, 2 * i, d, device, gen)
            dn = random_weights(fmt, e, d, i, device, gen)
            ours = time_ms(lambda _: moe.fused_moe_triton(x, w, ids, gu, dn), warmup=3, iters=10, device=device)
            tflops = flops / (ours * 1e-3) / 1e12
            rows.append(Row(f"deep {fmt} prefill T={tokens}", ours, base, None, "bf16 bmm",
                            f"{tflops:.0f} TFLOP/s (bf16 bmm {flops / (base * 1e-3) / 1e12:.0f})"))
    return rows


SWEEP = ((32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 8, 3))


def sweep_decode_tiles(device) -> None:
    """Print kernel-only times of the decode launch shape for a few tiles (informs moe._tile_shape)."""
    for shape, label in ((DEEP, "deep"), (MIXTRAL, "mixtral")):
        gen = torch.Generator(device=device).manual_seed(3)
        for fmt in ("e8p",):
            gu = random_weights(fmt, shape["experts"], 2 * shape["i"], shape["d"], device, gen)
            dn = random_weights(fmt, shape["experts"], shape["d"], shape["i"], device, gen)
            sets = []
            for g in range(8):
                ids, w, first, m = routing_for(1, shape, g, device, gen)
                x = torch.randn((1, shape["d"]), generator=gen, device=device, dtype=torch.bfloat16)
                sets.append((x, w, ids, first))
            n_sets = min(8, shape["experts"] // m)
            nbytes = gu.packed_bytes(m) + dn.packed_bytes(m)
            for tile in SWEEP:
                moe.tile_override = tile
                kernels = [_prepared_kernels(s, gu, dn, "gemm") for s in sets[:n_sets]]
                ms = time_ms(lambda j: kernels[j](), n_inputs=n_sets, device=device)
                print(f"sweep {label} {fmt} T=1 tile {tile}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s")
            moe.tile_override = None


# (gate_up rows per program, down rows per program, gate_up launch options): moe.GEMV_BLOCK_N, moe.gemv_down_block_n,
# moe.gemv_gate_up_options. The first is the setting the tree ships (chosen by this sweep at 04:44 UTC,
# docs/BENCHMARKS.md, where 4 warps capped at 64 registers also lost).
GEMV_SWEEP = ((16, 32, {"num_warps": 2}), (16, 32, {"num_warps": 4}), (16, 16, {"num_warps": 4}),
              (8, 32, {"num_warps": 4}))


def _gemv_settings(config: tuple) -> None:
    moe.GEMV_BLOCK_N, moe.gemv_down_block_n, moe.gemv_gate_up_options = config


def _sweep_deep(name: str, body: str, device, copy_gbs: float, formats, token_counts, configs, apply, reference,
                run, bound: float, alone, seed: int) -> list[float]:
    """The loop both sweeps share (``body`` as _prepared_kernels names it, ``name`` as the lines print it): for
    each format and token count at the deep shape, each setting (``apply``)
    checked on the first input set against ``reference`` (a wrong one is reported and never chosen) and timed
    kernels only; at one token ``alone`` says where the time goes. Returns the log-time sum per setting."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d, i, e = DEEP["d"], DEEP["i"], DEEP["experts"]
    log_sum = [0.0] * len(configs)
    for fmt in formats:
        gu = random_weights(fmt, e, 2 * i, d, device, gen)
        dn = random_weights(fmt, e, d, i, device, gen)
        for tokens in token_counts:
            sets, n_sets, m = _decode_inputs(DEEP, tokens, device, gen)
            nbytes = gu.packed_bytes(m) + dn.packed_bytes(m)
            x, w, ids, _ = sets[0]
            ref = reference(x.float(), w, ids, gu, dn)
            for c, config in enumerate(configs):
                apply(config)
                err = ((run(x, w, ids, gu, dn).float() - ref).norm() / ref.norm()).item()
                if not err < bound:  # reported and never chosen; the others are still timed
                    print(f"sweep {name} deep {fmt} T={tokens} {config}: WRONG, rel err {err:.2e} vs the reference")
                    log_sum[c] = float("inf")
                    continue
                kernels = [_prepared_kernels(s, gu, dn, body) for s in sets[:n_sets]]
                ms = time_ms(lambda j: kernels[j](), n_inputs=n_sets, device=device)
                log_sum[c] += math.log(ms)
                gbs = nbytes / ms / 1e6
                line = (f"sweep {name} deep {fmt} T={tokens} {config}: {ms * 1e3:.1f} us, {gbs:.0f} GB/s, "
                        f"{gbs / copy_gbs:.0%} of copy, rel err {err:.1e}")
                if tokens == 1:
                    line += "; alone: " + ", ".join(f"{k} {v:.1f} us" for k, v in alone(sets, n_sets, gu, dn).items())
                print(line, flush=True)
    return log_sum


def sweep_gemv(device, copy_gbs: float, formats=("q2_0", "e8p", "e8p3"), token_counts=(1, 8),
               configs=GEMV_SWEEP) -> tuple:
    """Kernel-only times of the GEMV body at the deep shape for the GEMV_SWEEP settings (gate_up rows, down rows,
    gate_up options), each checked against the float32 reference; leaves moe at the setting with the lowest
    geometric mean of time over the cases, for every format (so the rows measured after it use it), and returns it."""
    moe.gemv_gate_up_options_by_format = {}  # one setting for every format while sweeping
    alone = lambda sets, n_sets, gu, dn: {  # noqa: E731
        "gate_up": _gemv_launch_us(sets, n_sets, gu, dn, True, device),
        "down": _gemv_launch_us(sets, n_sets, gu, dn, False, device)}
    log_sum = _sweep_deep("gemv", "gemv", device, copy_gbs, formats, token_counts, configs, _gemv_settings,
                          fused_moe_reference, fused_gemv, 1e-2, alone, seed=4)
    best = configs[min(range(len(configs)), key=log_sum.__getitem__)]
    _gemv_settings(best)
    print(f"sweep gemv: fastest (geometric mean) over {formats} x T={token_counts}: {best}; the rows below use it",
          flush=True)
    return best


def _gemv_launch_us(sets, n_sets: int, gu: ExpertWeights, dn: ExpertWeights, dual: bool, device) -> float:
    """Device microseconds of the GEMV body's gate_up (``dual``) or down launch alone on the decode inputs."""
    launches = []
    for x, w, ids, _ in sets[:n_sets]:
        expert_ids = ids.reshape(-1).to(torch.int32).contiguous()
        h = torch.randn((ids.numel(), gu.shape[1] // 2), device=device).to(x.dtype)
        if dual:
            out = torch.empty_like(h)
            launches.append(lambda x=x, out=out, e=expert_ids, k=ids.shape[1]: moe.launch_expert_gemv(
                x, out, e, gu, dual=True, a_row_div=k))
        else:
            out = torch.empty((ids.numel(), gu.shape[2]), dtype=torch.float32, device=device)
            routing = w.reshape(-1).float().contiguous()
            launches.append(lambda h=h, out=out, e=expert_ids, r=routing: moe.launch_expert_gemv(
                h, out, e, dn, routing=r))
    return time_ms(lambda j: launches[j](), n_inputs=n_sets, device=device) * 1e3


def fused_gemv(x, w, ids, gu, dn):
    """moe.fused_moe_triton with the GEMV body even where moe.use_mma would take the tensor-core body."""
    saved, moe.MMA_MIN_PAIRS = moe.MMA_MIN_PAIRS, 1 << 30
    try:
        return moe.fused_moe_triton(x, w, ids, gu, dn, gemv=True)
    finally:
        moe.MMA_MIN_PAIRS = saved


def _deep_decode_error(op, gu: ExpertWeights, dn: ExpertWeights, dtype, tokens: int, gen, device,
                       int8_reference: bool = False) -> float:
    """Relative error of ``op(x, weights, ids, gu, dn)`` against the float32 reference (with 8-bit activations
    when ``int8_reference``) on random ``dtype`` activations at D=6144, 64 experts, top-8, one token routed twice
    to one expert; the output lands in a buffer poisoned with NaN first."""
    x = torch.randn((tokens, 6144), generator=gen, device=device).to(dtype)
    ids = torch.rand((tokens, 64), generator=gen, device=device).topk(8, 1).indices
    ids[0, 1] = ids[0, 0]
    w = torch.rand((tokens, 8), generator=gen, device=device)
    ref = fused_moe_reference(x.float(), w, ids, gu, dn, int8_activations=int8_reference)
    out = torch.full((tokens, 6144), float("nan"), device=device)
    out.copy_(op(x, w.to(dtype), ids, gu, dn).float())
    return ((out - ref).norm() / ref.norm()).item()


def check_gemv(device, formats=FORMATS) -> list[str]:
    """The GEMV body (q2_0 levels in inline assembly, activations converted as loaded) against the float32
    reference at the deep widths, bf16 and fp16 activations, 1 and 8 tokens; raises on mismatch."""
    gen = torch.Generator(device=device).manual_seed(7)
    lines = []
    for fmt in formats:
        gu = random_weights(fmt, 64, 2 * 2048, 6144, device, gen)
        dn = random_weights(fmt, 64, 6144, 2048, device, gen)
        for dtype, bound in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
            for tokens in (1, 8):
                err = _deep_decode_error(fused_gemv, gu, dn, dtype, tokens, gen, device)
                lines.append(f"{fmt} GEMV body {dtype} T={tokens}: rel err {err:.2e} (bound {bound:.0e})")
                if not err < bound:
                    raise AssertionError(f"GEMV body disagrees with the reference: {lines[-1]}")
    return lines


# Bounds of the integer-dot body against the reference with the same int8 rounding, by activation dtype. With
# float32 activations both round the same values (the rotation is the same kernel, quantize_triton equals its
# definition bit for bit), and only h's float32 summation order may flip a rare rounding. With fp16/bf16 the fast
# path rotates x and stores h in that dtype, and each value moved by a dtype rounding δ crosses an int8 rounding
# boundary with probability δ/s, then moving by a whole step s: an error of sqrt(δ·s) instead of δ, a few times
# the dtype's own (measured in the interpreter at D = I = 128, bf16: 1.0e-2 for q2_0, 1.3e-2 for q1_0).
DP4A_BOUNDS = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def check_dp4a(device) -> list[str]:
    """8-bit activations on the device: the quantization kernel bit for bit against the torch definition (IEEE
    division and rounding on the GPU), without and with the weights' rotation in the same launch (then also
    against the two launches it replaces); the top-k sum launch bit for bit against the slot-order sum; the
    integer-dot body (dp4a assembly) against the reference with the same rounding at D=6144 I=2048 E=64 top-8,
    float32, fp16 and bf16, 1 and 8 tokens (one routed twice), bounds DP4A_BOUNDS; and its distance from the float
    reference (what the rounding costs); raises on a mismatch of the op (plane mismatches are reported)."""
    gen = torch.Generator(device=device).manual_seed(10)
    lines = []
    for fmt in ("q2_0", "q1_0"):
        a = torch.randn((8, 6144), generator=gen, device=device) * torch.rand((8, 1), generator=gen, device=device)
        a[0, 64:96] = 0
        lines.append(_planes_line(f"{fmt} int8 activation planes", int8_activations.quantize_triton(a, fmt),
                                  int8_activations.quantize_reference(a, fmt), "8 x 6144"))
        for dtype, k in itertools.product((torch.float32, torch.float16, torch.bfloat16), (6144, 2048)):
            a = (torch.randn((8, k), generator=gen, device=device) * 3).to(dtype)
            a[1, 256:512] = 0
            group = rotation_group(k)
            signs = random_signs(group, seed=k)
            want = int8_activations.quantize_reference(a, fmt, group, signs)
            what = f"{fmt} rotate+quantize {dtype} 8 x {k} (group {group})"
            lines.append(_planes_line(what, int8_activations.quantize_triton(a, fmt, group, signs), want, "torch"))
            two_step = int8_activations.quantize_triton(rotation.rotate_triton(a, group, signs=signs), fmt)
            lines.append(_planes_line(what, two_step, want, "torch, through the two launches it replaces"))
        gu = random_weights(fmt, 64, 2 * 2048, 6144, device, gen)
        dn = random_weights(fmt, 64, 6144, 2048, device, gen)
        op = functools.partial(moe.fused_moe_triton, gemv=True, int8_activations=True)
        for dtype, bound in DP4A_BOUNDS.items():
            for tokens in (1, 8):
                seed = int(torch.randint(0, 1 << 30, (1,), generator=gen, device=device))
                err = _deep_decode_error(op, gu, dn, dtype, tokens, torch.Generator(device=device).manual_seed(seed),
                                         device, int8_reference=True)
                err_float = _deep_decode_error(op, gu, dn, dtype, tokens,
                                               torch.Generator(device=device).manual_seed(seed), device)
                err_old = _deep_decode_error(two_step_dp4a, gu, dn, dtype, tokens,
                                             torch.Generator(device=device).manual_seed(seed), device,
                                             int8_reference=True)
                lines.append(f"{fmt} DP4A body {dtype} T={tokens}: rel err {err:.2e} vs the int8 reference (bound "
                             f"{bound:.0e}; two-step chain {err_old:.2e}), {err_float:.2e} vs the float reference")
                if not err < bound:
                    raise AssertionError(f"dp4a body disagrees with the int8-activation reference: {lines[-1]}")
    y = torch.randn((64, 6144), generator=gen, device=device)
    acc = y.view(8, 8, 6144)[:, 0]
    for j in range(1, 8):
        acc = acc + y.view(8, 8, 6144)[:, j]
    got = sum_top_k_slots(y, 8, torch.bfloat16)
    lines.append(f"top-k sum launch: {'equal to' if torch.equal(got, acc.bfloat16()) else 'DIFFERS from'} the "
                 f"slot-order sum then one bf16 rounding (8 tokens x 8 slots x 6144)")
    return lines


def _planes_line(what: str, got: torch.Tensor, want: torch.Tensor, against: str) -> str:
    """A line saying whether int8 planes equal the expected ones (reported, not raised: the timings are still
    worth having)."""
    if torch.equal(got, want):
        return f"{what}: equal to {against}"
    return (f"{what}: DIFFER from {against} in {int((got != want).sum())} of {got.numel()} words "
            f"({int((got[:, 8] != want[:, 8]).sum())} -Σq, {int((got[:, 9] != want[:, 9]).sum())} scales)")


def two_step_dp4a(x, topk_weights, topk_ids, gu: ExpertWeights, dn: ExpertWeights) -> torch.Tensor:
    """The dp4a decode op as moe.fused_moe_triton ran it before 6fa2189 (the A of the A/B): rotation and quantization
    of x and of h in separate launches, ids converted to int32 and weights to float32 in launches of their own,
    torch's top-k sum and cast (two launches); nine launches at one token against five."""
    tokens, top_k = topk_ids.shape
    xr = gu.rotate_input(x).contiguous()
    h = torch.empty((tokens * top_k, gu.shape[1] // 2), dtype=x.dtype, device=x.device)
    y = torch.empty((tokens * top_k, gu.shape[2]), dtype=torch.float32, device=x.device)
    routing = topk_weights.reshape(-1).float().contiguous()
    expert_ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    moe.launch_expert_dp4a(int8_activations.quantize_triton(xr, gu.format), h, expert_ids, gu, dual=True,
                           a_row_div=top_k)
    moe.launch_expert_dp4a(int8_activations.quantize_triton(dn.rotate_input(h), dn.format), y, expert_ids, dn,
                           routing=routing)
    return y.view(tokens, top_k, -1).sum(1).to(x.dtype)


def new_dp4a(x, topk_weights, topk_ids, gu: ExpertWeights, dn: ExpertWeights) -> torch.Tensor:
    """The dp4a decode op as moe.fused_moe_triton runs it (the B of the A/B)."""
    return moe.fused_moe_triton(x, topk_weights, topk_ids, gu, dn, gemv=True, int8_activations=True)


# (gate_up K step, down K step, gate_up warps, down warps, gate_up rows, down rows, rows per quantization program /
# 32): moe.dp4a_block_k, moe.dp4a_down_block_k, moe.dp4a_gate_up_options, moe.dp4a_down_options, moe.GEMV_BLOCK_N,
# moe.gemv_down_block_n, int8_activations.QUANTIZE_BLOCK_G. The first is the setting the tree ships.
DP4A_SWEEP = ((1024, 1024, 2, 4, 16, 32, 8), (1024, 1024, 2, 4, 16, 32, 16), (1024, 2048, 2, 4, 16, 32, 8),
              (1024, 1024, 2, 4, 16, 16, 8), (1024, 1024, 2, 4, 16, 64, 8))


def _dp4a_settings(config: tuple) -> None:
    moe.dp4a_block_k, moe.dp4a_down_block_k, gu_warps, dn_warps, moe.GEMV_BLOCK_N, moe.gemv_down_block_n, \
        int8_activations.QUANTIZE_BLOCK_G = config
    moe.dp4a_gate_up_options = {"num_warps": gu_warps}
    moe.dp4a_down_options = {"num_warps": dn_warps}


def sweep_dp4a(device, copy_gbs: float, formats=("q2_0", "q1_0"), token_counts=(1, 8), configs=DP4A_SWEEP,
               label: str = "") -> tuple:
    """Kernel-only times of the integer-dot body at the deep shape (the two rotate+quantize launches included) for
    DP4A_SWEEP, each checked against the int8 reference; at one token also each launch alone. Returns the fastest
    setting (geometric mean) and leaves moe at the shipped one (the first), which the rows after it measure."""
    saved = (moe.GEMV_BLOCK_N, moe.gemv_down_block_n)
    log_sum = _sweep_deep(
        "dp4a" + label, "dp4a", device, copy_gbs, formats, token_counts, configs, _dp4a_settings,
        lambda *a: fused_moe_reference(*a, int8_activations=True), new_dp4a, DP4A_BOUNDS[torch.bfloat16],
        lambda sets, n_sets, gu, dn: _dp4a_launch_us(sets, n_sets, gu, dn, device), seed=11)
    best = configs[min(range(len(configs)), key=log_sum.__getitem__)]
    _dp4a_settings(configs[0])
    moe.GEMV_BLOCK_N, moe.gemv_down_block_n = saved
    print(f"sweep dp4a: fastest (geometric mean) over {formats} x T={token_counts}: {best}; the rows below use the "
          f"shipped {configs[0]}", flush=True)
    return best


def _dp4a_launch_us(sets, n_sets: int, gu: ExpertWeights, dn: ExpertWeights, device, two_step: bool = False) -> dict:
    """Device microseconds of each launch of the integer-dot decode alone: rotate+quantize x, gate_up,
    rotate+quantize h, down, top-k sum (``two_step``: the launches those replaced)."""
    prepared = []
    for x, w, ids, _ in sets[:n_sets]:
        h = torch.randn((ids.numel(), gu.shape[1] // 2), device=device).to(x.dtype)
        ax = int8_activations.quantize_triton(x, gu.format, gu.group, gu.signs)
        ah = int8_activations.quantize_triton(h, dn.format, dn.group, dn.signs)
        y = torch.randn((ids.numel(), gu.shape[2]), device=device)
        prepared.append((x, h, ax, ah, y, ids.reshape(-1), w.reshape(-1), ids.shape[1]))
    if two_step:
        launches = {
            "rotate x": lambda p: gu.rotate_input(p[0]),
            "quantize x": lambda p: int8_activations.quantize_triton(p[0], gu.format),
            "rotate h": lambda p: dn.rotate_input(p[1]),
            "quantize h": lambda p: int8_activations.quantize_triton(p[1], dn.format),
            "ids to int32": lambda p: p[5].to(torch.int32),
            "sum + cast": lambda p: p[4].view(-1, p[7], p[4].shape[1]).sum(1).to(p[0].dtype),
        }
    else:
        launches = {
            "rotate+quantize x": lambda p: int8_activations.quantize_triton(p[0], gu.format, gu.group, gu.signs),
            "gate_up": lambda p: moe.launch_expert_dp4a(p[2], p[1], p[5], gu, dual=True, a_row_div=p[7]),
            "rotate+quantize h": lambda p: int8_activations.quantize_triton(p[1], dn.format, dn.group, dn.signs),
            "down": lambda p: moe.launch_expert_dp4a(p[3], p[4], p[5], dn, routing=p[6]),
            "top-k sum": lambda p: sum_top_k_slots(p[4], p[7], p[0].dtype),
        }
    return {k: time_ms(lambda j, f=f: f(prepared[j]), n_inputs=n_sets, device=device) * 1e3
            for k, f in launches.items()}


def _graphed(calls: list):
    """Each call captured in a CUDA graph of its own (after a warm-up call): returns replay functions."""
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    for call in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        graphs.append(g)
    return [g.replay for g in graphs]


def _dp4a_chain_rows(copy_gbs: float, device, token_counts=(1, 4, 8)) -> list[Row]:
    """The A/B of 6fa2189 at the deep shape, q2_0 and q1_0: the full op (eager and replayed from a CUDA graph, as a
    decode step runs it) and the kernels alone, the two-step chain (two_step_dp4a) as the baseline."""
    gen = torch.Generator(device=device).manual_seed(12)
    d, i, e = DEEP["d"], DEEP["i"], DEEP["experts"]
    rows = []
    for fmt in ("q2_0", "q1_0"):
        gu = random_weights(fmt, e, 2 * i, d, device, gen)
        dn = random_weights(fmt, e, d, i, device, gen)
        for tokens in token_counts:
            sets, n_sets, m = _decode_inputs(DEEP, tokens, device, gen)
            nbytes = gu.packed_bytes(m) + dn.packed_bytes(m)
            case = f"deep D6144 I2048 E64 top8 {fmt} decode T={tokens} ({m} experts)"
            ops = {name: [functools.partial(op, *sets[j][:3], gu, dn) for j in range(n_sets)]
                   for name, op in (("new", new_dp4a), ("old", two_step_dp4a))}
            diff = (ops["new"][0]().float() - ops["old"][0]().float()).abs().max().item()
            eager = {k: time_ms(lambda j, c=c: c[j](), n_inputs=n_sets, device=device) for k, c in ops.items()}
            graph = {}
            for k, c in ops.items():
                replays = _graphed(c)
                graph[k] = time_ms(lambda j, r=replays: r[j](), n_inputs=n_sets, device=device)
            kernels = {k: [_prepared_kernels(st, gu, dn, body) for st in sets[:n_sets]]
                       for k, body in (("new", "dp4a"), ("old", "dp4a_two_step"))}
            k_ms = {k: time_ms(lambda j, c=c: c[j](), n_inputs=n_sets, device=device) for k, c in kernels.items()}
            rows.append(Row(case + ", full op", eager["new"], eager["old"], nbytes, "two-step chain",
                            f"5 launches vs 9 (+ torch's); max |new - old| {diff:.1e}"))
            rows.append(Row(case + ", full op in a CUDA graph", graph["new"], graph["old"], nbytes, "two-step chain",
                            "graph replay"))
            rows.append(Row(case + ", kernels only", k_ms["new"], k_ms["old"], nbytes, "two-step chain",
                            "rotate+quantize x, gate_up, rotate+quantize h, down (old: quantize only)"))
            for row in rows[-3:]:  # printed as measured too: the table comes only at the end of the run
                print(f"dp4a A/B: {row.case}: {row.ours_ms * 1e3:.1f} us vs {row.baseline_ms * 1e3:.1f} us "
                      f"({row.fraction_of_copy(copy_gbs):.0%} of copy vs {nbytes / row.baseline_ms / 1e6 / copy_gbs:.0%})",
                      flush=True)
            if tokens == 1:
                for two_step in (False, True):
                    alone = _dp4a_launch_us(sets, n_sets, gu, dn, device, two_step)
                    print(f"dp4a launches alone, {fmt} T=1{' (two-step chain)' if two_step else ''}: "
                          + ", ".join(f"{k} {v:.1f} us" for k, v in alone.items()), flush=True)
    return rows


# (rows per program, q blocks per K step, warps, pipeline depth)
MMA_SWEEP = ((128, 2, 4, 3), (128, 4, 4, 3), (128, 1, 4, 3), (64, 4, 4, 3), (64, 2, 4, 3), (128, 2, 4, 4))


def sweep_mma(device, copy_gbs: float, token_counts=(1, 8), configs=MMA_SWEEP) -> tuple:
    """Print kernel-only times of the q2_0 tensor-core body at the deep shape for the MMA_SWEEP tiles (informs
    moe.mma_*), with the GEMV body on the same inputs; leaves moe.mma_* at the fastest tile over all token
    counts (so the rows measured after it use that tile) and returns it."""
    gen = torch.Generator(device=device).manual_seed(5)
    d, i, e = DEEP["d"], DEEP["i"], DEEP["experts"]
    totals = dict.fromkeys(configs, 0.0)
    gu = random_weights("q2_0", e, 2 * i, d, device, gen)
    dn = random_weights("q2_0", e, d, i, device, gen)
    for tokens in token_counts:
        sets, n_sets, m = _decode_inputs(DEEP, tokens, device, gen)
        nbytes = gu.packed_bytes(m) + dn.packed_bytes(m)
        for body, config in [("gemv", None)] + [("mma", c) for c in configs]:
            if config is not None:
                moe.mma_block_n, moe.mma_unroll, moe.mma_warps, moe.mma_stages = config
            try:
                kernels = [_prepared_kernels(s, gu, dn, body) for s in sets[:n_sets]]
                ms = time_ms(lambda j: kernels[j](), n_inputs=n_sets, device=device)
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is reported, not fatal
                print(f"sweep mma deep q2_0 T={tokens} {body} {config}: failed ({exc.__class__.__name__}: {exc})")
                if config is not None:
                    totals[config] = float("inf")
                continue
            if config is not None:
                totals[config] += ms
            gbs = nbytes / ms / 1e6
            print(f"sweep mma deep q2_0 T={tokens} {body} (block_n, unroll, warps, stages)={config}: "
                  f"{ms * 1e3:.1f} us, {gbs:.0f} GB/s, {gbs / copy_gbs:.0%} of copy", flush=True)
    best = min(totals, key=totals.get)
    moe.mma_block_n, moe.mma_unroll, moe.mma_warps, moe.mma_stages = best
    print(f"sweep mma: fastest over T={token_counts}: {best}; the rows below use it", flush=True)
    return best


def check_mma(device) -> list[str]:
    """The q2_0 tensor-core body (inline assembly, fp16 and bf16) against the float32 reference at the deep
    widths, 1 to 8 tokens (forced below moe.MMA_MIN_PAIRS); raises on mismatch."""
    gen = torch.Generator(device=device).manual_seed(6)
    lines = []
    gu = random_weights("q2_0", 64, 2 * 2048, 6144, device, gen)
    dn = random_weights("q2_0", 64, 6144, 2048, device, gen)
    saved, moe.MMA_MIN_PAIRS = moe.MMA_MIN_PAIRS, 1
    try:
        for dtype, bound in ((torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
            for tokens in (1, 3, 8):
                err = _deep_decode_error(functools.partial(moe.fused_moe_triton, gemv=True), gu, dn, dtype, tokens,
                                         gen, device)
                lines.append(f"q2_0 MMA body {dtype} T={tokens}: rel err {err:.2e} (bound {bound:.0e})")
                if not err < bound:
                    raise AssertionError(f"tensor-core q2_0 body disagrees with the reference: {lines[-1]}")
    finally:
        moe.MMA_MIN_PAIRS = saved
    return lines


# (experts, tokens, pairs per block) at top-8: decode (moe.DECODE_BLOCK_M) and prefill (PREFILL_BLOCK_M) sizes.
ROUTING_SHAPES = ((64, 1, 16), (128, 1, 16), (64, 8, 16), (128, 8, 16), (64, 512, 64), (128, 512, 64),
                  (64, 4096, 64), (128, 4096, 64))


def _top8(experts: int, tokens: int, kind: str, gen, device) -> torch.Tensor:
    """Router-like ids (distinct experts per token), ids with repeats, or skewed ids (most pairs on 2 experts)."""
    if kind == "distinct":
        return torch.rand((tokens, experts), generator=gen, device=device).topk(8, 1).indices
    ids = torch.randint(0, experts, (tokens, 8), generator=gen, device=device)
    if kind == "skewed":
        ids = torch.where(ids < experts // 2, 3, ids % 2 + experts - 2)
    return ids


def check_routing(device) -> list[str]:
    """routing.align_pairs_triton against align_pairs_reference, element for element, at ROUTING_SHAPES for
    router-like, repeating and skewed ids; raises on the first difference."""
    gen = torch.Generator(device=device).manual_seed(8)
    lines = []
    for experts, tokens, block_m in ROUTING_SHAPES:
        for kind, _ in itertools.product(("distinct", "repeats", "skewed"), range(3)):
            ids = _top8(experts, tokens, kind, gen, device)
            want = align_pairs_reference(ids, experts, block_m)
            # Freed blocks of the outputs' sizes hold a value no output has, so an element the kernel never
            # writes cannot pass by holding a previous call's value (the caching allocator reuses them).
            poison = [torch.full_like(want.pair_ids, -7), torch.full_like(want.block_expert, -7)]
            del poison
            got = align_pairs_triton(ids, experts, block_m)
            for name in ("pair_ids", "block_expert"):
                if not torch.equal(getattr(got, name), getattr(want, name)):
                    raise AssertionError(f"align_pairs kernel differs from the torch version in {name} at E={experts} "
                                         f"T={tokens} block_m={block_m} {kind} ids")
        lines.append(f"align_pairs E={experts} T={tokens} block_m={block_m}: equal to the torch version "
                     f"(3 x router-like, repeating, skewed ids)")
    return lines


def _host_us(fn, device, calls: int = 50) -> tuple[float, float]:
    """(host microseconds to issue one call, wall microseconds per call with the device synchronized around)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def routing_rows(device) -> list[Row]:
    """align_pairs, device kernel (ours) against the torch version: device time per call (events), host time."""
    gen = torch.Generator(device=device).manual_seed(9)
    rows = []
    for experts, tokens, block_m in ROUTING_SHAPES:
        ids = _top8(experts, tokens, "distinct", gen, device)
        ours = time_ms(lambda _: align_pairs_triton(ids, experts, block_m), device=device)
        base = time_ms(lambda _: align_pairs_reference(ids, experts, block_m), device=device)
        host = [_host_us(lambda f=f: f(ids, experts, block_m), device)
                for f in (align_pairs_triton, align_pairs_reference)]
        rows.append(Row(f"align_pairs E={experts} top8 T={tokens} block_m={block_m}", ours, base, None,
                        "torch align_pairs", f"host issue / synced wall per call: {host[0][0]:.0f} / {host[0][1]:.0f} "
                        f"us (torch {host[1][0]:.0f} / {host[1][1]:.0f} us)"))
    return rows


def run_dp4a(device: torch.device, copy_gbs: float):
    """EXPERTS_DP4A=1: the 8-bit-activation checks, the A/B of the one-launch rotation (6fa2189) against the two-step
    chain at T=1/4/8, and the integer-dot sweep for q2_0 (EXPERTS_DP4A_SWEEP=0 leaves it out)."""
    try:
        for line in check_dp4a(device):
            print("correctness:", line, flush=True)
    except AssertionError as exc:  # reported; the sweep checks every setting it times again
        print(f"correctness: FAILED: {exc}", flush=True)
    rows = []
    try:
        rows += _dp4a_chain_rows(copy_gbs, device)
    except Exception:  # noqa: BLE001 - keep what was measured
        traceback.print_exc()
    if os.environ.get("EXPERTS_DP4A_SWEEP") != "0":
        try:
            sweep_dp4a(device, copy_gbs, formats=("q2_0",))
        except Exception:  # noqa: BLE001 - informative only
            traceback.print_exc()
    return "Quantized MoE experts: q1_0/q2_0 dp4a decode, rotation and rounding in one launch vs the two-step chain", rows


# Warps per CTA of the CUDA body's (gate_up, down) launches (moe_cuda.warps); the first is the setting the tree ships.
CUDA_WARPS_SWEEP = ((4, 4), (2, 2), (8, 8))


def sweep_cuda(device, copy_gbs: float, formats=("e8p", "e8p3"), token_counts=(1, 8), configs=CUDA_WARPS_SWEEP):
    """Device time of the CUDA body's two launches per warps setting at the deep shape; sets the fastest (geometric
    mean over formats and token counts) for the rows that follow."""
    gen = torch.Generator(device=device).manual_seed(3)
    cases = []
    for fmt in formats:
        gu = random_weights(fmt, 64, 2 * 2048, 6144, device, gen)
        dn = random_weights(fmt, 64, 6144, 2048, device, gen)
        for tokens in token_counts:
            sets, n_sets, _ = _decode_inputs(DEEP, tokens, device, gen)
            cases.append((f"{fmt} T={tokens}", [_prepared_kernels(s, gu, dn, "cuda") for s in sets[:n_sets]],
                          n_sets, gu.packed_bytes(tokens * 8) + dn.packed_bytes(tokens * 8)))
    log_sum = {}
    for gate_up_warps, down_warps in configs:
        moe_cuda.warps.update({True: gate_up_warps, False: down_warps})
        parts = []
        for name, kernels, n_sets, nbytes in cases:
            us = time_ms(lambda j: kernels[j](), n_inputs=n_sets, device=device) * 1e3
            log_sum[(gate_up_warps, down_warps)] = log_sum.get((gate_up_warps, down_warps), 0.0) + math.log(us)
            parts.append(f"{name} {us:.1f} us ({nbytes / us / 1e3 / copy_gbs * 100:.0f} % of copy)")
        print(f"sweep cuda: warps gate_up {gate_up_warps} down {down_warps}: " + "; ".join(parts), flush=True)
    best = min(log_sum, key=log_sum.get)
    moe_cuda.warps.update({True: best[0], False: best[1]})
    print(f"sweep cuda: fastest (geometric mean) {best}; the rows below use it", flush=True)
    return best


def check_cuda(device) -> list[str]:
    """The dispatched GEMV regime (the CUDA body for e8p/e8p3) against the float32 reference at the deep widths,
    bf16 and fp16 activations, 1 and 8 tokens (check_gemv's cases)."""
    return [line.replace("GEMV body", "CUDA body") for line in check_gemv(device, formats=("e8p", "e8p3"))]


def check_cuda_int8(device) -> list[str]:
    """The E8 integer body on the device: its activation rows bit for bit against their torch definition (rotation and
    rounding in one launch, fp16 and bf16), and the op (both projections on the integer body) against the reference
    with the same rounding at D=6144 I=2048 E=64 top-8, 1 and 8 tokens, bounds DP4A_BOUNDS (the same argument: only
    the dtype roundings of x and h move a q), and its distance from the float reference; raises on a mismatch."""
    gen = torch.Generator(device=device).manual_seed(11)
    lines = []
    for dtype, k in itertools.product((torch.float16, torch.bfloat16), (6144, 2048)):
        a = (torch.randn((8, k), generator=gen, device=device) * 3).to(dtype)
        a[1, 256:512] = 0
        group = rotation_group(k)
        signs = random_signs(group, seed=k)
        used = k // 4 + 2 * k // int8_activations.E8_GROUP
        got = int8_activations.quantize_rows_triton(a, group, signs)[:, :used]
        same = torch.equal(got, int8_activations.quantize_rows_reference(a, group, signs)[:, :used])
        lines.append(f"E8 int8 rows {dtype} 8 x {k} (rotation group {group}): {'identical' if same else 'DIFFER'}")
        if not same:
            raise AssertionError(lines[-1])
    op = functools.partial(moe.fused_moe_triton, gemv=True, int8_activations=True)
    for fmt in ("e8p", "e8p3"):
        gu = random_weights(fmt, 64, 2 * 2048, 6144, device, gen)
        dn = random_weights(fmt, 64, 6144, 2048, device, gen)
        for dtype, tokens in itertools.product((torch.float16, torch.bfloat16), (1, 8)):
            seed = int(torch.randint(0, 1 << 30, (1,), generator=gen, device=device))
            err = _deep_decode_error(op, gu, dn, dtype, tokens, torch.Generator(device=device).manual_seed(seed),
                                     device, int8_reference=True)
            err_float = _deep_decode_error(op, gu, dn, dtype, tokens, torch.Generator(device=device).manual_seed(seed),
                                           device)
            lines.append(f"{fmt} integer body {dtype} T={tokens}: rel err {err:.2e} vs the int8 reference (bound "
                         f"{DP4A_BOUNDS[dtype]:.0e}), {err_float:.2e} vs the float reference")
            if not err < DP4A_BOUNDS[dtype]:
                raise AssertionError(f"E8 integer body disagrees with the int8 reference: {lines[-1]}")
    return lines


def run_cuda(device: torch.device, copy_gbs: float):
    """EXPERTS_CUDA=1: e8p / e8p3 decode on the CUDA C tensor-core bodies (moe_cuda.py): their checks, the float
    body's warps sweep, and deep T=1 / T=8 and Mixtral T=1 rows of the dispatched body (the integer one, on int8
    activations), the float CUDA body and the Triton GEMV body (kernels only and the full op)."""
    for line in check_cuda(device) + check_cuda_int8(device):
        print("correctness:", line, flush=True)
    sweep_cuda(device, copy_gbs)
    rows = []
    for shape, label, tokens in ((DEEP, "deep D6144 I2048 E64 top8", (1, 8)), (MIXTRAL, "mixtral D4096 I14336 E8 top2", (1,))):
        try:
            rows += _decode_rows(shape, label, tokens, copy_gbs, device, formats=("e8p", "e8p3"),
                                 other_bodies=("cuda_int8", "cuda", "gemv"))
        except Exception:  # noqa: BLE001 - keep what was measured
            traceback.print_exc()
    return ("Quantized MoE experts: e8p/e8p3 decode on int8 activations through integer MMAs vs the float CUDA body "
            "vs Triton GEMV vs bf16 bmm"), rows


def run(device: torch.device, copy_gbs: float):
    if os.environ.get("EXPERTS_DP4A") == "1":
        return run_dp4a(device, copy_gbs)
    if os.environ.get("EXPERTS_CUDA") == "1":
        return run_cuda(device, copy_gbs)
    gemv_checks = check_gemv(device)  # first: the GEMV sweep below times the body it checks
    for line in gemv_checks + check_dp4a(device) + check_routing(device) + check_correctness(device) + check_mma(device):
        print("correctness:", line, flush=True)
    if os.environ.get("EXPERTS_SWEEP_GEMV") == "1":
        sweep_gemv(device, copy_gbs)
    if os.environ.get("EXPERTS_SWEEP_MMA") == "1":
        sweep_mma(device, copy_gbs)
    if QUICK:
        sections = (lambda: routing_rows(device),
                    lambda: _decode_rows(DEEP, "deep D6144 I2048 E64 top8", (1, 8), copy_gbs, device),
                    lambda: _decode_rows(MIXTRAL, "mixtral D4096 I14336 E8 top2", (1,), copy_gbs, device))
    else:
        try:
            sweep_decode_tiles(device)
            sweep_gemv(device, copy_gbs)
        except Exception:  # noqa: BLE001 - informative only
            traceback.print_exc()
        sections = (lambda: routing_rows(device),
                    lambda: _decode_rows(DEEP, "deep D6144 I2048 E64 top8", (1, 4, 8, 32), copy_gbs, device),
                    lambda: _decode_rows(MIXTRAL, "mixtral D4096 I14336 E8 top2", (1, 4, 8, 32), copy_gbs, device),
                    lambda: _prefill_rows(copy_gbs, device))
    rows = []
    for section in sections:
        try:  # keep what was measured when one section fails
            rows += section()
        except Exception:  # noqa: BLE001 - reported, and the table says which rows exist
            traceback.print_exc()
    return "Quantized MoE experts (fused Triton) vs bf16 bmm" + (" (quick list)" if QUICK else ""), rows
