"""The rotation kernel against the device copy (`python bench/kernels.py rotation`; also part of `turbo`).

Both GPU bodies of rotation.rotate on bf16: the tensor-core product with the ±1 matrix (rotate_mma, what
rotate() runs for fp16/bf16) at a few launch settings, and the butterflies (rotate_triton, bit for bit the
reference, what the fused kernels inline). Bytes: the tensor read once and written once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.harness import Row, time_ms
from server.kernels.rotation import rotate_mma, rotate_reference, rotate_triton

ROWS = 1 << 19  # of 128 values: 64M values, 128 MiB in bf16
MMA_LAUNCHES = ((64, 4, 4), (128, 2, 4), (128, 2, 8), (64, 8, 4), (32, 8, 2), (64, 2, 4))  # the first: the default


def check(device: torch.device, verdict: Callable[[str, bool, str], None]) -> None:
    """The butterflies bit for bit against the reference (fp32), the tensor cores within summation order (bf16)."""
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0)).to(device)
    for group in (64, 128):
        diff = (rotate_triton(x, group) - rotate_reference(x, group)).abs().max().item()
        verdict(f"rotation G={group} fp32", diff == 0.0, f"max |triton - reference| = {diff:.3g} (want bit-identical)")
        xb = x.bfloat16()
        mismatch = (rotate_mma(xb, group) != rotate_reference(xb, group).bfloat16()).float().mean().item()
        verdict(f"rotation G={group} bf16 tensor cores", mismatch < 0.01,
                f"{mismatch:.2e} of outputs differ from the reference by float32 summation order (want < 1e-2)")


def rows(device: torch.device) -> list[Row]:
    out = []
    x = torch.randn(ROWS, 128, device=device, dtype=torch.bfloat16)
    copy_dst = torch.empty_like(x)
    copy_ms = time_ms(lambda _: copy_dst.copy_(x), device=device)
    moved = 2 * x.numel() * 2
    for group in (64, 128):
        name = f"rotation bf16 G={group}, {x.numel() >> 20}M values"
        for rows_per_program, programs_per_sm, warps in MMA_LAUNCHES:
            ms = time_ms(lambda _: rotate_mma(x, group, rows_per_program=rows_per_program,
                                              programs_per_sm=programs_per_sm, num_warps=warps), device=device)
            out.append(Row(name, ms, copy_ms, moved, "copy of the same tensor",
                           f"tensor cores (rotate_mma): {rows_per_program} rows a tile, {programs_per_sm} programs "
                           f"per SM, {warps} warps"))
        ms = time_ms(lambda _: rotate_triton(x, group), device=device)
        out.append(Row(name, ms, copy_ms, moved, "copy of the same tensor",
                       "butterflies (rotate_triton, bit for bit the reference), 4096 values per program"))
    return out


def run(device: torch.device, copy_gbs: float) -> tuple[str, list[Row]]:
    failures = []

    def verdict(name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            failures.append(name)

    check(device, verdict)
    status = "all GPU correctness checks passed" if not failures else f"GPU correctness FAILED: {', '.join(failures)}"
    return f"Rotation kernel ({status})", rows(device)
