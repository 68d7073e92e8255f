"""GPU sweep of the turbo decode kernels' launch settings:
`python bench/turbo_decode_sweep.py [--default-only] [--offset] [--quick] [--cuda] | --ncu`.

Correctness first (the swept launch settings against decode-then-attend in bf16, real K/V written by the
store kernel), then our decode against bf16 SDPA at the shapes the targets name: batch 8 at 64K and 16K and
batch 1 at 64K with 32 query / 8 KV heads, and batch 1 at 64K with 16 query / 8 KV heads (GQA 2, the
end-to-end case). Per shape: each launch setting of SETTINGS at choose_splits' count and at the counts that
give its programs-per-SM targets, and the merge alone. ``--default-only`` runs the first setting alone (to
compare two trees). ``--offset`` also checks and times every launch with engine-like key offsets (their
score term <q, o(p)>), next to the plain launch: turned (all D/2 rotate-half pairs) and partial with
OFFSET_PAIRS pairs per KV head (`--kv-key-offset partial --kv-key-turned-pairs P`). Prints only; the recorded table comes from
`python bench/kernels.py turbo`.
The CUDA C kernel (attention_cuda.py) is checked beside the Triton settings (its default launch) and timed in
each of CUDA_SETTINGS at its split rule and at the split counts of the setting's CTAs per SM, with every
offset; both builds of its scores (fp16 and int8 mmas, attention_cuda.INT8_KEYS) are checked, and timed as
CUDA_SETTINGS says. ``--quick``: the batch-8 shapes only, the default Triton setting and the engine's partial
offset (with ``--offset``). ``--cuda``: the CUDA C kernel alone (no Triton checks or timings, no merge alone).
``--ncu`` launches only the first two settings at batch 8 / 64K, twice each (for a profiler); ``--ncu-cuda`` the
CUDA C kernel there instead, twice each: fp16 keys, fp16 keys with the engine's partial offset, int8 keys.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import kernels_turbo
from bench.harness import require_gpu, time_ms
from server.kernels.turbo import attention, attention_cuda
from server.kernels.turbo.attention import (
    attention_over_decoded_pages,
    decode_attention_triton,
)

KV_HEADS, HEAD_DIM = kernels_turbo.KV_HEADS, kernels_turbo.HEAD_DIM  # the shapes random_decode_inputs builds
OFFSET_PAIRS = (8, 16)  # partial key offsets --offset also runs (turned pairs per KV head; 4 compiles as 8)
# (block_n, num_warps, max registers, pipeline stages) and the programs per SM to size the splits for, besides
# choose_splits' count; None: the compiler's choice. Residency from the offline sm_90 build (bench/turbo_sass.py):
# 64/4 at 128 / 96 / 80 registers holds 4 / 5 / 6 programs per SM (35 KB shared each); 16/1 (one warp, mma.sync)
# about 20 one-warp programs (10 KB shared each) at 96 or 80 registers. H200 2026-11-30 03:01 (docs/BENCHMARKS.md):
# the default wins at every shape; more programs per SM at fewer registers lose (b8/64K 0.368 ms vs 0.382 at 96,
# 0.438 at 80 registers), one-warp programs too (0.404 ms at 41 splits).
SETTINGS = (
    ((64, 4, 128, None), (8,)),
    ((64, 4, 96, None), (5, 10)),
    ((64, 4, 80, None), (6, 12)),
    ((16, 1, 96, 2), (20, 40)),
    ((16, 1, 80, 2), (20, 40)),
)
SHAPES = ((8, 65536, 32), (8, 16384, 32), (1, 65536, 32), (1, 65536, 16))  # batch, context, query heads
# The CUDA kernel's launch settings (warps per CTA, CTAs per SM to fit in registers (None: min_blocks), int8-mma
# scores) and the CTAs per SM to size the splits for, besides its rule (the first: the default). H200 2026-11-30:
# 8 warps at the rule's 4 splits win at b8/64K and b8/16K; a cp.async shared-memory ring (since dropped) lost 8-10 %.
CUDA_SETTINGS = (
    ((8, None, False), (2, 4)),
    ((4, None, False), (4, 8)),
    ((8, None, True), (2, 4)),
)


def _launch(setting) -> dict:
    block_n, num_warps, max_registers, num_stages = setting
    return dict(block_n=block_n, num_warps=num_warps, max_registers=max_registers, num_stages=num_stages)


def _split_counts(programs_per_sm, batch, ctx, block_n, device) -> list:
    """None (choose_splits) and the split counts that give each target number of programs per SM."""
    sms, rows = torch.cuda.get_device_properties(device).multi_processor_count, batch * KV_HEADS
    counts = [max(1, min(ctx // block_n, round(p * sms / rows))) for p in programs_per_sm]
    return [None] + sorted(set(counts))


def _check_settings(device, settings, offsets) -> list[str]:
    """Every swept setting (and a split count) vs decode-then-attend, bf16, real K/V from the store kernel; with
    each of ``offsets`` (None: no key offset, 0: turned on all pairs, P: partial on P pairs, _offset_name)."""
    gen = torch.Generator().manual_seed(1)
    failures = []
    for (case, (head_dim, gqa, k_kind, v_kind, lens)), offset in itertools.product(
            enumerate(kernels_turbo.CHECK_CASES), offsets):
        key_offset = None if offset is None else kernels_turbo.engine_key_offset(2, head_dim, device, gen,
                                                                                  turned_pairs=offset or None)
        store, tables, _ = kernels_turbo._filled_store(lens, 2, head_dim, k_kind, v_kind, device, gen, key_offset)
        meta = kernels_turbo._meta(lens, tables)
        q = torch.randn(len(lens), 2 * gqa, head_dim, generator=gen).to(device, torch.bfloat16)
        scale = head_dim**-0.5
        reference = attention_over_decoded_pages(q.float(), store.k, store.v, k_kind, v_kind, meta, scale,
                                                 store.key_offset).float()
        for setting, _ in settings if case < 2 else settings[:1]:  # every Triton setting on the first two cases
            for splits in (None, 7):
                fused = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt,
                                                store.key_offset, num_splits=splits, **_launch(setting)).float()
                err = (fused - reference).abs().max().item() / reference.abs().max().item()
                name = (f"D={head_dim} GQA={gqa} {k_kind}/{v_kind} lens={lens} {'/'.join(map(str, setting))} "
                        f"splits={splits}{_offset_name(offset)}")
                print(f"{'PASS' if err < 2e-2 else 'FAIL'} decode {name}: rel err {err:.2e}", flush=True)
                if err >= 2e-2:
                    failures.append(name)
        for splits, int8_keys in itertools.product((None, 7), (False, True)):
            out = attention_cuda.decode_attention_cuda(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt,
                                                       store.key_offset, num_splits=splits, int8_keys=int8_keys)
            name = (f"D={head_dim} GQA={gqa} {k_kind}/{v_kind} lens={lens} CUDA C{' int8 keys' * int8_keys} "
                    f"splits={splits}{_offset_name(offset)}")
            err = float("inf") if out is None else (out.float() - reference).abs().max().item() / \
                reference.abs().max().item()
            # the int8-key build rounds q and the centroids by design: 2.2e-2 of the scale on D = 64, turbo4 K with
            # the partial offset (attention_cuda's docstring; its GPU tests check it against its own definition)
            bound = 3e-2 if int8_keys else 2e-2
            print(f"{'PASS' if err < bound else 'FAIL'} decode {name}: rel err {err:.2e}"
                  f"{' (kernel unavailable)' if out is None else ''}", flush=True)
            if err >= bound:
                failures.append(name)
    return failures


def _offset_name(turned_pairs: int | None) -> str:
    """How a row names its key offset: none, turned on all pairs (0), partial on P."""
    return "" if turned_pairs is None else " key offset " + (f"partial{turned_pairs}" if turned_pairs else "turned")


def _merge_only_ms(store, metas, qs, splits, device) -> float:
    """The merge launch alone, on partial results of the real decode's shape."""
    q = qs[0]
    num_seqs, q_heads = q.shape[0], q.shape[1]
    splits = attention.whole_block_splits(metas[0].max_seq_len, attention.BLOCK_N, splits)
    part_acc = torch.randn(num_seqs * q_heads * splits, HEAD_DIM, device=device)
    part_m = torch.randn(num_seqs * q_heads * splits, device=device)
    part_l = torch.rand_like(part_m) + 1
    out = torch.empty_like(q)

    def merge(i):
        attention._merge_kernel[(num_seqs, q_heads)](
            out, out.stride(0), out.stride(1), metas[i].query_start_loc, metas[i].seq_lens, part_acc, part_m,
            part_l, splits, store.signs[0], store.signs[1], store.inv_sqrt, 1, BLOCK=attention.BLOCK_N,
            SPLIT_TILE=attention.MERGE_SPLIT_TILE, D=HEAD_DIM, G=HEAD_DIM, LOG2_G=HEAD_DIM.bit_length() - 1,
            RECENT=False, USE_PDL=False, num_warps=attention.MERGE_NUM_WARPS)

    return time_ms(merge, n_inputs=len(metas), device=device)


