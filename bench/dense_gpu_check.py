"""GPU check of the dense fast path: `python bench/dense_gpu_check.py` (prints, records nothing).

CI has no GPU, so this is where the Triton kernels meet bf16 and real sizes:
1. correctness: paged decode/prefill, KV write, fused RMSNorm/rotary/SwiGLU in bf16 vs the torch
   references; CUDA-graph replay vs eager forward (padding rows included), and at batch 1 vs the torch
   reference forward;
2. kernel timings next to the obvious baselines: decode vs SDPA over contiguous K/V, prefill vs
   causal SDPA, and a bf16 GEMV (the floor under batch-1 decode of any engine using cuBLAS);
3. the skinny decode matmul (server/kernels/gemv.py) at the Llama-3-8B projection shapes, M=1 and M=8:
   bf16 error vs F.linear and time / TB/s next to F.linear; with SiLU*up / RoPE fused, vs the composition;
   a small sweep of (BLOCK_N, BLOCK_K) at M=1 (prints; the defaults live in gemv._config);
4. one Llama-3-8B-shaped decode step (b1, random weights) as a replayed CUDA graph, with programmatic
   dependent launch (server/kernels/pdl.py) on and off: device time per step without host gaps.
Exits non-zero when a correctness check fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import copy_bandwidth_gbs, require_gpu, rotation_count, time_ms  # noqa: E402
from server.kernels.dense_attention import paged_attention, paged_decode, write_kv_pages  # noqa: E402
from server.kernels import gemv, pdl  # noqa: E402
from server.kernels.gemv import skinny_matmul, skinny_matmul_rope, skinny_matmul_silu_and_mul  # noqa: E402
from server.kernels.paged_kv import AttentionMetadata, paged_attention_reference  # noqa: E402
from server.kernels.rmsnorm import add_rms_norm, rms_norm  # noqa: E402
from server.kernels.rotary import apply_rotary  # noqa: E402
from server.kernels.swiglu import silu_and_mul  # noqa: E402

PAGE = 16
# Llama-3-8B projections as [out rows N, in K]: what one decode step streams, layer by layer.
GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}  # fmt: skip
failures: list[str] = []
CONFIGS_OUT: str | None = None


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    """Elementwise |actual - expected| <= atol + rtol * |expected| (rtol 1/64: two bf16 ulps)."""
    err = (actual.float() - expected.float()).abs()
    ok = bool((err <= atol + rtol * expected.float().abs()).all()) and bool(torch.isfinite(actual.float()).all())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max abs diff {err.max().item():.2e} "
          f"(tolerance {atol:.0e} + {rtol:.3f} * |expected|)", flush=True)  # fmt: skip
    if not ok:
        failures.append(name)


def paged_inputs(seq_lens, query_lens, q_heads, kv_heads, dim, device, dtype=torch.bfloat16, spare_pages=8):
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, device=device).to(torch.int32)
    width = max(pages_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(pages_per_seq):
        tables[s, :n] = order[used : used + n]
        used += n
    k = torch.randn(num_pages, PAGE, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(sum(query_lens), q_heads, dim, device=device, dtype=dtype)
    starts = torch.tensor([0] + list(query_lens), device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device), block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc=starts,
        seq_lens_cpu=list(seq_lens), query_lens_cpu=list(query_lens),
    )  # fmt: skip
    return q, k, v, meta


def check_attention(device) -> None:
    for q_heads, kv_heads, dim in [(9, 3, 64), (32, 8, 128), (16, 8, 128), (8, 1, 256)]:
        lens = [1, 17, 255, 1000, 4097, 3, 64, 2048]
        q, k, v, meta = paged_inputs(lens, [1] * len(lens), q_heads, kv_heads, dim, device)
        scale = dim**-0.5
        ref = paged_attention_reference(q, k, v, meta, scale)
        check(f"decode bf16 {q_heads}/{kv_heads} d{dim} auto splits", paged_attention(q, k, v, meta, scale), ref, 2e-2)
        for splits in (1, 64):
            out = paged_decode(q, k, v, meta.block_tables, meta.seq_lens, scale, splits)
            check(f"decode bf16 {q_heads}/{kv_heads} d{dim} {splits} splits", out, ref, 2e-2)
        cases = [(2048, 2048), (3512, 512), (700, 1), (33, 33), (5000, 1)]
        q, k, v, meta = paged_inputs(*zip(*cases), q_heads, kv_heads, dim, device)
        ref = paged_attention_reference(q, k, v, meta, scale)
        check(f"prefill bf16 {q_heads}/{kv_heads} d{dim} mixed", paged_attention(q, k, v, meta, scale), ref, 2e-2)

    pages = torch.zeros(4, PAGE, 2, 128, device=device, dtype=torch.bfloat16)
    pages_v = torch.zeros_like(pages)
    new_k = torch.randn(3, 2, 128, device=device, dtype=torch.bfloat16)
    write_kv_pages(new_k, new_k, pages, pages_v, torch.tensor([5, -1, 63], device=device))
    expected = torch.zeros_like(pages)
    expected.view(-1, 2, 128)[5], expected.view(-1, 2, 128)[63] = new_k[0], new_k[2]
    check("kv write skips slot -1", pages, expected, 0.0)


def check_fused_ops(device) -> None:
    from server.runtime.models.llama import RMSNorm
    from server.runtime.models.rope import RotaryEmbedding

    x = torch.randn(33, 4096, device=device, dtype=torch.bfloat16) * 3
    norm = RMSNorm(4096, 1e-5).to(device=device, dtype=torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    ref = norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    check("rms_norm bf16", rms_norm(x, norm.weight, 1e-5), ref, 1e-2, 1 / 64)
    res = torch.randn_like(x)
    summed = x + res
    ref = norm.weight * (summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    fused, fused_sum = add_rms_norm(x, res, norm.weight, 1e-5)
    check("add_rms_norm bf16 (sum)", fused_sum, summed, 0.0)
    check("add_rms_norm bf16 (normed)", fused, ref, 1e-2, 1 / 64)
    rotary = RotaryEmbedding(128, 500000.0, None, 8192).to(device)
    qkv = torch.randn(33, 48 * 128, device=device, dtype=torch.bfloat16)
    q, k = qkv[:, : 32 * 128].view(33, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(33, 8, 128)
    pos = torch.randint(0, 8192, (33,), device=device)
    freqs = pos[:, None].float() * rotary.inv_freq.float()
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]

    def rot(t):
        t1, t2 = t.float().chunk(2, -1)
        return t.float() * cos + torch.cat((-t2, t1), -1) * sin

    fq, fk = apply_rotary(pos, q, k, rotary.inv_freq, rotary.attention_scaling)
    check("rotary bf16 q", fq, rot(q), 1e-2, 1 / 64)
    check("rotary bf16 k", fk, rot(k), 1e-2, 1 / 64)
    gate_up = torch.randn(33, 2 * 14336, device=device, dtype=torch.bfloat16)
    g, u = gate_up.float().chunk(2, -1)
    check("silu_and_mul bf16", silu_and_mul(gate_up), F.silu(g) * u, 1e-2, 1 / 64)


def check_graph_replay(device) -> None:
    from bench.e2e import SHAPES, build_random_model
    from server.kernels.paged_kv import DenseKVStore
    from server.runtime.cuda_graphs import DecodeGraphs

    # Two layers: enough to exercise every captured kernel, too few for bf16 rounding differences between the
    # padded graph batch and the eager batch to grow the way they do through 30 random layers.
    cfg = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2)
    loaded = build_random_model(cfg, device, torch.bfloat16)
    num_pages, width = 96, 16  # 5 rows x 16 pages each, no page shared
    stores = [DenseKVStore(num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device)
              for _ in range(cfg.num_layers)]  # fmt: skip
    for s in stores:
        s.k_pages.normal_()
        s.v_pages.normal_()
    graphs = DecodeGraphs(loaded.model, stores, 8, width, 8192, device)
    graphs.capture()
    lens = [5, 40, 17, 100, 1]  # 5 rows replay the batch-8 graph with 3 padding rows
    tables = torch.arange(len(lens) * width, dtype=torch.int32, device=device).view(len(lens), width) % num_pages
    slots = torch.tensor([int(tables[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE for i, n in enumerate(lens)],
                         device=device)  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (len(lens),), device=device)
    positions = torch.tensor([n - 1 for n in lens], device=device)
    meta = AttentionMetadata(slots, tables, torch.tensor(lens, dtype=torch.int32, device=device),
                             torch.arange(len(lens) + 1, dtype=torch.int32, device=device), lens, [1] * len(lens))
    with torch.inference_mode():
        before = [s.k_pages.clone() for s in stores[:2]]
        replayed = graphs.run(ids, positions, meta).clone()
        after_graph = [s.k_pages.clone() for s in stores[:2]]
        eager = loaded.model.forward(ids, positions, stores, meta)
    check("CUDA graph replay vs eager forward (5 rows padded to 8)", replayed, eager, 5e-2)
    changed = sum(int((b != a).flatten(2).any(-1).sum()) for b, a in zip(before, after_graph))  # slots written
    print(f"{'ok  ' if changed == 2 * len(lens) else 'FAIL'} graph replay wrote {changed} slots in 2 layers "
          f"(expected {2 * len(lens)}: padding rows write nothing)")  # fmt: skip
    if changed != 2 * len(lens):
        failures.append("graph replay writes")
    # Batch 1 (one-row skinny matmuls, the fused KV write): the torch reference forward
    # (TURBOSERVE_REFERENCE_KERNELS=1) on the same GPU is the yardstick.
    one = AttentionMetadata(slots[1:2], tables[1:2], torch.tensor(lens[1:2], dtype=torch.int32, device=device),
                            torch.arange(2, dtype=torch.int32, device=device), lens[1:2], [1])  # fmt: skip
    with torch.inference_mode():
        replayed = graphs.run(ids[1:2], positions[1:2], one).clone()
        os.environ["TURBOSERVE_REFERENCE_KERNELS"] = "1"
        try:
            reference = loaded.model.forward(ids[1:2], positions[1:2], stores, one)
        finally:
            os.environ.pop("TURBOSERVE_REFERENCE_KERNELS")
    check("batch-1 CUDA graph replay vs torch reference forward", replayed, reference, 5e-2)
    del graphs, stores, loaded
    torch.cuda.empty_cache()


def check_fused_gemv(device) -> None:
    from server.runtime.models.rope import RotaryEmbedding

    rotary = RotaryEmbedding(128, 500000.0, None, 8192).to(device)
    w = torch.randn(6144, 4096, device=device, dtype=torch.bfloat16) * 4096**-0.5
    gate_up = torch.randn(28672, 4096, device=device, dtype=torch.bfloat16) * 4096**-0.5 * 3
    for rows in (1, 8):
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (rows,), device=device)
        q, k, v = F.linear(x, w).split([4096, 1024, 1024], -1)
        rq, rk = rotary(pos, q.reshape(rows, 32, 128), k.reshape(rows, 8, 128))  # the unfused Triton rotary
        composed = torch.cat((rq.flatten(1), rk.flatten(1), v), 1)
        fused = skinny_matmul_rope(x, w, None, pos, rotary.inv_freq, 1.0, 40, 128)
        check(f"qkv + RoPE fused bf16 M={rows} vs F.linear + rotary", fused, composed, 2e-2, 1 / 32)
        g, u = F.linear(x, gate_up).chunk(2, -1)
        check(f"gate_up + SiLU*up fused bf16 M={rows} vs F.linear + silu_and_mul",
              skinny_matmul_silu_and_mul(x, gate_up), silu_and_mul(torch.cat((g, u), -1)), 2e-2, 1 / 32)


def check_gemv(device) -> None:
    for name, (n, k) in GEMV_SHAPES.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5  # outputs ~ N(0, 1)
        bias = torch.randn(n, device=device, dtype=torch.bfloat16) if name == "qkv" else None  # Qwen2 has one
        for rows in (1, 8):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            ours, cublas = skinny_matmul(x, w, bias), F.linear(x, w, bias)
            check(f"skinny_matmul bf16 {name} {n}x{k} M={rows} vs F.linear", ours, cublas, 2e-2, 1 / 64)
            exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            check(f"skinny_matmul bf16 {name} {n}x{k} M={rows} vs float32", ours, exact, 1e-2, 1 / 128)
        del w


def gemv_timings(device, copy_gbs: float) -> None:
    print(f"\nskinny matmul (gemv.py) vs F.linear, bf16; weight bytes over time, copy {copy_gbs:.0f} GB/s")
    for name, (n, k) in GEMV_SHAPES.items():
        copies = rotation_count(2 * n * k, device, limit=4)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        for rows in (1, 8):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            ours = time_ms(lambda i: skinny_matmul(x, weights[i]), n_inputs=len(weights), iters=50, device=device)
            cublas = time_ms(lambda i: F.linear(x, weights[i]), n_inputs=len(weights), iters=50, device=device)
            print(f"{name} {n}x{k} M={rows}: ours {ours * 1e3:.1f} us ({2 * n * k / ours / 1e9:.2f} TB/s, "
                  f"{2 * n * k / ours / 1e6 / copy_gbs:.0%} of copy); F.linear {cublas * 1e3:.1f} us "
                  f"({2 * n * k / cublas / 1e9:.2f} TB/s)", flush=True)  # fmt: skip
        del weights


# Projections as a decode step runs them: (name, N, K, epilogue).
FUSED_SHAPES = [("qkv+rope", 6144, 4096, "rope"), ("o", 4096, 4096, "none"), ("gate_up+silu", 28672, 4096, "silu_and_mul"),
                ("down", 4096, 14336, "none")]  # fmt: skip


def _fused_call(x, w, epilogue, pos, inv_freq):
    if epilogue == "rope":
        return skinny_matmul_rope(x, w, None, pos, inv_freq, 1.0, 40, 128)
    if epilogue == "silu_and_mul":
        return skinny_matmul_silu_and_mul(x, w)
    return skinny_matmul(x, w)


# (weight rows per program, BLOCK_K, STAGES); a paired (fused) program holds half the rows' pairs. Each one
# compiled for sm_90 offline without spills (<= 128 registers: 4 programs per SM).
SWEEP = [(4, 1024, 3), (8, 512, 4), (16, 256, 4), (16, 512, 3), (32, 256, 3), (32, 128, 5)]
best_configs: dict[tuple[int, int, bool], tuple[int, int, int]] = {}  # as gemv.MEASURED_M1: fastest at M=1


def gemv_sweep(device, copy_gbs: float) -> None:
    """M=1 time of each decode projection (fused epilogues as the model runs them) per (BLOCK_N, BLOCK_K, STAGES);
    BLOCK_N counts pairs of rows when an epilogue is fused."""
    default = gemv._config
    x = torch.randn(1, 14336, device=device, dtype=torch.bfloat16)
    pos = torch.tensor([100], device=device)
    inv_freq = torch.rand(64, device=device)
    print(f"\nskinny matmul M=1 sweep: BLOCK_N x BLOCK_K / stages, time (of copy {copy_gbs:.0f} GB/s)")
    for name, n, k, epilogue in FUSED_SHAPES:
        paired = epilogue != "none"
        copies = rotation_count(2 * n * k, device, limit=4)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        xs = x[:, :k]
        results, timed_configs = [], []
        candidates = [(1, rows // 2 if paired else rows, block_k, stages) for rows, block_k, stages in SWEEP]
        for cfg in [default(1, n, k, paired)] + candidates:
            gemv._config = lambda *_, cfg=cfg, **__: cfg  # called with paired= by keyword
            try:
                t = time_ms(lambda i: _fused_call(xs, weights[i], epilogue, pos, inv_freq), n_inputs=copies, iters=50,
                            device=device)  # fmt: skip
                timed_configs.append((t, cfg))
                results.append(f"{cfg[1]}x{cfg[2]}/{cfg[3]}{' (default)' if not results else ''} {t * 1e3:.1f} us "
                               f"({2 * n * k / t / 1e6 / copy_gbs:.0%})")  # fmt: skip
            except Exception as exc:  # e.g. out of registers: report, try the next
                results.append(f"{cfg[1]}x{cfg[2]}/{cfg[3]} failed {type(exc).__name__}")
            finally:
                gemv._config = default
        best_configs[(n, k, paired)] = min(timed_configs)[1][1:]
        print(f"{name} {n}x{k}: " + "; ".join(results), flush=True)
        x8, pos8 = torch.randn(8, k, device=device, dtype=torch.bfloat16), pos.expand(8).contiguous()
        ours = time_ms(lambda i: _fused_call(x8, weights[i], epilogue, pos8, inv_freq), n_inputs=copies, iters=50,
                       device=device)  # fmt: skip
        unfused = {"rope": lambda y: apply_rotary(pos8, y[:, :4096].view(8, 32, 128), y[:, 4096:5120].view(8, 8, 128),
                                                  inv_freq, 1.0),
                   "silu_and_mul": silu_and_mul, "none": lambda y: y}[epilogue]  # fmt: skip
        cublas = time_ms(lambda i: unfused(F.linear(x8, weights[i])), n_inputs=copies, iters=50, device=device)
        print(f"{name} {n}x{k} M=8: ours {ours * 1e3:.1f} us, F.linear + separate op {cublas * 1e3:.1f} us", flush=True)
        del weights


def _runner_loop_ms(model, graphs, ids, positions, meta, steps: int = 30) -> float:
    """Wall ms per step of replay + LM head + greedy argmax + reading the token back, each step waiting for
    the last as the engine does: device time plus the runner's own host gaps (no scheduler, no engine)."""
    args = (ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(), meta.seq_lens_cpu, [0] * len(meta.seq_lens_cpu), meta.block_tables.cpu().numpy())
    with torch.inference_mode():
        for i in range(steps + 3):
            if i == 3:
                t0 = time.perf_counter()
            model.compute_logits(graphs.run_host(*args)).argmax(-1).tolist()
    return (time.perf_counter() - t0) / steps * 1e3


