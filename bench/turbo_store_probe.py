"""Where the CUDA C store kernel's time goes: the kernel timed beside variants of its source, on the GPU.

`python bench/turbo_store_probe.py` (32768 tokens x 8 KV heads x d128, turbo3 K+V, plain format, engine slots):
  * two bodies: store_cuda.source with CUDA_STORE_LAUNCH, the engine's build where key pairs turn;
  * K only: the same kernel launched for K alone (half the work; K and V blocks no longer share SMs);
  * one body: K and V through one copy of the code (ONE_BODY_LAUNCH: half the instructions to cache), the
    engine's build for this plain format (store_cuda.default_launch);
  * memory only: the arithmetic between the staged row and its stores removed (staging, 16-byte stores and
    the norm store stay): the floor of the kernel's memory traffic in this access pattern;
  * compute only: no global loads (the staging copies removed; the rows in shared memory are whatever they
    are), everything else as two bodies: the floor of the arithmetic and the stores.
Memory only and compute only write garbage codes; none of them is used anywhere else. Compare the times,
not the codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import copy_bandwidth_gbs, require_gpu, time_ms  # noqa: E402
from bench.kernels_turbo import engine_slots  # noqa: E402
from server.kernels import nvrtc  # noqa: E402
from server.kernels.turbo import store_cuda  # noqa: E402
from server.kernels.turbo.store import TurboKVStore  # noqa: E402

PAGE, HEADS, TOKENS = 16, 8, 32768
MATH_START = "    /* y = D2 H D1 x (times sqrt(G))"
MATH_END = "    if (slot >= 0) {  /* a negative slot marks a padding token */"
NO_MATH = """    u32 out[WORDS + (BITS == 3 ? 4 : 0)];
#pragma unroll
    for (int w = 0; w < WORDS + (BITS == 3 ? 4 : 0); ++w) out[w] = f_bits(x[w]) ^ f_bits(x[127 - w]);
    const float stored = x[7];
"""


def variants() -> dict[str, tuple[str, int, store_cuda.CudaStoreLaunch]]:
    """name -> (source, sides, launch)."""
    two, one = store_cuda.CUDA_STORE_LAUNCH, store_cuda.ONE_BODY_LAUNCH
    text = store_cuda.source(3, 3, 128, HEADS, PAGE, store_cuda.OFFSET_NONE, True, two)
    one_body = store_cuda.source(3, 3, 128, HEADS, PAGE, store_cuda.OFFSET_NONE, True, one)
    a, b = text.index(MATH_START), text.index(MATH_END)
    copy = "    if (tok + 2 * i < end) copy16(dst + 2 * i * STAGE_ROW, p);"
    assert copy in text and one_body != text
    return {"two bodies": (text, 2, two), "K only": (text, 1, two), "one body": (one_body, 2, one),
            "memory only": (text[:a] + NO_MATH + text[b:], 2, two), "compute only": (text.replace(copy, ""), 2, two)}


def main() -> None:
    device = require_gpu()
    copy_gbs = copy_bandwidth_gbs(device)
    k = torch.randn(TOKENS, HEADS, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    positions = torch.arange(TOKENS, device=device)
    num_pages = 2 * TOKENS // PAGE
    slots = engine_slots(TOKENS, num_pages, PAGE, device, torch.Generator().manual_seed(1))
    store = TurboKVStore(num_pages, PAGE, HEADS, 128, "turbo3", "turbo3", device, torch.bfloat16)
    moved = 2 * k.numel() * 2 + TOKENS * TurboKVStore.bytes_per_token(HEADS, 128, "turbo3", "turbo3")
    print(f"device copy bandwidth {copy_gbs:.0f} GB/s; turbo3 K+V plain, {moved / 1e6:.0f} MB moved at full size")
    for name, (src, sides, launch) in variants().items():
        try:
            kernel = nvrtc.cuda_kernel(src, store_cuda.KERNEL_NAME, device)
            if kernel is None:
                raise RuntimeError("NVRTC refused the source (see the log above)")
            ms = time_ms(lambda _: store_cuda.launch_store(kernel, k, v, slots, positions, store.k, store.v, None,
                                                           launch, sides), device=device)
            share = moved * sides / 2 / (ms * 1e-3) / 1e9 / copy_gbs
            print(f"probe {name}: {ms:.4f} ms ({share:.0%} of copy for its bytes)", flush=True)
        except Exception as error:  # one broken variant must not hide the others
            print(f"probe {name}: FAILED {type(error).__name__}: {error}", flush=True)


if __name__ == "__main__":
    main()
