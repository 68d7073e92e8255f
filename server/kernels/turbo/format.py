"""The turbo2/3/4 storage format: reference quantize/dequantize and the byte layout.

Per token and KV head (specs/turboquant.md, "Groups" .. "Storage per group"):
  * the head's D values split into D/G groups (G = 128 if D % 128 == 0, else 64);
  * each group: norm n, unit vector rotated (rotation.py), each coordinate mapped to the
    nearest centroid of codebook(bits, G) (ties to the upper index); the stored norm is
    n / ||c|| so the reconstruction keeps the input's length (fp16, round to nearest).

Byte layout of one token's indices for one head (a "row", D * bits / 8 bytes): little-endian
32-bit words, each holding the next 32 / width values of a bit plane, and inside every word
nibble k (bits 4k..4k+3) holds the word's values k, k + 8, k + 16, k + 24 (as many as fit,
``width`` bits each, the first lowest):
  * turbo4 (width 4): nibble k = value k, i.e. byte j = idx[2j] | idx[2j+1] << 4;
  * turbo2 (width 2): nibble k = value k | value k + 8 << 2;
  * turbo3: two bit planes. Bytes [0, D/4): the low two bits of every value, laid out like
    turbo2. Bytes [D/4, 3D/8): the third bit (width 1), bit 4k + j of word c = bit 2 of value
    32c + 8j + k.
Why: the decode kernel turns a row into 4-bit PRMT selectors of 8 consecutive values with
one mask (and at most a shift) per plane (codes.decode_rows), and the looked-up fp16 pairs
are consecutive values, ready to store as they come. The torch decode (dequantize_stored)
looks each byte up whole instead: one key per byte holds all of its fields (turbo3: the low
plane's byte and the four third bits that belong to it).
Norms live apart from the indices (fp16, one per group). For D = 128 a turbo3 row is 48
bytes: both planes start on 16-byte boundaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from server.kernels.rotation import rotate_reference
from server.kernels.turbo.codebook import codebook

TURBO_BITS = {"turbo2": 2, "turbo3": 3, "turbo4": 4}
NORM_BYTES = 2  # fp16


def index_bits(kind: str) -> int:
    if kind not in TURBO_BITS:
        raise ValueError(f"unknown turbo KV kind {kind!r}; expected one of {', '.join(TURBO_BITS)}")
    return TURBO_BITS[kind]


def group_size(head_dim: int) -> int:
    """The spec's group for a head: 128 when it divides head_dim, else 64; anything else is refused."""
    if head_dim > 0 and head_dim % 128 == 0:
        return 128
    if head_dim > 0 and head_dim % 64 == 0:
        return 64
    raise ValueError(
        f"TurboQuant KV cache needs head_dim to be a multiple of 64, but this model has head_dim {head_dim}; "
        f"use --kv-cache-dtype bf16 (or f16) for this model"
    )


def bits_per_value(kind: str, group: int = 128) -> float:
    """Index bits plus the fp16 norm shared by a group (spec table: 2.125 / 3.125 / 4.125 at G=128)."""
    return index_bits(kind) + 8 * NORM_BYTES / group


@dataclass(frozen=True)
class RowLayout:
    """Where one token's data for one head lives: ``row_bytes`` of indices, ``num_groups`` norms."""

    kind: str
    head_dim: int

    @property
    def bits(self) -> int:
        return index_bits(self.kind)

    @property
    def group(self) -> int:
        return group_size(self.head_dim)

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.bits // 8

    @property
    def bytes_per_head(self) -> int:
        return self.row_bytes + NORM_BYTES * self.num_groups


