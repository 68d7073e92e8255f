"""Expert decode launches, repeated, for a profiler to read: `python bench/experts_profile.py FMT TOKENS [BODY]`.

Deep shape of issue 5 (D=6144, I=2048, 64 experts, top-8), random valid codes, bf16 activations; BODY is one of
bench/kernels_experts._prepared_kernels' bodies (by default the one moe.fused_moe dispatches: "cuda_int8" for
e8p/e8p3, "dp4a" for q1_0/q2_0). Runs the body's launches 3 times on each of the input sets that the benchmark
rotates through, synchronizes, and exits.
Under ncu, for example:

    ncu --kernel-name regex:experts_ --launch-skip 4 --launch-count 4 --section WarpStateStats \
        python bench/experts_profile.py e8p 1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.kernels_experts import DEEP, _decode_body, _decode_inputs, _prepared_kernels, random_weights  # noqa: E402


def main(argv: list[str]) -> int:
    fmt, tokens = argv[0], int(argv[1])
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    d, i, e = DEEP["d"], DEEP["i"], DEEP["experts"]
    gu = random_weights(fmt, e, 2 * i, d, device, gen)
    dn = random_weights(fmt, e, d, i, device, gen)
    body = argv[2] if len(argv) > 2 else _decode_body(gu, dn, tokens * DEEP["top_k"])
    sets, n_sets, _ = _decode_inputs(DEEP, tokens, device, gen)
    runs = [_prepared_kernels(s, gu, dn, body) for s in sets[:n_sets]]
    for _ in range(3):
        for run in runs:
            run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
