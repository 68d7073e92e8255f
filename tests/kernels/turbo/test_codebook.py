"""Lloyd-Max codebooks for the sphere marginal vs an independent mpmath computation (specs/turboquant.md)."""

import mpmath
import pytest
import torch

from server.kernels.turbo.codebook import codebook

mpmath.mp.dps = 20


def density(group):
    """The exact sphere marginal (1 - t^2)^((G-3)/2), unnormalized, as an mpmath function."""
    return lambda t: (1 - t * t) ** (mpmath.mpf(group - 3) / 2)


def cells(book):
    edges = [-1.0, *book.midpoints, 1.0]
    return list(zip(edges[:-1], edges[1:], book.centroids))


def test_g128_b3_matches_the_spec_quoted_values():
    positive = codebook(3, 128).centroids[4:]
    for got, quoted in zip(positive, (0.02160, 0.06659, 0.11814, 0.18840)):
        assert abs(got - quoted) < 6e-6, (positive, "spec quotes 0.02160, 0.06659, 0.11814, 0.18840")


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [64, 128])
def test_every_centroid_is_the_mean_of_its_cell(bits, group):
    """The Lloyd-Max centroid condition, integrated independently with mpmath quadrature."""
    f = density(group)
    book = codebook(bits, group)
    for lo, hi, c in cells(book):
        mass = mpmath.quad(f, [lo, c, hi])
        mean = mpmath.quad(lambda t: t * f(t), [lo, c, hi]) / mass
        assert abs(float(mean) - c) < 1e-8, f"bits={bits} G={group}: centroid {c} but cell mean {float(mean)}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_is_symmetric_and_sorted(bits):
    c = codebook(bits, 128).centroids
    assert len(c) == 2**bits and list(c) == sorted(c)
    assert all(a == -b for a, b in zip(c, reversed(c)))
    assert codebook(bits, 128).midpoints[2 ** (bits - 1) - 1] == 0.0


@pytest.mark.parametrize("bits,spec_optimum", [(2, 0.1160), (3, 0.0340), (4, 0.0093)])
def test_distortion_times_dimension_is_the_spec_optimum(bits, spec_optimum):
    """G * E[(t - c(t))^2] under the exact density equals the spec's 'exact sphere Lloyd-Max optimum'."""
    f = density(128)
    book = codebook(bits, 128)
    total = mpmath.quad(f, [-1, 0, 1])
    mse = sum(mpmath.quad(lambda t: (t - c) ** 2 * f(t), [lo, c, hi]) for lo, hi, c in cells(book)) / total
    assert abs(128 * float(mse) - spec_optimum) < 0.0001, 128 * float(mse)


def test_codebook_is_cached_and_deterministic():
    assert codebook(3, 64) is codebook(3, 64)


def test_bad_codebook_request_is_refused():
    with pytest.raises(ValueError, match="bits"):
        codebook(5, 128)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group", [64, 128])
def test_odd_polynomial_reproduces_every_centroid_in_float32(bits, group):
    """Attention decodes centroids with this polynomial; evaluate it in float32 the way a kernel does."""
    book = codebook(bits, group)
    n = 2**bits
    t = torch.arange(n, dtype=torch.float32) * (2.0 / (n - 1)) - 1.0
    coef = book.odd_polynomial_tensor()
    acc = torch.full_like(t, coef[-1].item())
    for a in reversed(coef[:-1].tolist()):
        acc = acc * t * t + a
    got = (acc * t).double()
    want = torch.tensor(book.centroids, dtype=torch.float64)
    assert ((got - want).abs() / want.abs()).max() < 2e-6
