"""Randomized Walsh-Hadamard rotation (specs/turboquant.md, "Rotation"): reference vs Triton vs float64."""

import math

import pytest
import torch

from server.kernels.rotation import (
    SIGNS1,
    SIGNS2,
    flip_signs,
    rotate,
    rotate_dense,
    rotate_reference,
    rotate_triton,
    sign_bits,
)

# 256-bit tables for the weight-rotation use (any words work; these are arbitrary).
WIDE = ((*SIGNS1, 0x01234567, 0x89ABCDEF, 0xDEADBEEF, 0x0BADF00D), (*SIGNS2, 0x7F00FF00, 0x1, 0x80000000, 0x55555555))


def sylvester(g: int) -> torch.Tensor:
    """H_g by the Kronecker definition H_2n = [[H, H], [H, -H]] in float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < g:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def signs_float64(words, g: int) -> torch.Tensor:
    """Element e is bit e % 32 of word e // 32 (set -> -1), computed one element at a time."""
    return torch.tensor([-1.0 if (words[e // 32] >> (e % 32)) & 1 else 1.0 for e in range(g)], dtype=torch.float64)


def rotation_matrix(g: int, signs=(SIGNS1, SIGNS2)) -> torch.Tensor:
    d1, d2 = torch.diag(signs_float64(signs[0], g)), torch.diag(signs_float64(signs[1], g))
    return d2 @ sylvester(g) @ d1 / math.sqrt(g)


def test_first_sign_bits_match_the_spec_words():
    # 0xE46A0359 ends in binary 1001: elements 0 and 3 negative, 1 and 2 positive.
    assert sign_bits(SIGNS1, 4).tolist() == [1, 0, 0, 1]
    # 0x16ACEE90 ends in binary 1001 0000: elements 4 and 7 negative.
    assert sign_bits(SIGNS2, 8).tolist() == [0, 0, 0, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("group,signs", [(64, (SIGNS1, SIGNS2)), (128, (SIGNS1, SIGNS2)), (256, WIDE)])
def test_reference_matches_float64_matrix(group, signs):
    x = torch.randn(5, 3 * group, dtype=torch.float64)
    r = rotation_matrix(group, signs)
    expect = (x.reshape(5, 3, group) @ r.T).reshape(5, 3 * group)
    got = rotate_reference(x.float(), group, signs=signs).double()
    assert torch.allclose(got, expect, atol=2e-6, rtol=0), (got - expect).abs().max()
    back = rotate_reference(expect.float(), group, inverse=True, signs=signs).double()
    assert torch.allclose(back, x, atol=2e-6, rtol=0), (back - x).abs().max()


@pytest.mark.parametrize("group,signs", [(16, (SIGNS1, SIGNS2)), (64, (SIGNS1, SIGNS2)), (128, (SIGNS1, SIGNS2)), (256, WIDE)])
@pytest.mark.parametrize("inverse", [False, True])
def test_the_cpus_matrix_form_matches_float64_and_the_reference(group, signs, inverse):
    """rotate_dense (what rotate runs on a CPU): any leading shape, within float32 rounding of the float64 matrix and
    of the butterflies, forward and inverse."""
    x = torch.randn(2, 5, 3 * group, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (2, 5, 1))
    r = rotation_matrix(group, signs)
    expect = x.reshape(2, 5, 3, group) @ (r if inverse else r.T)
    got = rotate_dense(x.float(), group, inverse, signs)
    assert got.dtype == torch.float32 and got.shape == x.shape
    size = x.reshape(2, 5, 3, group).norm(dim=-1, keepdim=True)
    assert ((got.double().reshape(expect.shape) - expect).abs() / size).max() < 1e-6
    reference = rotate_reference(x.float(), group, inverse, signs)
    assert ((got - reference).double().reshape(expect.shape).abs() / size).max() < 1e-6
    assert torch.equal(rotate(x.float(), group, inverse, signs), got)


@pytest.mark.parametrize("group,signs", [(16, (SIGNS1, SIGNS2)), (64, (SIGNS1, SIGNS2)), (128, (SIGNS1, SIGNS2)), (256, WIDE)])
@pytest.mark.parametrize("inverse", [False, True])
def test_triton_is_bit_identical_to_reference(group, signs, inverse):
    x = torch.randn(3, 7, 2 * group) * 10.0 ** torch.randint(-3, 4, (3, 7, 1))
    expect = rotate_reference(x, group, inverse, signs)
    got = rotate_triton(x, group, inverse, signs)
    assert torch.equal(got, expect), (got - expect).abs().max()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of float32 tensors (torch.equal calls -0.0 and +0.0 equal)."""
    return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


@pytest.mark.parametrize("group,signs", [(64, (SIGNS1, SIGNS2)), (128, (SIGNS1, SIGNS2)), (256, WIDE)])
@pytest.mark.parametrize("inverse", [False, True])
def test_triton_bits_fp16_odd_rows_partial_tiles(group, signs, inverse):
    # float32 inputs: test_triton_is_bit_identical_to_reference. 5 x 3 x 3 = 45 groups at 16 rows
    # per program: the third program's tile is partly masked.
    x = (torch.randn(5, 3, 3 * group) * 10.0 ** torch.randint(-2, 3, (5, 3, 1))).half()
    expect = rotate_reference(x, group, inverse, signs)
    got = rotate_triton(x, group, inverse, signs, out_dtype=torch.float32, elements_per_program=16 * group)
    assert same_bits(got, expect), (got - expect).abs().max()


@pytest.mark.parametrize("group", [64, 128])
def test_triton_bits_on_signed_zeros_and_subnormals(group):
    # The butterfly's a - b is computed as a + b·(-1) and the second sign table rides on the scale:
    # signed zeros (0 - 0 = +0, -0 - 0 = -0) and subnormals must come out with the reference's bits.
    g = torch.Generator().manual_seed(7)
    sign = torch.where(torch.rand(6, group, generator=g) < 0.5, -1.0, 1.0)
    zeros = sign * 0.0
    subnormal = sign * torch.randint(1, 1 << 20, (6, group), generator=g).float() * 2.0**-149
    mixed = torch.where(torch.rand(6, group, generator=g) < 0.7, zeros, torch.randn(6, group, generator=g) * 1e30)
    x = torch.cat([zeros, subnormal, mixed])
    assert (zeros.view(torch.int32) < 0).any() and (subnormal.abs() < 2.0**-126).all()
    for inverse in (False, True):
        expect = rotate_reference(x, group, inverse)
        got = rotate_triton(x, group, inverse)
        assert same_bits(got, expect), (got.view(torch.int32) != expect.view(torch.int32)).sum()
        assert (expect.view(torch.int32) == torch.tensor(-(2**31), dtype=torch.int32)).any()  # a -0.0 was produced


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_round_trip_any_leading_shape(dtype):
    x = torch.randn(2, 3, 1, 256).to(dtype)
    for group in (64, 128):
        y = rotate(x, group)
        assert y.dtype == dtype and y.shape == x.shape
        back = rotate_triton(rotate_triton(x, group, out_dtype=torch.float32), group, inverse=True)
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        assert torch.allclose(back.float(), x.float(), atol=tol * 4, rtol=tol), (back.float() - x.float()).abs().max()


def test_rotation_preserves_norm():
    x = torch.randn(100, 128, dtype=torch.float64)
    y = rotate_reference(x.float(), 128).double()
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)


def test_sign_bit_flip_is_multiplication_by_minus_one():
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, 1.17e-38])
    x = torch.cat([special, torch.randn(4096) * 10.0 ** torch.randint(-30, 30, (4096,)).float()])
    bits = torch.randint(0, 2, x.shape, dtype=torch.int32)
    flipped = flip_signs(x.clone(), bits)
    multiplied = torch.where(bits == 1, x * -1.0, x)
    assert torch.equal(flipped.view(torch.int32), multiplied.view(torch.int32))


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="power of two"):
        rotate(torch.zeros(96), 96)
    with pytest.raises(ValueError, match="not a multiple"):
        rotate(torch.zeros(3, 100), 64)
    with pytest.raises(ValueError, match="needs 256"):
        rotate(torch.zeros(256), 256)
