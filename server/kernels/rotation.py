"""Randomized Walsh-Hadamard rotation with packed sign bits (specs/turboquant.md, "Rotation").

For each group x of ``group`` consecutive values along the last dimension:

    forward:  y = D2 · H · D1 · x / sqrt(G)
    inverse:  x = D1 · H · D2 · y / sqrt(G)

H is the unnormalized Sylvester Hadamard matrix in natural order, applied as butterfly
stages h = 1, 2, ..., G/2 that map the pair (j, j+h) to (a+b, a-b). D1, D2 are diagonal
sign matrices read from packed 32-bit words: element e is bit (e & 31) of word (e >> 5),
a set bit meaning -1. A sign is applied by flipping the float's sign bit, which is
bit-identical to multiplying by -1 for every finite value (spec, "Rotation").

The rotation is linear and orthogonal, so it does not normalize: callers that want the
unit-vector form divide by the norm themselves. The Triton body rounds every value exactly
where the reference does (same float32 sums in the same stage order, written in forms whose
results are identical: see fwht_rows and rotate_rows), so the two agree bit for bit.

On a CPU, ``rotate`` multiplies by the rotation's matrix instead (rotate_dense, built from the reference):
one GEMM against the butterflies' seven stages of small torch ops, 81 -> 2.3 us for the few rows of a decode
step, 5.5 -> 0.55 ms for a 2048-token chunk of 3 heads (one core, Zen 4). Its float32 sums run in another
order, so it agrees with the reference to rounding (about 1e-6 of the norm), not bit for bit.

Shared by the TurboQuant KV cache and the expert-weight formats.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from server.kernels.backend import use_triton
from server.kernels.timing import timed

# The spec's tables (also used by the llama.cpp TurboQuant forks): 128 signs each.
SIGNS1 = (0xE46A0359, 0x42F85949, 0xA4C63BBB, 0x49F250A9)
SIGNS2 = (0x16ACEE90, 0x3F628FDC, 0xB7A5357A, 0xBEA56562)

SignWords = Sequence[int]


def check_group(group: int, signs: tuple[SignWords, SignWords]) -> None:
    """Raise ValueError unless ``group`` is a power of two covered by both sign tables."""
    if group < 2 or group & (group - 1):
        raise ValueError(f"rotation group must be a power of two >= 2, got {group}")
    for name, words in zip(("first", "second"), signs):
        if 32 * len(words) < group:
            raise ValueError(
                f"the {name} sign table has {32 * len(words)} bits but group {group} needs {group}; "
                f"pass {group // 32} packed 32-bit words per table for this group size"
            )


def check_rows(x: torch.Tensor, group: int, signs: tuple[SignWords, SignWords]) -> None:
    """check_group, and raise ValueError unless x's last dim is whole groups."""
    check_group(group, signs)
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the rotation group {group}")


