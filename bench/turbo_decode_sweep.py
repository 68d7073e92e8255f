"""Quick GPU sweep of the turbo decode kernel: `python bench/turbo_decode_sweep.py`.

Correctness first (kernels_turbo.check_correctness: rotation, store, and the fused decode against
decode-then-attend at real sizes in bf16), then our decode against bf16 SDPA at the shapes the
targets name (batch 8 at 64K and 16K, batch 1 at 64K) for each launch setting of
kernels_turbo.SWEEP and programs per SM (the split count follows from it). Prints only: the recorded table comes from
`python bench/kernels.py turbo`, run with the settings this sweep picks.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import kernels_turbo  # noqa: E402
from bench.harness import require_gpu  # noqa: E402
from server.kernels.turbo import attention  # noqa: E402

PROGRAMS_PER_SM = (4, 8, 16)
SHAPES = ((8, 65536), (8, 16384), (1, 65536))  # (batch, context)


def main() -> int:
    device = require_gpu()
    failures = kernels_turbo.check_correctness(device)
    for batch, ctx in SHAPES:
        sdpa = kernels_turbo._sdpa_ms(batch, ctx, device)
        for kind in ("turbo3", "turbo4"):
            for programs in PROGRAMS_PER_SM:
                attention.PROGRAMS_PER_SM = programs
                for row in kernels_turbo._decode_case(batch, ctx, kind, device, kernels_turbo.SWEEP):
                    print(f"{row.case}, {row.note}, {programs} programs/SM: {row.ours_ms:.4f} ms vs SDPA "
                          f"{sdpa:.4f} ms = {sdpa / row.ours_ms:.2f}x", flush=True)
    print("all GPU correctness checks passed" if not failures else f"GPU correctness FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
