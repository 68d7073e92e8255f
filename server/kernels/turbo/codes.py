"""Triton device functions for the turbo row layout (format.py documents it) and codebook lookups.

Decoding, specs/turboquant.md "Decoding": a row's codes are read as 32-bit words and turned
into *nibble selectors*: 32-bit words whose nibble k holds one value's index (turbo2/turbo3:
index < 8 in bits 0-2, bit 3 clear; turbo4: the stored nibbles as they are). The row layout
(format.py) makes that one mask and at most one shift per bit plane.
  * fp16 operands (the GPU case): a byte-permute lookup. The fp16 centroids' low bytes and
    high bytes sit in 2 + 2 registers; PRMT picks 4 bytes by 4 selector nibbles, so 4 values
    cost 2 lookups + 2 interleaves (turbo4: 16 centroids = 2 tables of 8 and a byte select by
    index bit 3). ``ASM`` runs it as PTX; without it (the interpreter, non-NVIDIA targets) the
    same instruction sequence runs on a Triton model of PRMT, so CPU tests cover the layout.
  * float32 (fp32 queries): the nibbles are split out as indices and the codebook's odd
    polynomial evaluated (centroid_by_polynomial).
The store kernel (quantize.py) writes rows with store_indices.
"""

import functools

import torch
import triton
import triton.language as tl

from server.kernels.turbo.codebook import codebook

LOW2 = tl.constexpr(0x33333333)  # bits 0-1 of every nibble
BIT2 = tl.constexpr(0x44444444)  # bit 2 of every nibble

# The lookups run as pack=8 inline PTX over a selector broadcast to its 8 values: operands are
# $0-$3 the four fp16 pairs (values 0-7), then 8 copies of each input ($4 selector, $12 + 8 i
# table word i), so one asm instance writes whole 32-bit pairs that go to shared memory as they are.
def _ptx(body: str, tables: int) -> tl.constexpr:
    names = {"s": "$4", **{f"t{i}": f"${12 + 8 * i}" for i in range(tables)}}
    return tl.constexpr("{\n" + body.format(**names) + "}")


# prmt picks byte (nibble & 7) of {b, a}: low bytes of values 0-3 from {t1, t0}, high bytes from
# {t3, t2}; 0x5140 / 0x7362 interleave them into fp16 pairs. Nibbles 4-7: the selector >> 16.
_LOOKUP8_PTX = _ptx("""\
.reg .b32 tl_s, tl_l, tl_h;
prmt.b32 tl_l, {t0}, {t1}, {s};
prmt.b32 tl_h, {t2}, {t3}, {s};
prmt.b32 $0, tl_l, tl_h, 0x5140;
prmt.b32 $1, tl_l, tl_h, 0x7362;
shr.u32 tl_s, {s}, 16;
prmt.b32 tl_l, {t0}, {t1}, tl_s;
prmt.b32 tl_h, {t2}, {t3}, tl_s;
prmt.b32 $2, tl_l, tl_h, 0x5140;
prmt.b32 $3, tl_l, tl_h, 0x7362;
""", 4)

# turbo4: the stored word; t0-t3 hold centroids 0-7, t4-t7 centroids 8-15, both read with the low
# 3 bits. A byte mask from bit 3 (prmt's sign-replicate flag 8 on the byte whose top bit is that
# value's bit 3: w << 4 for even, w for odd nibbles) selects between them (lop3 0xD8: c ? b : a).
_LOOKUP16_HALF = """\
prmt.b32 tl_ln, {t0}, {t1}, tl_s;
prmt.b32 tl_lp, {t4}, {t5}, tl_s;
prmt.b32 tl_hn, {t2}, {t3}, tl_s;
prmt.b32 tl_hp, {t6}, {t7}, tl_s;
lop3.b32 tl_l, tl_ln, tl_lp, tl_m, 0xD8;
lop3.b32 tl_h, tl_hn, tl_hp, tl_m, 0xD8;
"""
_LOOKUP16_PTX = _ptx("""\
.reg .b32 tl_s, tl_w4, tl_m, tl_ln, tl_lp, tl_hn, tl_hp, tl_l, tl_h;
and.b32 tl_s, {s}, 0x77777777;
shl.b32 tl_w4, {s}, 4;
prmt.b32 tl_m, tl_w4, {s}, 0xD9C8;
""" + _LOOKUP16_HALF + """\
prmt.b32 $0, tl_l, tl_h, 0x5140;
prmt.b32 $1, tl_l, tl_h, 0x7362;
prmt.b32 tl_m, tl_w4, {s}, 0xFBEA;
shr.u32 tl_s, tl_s, 16;
""" + _LOOKUP16_HALF + """\
prmt.b32 $2, tl_l, tl_h, 0x5140;
prmt.b32 $3, tl_l, tl_h, 0x7362;
""", 8)


