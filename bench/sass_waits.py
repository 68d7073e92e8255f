"""Where a kernel's main loop waits for its loads, from the sm_90 control bits: no GPU needed.

`python bench/sass_waits.py MODULE:ATTR FUNCTION` builds a CUDA C source (as bench/cuda_sass.py: local NVRTC,
Triton's ptxas) and lists, for the innermost loop holding eight or more MMAs, each global load with the
dependency barrier it sets and each instruction that waits on a barrier a load of the loop set earlier in the
same pass. Some of those are the waits a step means (its own data); the ones to look at wait right after the
load they cover, or for a load the step does not read. `loop_waits(cubin)` does the same for any cubin (a Triton
kernel's `kernel.asm["cubin"]`).

Why: every variable-latency instruction sets one of six barriers, and a wait covers everything in flight on that
barrier. ptxas may put the wait for a value loaded before a loop at its first use inside the loop, after the loop
has issued its next tile's loads on the same barrier: the step then waits for the tile it just began to prefetch.
ncu names the stalled instruction; these bits say which loads it waits for. Found so: the turbo decode's partial
key offset (docs/BENCHMARKS.md, 2026-11-30 "the key offset's frequencies waited for before the main loop").

The bits (sm_70 and later): in the second 64-bit word of an instruction, from bit 41 on, 4 bits stall cycles,
1 yield, 3 write barrier, 3 read barrier, 6 wait mask (barrier 7 means none).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sass import TOOLS  # noqa: E402

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);\s+/\* (0x[0-9a-f]+) \*/")
_WORD = re.compile(r"/\* (0x[0-9a-f]+) \*/")
_BRANCH = re.compile(r"(@!?U?P\w+\s+)?BRA\s+.*?(0x[0-9a-f]+)")


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str
    write_barrier: int  # 7: none
    wait_mask: int

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words[0].startswith("@") else words[0]


def instructions(cubin: bytes, function: str | None = None) -> list[Instruction]:
    """The SASS of ``function`` (the cubin's only one when None) with each instruction's barrier bits."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
    if function is not None:
        sass = sass.split(f"Function : {function}\n", 1)[1].split("Function : ", 1)[0]
    lines, out = sass.splitlines(), []
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        if m:
            control = int(_WORD.search(lines[i + 1]).group(1), 16) >> 41
            out.append(Instruction(int(m.group(1), 16), m.group(2).strip(), (control >> 5) & 7, (control >> 11) & 63))
    return out


def main_loop(code: list[Instruction]) -> list[Instruction]:
    """The shortest loop (backward branch to its target) that holds eight or more MMA instructions."""
    best = None
    for ins in code:
        m = _BRANCH.match(ins.text)
        if m and int(m.group(2), 16) < ins.address:
            start = int(m.group(2), 16)
            body = [x for x in code if start <= x.address <= ins.address]
            if sum("MMA" in x.text for x in body) >= 8 and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        raise SystemExit("no loop with eight or more MMAs")
    return best


def loop_waits(cubin: bytes, function: str | None = None) -> list[str]:
    """Lines for the main loop: its loads with their barriers, and each wait on a barrier that a load earlier in
    the same pass set (flagged: the wait also covers that load)."""
    body = main_loop(instructions(cubin, function))
    lines, pending = [f"main loop: {len(body)} instructions"], {}
    for k, ins in enumerate(body):
        waited = [b for b in range(6) if ins.wait_mask >> b & 1]
        late = [f"{b} (load at {pending[b]})" for b in waited if b in pending]
        for b in waited:
            pending.pop(b, None)
        if ins.opcode.startswith("LDG") and ins.opcode != "LDGDEPBAR" and ins.write_barrier != 7:
            pending[ins.write_barrier] = k
            lines.append(f"  {k:5d} sets barrier {ins.write_barrier}: {ins.text[:80]}")
        elif late:
            lines.append(f"  {k:5d} WAITS ON {', '.join(late)}: {ins.text[:80]}")
    return lines


if __name__ == "__main__":
    from bench.cuda_sass import nvrtc_ptx, sm90_cubin

    module, attr = sys.argv[1].split(":")
    cubin, _ = sm90_cubin(nvrtc_ptx(getattr(importlib.import_module(module), attr)))
    print("\n".join(loop_waits(cubin, sys.argv[2])))
