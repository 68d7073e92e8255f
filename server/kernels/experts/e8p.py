"""E8P codebook (2 bits/weight) and its 3-bit residual extension (specs/expert-formats.md, "E8P codebook").

A 16-bit code holds 8 weights: the high byte picks a row of the 256-row absolute table,
the low byte the signs and the ±1/4 shift. Every code decodes to a distinct point of
E8 + 1/4 or E8 - 1/4. `e8p3` adds an 8-bit code into a 256-point E8 codebook scaled by
1/RESIDUAL_SCALE that quantizes what `e8p` left over.

Everything here is plain torch: the definition of the formats. Kernels consume the
packed words of `kernel_table()` and `residual_table_packed()`.
"""

from __future__ import annotations

import functools
import itertools

import torch

RESIDUAL_SCALE = 2.04  # QuIP#'s RVQ residual scale: residual points are E8 / 2.04
_CHUNK = 4096  # rows per encoder step: bounds the [rows, 256, 8] temporaries to ~32 MB


@functools.cache
def abs_table() -> torch.Tensor:
    """[256, 8] float32 absolute rows, in code order.

    The 227 rows |x| for x in E8 ∩ (Z + 1/2)^8 with ||x||^2 <= 10, sorted lexicographically
    (every |v| with half-odd coordinates and ||v||^2 <= 10 is such an |x|: flipping one sign
    fixes the parity of the sum), then 29 of the 56 rows with five 3/2 and three 1/2
    (||x||^2 = 12): the first 29 in lexicographic order. The spec leaves that choice open;
    any 29 keep the codebook a set of distinct E8 points.
    """
    halves = torch.tensor([0.5, 1.5, 2.5, 3.5])
    rows = torch.cartesian_prod(*[halves] * 8)
    inner = rows[(rows * rows).sum(1) <= 10]
    outer = torch.tensor(
        [[1.5 if i not in small else 0.5 for i in range(8)] for small in itertools.combinations(range(8), 3)]
    )
    table = torch.cat([_sorted_rows(inner), _sorted_rows(outer)[:29]])
    assert table.shape == (256, 8)
    return table


def _sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    key = torch.zeros(rows.shape[0], dtype=torch.int64)
    for k in range(8):  # coordinates are < 4, so base 8 on 2x keeps lexicographic order
        key = key * 8 + (rows[:, k] * 2).long()
    return rows[torch.argsort(key)]


@functools.cache
def abs_row_odd() -> torch.Tensor:
    """[256] bool: the row's coordinate sum is odd, so its last coordinate is negated on decode."""
    return (abs_table().sum(1).long() % 2) == 1


@functools.cache
def abs_table_packed() -> torch.Tensor:
    """[256] int32 kernel table: nibble k (bits 4k..4k+2) holds 2·|x_k| (1, 3, 5 or 7), bit 31 the odd-sum flag.

    One 32-bit word per row instead of 8 floats: a kernel loads one word per code and builds all
    8 weights of the code with word-wide integer ops (moe_triton.py), so the table is 1 KiB and
    stays in L1, with no per-lane float gathers.
    """
    nib = (abs_table() * 2).long()
    word = (nib << (4 * torch.arange(8))).sum(1) | (abs_row_odd().long() << 31)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


@functools.cache
def sign_table_packed() -> torch.Tensor:
    """[256] int32 kernel table per sign byte s: the shift parity and the negative coordinates in one word.

    With p = popcount(s) & 1 and f = s ^ p (spec decode rule), nibble k holds 0xE where bit k of f
    is set (coordinate k negative; bits 1..3, so it masks 2·(2|x_k|)) and p in bit 0 of every
    nibble (moe_triton._e8p_code_nibbles). One lookup replaces the per-code parity and bit spreading
    (about 15 integer instructions per code); one word per code keeps it to one shared-memory or
    L1 access.
    """
    s = torch.arange(256)
    p = _popcount8(s) & 1
    f = s ^ p
    bits = (f[:, None] >> torch.arange(8)) & 1
    word = (bits * 0xE << (4 * torch.arange(8))).sum(1) | p * 0x11111111
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


