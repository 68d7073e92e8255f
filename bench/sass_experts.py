"""Static sm_90 SASS of the quantized-expert decode kernels, no GPU needed: `python bench/sass_experts.py`.

Compiles the GEMV body (moe_gemv.py), the q2_0 tensor-core body (moe_mma.py) and the GEMM body's decode
launch shape (moe_triton.py, BLOCK_M 16) with Triton's bundled ptxas (bench/sass.py) and counts the instructions
of the K loop (the longest backward branch) per weight a thread handles in one iteration. At the
H200's copy bandwidth, 80% of it at 2 bits/weight leaves about 2.5 issued instructions per weight.
Pointers, N, K and the weight/activation strides are marked divisible by 16, as a launch at these
shapes specializes them (without it the loads are not vectorized). The GEMV body is compiled with moe's launch
settings (rows per program, warps); its "16-byte loads" column counts the LDG.128 of a thread in one K step.
Counts depend on the Triton version: count with the GPU machine's 3.6.0 (bench/turbo_sass.py says how to
install it beside the venv: `PYTHONPATH=/tmp/t36 python bench/sass_experts.py`). This counts work, not time;
speed comes only from `python bench/kernels.py experts` on the GPU. `--dp4a` counts the integer-dot body of q1_0/q2_0
(moe_dp4a.py) instead, at K steps of 256, 512 and 1024, with its dp4a (IDP) and shared-memory instructions.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sass import TOOLS, compile_sm90, sass_counts  # noqa: E402  (also turns the interpreter off)
from server.kernels.experts import moe  # noqa: E402
from server.kernels.experts.moe import DECODE_BLOCK_M, _gemv_block_k  # noqa: E402
from server.kernels.experts.moe_dp4a import _expert_dp4a  # noqa: E402
from server.kernels.experts.moe_gemv import _expert_gemv  # noqa: E402
from server.kernels.experts.moe_mma import _expert_mma  # noqa: E402
from server.kernels.experts.moe_triton import FORMAT_IDS, _expert_gemm  # noqa: E402

CODES = {"e8p": "*i16", "e8p3": "*i16", "q1_0": "*u8", "q2_0": "*u8"}
AUX = {"e8p": "*i16", "e8p3": "*u8", "q1_0": "*fp16", "q2_0": "*fp16"}
STRIDES = ("stride_am", "stride_sm", "stride_om", "stride_we", "stride_wn", "stride_xe", "stride_xn", "stride_se",
           "stride_sn")
# Multiples of 16 at the D=6144, I=2048 decode shape (the unit strides of E8 row sums and scales are not).
DIVISIBLE = frozenset({"N", "K", "stride_am", "stride_om", "stride_we", "stride_wn", "stride_xe", "stride_xn",
                       "stride_se"})
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$")


def loop_opcodes(kernel) -> collections.Counter:
    """Opcodes of the longest loop: from a backward branch's target to the branch itself."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    ops = []
    longest = (0, 0, -1)
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        address, opcode, rest = int(m.group(1), 16), m.group(2), m.group(3)
        ops.append((address, opcode))
        target = re.search(r"0x([0-9a-f]+)", rest)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            size = sum(1 for a, _ in ops if start <= a <= address)
            longest = max(longest, (size, start, address))
    _, start, end = longest
    return collections.Counter(op for a, op in ops if start <= a <= end)


def loop_length(kernel) -> int:
    """Instructions of the longest loop, NOPs included (the issue slots a pass takes)."""
    return sum(loop_opcodes(kernel).values())


def _signature(fmt: str, dual: bool, body: str) -> dict:
    """Argument types of a launch with bf16 activations (the GEMV body converts them as it loads them)."""
    sig = {"a_ptr": "*bf16"} | ({} if body == "gemv" else {"a_sum_ptr": "*fp32"})
    sig |= {"out_ptr": "*bf16" if dual else "*fp32"}
    if body == "gemv":
        sig |= {"expert_ids_ptr": "*i32", "routing_ptr": "*fp32"}
    else:
        sig |= {"pair_ids_ptr": "*i32", "block_expert_ptr": "*i32", "routing_ptr": "*fp32"}
    sig |= {"w_ptr": CODES[fmt], "aux_ptr": AUX[fmt], "scale_ptr": "*fp16" if fmt.startswith("e8") else CODES[fmt],
            "table_ptr": "*i32", "rtable_ptr": "*i32", "N": "i32", "K": "i32"}
    sig |= {"field_mask": "i32"} if body == "gemv" else {"num_pairs": "i32"}
    return sig | {s: "i32" for s in STRIDES if body != "gemv" or s != "stride_sm"}


