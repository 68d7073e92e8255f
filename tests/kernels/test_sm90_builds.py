"""The hot Triton kernels compile for sm_90 in the configurations the engine launches (no GPU needed): the turbo
decode and store, the rotation, the quantized experts' decode bodies and the E8 int8 activation rows, the turbo
pages' dense decode for prefill, the dense prefill; and the turbo decode's builds leave room in shared memory
for the programs an SM its register cap plans for.

The CPU interpreter runs code the GPU compiler rejects (7a08627, reverted: a name rebound with another type in one
constexpr branch compiled nowhere but passed every interpreter test), so CI also compiles these builds offline
with Triton's bundled ptxas (bench/sass.py), in a process of its own: the suite's interpreter setting would make
every kernel an interpreted one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

BUILDS = """
import sys
from bench import sass, sass_experts, turbo_sass, turbo_store_sass
builds = [
    *[dict(bits_k=3, bits_v=3, recent=recent, offset=offset) for recent in (False, True) for offset in (None, 8)],
    dict(bits_k=4, bits_v=2, head_dim=64, gqa=3, recent=True, offset=8),  # mixed kinds, D = 64, GQA 3
    dict(bits_k=3, bits_v=3, offset=8, store=True),  # the fused write (TURBOSERVE_FUSED_TURBO_STORE=1)
]
from server.kernels.turbo import attention
# MAX_REGISTERS plans RESIDENT_PROGRAMS programs an SM; shared memory must not cut that (an H200 SM gives 228 KB,
# less 1 KB a block reserved; 20d660f: the window's pipelined ring loop took 57 KB a program, so 3 fit)
budget = 233472 // attention.RESIDENT_PROGRAMS - 2048
for b in builds:
    bits_k, bits_v = b.pop("bits_k"), b.pop("bits_v")
    kernel = turbo_sass.compile_decode(bits_k, bits_v, 64, 4, max_registers=attention.MAX_REGISTERS, **b)
    assert kernel.metadata.shared <= budget, f"decode {bits_k} {bits_v} {b}: {kernel.metadata.shared} bytes shared"
    print("decode", bits_k, bits_v, b, flush=True)
for recent in (False, True):
    turbo_store_sass.compile_store(3, 8, 4, recent=recent, pdl=True)
    print("store, recent", recent, flush=True)
sass.rotation_rows()
for fmt in ("e8p", "e8p3", "q2_0"):
    for dual in (True, False):
        sass_experts.count(fmt, dual, "gemv")
        sass_experts.count(fmt, dual, "gemm")
sass_experts.count_dp4a("q2_0", True)
sass_experts.count_dp4a("q1_0", False)
sass_experts.count_mma(True, True)
from server.kernels.experts import int8_activations
rows_sig = {"a_ptr": "*bf16", "out_ptr": "*i32", "first_ptr": "*i32", "second_ptr": "*i32", "inv_sqrt": "fp32",
            "K": "i32", "G": "i32", "stride_a": "i32", "stride_o": "i32"}
for rot in (0, 128, 256):  # the E8 integer body's activation rows, without and with the weights' rotation
    sass.compile_sm90(int8_activations._quantize_rows_kernel, rows_sig,
                      {"ROTATION": rot, "LOG2_ROTATION": max(rot, 1).bit_length() - 1, "USE_PDL": True}, 4)
from server.kernels.turbo import dense_pages
pages_sig = {"codes_ptr": "*u8", "norms_ptr": "*fp16", "poly_ptr": "*fp32", "page_ids_ptr": "*i64",
             "page_start_ptr": "*i64", "out_ptr": "*bf16", "first_ptr": "*i32", "second_ptr": "*i32", "inv_sqrt": "fp32",
             "const_ptr": "*fp32", "mean_ptr": "*fp32", "sink_ptr": "*fp32", "inv_freq_ptr": "*fp32", "n_rows": "i32"}
for offset in (False, True):  # prefill's pages back to bf16: values, and keys with o(p)
    sass.compile_sm90(dense_pages._dense_pages_kernel, pages_sig, {"H": 8, "PAGE_SIZE": 16, "ROWS": 32, "D": 128,
                      "G": 128, "LOG2_G": 7, "BITS": 3, "OFFSET": offset, "ASM": True}, 4)
from server.kernels import dense_attention
prefill_sig = {name: "*bf16" for name in ("q_ptr", "k_pages_ptr", "v_pages_ptr")}
prefill_sig |= {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32", "out_ptr": "*bf16",
                "scale_log2": "fp32", **{n: "i32" for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh",
                "stride_page", "stride_slot", "stride_head", "stride_bt")}, "k_near_ptr": "*bf16",
                "v_near_ptr": "*bf16", "stride_near_seq": "i32", "window": "i32"}
strides = frozenset(n for n in prefill_sig if n.startswith("stride") and n != "stride_bt")  # multiples of D
for head_dim in (64, 128):  # the embedded model's heads and the depth shape's, plain and with the recent window
    for recent in (False, True):
        launch = dense_attention._prefill_launches(head_dim, recent)[0]
        tiles = {k: launch[k] for k in ("BLOCK_M", "BLOCK_N")}
        options = {k: launch[k] for k in ("num_stages", "maxnreg")}
        kernel = sass.compile_sm90(dense_attention._prefill_kernel, prefill_sig, {
            "PAGE_SIZE": 16, "GROUP": 2, "HEAD_DIM": head_dim, "BLOCK_D": head_dim, "DOT_PRECISION": "tf32",
            "RECENT": recent, **tiles}, launch["num_warps"], strides, **options)
        assert kernel.metadata.shared <= 232448, f"prefill d{head_dim}: {kernel.metadata.shared} bytes shared"
print("all built")
"""


def test_turbo_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", BUILDS], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.endswith("all built\n"), done.stdout
