"""SASS instruction counts of the turbo store kernels' loops, compiled for sm_90 on any machine.

`python bench/turbo_store_sass.py` prints, for turbo3 and turbo4 K/V (head_dim 128, 8 KV heads):
  * the Triton kernel (key offset turned) at a few tile settings: registers, and the instructions of the
    wider tile loop (K or V) per stored value with its most common opcodes;
  * the CUDA C kernel (store_cuda.py; needs a local NVRTC, see bench/cuda_sass.py) without and with a
    fixed key offset, built with one copy of the body for K and V (CudaStoreLaunch.one_body, so that one loop is
    counted): registers, spills, and the item loop's instructions per stored value (one thread stores
    128 values per item). The partial offset adds a loop over the pairs (not counted here).
A proxy for issue-bound work, not a speed measurement (bench/turbo_store_sweep.py times the kernels on
the GPU).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile real kernels, not interpreted ones
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sass import TOOLS, compile_sm90, sass_counts  # noqa: E402
from bench.turbo_sass import main_loop  # noqa: E402
from server.kernels.turbo import quantize  # noqa: E402

TYPES = {"k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64", "k_codes": "*u8", "v_codes": "*u8",
         "k_norms": "*fp16", "v_norms": "*fp16", "k_mid": "*fp32", "v_mid": "*fp32", "k_cent": "*fp32",
         "v_cent": "*fp32", "pos_ptr": "*i64", "k_const": "*fp32", "k_mean": "*fp32", "k_sink": "*fp32", "inv_freq": "*fp32",
         "first_ptr": "*i32", "second_ptr": "*i32", "inv_sqrt": "fp32", "recent_k_ptr": "*bf16",
         "recent_v_ptr": "*bf16", "recent_rows_ptr": "*i32"}
SETTINGS = [(16, 4), (32, 4), (64, 8)]  # (rows per tile, warps)


def compile_store(bits: int, rows: int, warps: int, recent: bool = False, pdl: bool = False):
    """The store kernel compiled for sm_90 (turbo ``bits`` K and V, turned key offset; ``recent``: with the recent
    window's ring, RECENT; ``pdl``: as a programmatic dependent launch, USE_PDL)."""
    constants = {"H": 8, "PAGE_SIZE": 16, "ROWS": rows, "D": 128, "G": 128, "LOG2_G": 7, "K_BITS": bits,
                 "V_BITS": bits, "K_OFFSET": "turned", "STAGES": 1, "ASM": True,
                 "RECENT": recent, "USE_PDL": pdl}
    fn = quantize._store_kernel
    signature, constexprs = {}, {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", constants[name]
        else:
            signature[name] = TYPES.get(name, "i32")
    strides = frozenset(name for name in signature if "stride" in name)  # multiples of 16 in a real launch
    return compile_sm90(fn, signature, constexprs, warps, strides)


def store_loop(bits: int, rows: int, warps: int) -> tuple[list[str], dict]:
    kernel = compile_store(bits, rows, warps)
    _, resources = sass_counts(kernel)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", cubin.name], capture_output=True, text=True, check=True)
    return main_loop(sass.stdout), resources


def cuda_lines() -> list[str]:
    from bench.cuda_sass import nvrtc_ptx, sm90_cubin
    from server.kernels.turbo import store_cuda

    lines = []
    for bits in (3, 4):
        for offset, name in ((store_cuda.OFFSET_NONE, "plain"), (store_cuda.OFFSET_FIXED, "fixed offset")):
            # one copy of the body (ONE_BODY): with two, the compiler interleaves K's and V's loops
            launch = store_cuda.CudaStoreLaunch(one_body=True)
            cubin, report = sm90_cubin(nvrtc_ptx(store_cuda.source(bits, bits, 128, 8, 16, offset, launch=launch)))
            spills = re.search(r"(\d+) bytes spill stores", report).group(1)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([TOOLS / "cuobjdump", "-sass", f.name], capture_output=True, text=True,
                                      check=True)
                usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                                       check=True)
            loop = main_loop(sass.stdout)
            regs = re.search(r"REG:(\d+)", usage.stdout).group(1)
            opcodes = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in loop)
            lines.append(f"CUDA C turbo{bits}, {name}: {regs} registers, {spills} bytes spilled, item loop {len(loop)} "
                         f"instructions = {len(loop) / 128:.1f} per value; "
                         + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(10)))
    return lines


def main() -> None:
    try:
        print("\n".join(cuda_lines()))
    except (SystemExit, OSError, RuntimeError) as error:  # no local NVRTC: the Triton counts still print
        print(f"CUDA C kernel not built: {error}")
    for bits in (3, 4):
        for rows, warps in SETTINGS:
            loop, resources = store_loop(bits, rows, warps)
            per_thread = rows * 128 / (32 * warps)
            opcodes = collections.Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for t in loop)
            print(f"turbo{bits}, {rows} rows / {warps} warps: {resources['REG']} registers, tile loop "
                  f"{len(loop)} instructions = {len(loop) / per_thread:.1f} per value; "
                  + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(10)))


if __name__ == "__main__":
    main()