def count(fmt: str, dual: bool, body: str) -> tuple[float, int, int, int]:
    """(loop instructions per weight per thread, registers, spilled bytes, LDG.128 in the loop) at the D=6144
    decode shape."""
    k = 6144 if dual else 2048
    common = {"FORMAT": FORMAT_IDS[fmt], "DUAL": dual, "ROUTED": not dual, "A_ROW_DIV": 8 if dual else 1}
    if body == "gemv":
        block_n, block_k = moe.GEMV_BLOCK_N if dual else moe.gemv_down_block_n, _gemv_block_k(fmt, k, dual)
        warps = moe.gemv_launch_options(fmt, dual)["num_warps"]
        constexprs = common | {"BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": True, "ASM": True}
        kernel = compile_sm90(_expert_gemv, _signature(fmt, dual, body) | dict.fromkeys(constexprs, "constexpr"),
                              constexprs, warps, DIVISIBLE)
    else:  # moe._tile_shape at one-token decode: 32 rows, 128 inputs (q: one block) per step
        block_n, block_k, warps = 32, {"q1_0": 128, "q2_0": 64}.get(fmt, 128), 4
        constexprs = common | {"BLOCK_M": DECODE_BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": True,
                               "MAGIC": 128, "IEEE": False}
        kernel = compile_sm90(_expert_gemm, _signature(fmt, dual, body) | dict.fromkeys(constexprs, "constexpr"),
                              constexprs, warps, DIVISIBLE)
    rows = 2 * block_n if dual else block_n
    _, res = sass_counts(kernel)
    loop = loop_opcodes(kernel)
    wide_loads = sum(n for op, n in loop.items() if op.startswith("LDG") and op.endswith(".128"))
    return sum(loop.values()) / (rows * block_k / (32 * warps)), res["REG"], res["LOCAL"], wide_loads


def count_mma(dual: bool, bf16: bool) -> tuple[float, int, int, int, int]:
    """(loop instructions per weight per thread, registers, spilled bytes, shared-memory stores in the loop (none
    of them the dequantized tile's: it feeds the MMA from registers), warpgroup MMAs in the loop) of the q2_0 tensor-core body (moe_mma.py) at moe.mma_* and the D=6144 shape."""
    sig = {"a_ptr": "*bf16" if bf16 else "*fp16", "out_ptr": "*bf16" if dual else "*fp32", "pair_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "routing_ptr": "*fp32", "w_ptr": "*u8", "d_ptr": "*fp16", "N": "i32",
           "K": "i32", "num_pairs": "i32", "stride_am": "i32", "stride_om": "i32", "stride_we": "i32",
           "stride_wn": "i32", "stride_de": "i32", "stride_dn": "i32"}
    constexprs = {"DUAL": dual, "ROUTED": not dual, "A_ROW_DIV": 8 if dual else 1, "BLOCK_N": moe.mma_block_n,
                  "BLOCK_T": moe.MMA_BLOCK_T, "ASM": True, "UNROLL": moe.mma_unroll}
    divisible = frozenset({"N", "K", "stride_am", "stride_om", "stride_we", "stride_wn", "stride_de", "stride_dn"})
    kernel = compile_sm90(_expert_mma, sig | dict.fromkeys(constexprs, "constexpr"), constexprs, moe.mma_warps,
                          divisible)
    _, res = sass_counts(kernel)
    loop = loop_opcodes(kernel)
    weights = moe.mma_block_n * 64 * moe.mma_unroll / (32 * moe.mma_warps)
    stores = sum(n for op, n in loop.items() if op.startswith("STS"))  # the weight tile's would be STS.128
    return (sum(loop.values()) / weights, res["REG"], res["LOCAL"], stores,
            sum(n for op, n in loop.items() if "GMMA" in op))


