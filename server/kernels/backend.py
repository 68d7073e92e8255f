"""Which body of a kernel runs: the Triton fast path or the torch reference.

The fast path runs on CUDA/ROCm tensors when Triton imports; everything else (CPU, a
platform without Triton, TURBOSERVE_REFERENCE_KERNELS=1) takes the reference, which
defines the op. Tests call the Triton launchers directly under TRITON_INTERPRET=1.
A few hot paths also have a CUDA C body (nvrtc.py) that NVIDIA GPUs run in place of the Triton one.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from server.kernels import nvrtc

log = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """True when the fast body should handle tensors living where ``t`` lives."""
    return t.is_cuda and triton_available() and os.environ.get("TURBOSERVE_REFERENCE_KERNELS") != "1"


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's SM (CU) count, which launchers size their grids by; 4 elsewhere (the CPU interpreter, where a
    few programs keep the tests' loops running more than once)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively, in AMX tiles or by AVX512-BF16 dot products: there bf16
    GEMMs run 4-5x faster than float32 (2048 x 576 x 3072 on the 2-core CI machines: 3.2 ms against 17.7 with
    AMX, 8.8 against 44.4 on a Zen 4 with AVX512-BF16) and a GEMV streams half the bytes. Elsewhere bf16 is
    emulated and can be slower than float32."""
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe is not None and probe() for probe in probes)  # private, hence looked up; torch >= 2.3


def inline_ptx(device: torch.device) -> bool:
    """Whether Triton kernels for ``device`` may use NVIDIA inline assembly (PRMT, LOP3, MUFU sin/cos):
    CUDA builds of torch only (not ROCm), and not in the CPU interpreter, which cannot run PTX."""
    return device.type == "cuda" and torch.version.cuda is not None and os.environ.get("TRITON_INTERPRET") != "1"


def describe(device: torch.device) -> str:
    """One line for the start-up log: which kernel bodies this device will run."""
    if device.type != "cuda":
        return f"reference torch kernels on {device.type}"
    if not triton_available():
        return "reference torch kernels (Triton is not installed)"
    if os.environ.get("TURBOSERVE_REFERENCE_KERNELS") == "1":
        return "reference torch kernels (TURBOSERVE_REFERENCE_KERNELS=1)"
    if nvrtc.cuda_kernels_enabled(device):
        return "Triton fast kernels, CUDA C through NVRTC where Triton cannot reach (server/kernels/nvrtc.py)"
    return "Triton fast kernels"
