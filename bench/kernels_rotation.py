"""The rotation kernel against the device copy (`python bench/kernels.py rotation`; also part of `turbo`).

rotation.rotate's GPU body (rotate_triton: butterflies in registers, bit for bit the reference) on bf16 at a few
tile sizes. Bytes: the tensor read once and written once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bench.harness import Row, time_ms
from server.kernels.rotation import rotate_reference, rotate_triton

ROWS = 1 << 19  # of 128 values: 64M values, 128 MiB in bf16
VALUES_PER_PROGRAM = (4096, 2048, 1024)  # the first: the default


def check(device: torch.device, verdict: Callable[[str, bool, str], None]) -> None:
    """The Triton body bit for bit against the reference, fp32 and bf16 inputs."""
    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0)).to(device)
    for group in (64, 128):
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            diff = (rotate_triton(xd, group).float() - rotate_reference(xd, group).to(dtype).float()).abs().max()
            verdict(f"rotation G={group} {dtype}", diff.item() == 0.0,
                    f"max |triton - reference| = {diff.item():.3g} (want bit-identical)")


def rows(device: torch.device) -> list[Row]:
    out = []
    x = torch.randn(ROWS, 128, device=device, dtype=torch.bfloat16)
    copy_dst = torch.empty_like(x)
    copy_ms = time_ms(lambda _: copy_dst.copy_(x), device=device)
    moved = 2 * x.numel() * 2
    for group in (64, 128):
        name = f"rotation bf16 G={group}, {x.numel() >> 20}M values"
        for per_program in VALUES_PER_PROGRAM:
            ms = time_ms(lambda _: rotate_triton(x, group, elements_per_program=per_program), device=device)
            out.append(Row(name, ms, copy_ms, moved, "copy of the same tensor", f"{per_program} values per program"))
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
