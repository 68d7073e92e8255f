"""Turbo stores with the calibrated per-head transform on the GPU: `python bench/turbo_transform.py`.

1. Correctness in bf16 at real sizes (PASS/FAIL lines first): a store with an offset m and
   power-of-two scales s, t is written by the Triton store kernel and read through
   TurboKVStore.attend (fused decode, and prefill over decoded pages); the result must match a
   float64 attention over the keys and values the pages stand for (decoded / s + m, decoded / t).
2. Time: the store kernel with and without the transform (the bf16 index_copy_ of a dense
   cache as in `bench/kernels.py turbo`), and a decode step through TurboKVStore.attend with the
   transform against the same store without it: the price of q / s and out / t.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Row, command_line, copy_bandwidth_gbs, report, require_gpu, time_ms
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.format import dequantize_reference
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore

PAGE = 16


def transformed_store(num_pages, kv_heads, head_dim, kind, device, gen):
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, kind, kind, device, torch.bfloat16)
    pow2 = lambda: torch.exp2(torch.randint(-2, 3, (kv_heads, head_dim), generator=gen).float())
    store.set_transform(torch.randn(kv_heads, head_dim, generator=gen) * 4, pow2(), pow2())
    return store


def decode_meta(batch, ctx, device):
    pages = -(-ctx // PAGE)
    tables = torch.arange(batch * pages, dtype=torch.int32, device=device).reshape(batch, pages)
    return AttentionMetadata(torch.zeros(0, dtype=torch.long, device=device), tables,
                             torch.full((batch,), ctx, dtype=torch.int32, device=device),
                             torch.arange(batch + 1, dtype=torch.int32, device=device), [ctx] * batch, [1] * batch)


def oracle(q, store, meta, scale):
    """float64 attention over decoded / s + m and decoded / t, causal over each sequence."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // store.num_kv_heads
    starts = meta.query_start_loc.tolist()
    for b, (n, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        pages = meta.block_tables[b, : -(-n // PAGE)].long()
        k, v = (dequantize_reference(p.codes[pages], p.norms[pages], kind, store.head_dim).double()
                .transpose(1, 2).reshape(-1, store.num_kv_heads, store.head_dim)[:n]
                for p, kind in ((store.k, store.k_kind), (store.v, store.v_kind)))
        k = k / store.k_scale.double() + store.k_offset.double()
        v = v / store.v_scale.double()
        qs = q[starts[b]: starts[b] + q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k.repeat_interleave(group, 1)) * scale
        causal = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - q_len, n, device=q.device)[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        out[starts[b]: starts[b] + q_len] = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(group, 1))
    return out


def check(device) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(0)
    for head_dim, kv_heads, group, kind in ((64, 3, 3, "turbo3"), (128, 8, 4, "turbo4"), (128, 8, 4, "turbo3")):
        seq_lens = [1, 17, 300]
        pages = [-(-n // PAGE) for n in seq_lens]
        store = transformed_store(sum(pages), kv_heads, head_dim, kind, device, gen)
        tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
        first = 0
        for b, n in enumerate(seq_lens):
            tables[b, : pages[b]] = torch.arange(first, first + pages[b])
            first += pages[b]
            slots = tables[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
            k = store.k_offset.cpu() + torch.randn(n, kv_heads, head_dim, generator=gen)
            v = torch.randn(n, kv_heads, head_dim, generator=gen) + 1.0
            store.write(k.to(device, torch.bfloat16), v.to(device, torch.bfloat16), slots.to(device))
        for what, q_lens in (("decode", [1, 1, 1]), ("prefill", [1, 17, 300])):
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            meta = AttentionMetadata(torch.zeros(0, dtype=torch.long, device=device), tables.to(device),
                                     torch.tensor(seq_lens, dtype=torch.int32, device=device), starts.to(device),
                                     list(seq_lens), list(q_lens))
            q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(device, torch.bfloat16)
            want = oracle(q, store, meta, head_dim**-0.5)
            err = (store.attend(q, meta, head_dim**-0.5).double() - want).abs().max().item()
            tol = 1e-2 * want.abs().max().item()  # bf16 q, fp16 operands inside the kernels, bf16 output
            ok = err < tol
            print(f"{'PASS' if ok else 'FAIL'} transformed {kind} D={head_dim} {what}: max abs error {err:.3g} "
                  f"(tolerance {tol:.3g})", flush=True)
            if not ok:
                failures.append(f"{kind} D={head_dim} {what}")
    return failures


def store_rows(device) -> list[Row]:
    tokens, kv_heads, head_dim = 32768, 8, 128
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(tokens * 2, device=device)[:tokens]
    dense_k, dense_v = (torch.empty(tokens * 2, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
                        for _ in range(2))

    def dense_write(_):
        dense_k.index_copy_(0, slots, k)
        dense_v.index_copy_(0, slots, v)

    dense_ms = time_ms(dense_write, device=device)
    rows = []
    gen = torch.Generator().manual_seed(1)
    for kind in ("turbo3", "turbo4"):
        store = transformed_store(tokens * 2 // PAGE, kv_heads, head_dim, kind, device, gen)
        moved = 2 * k.numel() * 2 + tokens * TurboKVStore.bytes_per_token(kv_heads, head_dim, kind, kind) + tokens * 8
        for label, transform in (("with m, s, t", (store.k_offset, store.k_scale, store.v_scale)),
                                 ("plain format", (None, None, None))):
            ms = time_ms(lambda _, store=store, transform=transform: store_turbo_triton(
                k, v, slots, store.k, store.v, store.signs, store.inv_sqrt, *transform), device=device)
            rows.append(Row(f"store {kind}, {tokens} tokens x {kv_heads} heads, K+V, {label}", ms, dense_ms, moved,
                            "bf16 index_copy_ of K and V", "16 token-head rows per program"))
    return rows


def attend_rows(device) -> list[Row]:
    rows = []
    gen = torch.Generator().manual_seed(2)
    for batch, ctx, q_heads, kv_heads, head_dim in ((8, 4096, 32, 8, 128), (32, 2048, 9, 3, 64), (1, 1024, 9, 3, 64)):
        meta = decode_meta(batch, ctx, device)
        store = transformed_store(batch * -(-ctx // PAGE), kv_heads, head_dim, "turbo3", device, gen)
        for pages in (store.k, store.v):  # random valid codes and positive norms: timing only
            pages.codes.copy_(torch.randint(0, 256, pages.codes.shape, dtype=torch.uint8, device=device))
            pages.norms.copy_(torch.rand(pages.norms.shape, device=device).half() + 0.5)
        q = torch.randn(batch, q_heads, head_dim, device=device, dtype=torch.bfloat16)
        step = lambda _, store=store, q=q, meta=meta, scale=head_dim**-0.5: store.attend(q, meta, scale)
        scaled = time_ms(step, device=device)
        store.scaled = False  # the same pages read without q / s and out / t: only the two multiplies differ
        plain = time_ms(step, device=device)
        store.scaled = True
        rows.append(Row(f"decode turbo3 batch {batch} ctx {ctx}, {q_heads}/{kv_heads} heads d{head_dim}, "
                        "TurboKVStore.attend with s, t", scaled, plain, None, "same store without q / s, out / t",
                        "eager launches"))
    return rows


def main() -> int:
    device = require_gpu()
    failures = check(device)
    copy_gbs = copy_bandwidth_gbs(device)
    rows = store_rows(device) + attend_rows(device)
    report("Turbo stores with the calibrated transform", rows, copy_gbs, command_line("bench/turbo_transform.py", None),
           device=device)
    if failures:
        print("FAILED:", ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
