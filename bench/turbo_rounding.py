"""What the turbo decode's roundings cost, on the CPU: `python bench/turbo_rounding.py` (prints; no GPU).

Per kind and group: (1) the int8 centroids of the int8-key build (attention_cuda.int8_centroids) against the
plain rounding at +-127, as summed squared errors over the codebook; (2) the int8-key build's logit error against
turbo's own (the turbo logits against the unquantized keys), rms over 4096 keys N(0.5, 4) per dim and 32 Gaussian
queries, the setup of tests/kernels/turbo/test_attention_cuda.py's rounding-analysis test; (3) E[cos theta]
between a vector and its length-keeping reconstruction (spec "Norm correction"), over 20,000 Gaussian vectors:
every decoded vector points E[cos theta] of the way along the true one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.kernels.rotation import rotate
from server.kernels.turbo.attention_cuda import int8_centroids
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.format import (
    dequantize_rotated,
    quantize_reference,
    unpack_indices,
)

KINDS = {"turbo2": 2, "turbo3": 3, "turbo4": 4}


def centroid_fit(bits: int, group: int) -> tuple[float, float]:
    """(squared error of int8_centroids, of the plain rounding with the largest |centroid| at 127)."""
    c = torch.tensor(codebook(bits, group).centroids, dtype=torch.float64)
    n, unit = int8_centroids(bits, group)
    plain = c.abs().max() / 127
    return ((torch.tensor(n, dtype=torch.float64) * unit - c).pow(2).sum().item(),
            (torch.round(c / plain) * plain - c).pow(2).sum().item())


def logit_errors(kind: str, group: int) -> tuple[float, float]:
    """(rms logit error of the int8-key build vs the exact centroids, rms of turbo's own vs unquantized keys)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(4096, group, generator=gen, dtype=torch.float64) * 2 + 0.5
    q = torch.randn(32, group, generator=gen, dtype=torch.float64)
    bits = KINDS[kind]
    codes, norms = quantize_reference(keys.float(), kind)
    idx, n = unpack_indices(codes, bits, group).long(), norms.double()[:, 0]
    c8, unit = int8_centroids(bits, group)
    c8 = torch.tensor(c8, dtype=torch.float64) * unit
    c = torch.tensor(codebook(bits, group).centroids, dtype=torch.float64)
    rotated = rotate(q, group)
    step = rotated.abs().amax(-1, keepdim=True) / 127
    exact = rotated @ (c[idx] * n[:, None]).T
    int8 = (torch.round(rotated / step) * step) @ (c8[idx] * n[:, None]).T
    rms = lambda x: x.pow(2).mean().sqrt().item()
    return rms(int8 - exact), rms(q @ keys.T - exact)


def mean_cos(kind: str, group: int) -> float:
    x = torch.randn(20000, 1, group, generator=torch.Generator().manual_seed(0))
    codes, norms = quantize_reference(x, kind)
    r, y = dequantize_rotated(codes, norms, kind, group), rotate(x, group)
    return ((r * y).sum(-1) / (r.norm(dim=-1) * y.norm(dim=-1))).mean().item()


def main() -> int:
    print("| kind | G | int8 centroids sq. error (plain at 127) | int8-key logit rms | turbo logit rms | turbo / int8 "
          "| E[cos theta] |\n|---|---:|---:|---:|---:|---:|---:|")
    for kind, bits in KINDS.items():
        for group in (64, 128):
            fit, plain = centroid_fit(bits, group)
            int8, turbo = logit_errors(kind, group)
            print(f"| {kind} | {group} | {fit:.3g} ({plain:.3g}, {plain / fit:.1f}x) | {int8:.4g} | {turbo:.4g} "
                  f"| {turbo / int8:.1f} | {mean_cos(kind, group):.5f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
