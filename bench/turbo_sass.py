"""SASS instruction count of the turbo decode kernel's main loop, compiled for sm_90 on any machine.

`python bench/turbo_sass.py [--bits-k 3 --bits-v 3] [--offset] [BLOCK/WARPS[/MAX_REGISTERS] ...]` prints, per
launch setting (with --offset also for the kernel with the key offset's score term, turned on all 64 rotate-half
pairs and partial on OFFSET_PAIRS of them), the instructions between
the loop's backward branch and its target (one step of BLOCK tokens), per stored K/V value, the registers and
shared memory, the store wavefronts of the decoded K and V tiles over conflict-free (a model of the swizzled
shared tiles, see tile_store_conflicts), and the barrier / shared-memory / shuffle / mma instructions of a step.
A proxy for the kernel being instruction-bound (docs/BENCHMARKS.md), not a speed measurement.
Pointers and integer arguments carry the 16-byte divisibility a real launch has; without it the
compiler reports unvectorized loads the launch does not have.
Counts depend on the Triton version (each line names it): compile with the GPU machine's (3.6.0, not this
venv's 3.7.1), e.g. `pip download --no-deps triton==3.6.0 -d /tmp/t36 && pip install --no-deps --target
/tmp/tri36 /tmp/t36/triton-*.whl`, then `PYTHONPATH=/tmp/tri36 python bench/turbo_sass.py`. The versions
differ where it matters: the same kernel counts 443 instructions per step under 3.6.0 and 476 under 3.7.1,
and a K tile decoded straight into the mma's register operand compiled register-only under 3.7.1 but
through scalar shared-memory stores under 3.6.0 (43 % slower on the H200, docs/BENCHMARKS.md 03:13).
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
                 "first_ptr": "*i32", "second_ptr": "*i32", "const_ptr": "*fp32", "mean_ptr": "*fp32",
                 "sink_ptr": "*fp32", "inv_freq_ptr": "*fp32", "pairs_ptr": "*i32", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                 "new_k_ptr": "*bf16", "new_v_ptr": "*bf16", "new_slot_ptr": "*i64", "new_pos_ptr": "*i64",
                 "k_mid": "*fp32", "k_cent": "*fp32", "v_mid": "*fp32", "v_cent": "*fp32", "recent_k_ptr": "*bf16",
                 "recent_v_ptr": "*bf16", "recent_rows_ptr": "*i32"}
FLOAT_ARGS = ("inv_sqrt", "qk_scale")
OFFSET_PAIRS = (16, 8, 4)  # --offset's partial key offsets: turned pairs per KV head
ADDRESS = re.compile(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(.*?);")


def compile_decode(bits_k: int, bits_v: int, block: int, warps: int, head_dim: int = 128, gqa: int = 4,
                   max_registers: int | None = None, column_order: dict | None = None, offset: int | None = None,
                   store: bool = False, recent: bool = False, pdl: bool = True):
    """The decode kernel compiled for sm_90 (a CompiledKernel: .asm holds "ttgir" and "cubin"); ``offset``:
    with the key offset's score term (OFFSET) over that many turned rotate-half pairs per KV head; ``store``: with
    the fused write of the new token (STORE, its key offset turned when ``offset`` is given); ``recent``: with the
    recent window's program (RECENT); ``pdl``: as a programmatic dependent launch (USE_PDL), as the engine launches it
    on sm_90."""
    fn = attention._decode_kernel
    group = 128 if head_dim % 128 == 0 else 64
    order = attention.COLUMN_ORDER if column_order is None else column_order
    constants = dict(H_KV=8, GQA=gqa, GQA_PAD=max(16, triton.next_power_of_2(gqa)), PAGE_SIZE=16, D=head_dim,
                     G=group, LOG2_G=group.bit_length() - 1, K_BITS=bits_k, V_BITS=bits_v, BLOCK=block, F16=True,
                     ASM=True, K_ORDER=order.get((bits_k, head_dim), ()), V_ORDER=order.get((bits_v, head_dim), ()),
                     V_UNDO=attention._inverse(order.get((bits_v, head_dim), ())),
                     K_UNDO=attention._inverse(order.get((bits_k, head_dim), ())), OFFSET=offset is not None,
                     P=offset or 0, PP=max(8, triton.next_power_of_2(offset or 0)), STORE=store,
                     STORE_OFFSET="none" if offset is None else "turned", RECENT=recent,
                     USE_PDL=pdl)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", constants[name]
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = POINTER_TYPES.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=warps, **({} if max_registers is None else {"maxnreg": max_registers}))
    return triton.compile(ASTSource(fn, signature, constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def decode_sass(kernel) -> tuple[str, str]:
    """(SASS, cuobjdump's resource usage) of a compiled kernel."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return tuple(subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True, check=True).stdout
                     for flag in ("-sass", "-res-usage"))


