"""CUDA C kernels compiled at run time by NVRTC, for the few hot paths Triton cannot reach.

Triton decides where a decoded value lives; a kernel that must decode straight into the register
layout of an `mma.sync` operand (no round trip through shared memory) or look codes up in a
shared-memory table is written in CUDA C instead, and says why in its own docstring. NVRTC ships
with torch's CUDA runtime (`torch.cuda._compile_kernel`), so a serving host needs no nvcc and no
build step; each source compiles once per process and device capability.

Every such kernel keeps a Triton or torch path beside it: `cuda_kernel` answers None on CPUs, on
ROCm, with TURBOSERVE_CUDA_KERNELS=0, and when NVRTC is missing or refuses the source (logged once),
and the caller takes that path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
from typing import Any

import torch

log = logging.getLogger(__name__)


def cuda_kernels_enabled(device: torch.device) -> bool:
    """Whether CUDA C kernels may run for tensors on ``device``: an NVIDIA GPU, not switched off."""
    return (device.type == "cuda" and torch.version.cuda is not None
            and os.environ.get("TURBOSERVE_CUDA_KERNELS", "1") != "0"
            and os.environ.get("TURBOSERVE_REFERENCE_KERNELS") != "1"
            and hasattr(torch.cuda, "_compile_kernel"))


def cuda_kernel(source: str, name: str, device: torch.device, options: tuple[str, ...] = ()) -> Any | None:
    """The compiled ``extern "C"`` kernel ``name`` of ``source`` for ``device``, or None where CUDA C cannot run.

    The result is called as ``kernel(grid=(x, y, z), block=(x, y, z), args=[...])``; tensors pass as pointers,
    Python ints as 32-bit ints and Python floats as doubles. ``options``: extra NVRTC flags (e.g.
    "--use_fast_math").
    """
    if not cuda_kernels_enabled(device):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return _compile(source, name, f"{major}{minor}", options)


@functools.cache
def _compile(source: str, name: str, capability: str, options: tuple[str, ...]) -> Any | None:
    try:
        return Kernel(torch.cuda._compile_kernel(source, name, compute_capability=capability,
                                                 nvcc_options=list(options)))
    except Exception as error:  # NVRTC absent or the source refused: the caller's other path serves
        log.warning("CUDA C kernel %s unavailable on sm_%s (%s); using the Triton path", name, capability,
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return None


class Kernel:
    """A compiled kernel, launched with its arguments packed into one buffer. torch's own launcher makes a ctypes
    object, a reference and a cast per argument: host time that every layer of an eager step (prefill, decode
    rows beside a chunk) pays; under cProfile, over half of a turbo decode call's (40 arguments)."""

    def __init__(self, compiled: Any):
        self.func = compiled.func

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: list) -> None:
        _, params = pack_arguments(args)  # the buffer lives until the launch has copied the values
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        result = _driver().cuLaunchKernel(self.func, *grid, *block, 0, stream, params, None)
        if result != 0:
            raise RuntimeError(f"cuLaunchKernel failed: CUresult {result}")


def pack_arguments(args: list) -> tuple[ctypes.Array, ctypes.Array]:
    """(buffer, kernelParams) for cuLaunchKernel: the arguments packed with C alignment (tensors as their data
    pointers, ints as int32, floats as double), and a pointer to each."""
    kinds = "".join(_KIND.get(type(a)) or ("P" if isinstance(a, torch.Tensor) else _unsupported(a)) for a in args)
    values = [a.data_ptr() if kind == "P" else a for a, kind in zip(args, kinds)]
    buffer = ctypes.create_string_buffer(struct.pack("@" + kinds, *values))
    base = ctypes.addressof(buffer)
    return buffer, (ctypes.c_void_p * len(args))(*(base + offset for offset in _offsets(kinds)))


_KIND = {int: "i", bool: "i", float: "d"}


def _unsupported(arg: Any) -> str:
    raise TypeError(f"a CUDA C kernel takes tensors, ints and floats, got {type(arg).__name__}")


@functools.cache
def _offsets(kinds: str) -> tuple[int, ...]:
    return tuple(struct.calcsize("@" + kinds[: i + 1]) - struct.calcsize(kind) for i, kind in enumerate(kinds))


@functools.cache
def _driver() -> Any:
    return torch.cuda._utils._get_gpu_runtime_library()
