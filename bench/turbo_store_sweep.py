"""The turbo store kernel on the GPU: correctness at real sizes, then its settings against copy bandwidth.

`python bench/turbo_store_sweep.py`

1. Correctness (PASS/FAIL lines): bf16 and fp16 K/V through the store (with the engine's kinds of key
   offset, key_offset.py: turned on all pairs at d64, partial on 8 / 16 pairs at d128 / d256) against format.quantize_reference of k - o(p) on the same device: index
   mismatches (a value within an ulp of a midpoint may differ, nothing else), norms of the groups whose
   indices all agree, zero rows, padding slots (-1) and slots nobody wrote.
2. Timing, 32768 tokens x 8 KV heads x d128, K+V: the store's launch settings (quantize.StoreLaunch)
   with the turned key offset, for slots as an engine step writes them (pages shuffled, tokens contiguous
   inside a page), and the default for tokens scattered one by one, with the fixed offset (the engine's
   default) and without one (the plain format);
   baseline: bf16 index_copy_ of K and V through the same slots.
   Bytes: bf16 K and V read + the turbo pages written (indices and norms) + the slot mapping and positions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import (  # noqa: E402
    BENCHMARKS_DOC, Row, command_line, copy_bandwidth_gbs, report, require_gpu, time_ms,
)
from bench.kernels_turbo import engine_key_offset, engine_slots, store_errors  # noqa: E402
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at  # noqa: E402
from server.kernels.turbo.quantize import STORE_LAUNCH, StoreLaunch, store_turbo_triton  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, HEADS, TOKENS, CHECK_TOKENS = 16, 8, 32768, 3000
CHECKS = [(128, "turbo3", "turbo3"), (128, "turbo4", "turbo4"), (64, "turbo2", "turbo4"), (256, "turbo4", "turbo3")]
SETTINGS = [STORE_LAUNCH, StoreLaunch(rows=16), StoreLaunch(programs_per_sm=2), StoreLaunch(programs_per_sm=8),
            StoreLaunch(programs_per_sm=1 << 20), StoreLaunch(stages=2), StoreLaunch(stages=3),
            StoreLaunch(max_registers=None), StoreLaunch(rows=32, stages=2)]  # the first is the default
CHECK_DTYPES = {torch.bfloat16: CHECKS, torch.float16: CHECKS[:1] + CHECKS[-1:]}


def check(device) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(0)
    for dtype, cases in CHECK_DTYPES.items():
        for head_dim, k_kind, v_kind in cases:
            tokens = CHECK_TOKENS
            store = TurboKVStore(2 * tokens // PAGE, PAGE, HEADS, head_dim, k_kind, v_kind, device, dtype)
            turned_pairs = {128: 8, 256: 16}.get(head_dim)  # partial offsets there, turned on all pairs at d64
            store.set_key_offset(engine_key_offset(HEADS, head_dim, device, gen, turned_pairs=turned_pairs))
            positions = torch.arange(tokens, device=device)
            offsets = key_offset_at(store.key_offset, positions)
            k = (torch.randn(tokens, HEADS, head_dim, generator=gen).to(device) * 3 + offsets).to(dtype)
            v = torch.randn(tokens, HEADS, head_dim, generator=gen).to(device, dtype)
            v[11] = 0.0
            slots = engine_slots(tokens, store.k.codes.shape[0], PAGE, device, gen)
            slots[5] = -1  # padding
            store.write(k, v, slots, positions)
            keep = slots >= 0
            for label, pages, kind, x in (("K", store.k, k_kind, k.float() - offsets),
                                          ("V", store.v, v_kind, v)):
                s = slots[keep]
                mism, rel = store_errors(pages, kind, x[keep], s)
                written = torch.zeros(pages.codes.shape[0] * PAGE, dtype=torch.bool, device=device)
                written[s] = True
                untouched = pages.codes.transpose(1, 2).reshape(-1, pages.codes.shape[1] * pages.codes.shape[3])
                stray = untouched[~written].ne(0).any().item()
                ok = mism < 1e-4 and rel < 1e-3 and not stray
                name = (f"store {label} {kind} D={head_dim} {str(dtype).split('.')[1]} key offset "
                        f"{'turned' if turned_pairs is None else f'partial{turned_pairs}'}")
                print(f"{'PASS' if ok else 'FAIL'} {name}: index mismatch {mism:.1e}, norm rel err {rel:.1e}, "
                      f"writes outside its slots: {stray}", flush=True)
                if not ok:
                    failures.append(name)
    return failures


def timings(device, copy_gbs: float) -> list[Row]:
    k = torch.randn(TOKENS, HEADS, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    positions = torch.arange(TOKENS, device=device)
    num_pages = 2 * TOKENS // PAGE
    gen = torch.Generator().manual_seed(1)
    patterns = {"engine slots": engine_slots(TOKENS, num_pages, PAGE, device, gen),
                "scattered slots": torch.randperm(num_pages * PAGE, generator=gen)[:TOKENS].to(device)}
    dense_k = torch.empty(num_pages * PAGE, HEADS, 128, device=device, dtype=torch.bfloat16)
    dense_v = torch.empty_like(dense_k)
    rows = []
    for pattern, slots in patterns.items():
        def dense_write(_):
            dense_k.index_copy_(0, slots, k)
            dense_v.index_copy_(0, slots, v)

        dense_ms = time_ms(dense_write, device=device)
        for kind in ("turbo3", "turbo4"):
            store = TurboKVStore(num_pages, PAGE, HEADS, 128, kind, kind, device, torch.bfloat16)
            pages_bytes = TOKENS * TurboKVStore.bytes_per_token(HEADS, 128, kind, kind)
            moved = 2 * k.numel() * 2 + pages_bytes + slots.numel() * 8 * 2  # bf16 K, V read; pages, slots, positions
            turned = engine_key_offset(HEADS, 128, device, gen)
            fixed = KeyOffset.fixed(turned.mean, turned.inv_freq)
            runs = [(launch, "turned") for launch in (SETTINGS if pattern == "engine slots" else SETTINGS[:1])]
            for launch, offset in runs + [(STORE_LAUNCH, "fixed"), (STORE_LAUNCH, "none")]:
                case = f"store {kind}, {TOKENS} tokens x {HEADS} heads, K+V, {pattern}, " + (
                    "plain format" if offset == "none" else f"{offset} key offset")
                key_offset = {"turned": turned, "fixed": fixed, "none": None}[offset]
                ms = time_ms(lambda _: store_turbo_triton(k, v, slots, positions, store.k, store.v, store.signs,
                                                          store.inv_sqrt, key_offset, offset == "turned",
                                                          launch=launch), device=device)
                fields = launch.__dataclass_fields__
                note = (f"default {launch}" if launch == STORE_LAUNCH else ", ".join(
                    f"{f}={getattr(launch, f)}" for f in fields if getattr(launch, f) != getattr(STORE_LAUNCH, f)))
                rows.append(Row(case, ms, dense_ms, moved, "bf16 index_copy_ of K and V", note))
                print(f"{case}: {ms:.4f} ms ({rows[-1].fraction_of_copy(copy_gbs):.0%} of copy), {note}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-record", action="store_true", help="print without writing docs/BENCHMARKS.md")
    args = parser.parse_args()
    device = require_gpu()
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    failures = check(device)
    rows = timings(device, copy_gbs)
    status = "all GPU correctness checks passed" if not failures else f"GPU correctness FAILED: {', '.join(failures)}"
    report(f"Turbo store kernel settings ({status})", rows, copy_gbs, command_line("bench/turbo_store_sweep.py", None),
           device=device, doc_path=None if args.no_record else BENCHMARKS_DOC)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
