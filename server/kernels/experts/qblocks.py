"""q1_0 and q2_0: llama.cpp's 1- and 2-bit block formats (GGML types 41 and 42).

On disk (GGUF) a block is an fp16 scale d followed by 16 bytes of codes, LSB first:
  q1_0: 128 weights, bit j of byte j/8 set -> +d, clear -> -d           (18 bytes / 128)
  q2_0:  64 weights, 2 bits j of byte j/4 -> (code - 1)·d, code in 0..3  (18 bytes / 64)
In memory we keep the same bytes split in two arrays, d [..., K/block] and codes
[..., K*bits/8], so kernels load codes as aligned 32-bit words instead of 18-byte
records. `to_gguf_blocks` / `from_gguf_blocks` convert losslessly, so a GGUF tensor is
used as is, without re-quantizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GGML_TYPE = {"q1_0": 41, "q2_0": 42}


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block: int  # weights per fp16 scale
    bits: int  # bits per weight code

    @property
    def code_bytes(self) -> int:
        return self.block * self.bits // 8  # 16 for both


Q1_0 = BlockFormat("q1_0", 128, 1)
Q2_0 = BlockFormat("q2_0", 64, 2)
BLOCK_FORMATS = {f.name: f for f in (Q1_0, Q2_0)}
_Q2_SCALE_GRID = torch.linspace(0.5, 1.25, 16)  # candidate d, as fractions of the level-fitting d


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., n] uint8 -> [..., n * 8 / bits] int64 values, LSB first within each byte."""
    shifts = torch.arange(0, 8, bits, device=codes.device)
    vals = (codes.long()[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.flatten(-2)


def pack_codes(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of unpack_codes: [..., m] ints < 2**bits -> [..., m * bits / 8] uint8."""
    per_byte = 8 // bits
    v = vals.long().reshape(*vals.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, device=vals.device)
    return (v << shifts).sum(-1).to(torch.uint8)


def dequantize(fmt: BlockFormat, d: torch.Tensor, codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """d [..., K/block] fp16, codes [..., K*bits/8] uint8 -> weights [..., K]."""
    c = unpack_codes(codes, fmt.bits).to(dtype)
    levels = 2 * c - 1 if fmt.bits == 1 else c - 1  # q1_0: ±1; q2_0: -1, 0, 1, 2
    scale = d.to(dtype).repeat_interleave(fmt.block, dim=-1)
    return levels * scale


def quantize(fmt: BlockFormat, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of the block) -> (d fp16 [..., K/block], codes uint8) minimizing block MSE."""
    if w.shape[-1] % fmt.block:
        raise ValueError(f"{fmt.name} needs rows whose length is a multiple of {fmt.block}, got {w.shape[-1]}")
    blocks = w.float().reshape(*w.shape[:-1], -1, fmt.block)
    if fmt.bits == 1:
        d = blocks.abs().mean(-1).half()  # the MSE-optimal magnitude for ±d
        codes = (blocks >= 0).long()
    else:
        d, codes = _quantize_q2(blocks)
    return d, pack_codes(codes.flatten(-2), fmt.bits)


def _quantize_q2(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels (code - 1)·d are {-1, 0, 1, 2}·d: asymmetric, so try both signs of d and a grid of sizes."""
    lo, hi = -blocks.amin(-1), blocks.amax(-1)
    best_err, best_d, best_codes = None, None, None
    for sign, fit in ((1.0, torch.maximum(lo, hi / 2)), (-1.0, torch.maximum(hi, lo / 2))):
        for frac in _Q2_SCALE_GRID:
            d = (sign * fit * frac).half().float()
            safe = torch.where(d == 0, torch.ones_like(d), d)
            codes = (torch.round(blocks / safe[..., None]) + 1).clamp(0, 3)
            err = ((codes - 1) * d[..., None] - blocks).pow(2).sum(-1)
            if best_err is None:
                best_err, best_d, best_codes = err, d, codes
            else:
                take = err < best_err
                best_err = torch.where(take, err, best_err)
                best_d = torch.where(take, d, best_d)
                best_codes = torch.where(take[..., None], codes, best_codes)
    return best_d.half(), best_codes.long()


def to_gguf_blocks(fmt: BlockFormat, d: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Split arrays -> GGUF bytes [..., K/block * 18] uint8 (d little-endian, then the codes)."""
    nb = d.shape[-1]
    d_bytes = d.contiguous().view(torch.uint8).reshape(*d.shape, 2)
    c = codes.reshape(*codes.shape[:-1], nb, fmt.code_bytes)
    return torch.cat([d_bytes, c], -1).reshape(*d.shape[:-1], nb * (2 + fmt.code_bytes))


def from_gguf_blocks(fmt: BlockFormat, raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF bytes [..., K/block * 18] uint8 -> (d fp16 [..., K/block], codes uint8 [..., K*bits/8])."""
    if k % fmt.block or raw.shape[-1] != k // fmt.block * (2 + fmt.code_bytes):
        raise ValueError(
            f"{fmt.name}: a row of {k} weights needs {k // fmt.block} blocks of {2 + fmt.code_bytes} bytes, "
            f"got {raw.shape[-1]} bytes"
        )
    blocks = raw.reshape(*raw.shape[:-1], k // fmt.block, 2 + fmt.code_bytes)
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    codes = blocks[..., 2:].reshape(*raw.shape[:-1], -1).contiguous()
    return d, codes
