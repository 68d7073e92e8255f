"""The two-pass argmax (server/kernels/argmax.py) against torch.argmax, through the Triton interpreter."""

import pytest
import torch

from server.kernels.argmax import argmax_rows


@pytest.mark.parametrize("cols", [1, 7, 64, 65, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_rows_match_torch(cols, dtype):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(3, cols, generator=g).to(dtype)
    assert torch.equal(argmax_rows(x, chunk=64), x.argmax(dim=-1))


def test_ties_take_the_first_index_within_and_across_chunks():
    x = torch.zeros(4, 300)
    x[0, [5, 6, 200]] = 3.0  # tie inside the first chunk and with a later chunk
    x[1, [130, 129]] = 2.0  # tie inside a later chunk
    x[2, [63, 64]] = 1.0  # tie across a chunk boundary
    # row 3: all equal -> index 0
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [5, 129, 63, 0]  # torch's own rule, checked independently of our kernel
    assert torch.equal(argmax_rows(x, chunk=64), expected)


def test_rows_of_minus_infinity_and_a_strided_view():
    x = torch.full((2, 200), float("-inf"))
    x[1, 150] = -1e30
    assert argmax_rows(x, chunk=64).tolist() == [0, 150]
    wide = torch.randn(3, 500)
    view = wide[:, 100:400]  # row stride 500, not the row length
    assert torch.equal(argmax_rows(view, chunk=64), view.argmax(dim=-1))


def test_nan_ranks_as_infinity():
    x = torch.randn(1, 300)
    x[0, 250] = float("nan")
    assert argmax_rows(x, chunk=64).tolist() == [250]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rows, columns"):
        argmax_rows(torch.zeros(5))
    with pytest.raises(ValueError, match="rows, columns"):
        argmax_rows(torch.zeros(2, 0))
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)


def test_the_sampler_takes_the_kernel_where_triton_runs(monkeypatch):
    from server.runtime import sampler

    from server.kernels import argmax

    monkeypatch.setattr(sampler, "use_triton", lambda t: True)  # the CPU interpreter stands in for CUDA
    calls = []
    monkeypatch.setattr(argmax, "argmax_rows", lambda x, real=argmax.argmax_rows: calls.append(x.shape) or real(x))
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(sampler._argmax(logits), logits.argmax(dim=-1))
    assert calls == [(3, 5000)]