@functools.cache
def kernel_table() -> torch.Tensor:
    """[512] int32: abs_table_packed() then sign_table_packed() (the kernels' `table_ptr`)."""
    return torch.cat([abs_table_packed(), sign_table_packed()])


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [...] int (low 16 bits used) -> points [..., 8] (spec decode rule, literally)."""
    dev = codes.device
    c = codes.long() & 0xFFFF
    a, s = c >> 8, c & 0xFF
    p = _popcount8(s) & 1
    f = s ^ p
    base = abs_table().to(dev, dtype)[a]
    last_sign = torch.where(abs_row_odd().to(dev)[a], -1.0, 1.0).to(dtype)
    base = torch.cat([base[..., :7], base[..., 7:] * last_sign[..., None]], -1)
    bits = (f[..., None] >> torch.arange(8, device=dev)) & 1
    shift = torch.where(p.bool(), -0.25, 0.25).to(dtype)
    return base * (1 - 2 * bits).to(dtype) + shift[..., None]


def _popcount8(s: torch.Tensor) -> torch.Tensor:
    return ((s[..., None] >> torch.arange(8, device=s.device)) & 1).sum(-1)


def encode(x: torch.Tensor) -> torch.Tensor:
    """x [n, 8] float -> [n] int16 codes of the nearest E8P codeword (exact, spec's cost formula)."""
    if x.ndim != 2 or x.shape[1] != 8:
        raise ValueError(f"e8p.encode expects [n, 8] vectors, got {tuple(x.shape)}")
    out = [_encode_chunk(x[i : i + _CHUNK].float()) for i in range(0, x.shape[0], _CHUNK)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int16, device=x.device)


def _encode_chunk(x: torch.Tensor) -> torch.Tensor:
    dev = x.device
    table = abs_table().to(dev)
    row_norm = (table * table).sum(1)
    row_parity = abs_row_odd().to(dev).long()  # a row with odd sum needs an odd number of negative coordinates
    best_cost, best_code = None, None
    for p, shift in ((0, 0.25), (1, -0.25)):
        y = x - shift
        neg = y < 0
        prod = y.abs()[:, None, :] * table[None]  # [n, 256, 8]: |y_i| a_i
        cost = (y * y).sum(1, keepdim=True) + row_norm[None] - 2 * prod.sum(-1)
        mismatch = (neg.long().sum(1, keepdim=True) & 1) != row_parity[None]
        cheapest, flip_at = prod.min(-1)
        cost = cost + torch.where(mismatch, 4 * cheapest, torch.zeros_like(cheapest))
        cost, row = cost.min(1)
        flip = mismatch.gather(1, row[:, None])[:, 0]
        flip_k = flip_at.gather(1, row[:, None])[:, 0]
        negative = neg ^ (flip[:, None] & (torch.arange(8, device=dev)[None] == flip_k[:, None]))
        code = _code_from(row, negative, p)
        if best_cost is None:
            best_cost, best_code = cost, code
        else:
            take = cost < best_cost
            best_cost, best_code = torch.where(take, cost, best_cost), torch.where(take, code, best_code)
    return best_code.to(torch.int16)


def _code_from(row: torch.Tensor, negative: torch.Tensor, p: int) -> torch.Tensor:
    """Invert the decode rule: which sign byte s gives these negative coordinates and shift parity p."""
    flips = negative.long()
    flips[:, 7] ^= abs_row_odd().to(row.device)[row].long()  # decode negates the last coordinate of odd rows
    f = (flips << torch.arange(8, device=row.device)).sum(1)  # even popcount by construction
    s = f ^ p  # p = 1 flips bit 0, making popcount(s) odd: decode reads p back from it
    return (row << 8) | s


@functools.cache
def residual_table() -> torch.Tensor:
    """[256, 8] float32 residual codebook (unscaled E8 points), in code order.

    The 241 points of E8 with ||x||^2 <= 2 (origin, 112 of the form ±e_i ± e_j, 128 of
    (±1/2)^8 with even sum) sorted lexicographically, then the 16 points ±2 e_i sorted
    lexicographically without the last one: 256 distinct points.
    """
    pts = [torch.zeros(1, 8)]
    for i, j in itertools.combinations(range(8), 2):
        for si, sj in itertools.product((-1.0, 1.0), repeat=2):
            v = torch.zeros(8)
            v[i], v[j] = si, sj
            pts.append(v[None])
    halves = torch.cartesian_prod(*[torch.tensor([-0.5, 0.5])] * 8)
    pts.append(halves[halves.sum(1).round().long() % 2 == 0])
    small = torch.cat(pts)
    big = torch.cat([torch.eye(8) * 2, -torch.eye(8) * 2])
    table = torch.cat([_lex_sorted(small), _lex_sorted(big)[:15]])
    assert table.shape == (256, 8)
    return table


def _lex_sorted(rows: torch.Tensor) -> torch.Tensor:
    key = torch.zeros(rows.shape[0], dtype=torch.int64)
    for k in range(8):  # coordinates lie in [-2, 2] on a 1/2 grid
        key = key * 16 + (rows[:, k] * 2 + 4).long()
    return rows[torch.argsort(key)]


def decode_residual(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [...] uint8 -> residual contribution [..., 8] (already divided by RESIDUAL_SCALE)."""
    return residual_table().to(codes.device, dtype)[codes.long() & 0xFF] / RESIDUAL_SCALE


def encode_residual(r: torch.Tensor) -> torch.Tensor:
    """r [n, 8] (what e8p left over) -> [n] uint8 codes of the nearest point of residual_table()/RESIDUAL_SCALE."""
    table = residual_table().to(r.device)
    scaled = r.float() * RESIDUAL_SCALE
    out = []
    for i in range(0, scaled.shape[0], _CHUNK * 8):
        part = scaled[i : i + _CHUNK * 8]
        out.append(((table * table).sum(1)[None] - 2 * part @ table.T).argmin(1))
    return torch.cat(out).to(torch.uint8) if out else torch.empty(0, dtype=torch.uint8, device=r.device)


@functools.cache
def residual_table_packed() -> torch.Tensor:
    """[256] int32 kernel table: bits 4k..4k+3 hold 2·r_k + 4 (coordinates are in [-2, 2] on a 1/2 grid)."""
    nib = (residual_table() * 2 + 4).long()
    word = (nib << (4 * torch.arange(8))).sum(1) & 0xFFFFFFFF
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