def sign_bits(words: SignWords, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first ``group`` sign bits as int32 0/1 (1 means -1), element e from bit e & 31 of word e >> 5.
    Cached per table, group and device (the CPU reference rotates a few rows per layer and step): do not modify."""
    return _sign_bits(tuple(int(x) & 0xFFFFFFFF for x in words), group, torch.device(device))


@functools.lru_cache(maxsize=256)
def _sign_bits(words: tuple[int, ...], group: int, device: torch.device) -> torch.Tensor:
    e = torch.arange(group)
    w = torch.tensor(words, dtype=torch.int64)
    return ((w[e >> 5] >> (e & 31)) & 1).to(torch.int32).to(device)


def sign_words_tensor(words: SignWords, device: torch.device | str) -> torch.Tensor:
    """The packed words as an int32 tensor for kernels (two's complement view of the unsigned words)."""
    # int32 view of the unsigned words (two's complement), so kernels can shift them.
    vals = [int(x) & 0xFFFFFFFF for x in words]
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in vals], dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=256)
def _device_words(words: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Built once per table and device: a host-to-device copy per call would cost a sync and is not
    # allowed while a CUDA graph is being captured (the experts rotate activations inside the model).
    return sign_words_tensor(words, device)


def device_sign_words(words: SignWords, device: torch.device) -> torch.Tensor:
    """The packed words as a cached int32 tensor on ``device``, for kernels outside this module that call
    rotate_rows (one table's words, first or second)."""
    return _device_words(tuple(words), device)


def flip_signs(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """x (float32) with its sign bit XORed where bits == 1 (spec: bit-identical to * -1)."""
    return (x.view(torch.int32) ^ (bits << 31)).view(torch.float32)


def fwht_reference(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard transform over the last dim (natural order), float32."""
    g = x.shape[-1]
    h = 1
    while h < g:
        pairs = x.reshape(*x.shape[:-1], g // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*x.shape[:-1], g)
        h *= 2
    return x


def rotate_reference(
    x: torch.Tensor, group: int, inverse: bool = False, signs: tuple[SignWords, SignWords] = (SIGNS1, SIGNS2)
) -> torch.Tensor:
    """The definition of the rotation, in float32; returns float32 of x's shape."""
    check_rows(x, group, signs)
    first, second = (signs[1], signs[0]) if inverse else (signs[0], signs[1])
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    g = flip_signs(g.contiguous(), sign_bits(first, group, x.device))
    g = fwht_reference(g) * inv_sqrt_group(group)
    g = flip_signs(g.contiguous(), sign_bits(second, group, x.device))
    return g.reshape(x.shape)


@functools.lru_cache(maxsize=64)
def rotation_matrix(group: int, inverse: bool, signs: tuple[tuple[int, ...], tuple[int, ...]],
                    device: torch.device) -> torch.Tensor:
    """float32 [group, group] M with x @ M = rotate_reference(x) for a row x of one group: row i is the rotation
    of the i-th unit vector. Cached per table and device: do not modify."""
    return rotate_reference(torch.eye(group, device=device), group, inverse, signs)


def rotate_dense(
    x: torch.Tensor, group: int, inverse: bool = False, signs: tuple[SignWords, SignWords] = (SIGNS1, SIGNS2)
) -> torch.Tensor:
    """The rotation as one matrix product per group, float32 of x's shape (module docstring: the CPU's body)."""
    check_rows(x, group, signs)
    words = tuple(tuple(int(w) & 0xFFFFFFFF for w in table) for table in signs)
    m = rotation_matrix(group, inverse, words, x.device)
    return (x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group) @ m).reshape(x.shape)


@functools.cache  # every turbo launch asks for it; building the tensor costs ~10 us of an eager step's host time
def inv_sqrt_group(group: int) -> float:
    # The same float32 constant in the reference and in the kernels keeps them bit-identical.
    return float(torch.tensor(1.0 / math.sqrt(group), dtype=torch.float32))


@triton.jit
def sign_masks(words_ptr, GROUP: tl.constexpr):
    """[1, GROUP] int32 with only bit 31 set where bit e of the packed words is set (1 means -1).

    The words (one per 32 elements) are read as scalars and picked per element: a vector load
    indexed by e >> 5 is a separate layout anchor that Triton converts to x's layout through
    shared memory, with barriers (seen in the sm_90 SASS for G = 128).
    """
    e = tl.arange(0, GROUP)[None, :]
    word = tl.zeros((1, GROUP), tl.int32)
    for w in tl.static_range((GROUP + 31) // 32):
        word = tl.where((e >> 5) == w, tl.load(words_ptr + w), word)
    return ((word >> (e & 31)) & 1) << 31


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, GROUP: tl.constexpr, LOG2_GROUP: tl.constexpr):
    """Unnormalized Hadamard transform of each row of a [ROWS, GROUP] float32 tile, in registers.

    Stage h views a row as [GROUP / 2h, 2, h], the pair (j, j+h) on the size-2 axis. Each
    element fetches its partner (the XOR of the pair with itself removed: one shuffle when the
    pair spans two threads, nothing when one thread holds both) and computes partner + x·(±1):
    the lower element b + a, the upper a + (-b), the reference's a+b and a-b bit for bit, since
    the product by ±1 is exact and the fused multiply-add rounds once, like the add.
    """
    for s in tl.static_range(LOG2_GROUP):
        x4 = tl.reshape(x, (ROWS, GROUP >> (s + 1), 2, 1 << s))
        bits = x4.to(tl.int32, bitcast=True)
        partner = (bits ^ tl.reduce(bits, 2, _xor, keep_dims=True)).to(tl.float32, bitcast=True)
        sign = 1.0 - 2.0 * tl.arange(0, 2)[None, None, :, None].to(tl.float32)
        x = tl.reshape(partner + x4 * sign, (ROWS, GROUP))
    return x


@triton.jit
def rotate_rows(x, first_ptr, second_ptr, inv_sqrt, ROWS: tl.constexpr, GROUP: tl.constexpr,
                LOG2_GROUP: tl.constexpr):
    """Rotate each row of a [ROWS, GROUP] float32 tile: second · H · first · x / sqrt(G).

    The second sign table is folded into the scale: y · (-s) rounds to exactly -(y · s) (round
    to nearest is symmetric), so one multiply by a per-column ±1/sqrt(G) equals the reference's
    multiply then sign-bit flip.
    """
    x = (x.to(tl.int32, bitcast=True) ^ sign_masks(first_ptr, GROUP)).to(tl.float32, bitcast=True)
    scale = tl.where(sign_masks(second_ptr, GROUP) != 0, -inv_sqrt, inv_sqrt)
    return fwht_rows(x, ROWS, GROUP, LOG2_GROUP) * scale


@triton.jit
def _rotate_kernel(x_ptr, out_ptr, first_ptr, second_ptr, n_rows, inv_sqrt,
                   ROWS: tl.constexpr, GROUP: tl.constexpr, LOG2_GROUP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None].to(tl.int64) * GROUP + tl.arange(0, GROUP)[None, :]
    mask = rows[:, None] < n_rows
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = rotate_rows(x, first_ptr, second_ptr, inv_sqrt, ROWS, GROUP, LOG2_GROUP)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rotate_triton(
    x: torch.Tensor,
    group: int,
    inverse: bool = False,
    signs: tuple[SignWords, SignWords] = (SIGNS1, SIGNS2),
    out_dtype: torch.dtype | None = None,
    elements_per_program: int = 4096,
) -> torch.Tensor:
    """Triton body of ``rotate``: float32 math, output in ``out_dtype`` (default: x's dtype).

    ``elements_per_program`` (a power of two) trades registers for fewer programs; 4096
    measured fastest on the H200 (docs/BENCHMARKS.md).
    """
    check_rows(x, group, signs)
    first, second = (signs[1], signs[0]) if inverse else (signs[0], signs[1])
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    n_rows = src.numel() // group
    rows = max(1, min(elements_per_program // group, triton.next_power_of_2(max(n_rows, 1))))
    if n_rows:
        with timed("rotation", x.device):
            _rotate_kernel[(triton.cdiv(n_rows, rows),)](
                src, out, _device_words(tuple(first), x.device), _device_words(tuple(second), x.device),
                n_rows, inv_sqrt_group(group), ROWS=rows, GROUP=group, LOG2_GROUP=group.bit_length() - 1,
            )
    return out


def rotate(
    x: torch.Tensor, group: int, inverse: bool = False, signs: tuple[SignWords, SignWords] = (SIGNS1, SIGNS2)
) -> torch.Tensor:
    """Rotate every ``group``-sized slice of x's last dim; any leading shape; result in x's dtype.

    ``signs`` is (first table, second table) as packed 32-bit words, each covering at least
    ``group`` bits; the defaults are the spec's 128-bit tables. ``inverse=True`` undoes the
    forward rotation (up to float rounding). Triton bit for bit the reference; a CPU to rounding (rotate_dense).
    """
    if use_triton(x):
        return rotate_triton(x, group, inverse, signs)
    return rotate_dense(x, group, inverse, signs).to(x.dtype)