def _sweep_shape(batch, ctx, q_heads, settings, cuda_settings, device, offsets) -> None:
    sdpa = kernels_turbo.sdpa_ms(batch, ctx, q_heads, device)
    torch.cuda.empty_cache()
    store, metas, qs, turbo_bytes = kernels_turbo.random_decode_inputs(batch, ctx, q_heads, "turbo3", device)
    scale = HEAD_DIM**-0.5
    label = f"turbo3 b{batch} ctx{ctx // 1024}K {q_heads}q/{KV_HEADS}kv"
    print(f"{label}: bf16 SDPA {sdpa:.4f} ms", flush=True)
    key_offsets = {p: kernels_turbo.engine_key_offset(KV_HEADS, HEAD_DIM, device, torch.Generator().manual_seed(2),
                                                      turned_pairs=p or None) for p in offsets if p is not None}
    for (setting, programs_per_sm), offset in itertools.product(settings, offsets):
        for splits in _split_counts(programs_per_sm, batch, ctx, setting[0], device):
            launch = dict(num_splits=splits, **_launch(setting))

            def ours(i, launch=launch, offset=offset):
                return decode_attention_triton(qs[i], store.k, store.v, metas[i], scale, store.signs, store.inv_sqrt,
                                               key_offsets.get(offset), **launch)

            ms = time_ms(ours, n_inputs=len(qs), device=device)
            chosen = attention.choose_splits(batch, KV_HEADS, ctx, device, setting[0]) if splits is None else splits
            print(f"  {label} {'/'.join(map(str, setting))} splits={chosen}{' (rule)' if splits is None else ''}"
                  f"{_offset_name(offset)}: {ms:.4f} ms = {sdpa / ms:.2f}x SDPA, "
                  f"{turbo_bytes / ms / 1e6:.0f} GB/s", flush=True)
    for ((warps, blocks, int8_keys), programs_per_sm), offset in itertools.product(cuda_settings, offsets):
        for splits in _split_counts(programs_per_sm, batch, ctx, attention_cuda.TILE * warps, device):
            launch = dict(num_splits=splits, warps=warps, blocks=blocks, int8_keys=int8_keys)

            def cuda(i, launch=launch, offset=offset):
                return attention_cuda.decode_attention_cuda(qs[i], store.k, store.v, metas[i], scale, store.signs,
                                                            store.inv_sqrt, key_offsets.get(offset), **launch)

            ms = time_ms(cuda, n_inputs=len(qs), device=device)
            chosen = attention_cuda.choose_splits(batch, KV_HEADS, ctx, device, warps) if splits is None else splits
            print(f"  {label} CUDA C{' int8 keys' * int8_keys} {warps} warps, blocks {blocks} splits={chosen}"
                  f"{' (rule)' if splits is None else ''}{_offset_name(offset)}: {ms:.4f} ms = {sdpa / ms:.2f}x SDPA, "
                  f"{turbo_bytes / ms / 1e6:.0f} GB/s", flush=True)
    if not settings:  # --cuda: the CUDA kernel merges in its last CTA
        return
    splits = attention.choose_splits(batch, KV_HEADS, ctx, device)
    print(f"  {label} merge alone at {splits} splits: {_merge_only_ms(store, metas, qs, splits, device):.4f} ms",
          flush=True)


