"""The turbo store kernels on the GPU: correctness at real sizes, then their settings against copy bandwidth.

`python bench/turbo_store_sweep.py`

1. Correctness (PASS/FAIL lines), for the CUDA C kernel (store_cuda.py, what the engine runs where it can)
   and the Triton one: bf16 and fp16 K/V through the store with the kinds of key offset (key_offset.py:
   partial on 8 / 16 pairs at d128 / d256, turned on all pairs at d64 and d128, fixed, none) against
   format.quantize_reference of k - o(p) on the same device: index mismatches (a value within an ulp or
   two of a midpoint may differ, nothing else), norms of the groups whose indices all agree, zero rows,
   padding slots (-1) and slots nobody wrote. The CUDA kernel takes head_dim 128 and 256 and at most
   store_cuda.MAX_PAIRS turned pairs (d64 and the offset turned on all 64 pairs stay on Triton).
2. Timing, 32768 tokens x 8 KV heads x d128, K+V, for slots as an engine step writes them (pages shuffled,
   tokens contiguous inside a page) and for tokens scattered one by one: CUDA C with each key offset (partial
   on 8 pairs is the engine default, then fixed, none; turned on all 64 pairs stays on Triton), its launch
   settings (store_cuda.CudaStoreLaunch; one_body is checked for correctness above too), and Triton with the
   engine default; baseline: bf16 index_copy_ of K and V through the same slots. Bytes: bf16 K and V read +
   the turbo pages written (indices and norms) + the slot mapping and positions.
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
from bench.kernels_turbo import ENGINE_TURNED_PAIRS, engine_key_offset, engine_slots, store_errors  # noqa: E402
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at  # noqa: E402
from server.kernels.turbo.quantize import STORE_LAUNCH, store_turbo_triton  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402
from server.kernels.turbo.store_cuda import (  # noqa: E402
    CUDA_STORE_LAUNCH, MAX_PAIRS, ONE_BODY_LAUNCH, CudaStoreLaunch, default_launch, offset_build, store_turbo_cuda,
)

PAGE, HEADS, TOKENS, CHECK_TOKENS = 16, 8, 32768, 3000
# (head_dim, K kind, V kind, key offsets); "partial": ENGINE_TURNED_PAIRS pairs (16 at d256), "turned": all
CHECKS = [(128, "turbo3", "turbo3", ("partial", "turned", "fixed", "none")), (128, "turbo4", "turbo4", ("partial",)),
          (64, "turbo2", "turbo4", ("turned",)), (256, "turbo4", "turbo3", ("partial", "none")),
          (128, "turbo2", "turbo3", ("fixed",))]
CHECK_DTYPES = {torch.bfloat16: CHECKS, torch.float16: CHECKS[:1] + CHECKS[3:4]}
# store_cuda.default_launch takes the first with turned key pairs and the last without; 08:56 UTC also measured
# (2, 5) and (2, 4) two-body launches: 9 % and 14 % slower (fewer warps per SM)
CUDA_SETTINGS = [CUDA_STORE_LAUNCH, CudaStoreLaunch(warps=1, min_blocks=12), ONE_BODY_LAUNCH]


def _key_offset(kind: str, head_dim: int, device, gen) -> tuple[KeyOffset | None, bool]:
    """(offset, turns) of one kind: store_turbo_*'s key_offset and key_offset_turns."""
    if kind == "none":
        return None, False
    turned = engine_key_offset(HEADS, head_dim, device, gen, turned_pairs=None if kind == "turned" else (
        ENGINE_TURNED_PAIRS * head_dim // 128))
    if kind == "fixed":
        return KeyOffset.fixed(turned.mean + turned.const, turned.inv_freq), False
    return turned, True


def _store(backend: str, k, v, slots, positions, store, key_offset, turns, cuda_launch=None,
           triton_launch=STORE_LAUNCH) -> None:
    if backend == "cuda":
        if not store_turbo_cuda(k, v, slots, positions, store.k, store.v, key_offset, turns, cuda_launch):
            raise RuntimeError("the CUDA C store did not take this call (store_cuda.supports or NVRTC said no)")
    else:
        store_turbo_triton(k, v, slots, positions, store.k, store.v, store.signs, store.inv_sqrt, key_offset, turns,
                           launch=triton_launch)


def check(device) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(0)
    for dtype, cases in CHECK_DTYPES.items():
        for head_dim, k_kind, v_kind, offsets in cases:
            for offset_kind in offsets:
                for backend, launch in (("cuda", CUDA_STORE_LAUNCH), ("cuda one body", ONE_BODY_LAUNCH), ("triton", None)):
                    name = (f"store {backend} {k_kind}/{v_kind} D={head_dim} {str(dtype).split('.')[1]} key offset "
                            f"{offset_kind}")
                    if backend != "triton" and (head_dim % 128 or offset_kind == "turned" and head_dim // 2 > MAX_PAIRS):
                        continue  # store_cuda.supports says no: the engine takes the Triton kernel
                    if backend == "cuda one body" and k_kind != v_kind:
                        continue  # the same build as "cuda"
                    try:
                        failures += _check_case(name, backend.split()[0], head_dim, k_kind, v_kind, offset_kind,
                                                dtype, device, gen, launch)
                    except Exception as error:  # one broken case must not hide the others
                        print(f"FAIL {name}: {type(error).__name__}: {error}", flush=True)
                        failures.append(name)
    return failures


def _check_case(name, backend, head_dim, k_kind, v_kind, offset_kind, dtype, device, gen, launch) -> list[str]:
    tokens = CHECK_TOKENS
    store = TurboKVStore(2 * tokens // PAGE, PAGE, HEADS, head_dim, k_kind, v_kind, device, dtype)
    key_offset, turns = _key_offset(offset_kind, head_dim, device, gen)
    positions = torch.arange(tokens, device=device)
    offsets = (torch.zeros(tokens, HEADS, head_dim, device=device) if key_offset is None
               else key_offset_at(key_offset, positions))
    k = (torch.randn(tokens, HEADS, head_dim, generator=gen).to(device) * 3 + offsets).to(dtype)
    v = torch.randn(tokens, HEADS, head_dim, generator=gen).to(device, dtype)
    v[11] = 0.0
    k[12, 3] = 0.0
    slots = engine_slots(tokens, store.k.codes.shape[0], PAGE, device, gen)
    slots[5] = -1  # padding
    _store(backend, k, v, slots, positions, store, key_offset, turns, launch)
    keep = slots >= 0
    failures = []
    for label, pages, kind, x in (("K", store.k, k_kind, k.float() - offsets), ("V", store.v, v_kind, v)):
        s = slots[keep]
        mism, rel = store_errors(pages, kind, x[keep], s)
        written = torch.zeros(pages.codes.shape[0] * PAGE, dtype=torch.bool, device=device)
        written[s] = True
        untouched = pages.codes.transpose(1, 2).reshape(-1, pages.codes.shape[1] * pages.codes.shape[3])
        stray = untouched[~written].ne(0).any().item()
        ok = mism < 1e-4 and rel < 1e-3 and not stray
        print(f"{'PASS' if ok else 'FAIL'} {name} {label}: index mismatch {mism:.1e}, norm rel err {rel:.1e}, "
              f"writes outside its slots: {stray}", flush=True)
        if not ok:
            failures.append(f"{name} {label}")
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
            offsets = {name: _key_offset(name, 128, device, gen) for name in ("partial", "fixed", "none")}
            runs = [("cuda", launch, "partial") for launch in CUDA_SETTINGS] if pattern == "engine slots" else []
            # Triton: the engine default only (the 08:56 UTC block has it with every offset)
            runs += [(backend, None, name) for name in offsets for backend in ("cuda", "triton")
                     if (pattern == "engine slots" or name == "partial") and name != "turned"
                     and (backend == "cuda" or name == "partial")]
            for backend, launch, name in runs:
                key_offset, turns = offsets[name]
                dispatched = default_launch(store.k.bits, store.v.bits, offset_build(key_offset, turns))
                launch = launch or (dispatched if backend == "cuda" else None)
                case = (f"store {kind} {'CUDA C' if backend == 'cuda' else 'Triton'}, {TOKENS} tokens x {HEADS} heads, "
                        f"K+V, {pattern}, " + {"none": "plain format", "partial": f"partial key offset "
                                               f"({ENGINE_TURNED_PAIRS} pairs)", "turned": "turned key offset (64 pairs)",
                                               "fixed": "fixed key offset"}[name])
                if backend == "triton":
                    note = f"default {STORE_LAUNCH}"
                elif launch == dispatched:
                    note = f"default {launch}"
                else:
                    note = ", ".join(f"{f}={getattr(launch, f)}" for f in launch.__dataclass_fields__
                                     if getattr(launch, f) != getattr(dispatched, f))
                try:
                    ms = time_ms(lambda _: _store(backend, k, v, slots, positions, store, key_offset, turns, launch),
                                 device=device)
                except Exception as error:
                    print(f"{case}: FAILED {type(error).__name__}: {error}", flush=True)
                    continue
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
