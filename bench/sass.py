"""Static sm_90 instruction counts of the rotation kernel, no GPU needed: `python bench/sass.py`.

Triton's bundled ptxas compiles for the H200 on a CPU machine; cuobjdump (bundled too) prints the
SASS. The kernel has no loops, so the static count per thread is what each thread executes:
instructions per value = count / (values per program / threads). This counts work, not time;
speed comes only from `python bench/kernels.py turbo` on the GPU.
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

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from server.kernels import rotation  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, divisible: frozenset[str] = frozenset(),
                 **options):
    """A CompiledKernel for sm_90; every pointer argument is assumed 16-byte aligned (as torch allocates),
    and the integer arguments named in ``divisible`` multiples of 16 (as a launch specializes them). ``options``:
    further launch options (num_stages, maxnreg)."""
    hints = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
             if t.startswith("*") or name in divisible}
    source = ASTSource(fn, signature, constexprs, hints)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def sass_counts(kernel) -> tuple[collections.Counter, dict]:
    """(opcode counts without NOPs, {"REG", "STACK", "SHARED", "LOCAL"}) of a compiled kernel."""
    return cubin_counts(kernel.asm["cubin"])


def cubin_counts(binary: bytes) -> tuple[collections.Counter, dict]:
    """sass_counts of a cubin's bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary)
        cubin.flush()
        sass, usage = (subprocess.run([TOOLS / "cuobjdump", flag, cubin.name], capture_output=True, text=True,
                                      check=True) for flag in ("-sass", "-res-usage"))
    ops = collections.Counter(op for op in OPCODE.findall(sass.stdout) if not op.startswith("NOP"))
    return ops, dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, RESOURCES.search(usage.stdout).groups())))


def rotation_rows(num_warps: int = 4) -> list[str]:
    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "first_ptr": "*i32", "second_ptr": "*i32", "n_rows": "i32",
                 "inv_sqrt": "fp32", "ROWS": "constexpr", "GROUP": "constexpr", "LOG2_GROUP": "constexpr"}
    lines = ["| G | values/program | regs | instr/value | SHFL/value | LDS+STS | BAR | LDG.128+STG.128 | spills |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for group in (64, 128, 256):
        for per_program in (4096, 1024):
            constexprs = {"ROWS": per_program // group, "GROUP": group, "LOG2_GROUP": group.bit_length() - 1}
            ops, res = sass_counts(compile_sm90(rotation._rotate_kernel, signature, constexprs, num_warps))
            per_thread = per_program / (32 * num_warps)

            def count(prefix: str) -> int:
                return sum(n for op, n in ops.items() if op.startswith(prefix))

            wide = ops["LDG.E.128"] + ops["STG.E.128"]
            lines.append(f"| {group} | {per_program} | {res['REG']} | {sum(ops.values()) / per_thread:.1f} | "
                         f"{count('SHFL') / per_thread:.1f} | {count('LDS') + count('STS')} | {count('BAR')} | "
                         f"{wide} | {count('LDL') + count('STL')} |")
    return lines


if __name__ == "__main__":
    print(f"rotation kernel, bf16 in/out, 4 warps, sm_90 (Triton {triton.__version__}); counts per thread")
    print("\n".join(rotation_rows()))