def _bases(layout: str, key: str) -> list[tuple[int, int]]:
    found = re.search(key + r" = \[(.*?)\]\]", layout)
    return [tuple(map(int, b.split(","))) for b in re.findall(r"\[(-?\d+, ?-?\d+)\]", found.group(1) + "]")] if found else []


def _blocked_bases(layout: str, shape: tuple[int, int]) -> tuple[list, list, list]:
    """A 2-D #ttg.blocked layout as linear-layout bases (register, lane, warp) over (row, col)."""
    fields = {k: list(map(int, v.split(","))) for k, v in re.findall(r"(\w+) = \[([\d, ]+)\]", layout)}
    per_thread, per_warp, per_cta, order = (fields[k] for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA", "order"))
    bases = {"register": [], "lane": [], "warp": []}
    covered = [1, 1]
    for kind, sizes in (("register", per_thread), ("lane", per_warp), ("warp", per_cta)):
        for dim in order:
            for _ in range(sizes[dim].bit_length() - 1):
                unit = [0, 0]
                unit[dim] = covered[dim] if covered[dim] < shape[dim] else 0  # broadcast beyond the shape
                covered[dim] *= 2
                bases[kind].append(tuple(unit))
    for dim in order:  # the tile repeats over the rest of the shape in more registers
        while covered[dim] < shape[dim]:
            unit = [0, 0]
            unit[dim] = covered[dim]
            covered[dim] *= 2
            bases["register"].append(tuple(unit))
    return bases["register"], bases["lane"], bases["warp"]


def tile_store_conflicts(ttgir: str) -> list[float]:
    """Shared-memory wavefronts over the conflict-free count, per store of a 2-D fp16 register tile
    (#linear layout) into a swizzled shared tile: the decoded K and V tiles on their way to the mma.

    A model, checked against ncu on the H200 (turbo3: 2.00x here, 45 % of all shared store
    wavefronts counted as bank conflicts there): each thread stores the 16-byte vectors its
    registers hold contiguously, 8 lanes per 128-byte wavefront, one extra wavefront per extra
    distinct address on a bank.
    """
    layouts = dict(re.findall(r"^#(\w+) = (#ttg\.\w+<.*>)", ttgir, re.MULTILINE))
    ratios = []
    pattern = r"ttg\.local_alloc %\S+ : \(tensor<(\d+)x(\d+)xf16, #(\w+)>\) -> !ttg\.memdesc<\d+x\d+xf16, #(\w+)"
    for rows, cols, src, dst in re.findall(pattern, ttgir):
        rows, cols, src, dst = int(rows), int(cols), layouts[src], layouts[dst]
        swizzle = re.search(r"vec = (\d+), perPhase = (\d+), maxPhase = (\d+), order = \[(\d), (\d)\]", dst)
        if not swizzle:
            continue
        vec, per_phase, max_phase, fast_dim, _ = map(int, swizzle.groups())
        if src.startswith("#ttg.linear"):
            reg, lane, warp = (_bases(src, key) for key in ("register", "lane", "warp"))
        else:
            reg, lane, warp = _blocked_bases(src, (rows, cols))

        def coord(bits, basis, fast_dim=fast_dim):
            r = c = 0
            for i, (br, bc) in enumerate(basis):
                if bits >> i & 1:
                    r, c = r ^ br, c ^ bc
            return (r, c) if fast_dim == 1 else (c, r)  # (outer, inner) in shared memory

        inner_size = cols if fast_dim == 1 else rows
        vector = [next((i for i, b in enumerate(reg) if coord(1 << i, reg) == (0, 1 << k)), None) for k in range(3)]
        if None in vector:  # not a tile of 16-byte register vectors (the key offset's table, stored once)
            continue
        others = [i for i in range(len(reg)) if i not in vector]
        wavefronts = ideal = 0
        for w in range(1 << len(warp)):
            for o in range(1 << len(others)):
                r_bits = sum((o >> j & 1) << i for j, i in enumerate(others))
                addresses = []
                for ln in range(32):
                    (o1, i1), (o2, i2), (o3, i3) = coord(r_bits, reg), coord(ln, lane), coord(w, warp)
                    outer, inner = o1 ^ o2 ^ o3, i1 ^ i2 ^ i3
                    phase = (outer // per_phase) % max_phase
                    addresses.append(2 * (outer * inner_size + ((inner // vec) ^ phase) * vec + inner % vec))
                for q in range(0, 32, 8):
                    banks = {}
                    for a in addresses[q:q + 8]:
                        for word in range(a // 4, a // 4 + 4):
                            banks.setdefault(word % 32, set()).add(word)
                    wavefronts += max(len(v) for v in banks.values())
                    ideal += 1
        ratios.append(wavefronts / ideal)
    return ratios


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


def summary(bits_k: int, bits_v: int, block: int, warps: int, max_registers: int | None = None,
            column_order: dict | None = None, offset: int | None = None) -> str:
    """One line: main-loop instructions per stored value, registers, the ops that sync or go through
    shared memory, and the decoded tiles' store wavefronts over conflict-free (tile_store_conflicts)."""
    kernel = compile_decode(bits_k, bits_v, block, warps, max_registers=max_registers, column_order=column_order,
                            offset=offset)
    sass, usage = decode_sass(kernel)
    loop = main_loop(sass)
    values_per_thread = block * 128 * 2 / (32 * warps)  # K and V of a 128-wide head
    opcodes = collections.Counter(text.split()[1 if text.startswith("@") else 0].split(".")[0] for text in loop)
    regs, shared = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "SHARED"))
    syncs = ", ".join(f"{op} {opcodes[op]}" for op in ("BAR", "STS", "LDS", "STSM", "LDSM", "SHFL", "HGMMA", "HMMA"))
    return (f"Triton {triton.__version__}, K{bits_k}/V{bits_v} {block} tokens, {warps} warps"
            + ("" if max_registers is None else f", <= {max_registers} registers")
            + ("" if offset is None else f", key offset turning {offset} of 64 pairs")
            + f": {len(loop)} instructions per step, {len(loop) / values_per_thread:.2f} per stored value, "
            f"{regs} registers, {shared} B shared; tile stores "
            + "/".join(f"{r:.2f}x" for r in tile_store_conflicts(kernel.asm["ttgir"]))
            + f" of conflict-free wavefronts; per step: {syncs}; top: "
            + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(6)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits-k", type=int, default=3)
    parser.add_argument("--bits-v", type=int, default=3)
    default = f"{attention.BLOCK_N}/{attention.NUM_WARPS}" + (f"/{attention.MAX_REGISTERS}" if attention.MAX_REGISTERS else "")
    parser.add_argument("configs", nargs="*", default=[default],
                        help="BLOCK/WARPS[/MAX_REGISTERS], e.g. 64/4 128/8 64/4/128")
    parser.add_argument("--offset", action="store_true", help="also count the kernel with the key offset's term")
    args = parser.parse_args()
    for config in args.configs:
        block, warps, *cap = map(int, config.split("/"))
        for offset in (None, 64, *OFFSET_PAIRS) if args.offset else (None,):
            print(summary(args.bits_k, args.bits_v, block, warps, *cap, offset=offset), flush=True)


if __name__ == "__main__":
    main()
