"""Quantized expert weights: one projection of every expert of a layer, logically [E, N, K].

y = x · Wᵀ with W [N out, K in]. Stored tensors per format (specs/expert-formats.md, "Formats"):
  e8p   codes int16 [E, N, K/8] (one E8P code per 8 inputs), scale fp16 [E, N]
  e8p3  e8p's tensors + residual uint8 [E, N, K/8]
  q1_0  codes uint8 [E, N, K/8],  d fp16 [E, N, K/128]   (GGUF blocks, split; see qblocks.py)
  q2_0  codes uint8 [E, N, K/4],  d fp16 [E, N, K/64]
  bf16  weight bf16 [E, N, K]
Codes run along K, contiguous, so a kernel tile is a run of aligned wide loads.

Incoherence ("Incoherence" in the spec): the quantizer stores rotate(w_row) for every row,
with one randomized Hadamard rotation R per projection (its sign words kept here). As R is
orthogonal, W·x = (W·Rᵀ)·(R·x), so callers rotate x once with `rotate_input` and multiply by
the stored weights directly. GGUF q1_0/q2_0 tensors come unrotated (signs None).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from server.kernels import rotation
from server.kernels.experts import e8p, qblocks

FORMATS = ("e8p", "e8p3", "q1_0", "q2_0", "bf16")
MAX_ROTATION_GROUP = 256
# Std of the weights each E8 codebook fits best (argmin of the N(0,1) distortion over the
# global scale, spec "Measured distortion"); a row is divided by rms/this before encoding.
_E8_FIT_STD = {"e8p": 1.04, "e8p3": 0.99}


@dataclass
class ExpertWeights:
    format: str
    shape: tuple[int, int, int]  # (experts, out rows N, in cols K)
    tensors: dict[str, torch.Tensor]
    signs: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # input rotation (first, second words)
    group: int = 0  # rotation group; 0 when unrotated

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def to(self, device: torch.device | str) -> "ExpertWeights":
        return replace(self, tensors={k: v.to(device) for k, v in self.tensors.items()})

    def packed_bytes(self, experts: int | None = None) -> int:
        """Bytes a kernel streams for ``experts`` experts (default all), scales included."""
        total = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return total * (experts if experts is not None else self.shape[0]) // self.shape[0]

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> the activations these stored weights multiply (R·x, or x when unrotated)."""
        if self.signs is None:
            return x
        return rotation.rotate(x, self.group, signs=self.signs)

    def dequantize(self, experts: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
        """Reference decode of the stored (rotated-domain) weights -> [e, N, K] in ``dtype``."""
        t = self.tensors if experts is None else {k: v[experts] for k, v in self.tensors.items()}
        n, k = self.shape[1], self.shape[2]
        if self.format == "bf16":
            return t["weight"].to(dtype)
        if self.format in qblocks.BLOCK_FORMATS:
            return qblocks.dequantize(qblocks.BLOCK_FORMATS[self.format], t["d"], t["codes"], dtype)
        w = e8p.decode(t["codes"], dtype)
        if self.format == "e8p3":
            w = w + e8p.decode_residual(t["residual"], dtype)
        w = w.reshape(-1, n, k)
        return w * t["scale"].to(dtype)[..., None]


def bits_per_weight(fmt: str) -> float:
    """The spec's table (scales of the E8 formats excluded, as there)."""
    return {"e8p": 2.0, "e8p3": 3.0, "q1_0": 1.125, "q2_0": 2.25, "bf16": 16.0}[fmt]


def rotation_group(k: int) -> int:
    """Largest power of two dividing k, capped: the blocks of the block-diagonal rotation."""
    return min(k & -k, MAX_ROTATION_GROUP)


def check_shape(fmt: str, k: int) -> None:
    """Raise ValueError unless rows of length k fit the format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    unit = {"e8p": 8, "e8p3": 8, "q1_0": 128, "q2_0": 64, "bf16": 1}[fmt]
    if k % unit:
        raise ValueError(f"format {fmt} packs rows in units of {unit} weights; input width {k} is not a multiple")
    if fmt in ("e8p", "e8p3") and rotation_group(k) < 8:
        raise ValueError(f"format {fmt} needs an input width divisible by 8 for its rotation; got {k}")


def random_signs(group: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two packed sign tables of ``group`` bits (at least one 32-bit word each) from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    words = max(1, group // 32)
    draw = torch.randint(0, 1 << 32, (2, words), generator=gen, dtype=torch.int64)
    return tuple(int(v) for v in draw[0]), tuple(int(v) for v in draw[1])


def quantize(w: torch.Tensor, fmt: str, seed: int = 0, rotate: bool = True) -> ExpertWeights:
    """w [E, N, K] (or [N, K]: one expert) float -> ExpertWeights in ``fmt``.

    ``seed`` picks the rotation's signs: give each (layer, projection) its own. bf16 is
    never rotated (it is the exact baseline).
    """
    if w.ndim == 2:
        w = w[None]
    num_e, n, k = w.shape
    check_shape(fmt, k)
    if fmt == "bf16":
        return ExpertWeights(fmt, (num_e, n, k), {"weight": w.to(torch.bfloat16).contiguous()})
    signs, group = None, 0
    if rotate:
        group = rotation_group(k)
        signs = random_signs(group, seed)
        w = rotation.rotate_reference(w.float(), group, signs=signs)
    w = w.float()
    if fmt in qblocks.BLOCK_FORMATS:
        d, codes = qblocks.quantize(qblocks.BLOCK_FORMATS[fmt], w)
        tensors = {"codes": codes.contiguous(), "d": d.contiguous()}
    else:
        tensors = _quantize_e8(w, fmt)
    return ExpertWeights(fmt, (num_e, n, k), tensors, signs, group)


def _quantize_e8(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    num_e, n, k = w.shape
    rms = w.pow(2).mean(-1).sqrt().clamp_min(1e-12)  # [E, N]
    fit = rms / _E8_FIT_STD[fmt]
    groups = (w / fit[..., None]).reshape(-1, 8)
    codes = e8p.encode(groups)
    points = e8p.decode(codes)
    tensors = {"codes": codes.reshape(num_e, n, k // 8)}
    if fmt == "e8p3":
        residual = e8p.encode_residual(groups - points)
        points = points + e8p.decode_residual(residual)
        tensors["residual"] = residual.reshape(num_e, n, k // 8)
    q = points.reshape(num_e, n, k)
    # Codes fixed, the row scale minimizing ||w - s·q||² is <w,q>/<q,q>; never worse than `fit`.
    qq = q.pow(2).sum(-1)
    scale = torch.where(qq > 0, (w * q).sum(-1) / qq.clamp_min(1e-30), fit)
    tensors["scale"] = scale.to(torch.float16)
    return {name: t.contiguous() for name, t in tensors.items()}


def from_gguf(fmt: str, raw: torch.Tensor, n: int, k: int) -> ExpertWeights:
    """Raw GGUF q1_0/q2_0 block bytes of an [E, N, K] or [N, K] tensor -> ExpertWeights (no re-quantizing)."""
    if fmt not in qblocks.BLOCK_FORMATS:
        raise ValueError(f"only q1_0/q2_0 GGUF tensors are used as is, not {fmt!r}")
    bf = qblocks.BLOCK_FORMATS[fmt]
    row_bytes = k // bf.block * (2 + bf.code_bytes)
    if k % bf.block or raw.numel() % (n * row_bytes):
        raise ValueError(f"{fmt}: {raw.numel()} bytes are not whole [{n}, {k}] matrices of {bf.block}-weight blocks")
    d, codes = qblocks.from_gguf_blocks(bf, raw.reshape(-1, n, row_bytes), k)
    return ExpertWeights(fmt, (d.shape[0], n, k), {"codes": codes, "d": d})
