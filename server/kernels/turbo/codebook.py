"""Lloyd-Max codebooks for the sphere marginal (specs/turboquant.md, "Codebook").

After a random rotation, each coordinate t of a unit vector in R^G has the density
f(t) ∝ (1 - t^2)^((G-3)/2) on [-1, 1]. The b-bit codebook is the Lloyd-Max optimum for
that density: every centroid is the mean of f over its cell, and the cells are split at
the midpoints between neighbouring centroids. f is even, so the codebook is symmetric
(c_i = -c_(2^b-1-i)) and the middle midpoint is exactly 0.

Solved once per (bits, group) in float64: cumulative integrals of f and t·f on a fine grid
(trapezoid rule) turn each Lloyd step into a few interpolations; the iteration runs until
the centroids stop moving. Deterministic, no randomness, cached.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

_GRID_INTERVALS = 1 << 17  # on [0, 1]; trapezoid error ~1e-10 relative, far below fp32
_TOLERANCE = 1e-13
_MAX_ITERATIONS = 100_000


@dataclass(frozen=True)
class Codebook:
    bits: int
    group: int
    centroids: tuple[float, ...]  # float64, ascending, 2^bits values

    @property
    def midpoints(self) -> tuple[float, ...]:
        c = self.centroids
        return tuple((a + b) / 2 for a, b in zip(c[:-1], c[1:]))

    def centroids_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 centroids: the values every decoder (reference and kernels) uses."""
        return torch.tensor(self.centroids, dtype=torch.float32, device=device)

    @property
    def odd_polynomial(self) -> tuple[float, ...]:
        """a_0 .. a_(h-1) with c_i = t * sum_k a_k t^(2k), t = 2i / (2^bits - 1) - 1, h = 2^(bits-1).

        The codebook is odd around its middle, so h coefficients interpolate all 2^bits
        centroids. Kernels evaluate it (one int-to-float, h + 2 multiply-adds) instead of a
        chain of 2^bits selects; in float32 it reproduces the centroids to ~1e-7 relative.
        """
        half = len(self.centroids) // 2
        scale = (len(self.centroids) - 1) / 2
        t = torch.tensor([(i - scale) / scale for i in range(half, 2 * half)], dtype=torch.float64)
        powers = torch.stack([t ** (2 * k + 1) for k in range(half)], dim=1)
        return tuple(torch.linalg.solve(powers, torch.tensor(self.centroids[half:], dtype=torch.float64)).tolist())

    def odd_polynomial_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(self.odd_polynomial, dtype=torch.float32, device=device)

    def midpoints_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 decision boundaries: an index is the number of midpoints <= the value."""
        return torch.tensor(self.midpoints, dtype=torch.float32, device=device)


class _HalfDensity:
    """Cumulative mass and first moment of f(t) = (1 - t^2)^((G-3)/2) on [0, 1]."""

    def __init__(self, group: int):
        t = torch.linspace(0.0, 1.0, _GRID_INTERVALS + 1, dtype=torch.float64)
        f = (1.0 - t * t).clamp_min(0.0) ** ((group - 3) / 2)
        self.t = t.tolist()
        self.mass = _cumulative_trapezoid(f, t).tolist()
        self.moment = _cumulative_trapezoid(f * t, t).tolist()

    def at(self, x: float) -> tuple[float, float]:
        """(∫_0^x f, ∫_0^x t·f), linear between grid points."""
        i = min(bisect.bisect_right(self.t, x) - 1, _GRID_INTERVALS - 1)
        w = (x - self.t[i]) / (self.t[i + 1] - self.t[i])
        return (
            self.mass[i] + w * (self.mass[i + 1] - self.mass[i]),
            self.moment[i] + w * (self.moment[i + 1] - self.moment[i]),
        )


def _cumulative_trapezoid(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    steps = (y[1:] + y[:-1]) * (x[1:] - x[:-1]) / 2
    return torch.cat([torch.zeros(1, dtype=y.dtype), torch.cumsum(steps, 0)])


@functools.cache
def codebook(bits: int, group: int) -> Codebook:
    """The Lloyd-Max codebook for ``bits`` bits and rotation group ``group``."""
    if bits not in (1, 2, 3, 4) or group < 4:
        raise ValueError(f"codebooks exist for bits 1-4 and group >= 4, got bits={bits}, group={group}")
    density = _HalfDensity(group)
    half = 1 << (bits - 1)
    # Start from equally spaced points over +-3 standard deviations (std of a coordinate is 1/sqrt(G)).
    positive = [(i + 0.5) * 3.0 / (half * group**0.5) for i in range(half)]
    for _ in range(_MAX_ITERATIONS):
        edges = [0.0] + [(a + b) / 2 for a, b in zip(positive[:-1], positive[1:])] + [1.0]
        cumulative = [density.at(e) for e in edges]
        updated = [
            (m1 - m0) / (f1 - f0) for (f0, m0), (f1, m1) in zip(cumulative[:-1], cumulative[1:])
        ]
        moved = max(abs(a - b) for a, b in zip(updated, positive))
        positive = updated
        if moved < _TOLERANCE:
            break
    else:
        raise RuntimeError(f"Lloyd-Max iteration did not converge for bits={bits}, group={group}")
    return Codebook(bits, group, tuple([-c for c in reversed(positive)] + positive))
