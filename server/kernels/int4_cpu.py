"""4-bit weights multiplied as they are stored, on a CPU: ggml's Q4_0 / Q4_1 blocks through torch's int4 kernel.

A float32 GEMV streams 4 bytes a weight; the embedded SmolLM2's MLPs (Q4_1 in its GGUF) took ~11 ms of a ~30 ms
CPU decode step that way. torch's ``_weight_int4pack_mm_for_cpu`` reads half a byte a weight plus a scale and a
zero per group of 32 inputs, and means

    w = (q - 8) * scale + zero,   q in 0..15,

which is Q4_1's d * q + m with scale = d, zero = m + 8 d, and Q4_0's d * (q - 8) with zero = 0. Its fast path
takes bfloat16 activations, scales and zeros (float16 and float32 take a scalar path, 30-40x slower on the 2-core
CI machine): the scales and zeros round to bfloat16 (a relative 2^-9, a few percent of a quantization step) and
the activations are rounded to bfloat16 for the product. `int4_linear_reference` is that meaning in float32.
Products of many rows (prompt chunks) take a GEMM on the weight dequantized exactly (`int4_linear`): in float32,
or, where the CPU multiplies bf16 natively, in bfloat16 on a copy rounded once (4-5x faster;
backend.cpu_multiplies_bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # inputs per scale and zero: one ggml block
KINDS = ("Q4_0", "Q4_1")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d [, fp16 m], 16 bytes of nibbles
ROWS_MULTIPLE = 16  # the packing takes whole tiles of 16 output rows
# Rows of x up to which the int4 kernel beats dequantizing (576 x 3072 on the 2-core CPU: 1.3 ms against 1.2 at 64
# rows, 0.35 against 0.9 at 16)
INT4_ROWS = 32


def supported() -> bool:
    """Whether this torch has the CPU int4 kernel (torch 2.6 and later)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass
class Int4Codes:
    """Unpacked 4-bit weights: w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    q: torch.Tensor  # int32 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K / 32]
    zero: torch.Tensor  # float32 [N, K / 32]

    @staticmethod
    def from_ggml(blocks: torch.Tensor, kind: str) -> Int4Codes:
        """uint8 [N, K / 32 * block bytes], rows of ggml Q4_0 / Q4_1 blocks. In a block, byte j holds value j in
        its low nibble and value j + 16 in its high one."""
        if kind not in KINDS:
            raise ValueError(f"not a 4-bit ggml block type: {kind!r}; expected one of {', '.join(KINDS)}")
        size = _BLOCK_BYTES[kind]
        rows = blocks.shape[0]
        b = blocks.reshape(rows, -1, size)
        d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
        nibbles = b[..., size - 16 :].to(torch.int32)
        q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(rows, -1)
        if kind == "Q4_0":
            return Int4Codes(q, d, torch.zeros_like(d))
        m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        return Int4Codes(q, d, m + 8 * d)

    @staticmethod
    def cat(parts: list[Int4Codes]) -> Int4Codes:
        """Rows of several weights as one (e.g. gate and up, multiplied together)."""
        return Int4Codes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (exact in float64: fp16 scales times small integers)."""
        n, k = self.q.shape
        blocks = self.q.reshape(n, k // GROUP, GROUP).float()
        return ((blocks - 8) * self.scale[..., None] + self.zero[..., None]).reshape(n, k)


@dataclass
class Int4Weight:
    """What the kernel reads: the codes in torch's CPU int4 packing, scales and zeros as bfloat16 [K / 32, N, 2];
    the codes a byte each with their exact scales, which many-row products dequantize (int4_linear); and, where
    those products run in bfloat16, the dequantized weight rounded to it once (``dense``)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    codes: Int4Codes
    out_features: int
    in_features: int
    dense: torch.Tensor | None = None

    @staticmethod
    def pack(codes: Int4Codes, bf16_prompts: bool = False) -> Int4Weight:
        """bf16_prompts: multiply many-row products in bfloat16 (backend.cpu_multiplies_bf16)."""
        n, k = codes.q.shape
        if k % GROUP:
            raise ValueError(f"in_features {k} is not a multiple of the {GROUP}-input group")
        pad = -n % ROWS_MULTIPLE  # rows of zero weight (scale and zero 0), cut from the output
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (codes.q, codes.scale, codes.zero))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        dense = codes.dequantize().to(torch.bfloat16) if bf16_prompts else None
        return Int4Weight(packed, sz, Int4Codes(codes.q.to(torch.uint8), codes.scale, codes.zero), n, k, dense)

    def rounded_codes(self, q: torch.Tensor) -> Int4Codes:
        """The codes with the scales and zeros this weight multiplies by (bfloat16-rounded), for references."""
        sz = self.scales_and_zeros[:, : self.out_features].float()
        return Int4Codes(q, sz[..., 0].t(), sz[..., 1].t())


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [T, K] @ w^T -> [T, N] in x's dtype. Up to INT4_ROWS rows through the int4 kernel; more (a prompt's
    chunk) through a GEMM on the file's exact values: the int4 kernel is a GEMV at heart (576 x 3072, 2048 rows:
    42 ms against 19 ms in float32 with the ~1 ms dequantize, 2-core CPU). That GEMM takes ``w.dense`` and x
    rounded to bfloat16 where the weight keeps one, else the weight dequantized for the call in x's dtype."""
    if x.shape[0] > INT4_ROWS:
        if w.dense is not None:
            return F.linear(x.to(torch.bfloat16), w.dense).to(x.dtype)
        return F.linear(x, w.codes.dequantize().to(x.dtype))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), w.packed, GROUP,
                                                   w.scales_and_zeros)  # fmt: skip
    return y[:, : w.out_features].to(x.dtype)


def int4_linear_reference(x: torch.Tensor, codes: Int4Codes) -> torch.Tensor:
    """The meaning of int4_linear for up to INT4_ROWS rows, for weights packed from ``codes``' rounded_codes:
    bfloat16 activations, the products and sums in float32."""
    return (x.to(torch.bfloat16).float() @ codes.dequantize().t()).to(x.dtype)