@functools.cache
def byte_fields(width: int) -> tuple[int, ...]:
    """The values of one 32-bit word of ``width``-bit fields in the order its bytes hold them, each byte's fields from
    its lowest bits up: the field at word bit b = 8 j + width m (field m of byte j) is value k + 8 i where
    b = 4 k + width i (the layout above). Width 2: 0, 8, 1, 9, 2, 10, ... (stored_order's word)."""
    return tuple(b // 4 + 8 * (b % 4 // width) for b in range(0, 32, width))


@functools.cache
def _packing(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(byte_fields(width), device=device),
            width * torch.arange(8 // width, dtype=torch.int32, device=device))


def _pack_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Pack the values of the last dim into 32-bit words of ``width``-bit fields (the layout above) as bytes: the
    fields gathered into their bytes' order, then each byte's fields shifted into place and summed."""
    per_word = 32 // width
    words = fields.shape[-1] // per_word  # named, not -1: a batch of zero rows must reshape too
    order, shifts = _packing(width, fields.device)
    f = fields.to(torch.int32).reshape(*fields.shape[:-1], words, per_word)[..., order]
    return (f.reshape(*fields.shape[:-1], 4 * words, 8 // width) << shifts).sum(-1).to(torch.uint8)


def _unpack_words(words: torch.Tensor, width: int) -> torch.Tensor:
    """int32 words [..., n] -> their ``width``-bit fields, int32 [..., n * 32 / width]: value k + 8 i of a word at
    bits 4 k + width i (the layout above), one shift and mask for all of them."""
    v = torch.arange(32 // width, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> (4 * (v % 8) + width * (v // 8))) & ((1 << width) - 1)).flatten(-2)


def pack_indices(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx [..., D] (values < 2^bits) -> uint8 [..., D * bits / 8] in the layout above."""
    if bits == 3:
        return torch.cat([_pack_fields(idx & 3, 2), _pack_fields(idx >> 2, 1)], dim=-1)
    return _pack_fields(idx, bits)


def unpack_indices(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """uint8 [..., D * bits / 8] -> int32 indices [..., D]."""
    # The bytes as the layout's little-endian words (the byte order of every host torch runs us on).
    words = packed.contiguous().view(torch.int32)
    if bits == 3:
        return _unpack_words(words[..., : head_dim // 16], 2) | (_unpack_words(words[..., head_dim // 16 :], 1) << 2)
    return _unpack_words(words, bits)


def quantize_reference(x: torch.Tensor, kind: str, rotation=rotate_reference) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (indices packed uint8 [..., row_bytes], norms fp16 [..., D / G]). float32 math. ``rotation``:
    the definition's butterflies, or rotation.rotate_dense where a CPU serves (equal to rounding: a value within
    an ulp or so of a midpoint may take the other index, as in the kernels)."""
    layout = RowLayout(kind, x.shape[-1])
    book = codebook(layout.bits, layout.group)
    g = x.float().reshape(*x.shape[:-1], layout.num_groups, layout.group)
    n = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
    y = rotation(torch.where(n > 0, g / n, torch.zeros_like(g)), layout.group)
    # Count the midpoints at or below y: nearest centroid, a tie goes to the upper index.
    idx = (y[..., None] >= book.midpoints_tensor(x.device)).sum(-1).to(torch.int32)
    idx = torch.where(n > 0, idx, torch.zeros_like(idx))
    c_norm = torch.linalg.vector_norm(book.centroids_tensor(x.device)[idx], dim=-1, keepdim=True)
    stored = torch.where(c_norm > 1e-10, n / c_norm, n)
    codes = pack_indices(idx.reshape(*x.shape[:-1], layout.head_dim), layout.bits)
    return codes, stored.squeeze(-1).to(torch.float16)


@functools.cache
def stored_order(bits: int, head_dim: int) -> tuple[int, ...]:
    """The dim of each value dequantize_stored returns: the order a row's bytes hold them, each byte's fields from
    its lowest bits up (turbo2 and turbo3's low plane: values 2j, 2j + 8, 2j + 1, 2j + 9 of a word in byte j;
    turbo4: the natural order). It permutes within 16-value words, so every value stays in its group."""
    if bits == 4:
        return tuple(range(head_dim))
    return tuple(16 * w + v for w in range(head_dim // 16) for v in byte_fields(2))


@functools.cache
def natural_order(bits: int, head_dim: int) -> tuple[int, ...]:
    """stored_order's inverse: where dim d sits among dequantize_stored's values (index a stored-order tensor's last
    dim with it to get the natural order)."""
    return tuple(sorted(range(head_dim), key=stored_order(bits, head_dim).__getitem__))


@functools.cache
def _key_table(bits: int, group: int, device: torch.device) -> torch.Tensor:
    """float32 [keys, fields]: the centroids of the fields one key of _keys holds, lowest bits first."""
    key = torch.arange(1 << 12 if bits == 3 else 256, device=device)
    if bits == 3:  # the low plane's byte, then the four fields' third bits from bit 8 up
        fields = [(key >> 2 * f & 3) | (key >> 8 + f & 1) << 2 for f in range(4)]
    else:
        fields = [key >> bits * f & (1 << bits) - 1 for f in range(8 // bits)]
    return codebook(bits, group).centroids_tensor(device)[torch.stack(fields, dim=1)]


@functools.cache
def _third_bits(device: torch.device) -> torch.Tensor:
    """int64 [256, 2]: a turbo3 high-plane byte's third bits for its two low-plane bytes, each four at bit 8 up (see
    _keys)."""
    high = torch.arange(256, device=device)
    return torch.stack(((high & 3) | (high >> 2 & 12), (high >> 2 & 3) | (high >> 4 & 12)), dim=-1) << 8


def _keys(codes: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """int64 [..., keys]: a row's lookup keys in stored_order. turbo2/turbo4: its bytes. turbo3: each byte of the low
    plane with the third bits of its four fields above it. Byte j of a 32-value word of the high plane holds those
    bits for byte j of both 16-value words of the low plane (layout above): bits 0, 1, 4, 5 the first's, 2, 3, 6, 7
    the second's, in the order of the low byte's fields; one lookup per high byte splits them (_third_bits)."""
    if bits != 3:
        return codes.long()
    low = codes[..., : head_dim // 4].unflatten(-1, (head_dim // 32, 2, 4))
    high = codes[..., head_dim // 4 :].unflatten(-1, (head_dim // 32, 4))
    third = _third_bits(codes.device)[high.long()].transpose(-1, -2)  # [..., D / 32, 2, 4]
    return (low.long() | third).flatten(-3)


def dequantize_stored(codes: torch.Tensor, norms: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    """dequantize_rotated's values in stored_order, float32 [..., D]: one table lookup per byte of a row (per low byte
    for turbo3), the fastest torch decode. A dot product or a weighted sum over the values of many rows comes out
    the same in any order, so attention permutes its query (or its output) once instead of every cached row."""
    layout = RowLayout(kind, head_dim)
    table = _key_table(layout.bits, layout.group, codes.device)
    c = table.index_select(0, _keys(codes, layout.bits, head_dim).flatten())
    c = c.view(*codes.shape[:-1], layout.num_groups, layout.group)
    return (c * norms.float()[..., None]).flatten(-2)


def dequantize_rotated(codes: torch.Tensor, norms: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    """The rotated-domain values attention uses: norm * c[idx], float32 [..., D]."""
    values, bits = dequantize_stored(codes, norms, kind, head_dim), index_bits(kind)
    return values if bits == 4 else values[..., natural_order(bits, head_dim)]  # turbo4 stores the natural order


def dequantize_reference(codes: torch.Tensor, norms: torch.Tensor, kind: str, head_dim: int) -> torch.Tensor:
    """Back to the original domain: inverse rotation of each group, float32 [..., D]."""
    rotated = dequantize_rotated(codes, norms, kind, head_dim)
    return rotate_reference(rotated, group_size(head_dim), inverse=True)
