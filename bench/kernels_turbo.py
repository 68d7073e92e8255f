"""TurboQuant KV kernels vs bf16 (`python bench/kernels.py turbo`).

1. GPU correctness at real sizes in bf16 (printed as PASS/FAIL lines before any timing): the
   store kernel against the reference quantizer, the fused decode against decode-then-attend
   and a float32 attention over the dequantized K/V, the rotation kernel against its reference;
   each case again with a key offset (RoPE keys with a shared direction, the pages holding k - o(p)),
   plus one sequence of 128K positions (the offset's angles at their largest).
2. Decode attention, 32 query / 8 KV heads, head_dim 128, batch 1/8/32 x context 4K/16K/64K:
   turbo3 and turbo4, the engine's dispatched decode (the CUDA C kernel of attention_cuda.py where it runs)
   and the Triton kernel (both: split-K decode + merge with the inverse rotation) against
   F.scaled_dot_product_attention on contiguous bf16 K/V (the 4 query heads of a KV head as 4
   query rows, so SDPA reads each KV head once, as ours does). Bandwidth counts the compressed
   K/V bytes. Each shape also runs with a key offset like the engine's default (engine_key_offset, partial on
   ENGINE_TURNED_PAIRS pairs per KV head), so the cost of the score term <q, o(p)> is the difference of the
   two rows.
   A small sweep of the decode kernel's tile/warp/register/column-order settings at batch 8
   and batch 1, 64K comes first; the table rows run the kernel's defaults.
3. Rotation and store kernels against the device copy bandwidth (the store through slots as an engine
   step writes them: shuffled pages, tokens contiguous inside each; bench/turbo_store_sweep.py has more).

Turbo pages are filled with random codes and norms for timing (every byte is a valid code);
the correctness part writes real K/V through the store kernel.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from bench import kernels_rotation
from bench.harness import Row, rotation_count, time_ms
from server.config import DEFAULT_KV_KEY_TURNED_PAIRS
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo import attention, attention_cuda
from server.kernels.turbo.attention import attention_over_decoded_pages, decode_attention_triton
from server.kernels.turbo.format import RowLayout, quantize_reference, unpack_indices
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at, pair_mask
from server.kernels.turbo.quantize import store_turbo
from server.kernels.turbo.recent import RecentWindow
from server.kernels.turbo.store import TurboKVStore

PAGE = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# (block_n, num_warps, max registers, pipeline stages, column order of the decoded tiles); None: the
# compiler's choice; {}: the decode's natural column order (2-way bank-conflicted tile stores)
DEFAULT = (attention.BLOCK_N, attention.NUM_WARPS, attention.MAX_REGISTERS, attention.NUM_STAGES,
           attention.COLUMN_ORDER)  # the table rows
SWEEP = (DEFAULT, (64, 4, 128, None, {}), (64, 4, None, None, attention.COLUMN_ORDER),
         (128, 8, None, None, attention.COLUMN_ORDER))
SWEEP_SHAPES = ((8, 65536), (1, 65536))  # (batch, context)
BATCHES, CONTEXTS = (1, 8, 32), (4096, 16384, 65536)
CHECK_CASES = [  # head_dim, GQA, K kind, V kind, context lengths (2 KV heads)
    (128, 4, "turbo3", "turbo3", [4099, 1000, 17, 1]), (128, 4, "turbo4", "turbo3", [16384, 33]),
    (64, 3, "turbo4", "turbo2", [2000, 16, 15]), (256, 2, "turbo3", "turbo4", [1500, 2]),
]
LONG_OFFSET_CASE = (128, 4, "turbo3", "turbo3", [131072, 70001, 3])  # angles up to 1.3e5 rad, with the offset only
STORE_TOKENS = 32768
ENGINE_TURNED_PAIRS = DEFAULT_KV_KEY_TURNED_PAIRS  # the engine's default key offset: partial on 8 pairs


def _meta(seq_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    device = tables.device
    n = len(seq_lens)
    return AttentionMetadata(
        torch.zeros(0, dtype=torch.long, device=device), tables,
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.arange(n + 1, dtype=torch.int32, device=device), list(seq_lens), [1] * n,
    )


def _filled_store(seq_lens, kv_heads, head_dim, k_kind, v_kind, device, gen, key_offset=None):
    """A store holding real K/V for every sequence (written by the store kernel) in shuffled pages. With a
    ``key_offset`` the store subtracts it and the keys are like real ones: o(p) (RoPE of a shared direction,
    the sink at 0) plus what differs per token."""
    pages = [-(-n // PAGE) for n in seq_lens]
    store = TurboKVStore(sum(pages), PAGE, kv_heads, head_dim, k_kind, v_kind, device, torch.bfloat16)
    if key_offset is not None:
        store.set_key_offset(key_offset)
    order = torch.randperm(sum(pages), generator=gen).to(device)
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=device)
    kv = []
    start = 0
    for s, n in enumerate(seq_lens):
        tables[s, : pages[s]] = order[start : start + pages[s]].int()
        start += pages[s]
        pos = torch.arange(n, device=device)
        slots = tables[s, pos // PAGE].long() * PAGE + pos % PAGE
        k = (torch.randn(n, kv_heads, head_dim, generator=gen) * 2 + 0.3).to(device)
        if key_offset is not None:
            k = k + key_offset_at(key_offset, pos)
        k = k.to(torch.bfloat16)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device, torch.bfloat16)
        store.write(k, v, slots, pos)
        kv.append((k, v, slots))
    return store, tables, kv


def check_correctness(device: torch.device) -> list[str]:
    """Fast paths vs references in bf16 at real sizes; returns the failures (also printed)."""
    gen = torch.Generator().manual_seed(0)
    failures = []

    def verdict(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    kernels_rotation.check(device, verdict)

    cases = [(case, None) for case in CHECK_CASES] + [
        (case, engine_key_offset(2, case[0], device, gen, theta)) for case, theta in
        zip((*CHECK_CASES, LONG_OFFSET_CASE), (10000.0, 500000.0, 10000.0, 500000.0, 500000.0))]
    for (head_dim, gqa, k_kind, v_kind, lens), offset in cases:
        name = f"D={head_dim} GQA={gqa} K={k_kind} V={v_kind} lens={lens}" + ("" if offset is None else " key offset")
        store, tables, kv = _filled_store(lens, 2, head_dim, k_kind, v_kind, device, gen, offset)
        k, v, slots = kv[0]
        if offset is not None:  # the pages hold k - o(p)
            k = k.float() - key_offset_at(offset, torch.arange(k.shape[0], device=device))
        for label, pages, kind, src in (("K", store.k, k_kind, k), ("V", store.v, v_kind, v)):
            mism, nerr = store_errors(pages, kind, src, slots)
            verdict(f"store {label} {name}", mism < 1e-3 and nerr < 2e-3, f"index mismatch {mism:.2e}, norm rel err {nerr:.2e}")
        meta = _meta(lens, tables)
        q = torch.randn(len(lens), 2 * gqa, head_dim, generator=gen).to(device, torch.bfloat16)
        scale = head_dim**-0.5
        fused = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt,
                                        store.key_offset).float()
        reference = attention_over_decoded_pages(q.float(), store.k, store.v, k_kind, v_kind, meta, scale,
                                                 store.key_offset).float()
        err = (fused - reference).abs().max().item() / reference.abs().max().item()
        verdict(f"decode {name}", err < 2e-2, f"max |fused - reference| / max |reference| = {err:.2e}")
        cuda = attention_cuda.decode_attention_cuda(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt,
                                                    store.key_offset)
        err = float("inf") if cuda is None else (cuda.float() - reference).abs().max().item() / \
            reference.abs().max().item()
        verdict(f"CUDA C decode {name}", err < 2e-2, f"max |CUDA - reference| / max |reference| = {err:.2e}")
        del store, kv
    return failures


def store_errors(pages, kind: str, x: torch.Tensor, slots: torch.Tensor) -> tuple[float, float]:
    """(share of indices that differ from quantize_reference(x), largest norm relative error) of what the store
    wrote at ``slots``. An index that moved across a midpoint (float sums in another order) changes ||c|| and so
    that group's norm: norms are compared where every index of the group agrees."""
    head_dim, page = x.shape[-1], pages.codes.shape[2]
    codes, norms = quantize_reference(x, kind)
    got = unpack_indices(pages.codes[slots // page, :, slots % page], pages.bits, head_dim)
    want = unpack_indices(codes, pages.bits, head_dim)
    same = (got == want).reshape(*got.shape[:-1], norms.shape[-1], -1).all(-1)
    got_norms = pages.norms[slots // page, :, slots % page].float()
    rel = ((got_norms - norms.float()).abs() / norms.float().clamp_min(1e-6))[same]
    return (got != want).float().mean().item(), rel.max().item() if rel.numel() else float("inf")


def random_decode_inputs(batch: int, ctx: int, q_heads: int, kind: str, device):
    """(store, metas, qs, compressed bytes): enough independent (q, block table) inputs over one store of random
    pages to rotate past L2; every byte is a valid code, norms around a realistic size, pages shuffled."""
    layout = RowLayout(kind, HEAD_DIM)
    pages_per_seq = ctx // PAGE
    turbo_bytes = batch * ctx * KV_HEADS * 2 * layout.bytes_per_head
    n_inputs = rotation_count(turbo_bytes, device)
    num_pages = n_inputs * batch * pages_per_seq
    store = TurboKVStore(1, PAGE, KV_HEADS, HEAD_DIM, kind, kind, device, torch.bfloat16)
    for pages in (store.k, store.v):
        pages.codes = torch.randint(0, 256, (num_pages, KV_HEADS, PAGE, layout.row_bytes), dtype=torch.uint8,
                                    device=device)  # fmt: skip
        pages.norms = (torch.rand(num_pages, KV_HEADS, PAGE, 1, device=device) * 4 + 8).half()
    perm = torch.randperm(num_pages, device=device).int().reshape(n_inputs, batch, pages_per_seq)
    metas = [_meta([ctx] * batch, perm[i].contiguous()) for i in range(n_inputs)]
    qs = [torch.randn(batch, q_heads, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(n_inputs)]
    return store, metas, qs, turbo_bytes


def random_recent_decode_inputs(batch: int, ctx: int, q_heads: int, size: int, device):
    """random_decode_inputs (turbo3) plus a bf16 recent window of ``size`` random rows per sequence, the sequences on
    shuffled rows: (store, metas with recent_rows, qs, ring)."""
    store, metas, qs, _ = random_decode_inputs(batch, ctx, q_heads, "turbo3", device)
    ring = RecentWindow.empty(batch, size, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    ring.k.normal_()
    ring.v.normal_()
    rows = torch.randperm(batch, device=device).int()
    return store, [dataclasses.replace(m, recent_rows=rows) for m in metas], qs, ring


def _decode_case(batch: int, ctx: int, kind: str, device, configs, key_offset: bool = False,
                 dispatched: bool = False) -> list[Row]:
    """One row per (block_n, num_warps) config of the Triton decode on random pages of this shape; with an
    engine-like key offset (its score term) when ``key_offset``. ``dispatched``: one row of the engine's decode
    instead (TurboKVStore.attend: the CUDA C kernel where it runs, else Triton)."""
    store, metas, qs, turbo_bytes = random_decode_inputs(batch, ctx, Q_HEADS, kind, device)
    if key_offset:
        store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, device, torch.Generator().manual_seed(2),
                                               turned_pairs=ENGINE_TURNED_PAIRS))
    n_inputs = len(qs)
    scale = HEAD_DIM**-0.5

    def ours(i, config):
        block_n, num_warps, max_registers, num_stages, column_order = config
        return decode_attention_triton(qs[i], store.k, store.v, metas[i], scale, store.signs, store.inv_sqrt,
                                       store.key_offset, block_n=block_n, num_warps=num_warps,
                                       max_registers=max_registers, num_stages=num_stages, column_order=column_order)

    case = f"decode {kind} b{batch} ctx{ctx // 1024}K" + (
        f", key offset partial{ENGINE_TURNED_PAIRS}" if key_offset else "")
    if dispatched:
        cuda = attention_cuda.decode_attention_cuda(qs[0], store.k, store.v, metas[0], scale, store.signs,
                                                    store.inv_sqrt, store.key_offset) is not None
        ms = time_ms(lambda i: store.attend(qs[i], metas[i], scale), n_inputs=n_inputs, device=device)
        return [Row(case, ms, bytes_moved=turbo_bytes,
                    note="dispatched: " + ("CUDA C kernel (attention_cuda.py)" if cuda else "Triton kernel"))]
    rows = []
    for config in configs:
        ms = time_ms(lambda i: ours(i, config), n_inputs=n_inputs, device=device)
        block_n, num_warps, max_registers, num_stages, column_order = config
        note = f"BLOCK_N={block_n}, {num_warps} warps"
        note += "" if max_registers is None else f", <= {max_registers} registers"
        note += "" if num_stages is None else f", {num_stages} stages"
        note += "" if column_order else ", natural column order"
        rows.append(Row(case, ms, bytes_moved=turbo_bytes, note="Triton: " + note))
    return rows


def sdpa_ms(batch: int, ctx: int, q_heads: int, device) -> float:
    """bf16 SDPA (flash) decode over contiguous K/V of the same shape: the baseline."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    bf16_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    n_inputs = rotation_count(bf16_bytes, device)
    kvs = [(torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=device, dtype=torch.bfloat16),
            torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=device, dtype=torch.bfloat16)) for _ in range(n_inputs)]
    q = torch.randn(batch, KV_HEADS, q_heads // KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = time_ms(lambda i: F.scaled_dot_product_attention(q, *kvs[i]), n_inputs=n_inputs, device=device)
    del kvs
    return ms


def engine_key_offset(kv_heads: int, head_dim: int, device, gen: torch.Generator, theta: float = 500000.0,
                      turned_pairs: int | None = None) -> KeyOffset:
    """A key offset like the engine's (server/runtime/kv_calibration.py): a mean as long as a key on
    ``turned_pairs`` random rotate-half pairs per KV head (None: all, `--kv-key-offset turned`; else `partial`),
    a constant on the others, a sink unlike both, and RoPE's frequencies for ``theta`` (Llama 3's)."""
    half = head_dim // 2
    pairs = torch.stack([torch.randperm(half, generator=gen)[: turned_pairs or half].sort().values
                         for _ in range(kv_heads)]).to(torch.int32)
    turn = pair_mask(pairs, head_dim)
    mean, const, sink = (torch.randn(kv_heads, head_dim, generator=gen) * 3 for _ in range(3))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return KeyOffset(*(t.to(device) for t in (const * ~turn, mean * turn, sink, inv_freq, pairs)))


def engine_slots(tokens: int, num_pages: int, page: int, device, gen: torch.Generator) -> torch.Tensor:
    """Slots as an engine step writes them: consecutive tokens fill shuffled pages, contiguous inside a page."""
    pages = torch.randperm(num_pages, generator=gen)[: -(-tokens // page)]
    position = torch.arange(tokens)
    return (pages[position // page] * page + position % page).to(device)


def _rotation_and_store_rows(device) -> list[Row]:
    rows = kernels_rotation.rows(device)
    tokens = STORE_TOKENS
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = engine_slots(tokens, tokens * 2 // PAGE, PAGE, device, torch.Generator().manual_seed(0))
    positions = torch.arange(tokens, device=device)
    dense_k = torch.empty(tokens * 2, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    dense_v = torch.empty_like(dense_k)

    def dense_write(_):
        dense_k.index_copy_(0, slots, k)
        dense_v.index_copy_(0, slots, v)

    dense_ms = time_ms(dense_write, device=device)
    for kind in ("turbo3", "turbo4"):
        store = TurboKVStore(tokens * 2 // PAGE, PAGE, KV_HEADS, HEAD_DIM, kind, kind, device, torch.bfloat16)
        pages_bytes = tokens * TurboKVStore.bytes_per_token(KV_HEADS, HEAD_DIM, kind, kind)
        moved = 2 * k.numel() * 2 + pages_bytes + slots.numel() * 8 + positions.numel() * 8
        offset = engine_key_offset(KV_HEADS, HEAD_DIM, device, torch.Generator().manual_seed(1))
        # a fixed offset; the engine's default partial one is timed by bench/turbo_store_sweep.py
        store.set_key_offset(KeyOffset.fixed(offset.mean, offset.inv_freq))
        ms = time_ms(lambda _: store_turbo(k, v, slots, positions, store.k, store.v, store.signs, store.inv_sqrt,
                                           store.key_offset, store.offset_turns), device=device)
        rows.append(Row(f"store {kind}, {tokens} tokens x 8 heads, K+V, fixed key offset", ms, dense_ms, moved,
                        "bf16 index_copy_ of K and V", "the engine's store: CUDA C where it runs, else Triton "
                        "(bench/turbo_store_sweep.py times both)"))
    return rows


def run(device: torch.device, copy_gbs: float) -> tuple[str, list[Row]]:
    failures = check_correctness(device)
    sweep_rows = []
    for batch, ctx in SWEEP_SHAPES:
        sweep_rows += _decode_case(batch, ctx, "turbo3", device, SWEEP)
    for row in sweep_rows:
        row.note += " (sweep)"
        print(f"sweep {row.case}, {row.note}: {row.ours_ms:.4f} ms", flush=True)
    rows = list(sweep_rows)
    for batch in BATCHES:
        for ctx in CONTEXTS:
            sdpa = sdpa_ms(batch, ctx, Q_HEADS, device)
            for kind in ("turbo3", "turbo4"):
                for key_offset in (False, True):
                    for row in (*_decode_case(batch, ctx, kind, device, [DEFAULT], key_offset, dispatched=True),
                                *_decode_case(batch, ctx, kind, device, [DEFAULT], key_offset)):
                        row.baseline_ms, row.baseline_name = sdpa, "bf16 SDPA (flash)"
                        rows.append(row)
                        print(f"{row.case} ({row.note}): {row.ours_ms:.4f} ms vs SDPA {sdpa:.4f} ms "
                              f"({row.speedup:.2f}x)", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows += _rotation_and_store_rows(device)
    status = "all GPU correctness checks passed" if not failures else f"GPU correctness FAILED: {', '.join(failures)}"
    return f"TurboQuant KV kernels ({status})", rows