@functools.cache
def lookup_table(bits: int, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [8]: the fp16 centroids as the PRMT lookup's byte tables (see _LOOKUP8_PTX / _LOOKUP16_PTX).

    Words 0-3: low bytes of centroids 0-3, of 4-7, high bytes of 0-3, of 4-7 (missing centroids
    are 0); turbo4 continues with the same four words for centroids 8-15. Cached per device: the
    eager warm-up before a CUDA-graph capture builds it, the capture only reads it.
    """
    halves = torch.tensor(codebook(bits, group).centroids, dtype=torch.float16).view(torch.int16).int() & 0xFFFF
    halves = torch.cat([halves, torch.zeros(max(0, 8 - len(halves)), dtype=torch.int32)])
    words = []
    for table in halves.reshape(-1, 8):
        for part in (table & 0xFF, table >> 8):
            for quad in part.reshape(2, 4):
                words.append(sum(int(b) << (8 * i) for i, b in enumerate(quad.tolist())))
    words += [0] * (8 - len(words))
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32, device=device)


@triton.jit
def pack_words(fields, ROWS: tl.constexpr, N: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, N] int32 fields of WIDTH bits -> [ROWS, N * WIDTH / 32] words: nibble k of a word holds
    its values k, k + 8, ... (format.py)."""
    PER_NIBBLE: tl.constexpr = 4 // WIDTH
    f = tl.reshape(fields, (ROWS, N * WIDTH // 32, PER_NIBBLE, 8))
    shifts = 4 * tl.arange(0, 8)[None, :] + WIDTH * tl.arange(0, PER_NIBBLE)[:, None]
    return tl.sum(tl.sum(f << shifts[None, None, :, :], axis=3), axis=2)


@triton.jit
def split_words(words, WIDTH: tl.constexpr, LEVELS: tl.constexpr):
    """[R, C] int32 words -> [R, C, 2^LEVELS]: field k of each word at bit 0 (NOT masked).

    A halving tree of tl.join: level l pairs every word with itself shifted right by half of
    its remaining fields, so field k = sum of the level choices ends up at position k. The
    joined axes stay inside the thread that loaded the word: about one shift per value and no
    shared-memory round trip.
    """
    x = tl.join(words, words >> (WIDTH << (LEVELS - 1)))
    for level in tl.static_range(1, LEVELS):
        x = tl.join(x, x >> (WIDTH << (LEVELS - 1 - level)))
    return tl.reshape(x, (words.shape[0], words.shape[1], 1 << LEVELS))


@triton.jit
def _prmt_model(a, b, sel):
    """PTX prmt.b32 (default mode) in Triton: byte k = byte (nibble k & 7) of {b, a}, or that
    byte's sign replicated when nibble k & 8."""
    out = (a & 0) | (b & 0) | (sel & 0)  # the broadcast shape of the three
    for k in tl.static_range(4):
        n = (sel >> (4 * k)) & 15
        byte = (tl.where((n & 4) != 0, b, a) >> (8 * (n & 3))) & 0xFF
        byte = tl.where((n & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * k)
    return out


@triton.jit
def _fp16_pair(p):
    """An int32 holding two fp16 -> (low half, high half) as float16."""
    return (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True), (p >> 16).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _interleaved_model(lo, hi):
    """Four fp16 from their low-byte word and high-byte word (the 0x5140 / 0x7362 prmts)."""
    v0, v1 = _fp16_pair(_prmt_model(lo, hi, 0x5140))
    v2, v3 = _fp16_pair(_prmt_model(lo, hi, 0x7362))
    return v0, v1, v2, v3


@triton.jit
def _lookup8_model(sel, t0, t1, t2, t3):
    v0, v1, v2, v3 = _interleaved_model(_prmt_model(t0, t1, sel), _prmt_model(t2, t3, sel))
    s = (sel >> 16) & 0xFFFF
    v4, v5, v6, v7 = _interleaved_model(_prmt_model(t0, t1, s), _prmt_model(t2, t3, s))
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _select_model(neg, pos, mask):
    return (neg & ~mask) | (pos & mask)


@triton.jit
def _lookup16_model(w, t0, t1, t2, t3, t4, t5, t6, t7):
    s = w & 0x77777777
    w4 = w << 4
    m = _prmt_model(w4, w, 0xD9C8)
    lo = _select_model(_prmt_model(t0, t1, s), _prmt_model(t4, t5, s), m)
    hi = _select_model(_prmt_model(t2, t3, s), _prmt_model(t6, t7, s), m)
    v0, v1, v2, v3 = _interleaved_model(lo, hi)
    m = _prmt_model(w4, w, 0xFBEA)
    s = (s >> 16) & 0xFFFF
    lo = _select_model(_prmt_model(t0, t1, s), _prmt_model(t4, t5, s), m)
    hi = _select_model(_prmt_model(t2, t3, s), _prmt_model(t6, t7, s), m)
    v4, v5, v6, v7 = _interleaved_model(lo, hi)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [R, C] tensors -> [R, C, 8] in this order (each join level picks one bit of the position)."""
    x = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(x, (v0.shape[0], v0.shape[1], 8))


@triton.jit
def _table_word(table_ptr, i: tl.constexpr, ASM: tl.constexpr):
    """Word i of the lookup table, held in a per-thread register on the GPU.

    PRMT cannot read a uniform register in its table slots, so for a uniform word ptxas copies
    it before every lookup (sm_90 SASS: 0.5 instructions per value). OR-ing in thread index &
    (pointer >> 63), a zero ptxas cannot prove, makes the word per-thread: loaded once, kept.
    """
    word = tl.load(table_ptr + i)
    if ASM:
        word = tl.inline_asm_elementwise("{.reg .u32 t; mov.u32 t, %tid.x; and.b32 t, t, $2; or.b32 $0, $1, t;}",
                                         "=r,r,r", [word, (table_ptr.to(tl.int64) >> 63).to(tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return word


@triton.jit
def _broadcast8(x):
    """[R, C] -> [R, C, 8], every value 8 times inside its thread (joins keep the new axis in-thread)."""
    return _join8(x, x, x, x, x, x, x, x)


@triton.jit
def _expand(sel, table_ptr, BITS: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr):
    """Selector words [R, C] -> [R, C, 8]: fp16 centroids (LOOKUP) or int32 indices of nibbles 0-7."""
    if not LOOKUP:
        x = split_words(sel, 4, 3) & ((1 << BITS) - 1)
    else:
        t0 = _table_word(table_ptr, 0, ASM)
        t1 = _table_word(table_ptr, 1, ASM)
        t2 = _table_word(table_ptr, 2, ASM)
        t3 = _table_word(table_ptr, 3, ASM)
        if BITS == 4:
            t4 = _table_word(table_ptr, 4, ASM)
            t5 = _table_word(table_ptr, 5, ASM)
            t6 = _table_word(table_ptr, 6, ASM)
            t7 = _table_word(table_ptr, 7, ASM)
            if ASM:
                x = tl.inline_asm_elementwise(_LOOKUP16_PTX, "=r,=r,=r,=r" + ",r" * 72,
                                              [_broadcast8(sel), t0, t1, t2, t3, t4, t5, t6, t7],
                                              dtype=tl.float16, is_pure=True, pack=8)
            else:
                x = _join8(*_lookup16_model(sel, t0, t1, t2, t3, t4, t5, t6, t7))
        else:
            if ASM:
                x = tl.inline_asm_elementwise(_LOOKUP8_PTX, "=r,=r,=r,=r" + ",r" * 40, [_broadcast8(sel), t0, t1, t2, t3],
                                              dtype=tl.float16, is_pure=True, pack=8)
            else:
                x = _join8(*_lookup8_model(sel, t0, t1, t2, t3))
    return x


@triton.jit
def decode_rows(row_ptrs, mask, table_ptr, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                LOOKUP: tl.constexpr, ASM: tl.constexpr = False):
    """The rows starting at row_ptrs [ROWS] (uint8 pointers, 4-byte aligned as format.py's rows are)
    -> [ROWS, D]: fp16 centroids from the lookup table at table_ptr (LOOKUP), else int32 indices.

    Masked rows read as code 0. Selector j of a word group covers 8 consecutive values (format.py):
      turbo2: word w -> w & LOW2 (values 0-7 of the word), (w >> 2) & LOW2 (values 8-15);
      turbo3: low words w0, w1 and high word h of 32 values -> selector j (values 8j + k) takes its
              low bits from w0, w0 >> 2, w1, w1 >> 2 and bit 2 from h << 2, h << 1, h, h >> 1;
      turbo4: the stored word.
    """
    words_ptrs = row_ptrs.to(tl.pointer_type(tl.int32))
    if BITS == 3:
        low = tl.load(words_ptrs[:, None, None] + (2 * tl.arange(0, D // 32)[None, :, None] + tl.arange(0, 2)[None, None, :]),
                      mask=mask[:, None, None], other=0)
        w0, w1 = tl.split(low)
        h = tl.load(words_ptrs[:, None] + D // 16 + tl.arange(0, D // 32)[None, :], mask=mask[:, None], other=0)
        a = _expand((w0 & LOW2) | ((h << 2) & BIT2), table_ptr, BITS, LOOKUP, ASM)
        b = _expand(((w0 >> 2) & LOW2) | ((h << 1) & BIT2), table_ptr, BITS, LOOKUP, ASM)
        c = _expand((w1 & LOW2) | (h & BIT2), table_ptr, BITS, LOOKUP, ASM)
        d = _expand(((w1 >> 2) & LOW2) | ((h >> 1) & BIT2), table_ptr, BITS, LOOKUP, ASM)
        # [R, D/32, 8 (k), 2 (a/c), 2 (ac/bd)] -> [R, D/32, 2, 2, 8]: position 16 (c|d) + 8 (b|d) + k
        x = tl.permute(tl.join(tl.join(a, c), tl.join(b, d)), (0, 1, 3, 4, 2))
    elif BITS == 2:
        w = tl.load(words_ptrs[:, None] + tl.arange(0, D // 16)[None, :], mask=mask[:, None], other=0)
        x = tl.join(_expand(w & LOW2, table_ptr, BITS, LOOKUP, ASM),
                    _expand((w >> 2) & LOW2, table_ptr, BITS, LOOKUP, ASM))
        x = tl.permute(x, (0, 1, 3, 2))  # position 8j + k
    else:
        w = tl.load(words_ptrs[:, None] + tl.arange(0, D // 8)[None, :], mask=mask[:, None], other=0)
        x = _expand(w, table_ptr, BITS, LOOKUP, ASM)
    return tl.reshape(x, (ROWS, D))


@triton.jit
def store_indices(idx, row_ptrs, mask, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack indices [ROWS, D] into the rows starting at row_ptrs [ROWS] (4-byte aligned; inverse of decode_rows)."""
    words_ptrs = row_ptrs.to(tl.pointer_type(tl.int32))
    if BITS == 3:
        low = pack_words(idx & 3, ROWS, D, 2)
        tl.store(words_ptrs[:, None] + tl.arange(0, D // 16)[None, :], low, mask=mask[:, None])
        high = pack_words(idx >> 2, ROWS, D, 1)
        tl.store(words_ptrs[:, None] + D // 16 + tl.arange(0, D // 32)[None, :], high, mask=mask[:, None])
    else:
        packed = pack_words(idx, ROWS, D, BITS)
        tl.store(words_ptrs[:, None] + tl.arange(0, D * BITS // 32)[None, :], packed, mask=mask[:, None])


@triton.jit
def centroid_by_polynomial(idx, coef_ptr, BITS: tl.constexpr):
    """centroids[idx] as float32 from Codebook.odd_polynomial (coefficients at coef_ptr), ~1e-7 relative.

    2 idx + 1 becomes a float by OR-ing it into the mantissa of 2^23 and one exact subtraction
    (no int-to-float conversion, a quarter-rate instruction on sm_90).
    """
    HALF: tl.constexpr = 1 << (BITS - 1)
    LAST: tl.constexpr = (1 << BITS) - 1
    odd = ((idx << 1) | 0x4B000001).to(tl.float32, bitcast=True) - (8388609.0 + LAST)  # 2 idx - LAST, exact
    t = odd * (1.0 / LAST)
    t2 = t * t
    acc = tl.zeros(idx.shape, tl.float32) + tl.load(coef_ptr + HALF - 1)
    for j in tl.static_range(HALF - 1):
        acc = acc * t2 + tl.load(coef_ptr + HALF - 2 - j)
    return acc * t