def decode_step_timings(device, copy_gbs: float) -> None:
    """A Llama-3-8B-shaped batch-1 decode forward (no LM head) replayed as a CUDA graph, PDL on and off."""
    from bench.e2e import SHAPES, build_random_model, weight_bytes_per_decode_step
    from server.kernels.paged_kv import DenseKVStore
    from server.runtime.cuda_graphs import DecodeGraphs

    cfg = SHAPES["llama3-8b"]
    loaded = build_random_model(cfg, device, torch.bfloat16)
    lm_head = loaded.model.lm_head.weight.numel() * 2
    layer_bytes = weight_bytes_per_decode_step(loaded.model, cfg) - lm_head
    stores = [DenseKVStore(32, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device) for _ in range(cfg.num_layers)]
    for s in stores:
        s.k_pages.normal_()
        s.v_pages.normal_()
    seq_len = 200  # a short chat turn: the 256-token context bucket
    table = torch.arange(32, dtype=torch.int32, device=device)[None]
    meta = AttentionMetadata(torch.tensor([seq_len - 1], device=device), table,
                             torch.tensor([seq_len], dtype=torch.int32, device=device),
                             torch.tensor([0, 1], dtype=torch.int32, device=device), [seq_len], [1])  # fmt: skip
    ids, positions = torch.tensor([7], device=device), torch.tensor([seq_len - 1], device=device)
    outputs = {}
    measured = dict(gemv.MEASURED_M1)
    pre_default = gemv.PRE_WAIT_BYTES
    for setting, configs, pre in (("1", "default", 0), ("1", "default", 32768), ("1", "default", 0),
                                  ("1", "default", 32768), ("0", "default", 0), ("1", "swept", pre_default)):
        os.environ["TURBOSERVE_PDL"] = setting
        pdl._supported.cache_clear()
        gemv.PRE_WAIT_BYTES = pre
        if configs == "swept":
            gemv.MEASURED_M1.update(best_configs)
        try:
            graphs = DecodeGraphs(loaded.model, stores, 1, 32, cfg.max_position_embeddings, device)
            graphs.capture()
            outputs[setting + configs + str(pre)] = graphs.run(ids, positions, meta).clone()
            ms = time_ms(lambda _: graphs.graphs[1, graphs.context_bucket(seq_len)].replay(), warmup=5, iters=30,
                         device=device)
            if setting + configs + str(pre) == f"1default{pre_default}":
                host_loop_ms = _runner_loop_ms(loaded.model, graphs, ids, positions, meta)
                # Every bucket's plan is valid at this length: what a plan for longer contexts costs here.
                for context_len in graphs.context_lens[1:]:
                    other = time_ms(lambda _: graphs.graphs[1, context_len].replay(), warmup=5, iters=30, device=device)
                    print(f"8B decode forward b1 at context {seq_len}, graph planned for {context_len}: "
                          f"{other * 1e3:.0f} us/step", flush=True)
        finally:
            gemv.MEASURED_M1.clear()
            gemv.MEASURED_M1.update(measured)
        print(f"8B decode forward b1 graph replay, PDL {'on' if setting == '1' else 'off'}, {configs} configs, "
              f"W loaded before the wait: {f'{pre // 1024} KiB a program' if pre else 'one K tile'}: "
              f"{ms * 1e3:.0f} us/step ({layer_bytes / ms / 1e6:.0f} GB/s of weights without the LM head, "
              f"{layer_bytes / ms / 1e6 / copy_gbs:.0%} of copy); LM head adds one {lm_head / 1e6:.0f} MB GEMV",
              flush=True)  # fmt: skip
        del graphs
    print(f"host loop as the runner drives it (inputs copied, replay, LM head, argmax, token read back): "
          f"{host_loop_ms * 1e3:.0f} us/step", flush=True)
    if best_configs:
        print("swept M=1 configs (N, K, paired) -> (BLOCK_N, BLOCK_K, STAGES): " + str(best_configs))
        if CONFIGS_OUT:
            Path(CONFIGS_OUT).write_text(json.dumps({f"{n},{k},{int(fused)}": cfg for (n, k, fused), cfg in best_configs.items()}))
    os.environ.pop("TURBOSERVE_PDL")
    pdl._supported.cache_clear()
    gemv.PRE_WAIT_BYTES = pre_default
    check("8B decode forward, PDL on vs off (same kernels, other launch)", outputs["1default0"], outputs["0default0"], 0.0)
    reference = outputs["1default0"]
    check("8B decode forward, 32 KiB of W before the wait vs one tile (other summation order; bf16 output)",
          outputs["1default32768"], reference, 2e-2 * reference.abs().max().item())
    del loaded, stores
    torch.cuda.empty_cache()


