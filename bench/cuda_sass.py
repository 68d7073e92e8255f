"""Offline sm_90 build of a CUDA C kernel, no GPU needed: `python bench/cuda_sass.py FILE.cu|MODULE:ATTR NAME`.

The serving path compiles CUDA C with NVRTC on the GPU host (server/kernels/nvrtc.py). Here the same
source goes through a local NVRTC (the `nvidia-cuda-nvrtc` wheel's libnvrtc.so, found through
NVRTC_LIB or the wheel's package) to PTX, then Triton's bundled ptxas to an sm_90 cubin, so compile
errors, registers, spills and instruction counts show before any device time is spent. The source is
a .cu file or a module attribute holding the source string (e.g.
server.kernels.turbo.attention_cuda:SOURCE).
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sass import TOOLS, cubin_counts  # noqa: E402


def _libnvrtc() -> ctypes.CDLL:
    """libnvrtc of CUDA 12.8, whose PTX the bundled ptxas (12.8) reads; its builtins library loaded first, so
    that NVRTC's own dlopen of it finds it without LD_LIBRARY_PATH."""
    path = os.environ.get("NVRTC_LIB")
    if not path:
        found = [p for site in sys.path for p in glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*"))]
        if not found:
            raise SystemExit("no libnvrtc: `pip install --target DIR nvidia-cuda-nvrtc-cu12==12.8.*` and set NVRTC_LIB "
                             "to DIR/nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
        path = found[0]
    for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(path)


def nvrtc_ptx(source: str, arch: str = "compute_90", options: tuple[str, ...] = ()) -> str:
    """PTX of ``source``; raises with NVRTC's log when it refuses the source."""
    lib, prog = _libnvrtc(), ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    flags = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
    status = lib.nvrtcCompileProgram(prog, len(flags), (ctypes.c_char_p * len(flags))(*flags))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status:
        raise RuntimeError(f"NVRTC refused the source:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def sm90_cubin(ptx: str) -> tuple[bytes, str]:
    """(cubin, ptxas -v report) for sm_90."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        run = subprocess.run([TOOLS / "ptxas", "-arch=sm_90", "-v", "-o", out, src], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"ptxas refused the PTX:\n{run.stderr}")
        return out.read_bytes(), run.stderr


def _source(spec: str) -> str:
    if spec.endswith(".cu"):
        return Path(spec).read_text()
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


if __name__ == "__main__":
    spec, name = sys.argv[1], sys.argv[2]
    cubin, report = sm90_cubin(nvrtc_ptx(_source(spec)))
    ops, resources = cubin_counts(cubin)
    print(report.strip())
    print(f"{name}: {resources}, {sum(ops.values())} instructions")
    for op, n in ops.most_common(30):
        print(f"  {op:24s} {n}")
