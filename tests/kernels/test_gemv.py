"""Skinny decode matmul (server/kernels/gemv.py) vs F.linear vs a float64 oracle, through the Triton
interpreter on CPU (fp16/fp32 only), at sizes that are not multiples of any block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.kernels import gemv

# (rows, N, K): one row takes the CUDA-core body, 2..16 the tensor-core body; K = 2100 runs the K loop
# several times with a ragged last tile. Every dtype and bias setting on these:
NARROW = [(1, 37, 70), (3, 37, 70), (16, 45, 2100), (1, 37, 2100)]
# N = 17000 picks the widest slabs (32 rows, see gemv._config); once per body, for interpreter time.
WIDE = [(1, 17000, 40, torch.float16, True), (5, 17000, 40, torch.float16, True)]
DTYPES = (torch.float32, torch.float16)
CASES = [(*shape, dtype, bias) for shape in NARROW for dtype in DTYPES for bias in (False, True)]
# Output rounding: fp16 results may differ from another fp32-accumulated result by one fp16 ulp (2^-10).
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-3, 2.0**-10)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    err = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{what}: element {worst} differs by {err.flatten()[worst]:.3g} (allowed {bound.flatten()[worst]:.3g})"
    )


@pytest.mark.parametrize("rows,n,k,dtype,with_bias", CASES + WIDE)
def test_skinny_matmul_matches_linear_and_oracle(rows, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    oracle = x.double() @ w.double().T + (b.double() if with_bias else 0.0)
    fast = gemv.skinny_matmul(x, w, b)
    assert fast.dtype == dtype and fast.shape == (rows, n)
    atol, rtol = TOLERANCE[dtype]
    assert_close(fast, oracle, atol, rtol / 2, "skinny_matmul vs float64 oracle")  # half an ulp of rounding
    assert_close(fast, F.linear(x, w, b), atol, rtol, "skinny_matmul vs F.linear")


def test_linear_takes_the_kernel_for_one_row_and_cublas_for_more(monkeypatch):
    launched = []
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)  # the CPU interpreter stands in for CUDA
    monkeypatch.setattr(gemv, "skinny_matmul", lambda *a: launched.append(a[0].shape) or F.linear(*a))
    w = torch.randn(24, 40, dtype=torch.float16)
    for shape in [(1, 40), (1, 1, 40), (2, 40), (16, 40), (17, 40)]:
        x = torch.randn(*shape, dtype=torch.float16)
        assert gemv.linear(x, w).shape == (*shape[:-1], 24)
    assert launched == [(1, 40), (1, 40)], "rows are counted after flattening; 2 and more rows go to F.linear"
    gemv.linear(torch.randn(1, 40), w.float())  # float32 stays on F.linear (the kernel serves 16-bit weights)
    assert len(launched) == 2


def test_linear_reshapes_leading_dims_through_the_kernel(monkeypatch):
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    x = torch.randn(1, 1, 50, dtype=torch.float16)
    w, b = torch.randn(33, 50, dtype=torch.float16), torch.randn(33, dtype=torch.float16)
    assert_close(gemv.linear(x, w, b), F.linear(x, w, b), *TOLERANCE[torch.float16], "linear [1, 1, K]")


def test_skinny_matmul_rejects_bad_shapes():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="same K"):
        gemv.skinny_matmul(torch.randn(1, 31), w)
    with pytest.raises(ValueError, match="1..16 rows"):
        gemv.skinny_matmul(torch.randn(17, 32), w)
    with pytest.raises(ValueError, match="one dtype"):
        gemv.skinny_matmul(torch.randn(1, 32, dtype=torch.float16), w)


def test_a_kernel_that_does_not_build_falls_back_to_f_linear_and_says_so(monkeypatch, caplog):
    from triton.runtime.errors import OutOfResources

    def too_big(*args):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(gemv, "skinny_matmul", too_big)
    monkeypatch.setattr(gemv, "_unusable", None)
    x, w = torch.randn(1, 40, dtype=torch.float16), torch.randn(24, 40, dtype=torch.float16)
    with caplog.at_level("WARNING"):
        assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    assert "skinny matmul does not build on this GPU" in caplog.text
    assert gemv._unusable is not None, "one failed build turns the kernel off for the process (no rebuild per call)"
