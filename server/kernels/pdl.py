"""Programmatic dependent launch (PDL, sm_90+): a decode step's kernels start before the previous one ends.

Inside a decode CUDA graph every launch pays a ramp (the grid is scheduled, the first loads are in flight)
and a tail (the last programs drain) during which the memory system idles; with hundreds of launches a step
that adds up (issue 2). A kernel launched with PDL is scheduled as soon as every program of the kernel
before it has called ``gdc_launch_dependents``; it may then do work that depends on no earlier kernel
(stream its first weight tile) and must call ``gdc_wait`` before it reads anything an earlier kernel
wrote or writes anything at all. ``gdc_wait`` returns once the previous kernel has completed and its
writes are visible; since that kernel waited on its own predecessor the same way, stream order holds.

Kernels opt in with a ``USE_PDL`` constexpr (off in the CPU interpreter, which cannot run the PTX) and
launch with ``**launch_options(device)``. TURBOSERVE_PDL=0 turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _AVAILABLE = True
except ImportError:  # kernels still import these names; USE_PDL stays False, so they are never traced

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

    _AVAILABLE = False


@functools.cache
def _supported(device_index: int) -> bool:
    if not _AVAILABLE or os.environ.get("TURBOSERVE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    # NVIDIA only: a ROCm build's 'cuda' devices are AMD GPUs, whose capability reads 9.x too (MI200, MI300), and
    # gdc_wait is NVIDIA inline assembly
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index) >= (9, 0)


def launch_options(device: torch.device) -> dict:
    """Keyword arguments of a Triton launch: ``USE_PDL`` for the kernel and, when on, ``launch_pdl``."""
    if device.type == "cuda" and _supported(device.index if device.index is not None else torch.cuda.current_device()):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