def count_dp4a(fmt: str, dual: bool, block_k: int | None = None, warps: int | None = None) -> dict:
    """The integer-dot body (moe_dp4a.py) at moe's launch settings (or ``block_k`` / ``warps``) and the D=6144
    decode shape: loop instructions per weight a thread handles in one step, registers, spills, the loop's
    16-byte loads, IDP (dp4a) and shared-memory instructions (a layout conversion of the tile would show there)."""
    k = 6144 if dual else 2048
    block_k = block_k or max({"q1_0": 128, "q2_0": 64}[fmt], min(moe.dp4a_block_k if dual else moe.dp4a_down_block_k, k))
    warps = warps or (moe.dp4a_gate_up_options if dual else moe.dp4a_down_options)["num_warps"]
    block_n = moe.GEMV_BLOCK_N if dual else moe.gemv_down_block_n
    sig = {"act_ptr": "*i32", "out_ptr": "*bf16" if dual else "*fp32", "expert_ids_ptr": "*i32",
           "routing_ptr": "*fp32", "w_ptr": "*u8", "d_ptr": "*fp16", "N": "i32", "K": "i32", "G": "i32",
           "stride_am": "i32", "stride_om": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_de": "i32",
           "stride_dn": "i32"}
    constexprs = {"FORMAT": FORMAT_IDS[fmt], "DUAL": dual, "ROUTED": not dual, "A_ROW_DIV": 8 if dual else 1,
                  "BLOCK_N": block_n, "BLOCK_K": block_k, "EVEN_K": True, "ASM": True, "USE_PDL": True}
    divisible = frozenset({"N", "K", "G", "stride_am", "stride_om", "stride_we", "stride_wn", "stride_de",
                           "stride_dn"})
    kernel = compile_sm90(_expert_dp4a, sig | dict.fromkeys(constexprs, "constexpr"), constexprs, warps, divisible)
    _, res = sass_counts(kernel)
    loop = loop_opcodes(kernel)
    rows = 2 * block_n if dual else block_n
    return {"per_weight": sum(loop.values()) / (rows * block_k / (32 * warps)), "regs": res["REG"],
            "spill": res["LOCAL"], "ldg128": sum(n for op, n in loop.items() if op.startswith("LDG") and op.endswith(".128")),
            "ldg": sum(n for op, n in loop.items() if op.startswith("LDG")),
            "idp": sum(n for op, n in loop.items() if op.startswith("IDP")),
            "shared": sum(n for op, n in loop.items() if op.startswith(("LDS", "STS"))), "block_k": block_k,
            "warps": warps, "loop": loop}


def main() -> None:
    if "--dp4a" in sys.argv:
        print(f"Triton {triton.__version__}; integer-dot body (moe_dp4a.py)")
        print("| format | projection | K step | warps | instr/weight | regs | LDG (16-byte) | IDP | LDS+STS |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for fmt in ("q2_0", "q1_0"):
            for dual in (True, False):
                for block_k in (256, 512, 1024):
                    c = count_dp4a(fmt, dual, block_k)
                    print(f"| {fmt} | {'gate_up' if dual else 'down'} | {block_k} | {c['warps']} | {c['per_weight']:.2f} "
                          f"| {c['regs']} | {c['ldg']} ({c['ldg128']}) | {c['idp']} | {c['shared']} |"
                          f"{' (spills)' if c['spill'] else ''}", flush=True)
        return
    print(f"Triton {triton.__version__}")
    print("| format | projection | GEMV body instr/weight | regs | 16-byte loads | GEMM body (decode) instr/weight "
          "| regs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for fmt in ("e8p", "e8p3", "q2_0", "q1_0"):
        for dual in (True, False):
            gemv, gemv_regs, gemv_spill, gemv_wide = count(fmt, dual, "gemv")
            gemm, gemm_regs, gemm_spill, _ = count(fmt, dual, "gemm")
            spills = " (spills)" if gemv_spill or gemm_spill else ""
            print(f"| {fmt} | {'gate_up' if dual else 'down'} | {gemv:.2f} | {gemv_regs} | {gemv_wide} | {gemm:.2f} | "
                  f"{gemm_regs} |{spills}", flush=True)
    print(f"\nq2_0 tensor-core body (moe_mma.py), {moe.mma_block_n} rows x {moe.mma_unroll} q blocks per K step, "
          f"{moe.mma_warps} warps:")
    print("| activations | projection | instr/weight | regs | shared-memory stores in the loop | warpgroup MMAs |")
    print("|---|---|---:|---:|---:|---:|")
    for bf16 in (True, False):
        for dual in (True, False):
            per_weight, regs, spill, stores, mmas = count_mma(dual, bf16)
            print(f"| {'bf16' if bf16 else 'fp16'} | {'gate_up' if dual else 'down'} | {per_weight:.2f} | {regs} | "
                  f"{stores} | {mmas} |{' (spills)' if spill else ''}", flush=True)


if __name__ == "__main__":
    main()