def kernel_timings(device, copy_gbs: float) -> None:
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    for batch, ctx, q_heads, kv_heads in [(8, 65536, 32, 8), (1, 65536, 32, 8), (32, 2048, 32, 8), (1, 512, 9, 3)]:
        dim = 128 if q_heads == 32 else 64
        q, k, v, meta = paged_inputs([ctx] * batch, [1] * batch, q_heads, kv_heads, dim, device, spare_pages=0)
        scale = dim**-0.5
        ms = time_ms(lambda _: paged_attention(q, k, v, meta, scale), iters=50, device=device)
        kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
        kc = torch.randn(batch, kv_heads, ctx, dim, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        qc = torch.randn(batch, q_heads, 1, dim, device=device, dtype=torch.bfloat16)
        sdpa = time_ms(lambda _: F.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True), iters=50, device=device)
        print(f"decode b{batch} ctx {ctx} {q_heads}/{kv_heads} d{dim}: ours {ms * 1e3:.0f} us "
              f"({kv_bytes / ms / 1e6:.0f} GB/s); SDPA contiguous {sdpa * 1e3:.0f} us "
              f"({kv_bytes / sdpa / 1e6:.0f} GB/s)", flush=True)  # fmt: skip
        del q, k, v, kc, vc
    for tokens, q_heads, kv_heads, dim in [(2048, 32, 8, 128), (2048, 9, 3, 64)]:
        q, k, v, meta = paged_inputs([tokens], [tokens], q_heads, kv_heads, dim, device)
        ms = time_ms(lambda _: paged_attention(q, k, v, meta, dim**-0.5), iters=20, device=device)
        qc = q.view(1, tokens, q_heads, dim).transpose(1, 2)
        kc = torch.randn(1, kv_heads, tokens, dim, device=device, dtype=torch.bfloat16)
        sdpa = time_ms(lambda _: F.scaled_dot_product_attention(qc, kc, kc, is_causal=True, enable_gqa=True),
                       iters=20, device=device)  # fmt: skip
        flops = 2 * 2 * q_heads * dim * tokens * tokens / 2
        print(f"prefill {tokens} {q_heads}/{kv_heads} d{dim}: ours {ms * 1e3:.0f} us ({flops / ms / 1e9:.0f} TFLOP/s); "
              f"SDPA causal {sdpa * 1e3:.0f} us ({flops / sdpa / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip
    for rows, cols in [(14336 * 2, 4096), (4096, 14336), (6144, 4096), (128256, 4096)]:
        weights = [torch.randn(rows, cols, device=device, dtype=torch.bfloat16) for _ in range(2)]
        x = torch.randn(1, cols, device=device, dtype=torch.bfloat16)
        ms = time_ms(lambda i: F.linear(x, weights[i]), n_inputs=2, iters=50, device=device)
        print(f"GEMV bf16 {rows}x{cols} (F.linear, M=1): {rows * cols * 2 / ms / 1e6:.0f} GB/s", flush=True)
        del weights


def main() -> int:
    # --no-attention-timings: the kernels' correctness and the dense-layer timings only (saves device time);
    # --write-gemv-configs PATH: the sweep's fastest M=1 configurations as JSON (bench/e2e.py --gemv-configs).
    global CONFIGS_OUT
    attention_timings = "--no-attention-timings" not in sys.argv[1:]
    if "--write-gemv-configs" in sys.argv[1:]:
        CONFIGS_OUT = sys.argv[sys.argv.index("--write-gemv-configs") + 1]
    device = require_gpu()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    print(f"programmatic dependent launch: {pdl.launch_options(device)}", flush=True)
    for section in (check_attention, check_fused_ops, check_fused_gemv, check_gemv, check_graph_replay):
        try:
            section(device)
        except Exception:  # report and go on: one GPU run has to tell us everything it can
            traceback.print_exc()
            failures.append(section.__name__ + " raised")
    print(f"correctness checks: {len(failures)} failed {failures} ({time.perf_counter() - t0:.0f} s)", flush=True)
    copy_gbs = copy_bandwidth_gbs(device)
    if attention_timings:
        kernel_timings(device, copy_gbs)
    for timings in (gemv_timings, gemv_sweep, decode_step_timings):
        try:
            timings(device, copy_gbs)
        except Exception:  # the timings above still stand; the failure is reported and fails the run
            traceback.print_exc()
            failures.append(f"{timings.__name__} raised")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
