"""SASS instruction count of the turbo decode kernel's main loop, compiled for sm_90 on any machine.

`python bench/turbo_sass.py [--bits-k 3 --bits-v 3] [BLOCK/WARPS[/MAX_REGISTERS] ...]` prints, per launch
setting, the instructions between the loop's backward branch and its target (one step of BLOCK tokens),
per stored K/V value, the registers and shared memory, and the barrier / shared-memory / shuffle / mma
instructions of a step.
A proxy for the kernel being instruction-bound (docs/BENCHMARKS.md), not a speed measurement.
Pointers and integer arguments carry the 16-byte divisibility a real launch has; without it the
compiler reports unvectorized loads the launch does not have.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target even on a CPU box
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from server.kernels.turbo import attention  # noqa: E402

POINTER_TYPES = {"q_ptr": "*bf16", "q_start_ptr": "*i32", "seq_lens_ptr": "*i32", "tables_ptr": "*i32",
                 "k_codes": "*u8", "k_norms": "*fp16", "k_poly": "*fp32", "k_table": "*i32", "v_codes": "*u8",
                 "v_norms": "*fp16", "v_poly": "*fp32", "v_table": "*i32",
                 "first_ptr": "*i32", "second_ptr": "*i32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32",
                 "part_l_ptr": "*fp32"}
FLOAT_ARGS = ("inv_sqrt", "qk_scale")
ADDRESS = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);")


def decode_sass(bits_k: int, bits_v: int, block: int, warps: int, head_dim: int = 128, gqa: int = 4,
                max_registers: int | None = None) -> tuple[str, str]:
    """(SASS, cuobjdump's resource usage line) of the decode kernel compiled for sm_90."""
    fn = attention._decode_kernel
    group = 128 if head_dim % 128 == 0 else 64
    constants = dict(H_KV=8, GQA=gqa, GQA_PAD=max(16, triton.next_power_of_2(gqa)), PAGE_SIZE=16, D=head_dim,
                     G=group, LOG2_G=group.bit_length() - 1, K_BITS=bits_k, V_BITS=bits_v, BLOCK=block, F16=True,
                     ASM=True)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", constants[name]
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = POINTER_TYPES.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, **({} if max_registers is None else {"maxnreg": max_registers})))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return tuple(subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True, check=True).stdout
                     for flag in ("-sass", "-res-usage"))


def main_loop(sass: str) -> list[str]:
    """Instructions of the widest backward branch's loop (the token loop)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(ADDRESS.match, sass.splitlines()) if m]
    loops = []
    for address, text in code:
        target = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    if not loops:
        raise SystemExit("no loop found in the SASS")
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return [text for address, text in code if start <= address <= end]


def summary(bits_k: int, bits_v: int, block: int, warps: int, max_registers: int | None = None) -> str:
    """One line: main-loop instructions per stored value, registers, the ops that sync or go through shared memory."""
    sass, usage = decode_sass(bits_k, bits_v, block, warps, max_registers=max_registers)
    loop = main_loop(sass)
    values_per_thread = block * 128 * 2 / (32 * warps)  # K and V of a 128-wide head
    opcodes = collections.Counter(text.split()[1 if text.startswith("@") else 0].split(".")[0] for text in loop)
    regs, shared = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "SHARED"))
    syncs = ", ".join(f"{op} {opcodes[op]}" for op in ("BAR", "STS", "LDS", "STSM", "LDSM", "SHFL", "HGMMA", "HMMA"))
    return (f"K{bits_k}/V{bits_v} {block} tokens, {warps} warps"
            + ("" if max_registers is None else f", <= {max_registers} registers")
            + f": {len(loop)} instructions per step, {len(loop) / values_per_thread:.2f} per stored value, "
            f"{regs} registers, {shared} B shared; per step: {syncs}; top: "
            + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(6)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits-k", type=int, default=3)
    parser.add_argument("--bits-v", type=int, default=3)
    parser.add_argument("configs", nargs="*", default=[f"{attention.BLOCK_N}/{attention.NUM_WARPS}"],
                        help="BLOCK/WARPS[/MAX_REGISTERS], e.g. 64/4 128/8 64/4/128")
    args = parser.parse_args()
    for config in args.configs:
        block, warps, *cap = map(int, config.split("/"))
        print(summary(args.bits_k, args.bits_v, block, warps, *cap), flush=True)


if __name__ == "__main__":
    main()