def main() -> int:
    device = require_gpu()
    if "--ncu" in sys.argv:  # two launches each of the first two settings, for a profiler to read
        store, metas, qs, _ = kernels_turbo.random_decode_inputs(8, 65536, 32, "turbo3", device)
        for i, (setting, _) in enumerate(2 * SETTINGS[:2]):
            decode_attention_triton(qs[i % len(qs)], store.k, store.v, metas[i % len(qs)], HEAD_DIM**-0.5, store.signs,
                                    store.inv_sqrt, **_launch(setting))
        torch.cuda.synchronize()
        return 0
    if "--ncu-cuda" in sys.argv:
        store, metas, qs, _ = kernels_turbo.random_decode_inputs(8, 65536, 32, "turbo3", device)
        partial = kernels_turbo.engine_key_offset(KV_HEADS, HEAD_DIM, device, torch.Generator().manual_seed(2),
                                                  turned_pairs=kernels_turbo.ENGINE_TURNED_PAIRS)
        for i, (offset, int8_keys) in enumerate(2 * ((None, False), (partial, False), (None, True))):
            attention_cuda.decode_attention_cuda(qs[i % len(qs)], store.k, store.v, metas[i % len(qs)],
                                                 HEAD_DIM**-0.5, store.signs, store.inv_sqrt, offset,
                                                 int8_keys=int8_keys)
        torch.cuda.synchronize()
        return 0
    quick = "--quick" in sys.argv
    settings = SETTINGS[:1] if "--default-only" in sys.argv or quick else SETTINGS
    if "--cuda" in sys.argv:
        settings = ()
    offsets = (None, 0, *OFFSET_PAIRS) if "--offset" in sys.argv else (None,)
    if quick:
        offsets = offsets[:1] + (kernels_turbo.ENGINE_TURNED_PAIRS,) * ("--offset" in sys.argv)
    failures = _check_settings(device, settings, offsets)
    for batch, ctx, q_heads in SHAPES[:2] if quick else SHAPES:
        _sweep_shape(batch, ctx, q_heads, settings, CUDA_SETTINGS, device, offsets)
        torch.cuda.empty_cache()
    print("all GPU correctness checks passed" if not failures else f"GPU correctness FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
