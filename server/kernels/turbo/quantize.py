"""The store kernel: one launch quantizes a step's new K and V into their turbo pages.

Per (token, KV head) row and per group (format.py): norm n, rotate (rotation.py's butterflies),
nearest centroid, norm correction n / ||c||, pack (codes.store_indices), and scatter to the
token's slot. Program axis 1 picks K (0) or V (1), whose kinds may differ. Keys first lose their
offset o(p) (key_offset.py, computed here from the token's position): what is quantized is k - o(p).

Where the instructions go (sm_90 SASS per stored value: `python bench/turbo_store_sass.py`): the
rotation's butterflies are the floor; everything else is kept to a few selects per value:
  * each group is loaded as two halves that Triton lays out alike, so the last butterfly stage
    (h = G/2) pairs values inside one thread: one shuffle stage fewer, and the row sums cover
    twice the values per thread;
  * no division: the rotation is linear, so the unnormalized group is rotated and compared with
    the midpoints scaled by n (one multiply per midpoint and group, not one per value);
  * nearest centroid as a branch-free binary search over the magnitude |y| (the codebook is
    symmetric, specs/turboquant.md "Codebook"): BITS compares and 2^(BITS-1) - BITS selects, where
    counting all 2^BITS - 1 midpoints took three instructions per midpoint;
  * ||c||^2 sums c^2 picked from the 2^(BITS-1) magnitudes by the search's own bits.
The result equals quantize_reference up to rounding order (n scales the midpoints instead of
dividing y; float sums in the butterfly order): a value within an ulp of a midpoint may land on
the other side. An exact tie goes to the upper index on both sides, as the spec rules: below zero
the upper index is the smaller magnitude, so there |y| is compared one ulp smaller. A zero group
(n == 0) gets index 0 everywhere and norm 0 like the reference: its sign threshold is +inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from server.kernels import pdl
from server.kernels.backend import inline_ptx, multiprocessors
from server.kernels.pdl import gdc_launch_dependents, gdc_wait
from server.kernels.rotation import fwht_rows, sign_masks
from server.kernels.timing import timed
from server.kernels.turbo.codes import store_indices
from server.kernels.turbo.format import group_size
from server.kernels.turbo.key_offset import KeyOffset
from server.kernels.turbo.recent import RecentWindow
from server.kernels.turbo.sincos import sincos
from server.kernels.turbo.store_cuda import fills_a_wave, store_turbo_cuda


@dataclass(frozen=True)
class StoreLaunch:
    """How the store kernel is launched; the defaults are what the engine uses, the rest is for the bench sweep.

    Each of K and V gets ``programs_per_sm`` programs per SM (one per tile when there are fewer tiles),
    each looping over tiles of ``rows`` token-head rows, so the sign patterns and the codebook are loaded
    once per program (the compiler cannot hoist loads past the stores); a call whose tiles of ``small_rows``
    rows give every program at most one (decode steps) takes those, so its few rows spread over more
    programs. ``stages`` > 1 prefetches the next tiles' K/V (cp.async); ``max_registers`` caps registers
    for more programs per SM. ``pdl``: a programmatic dependent launch (server/kernels/pdl.py), so a decode
    step's store is scheduled while the qkv projection before it (which lets dependents start at once) still
    runs, and waits for it on the device.
    """

    rows: int = 32  # fastest on the H200 for turbo3, second for turbo4 (docs/BENCHMARKS.md, 01:39 UTC)
    # H200 2026-11-30 10:49 UTC, bench/turbo_b1_sweep.py, one token x 8 KV heads of turbo3 with the partial key
    # offset, microseconds a layer in a decode graph: rows 32 / 4 warps 3.84 (3.56 with pdl), rows 8 / 4 warps
    # 2.27, rows 8 / 2 warps 2.99 (2.75 with pdl)
    small_rows: int = 8
    programs_per_sm: int = 4
    num_warps: int = 4
    stages: int = 1
    max_registers: int | None = 128  # H200 01:49 UTC: turbo3 0.162 vs 0.180 ms uncapped, turbo4 0.192 vs 0.199
    pdl: bool = True


STORE_LAUNCH = StoreLaunch()
INTERPRETER_PROGRAMS = 2  # on CPU: few programs, so the tests run the tile loop more than once


@dataclass
class TurboPages:
    """One layer's K or V pages: codes [pages, kv_heads, page_size, row_bytes] uint8, norms [..., groups] fp16."""

    codes: torch.Tensor
    norms: torch.Tensor
    bits: int
    centroids: torch.Tensor  # float32 [2^bits]
    midpoints: torch.Tensor  # float32 [2^bits - 1]
    polynomial: torch.Tensor  # float32 [2^(bits-1)]: Codebook.odd_polynomial, what attention decodes with


@triton.jit
def _pick(bit, if_set, if_clear):
    return tl.where(bit, if_set, if_clear)


@triton.jit
def _half_entry(ptr, first, i: tl.constexpr, count: tl.constexpr):
    """ptr[first + i] as a float32 scalar, 0.0 from i = count on (smaller codebooks)."""
    return tl.load(ptr + first + i, mask=i < count, other=0.0)


@triton.jit
def _magnitude_search(a, n, p1, p2, p3, p4, p5, p6, p7, q0, q1, q2, q3, q4, q5, q6, q7, BITS: tl.constexpr):
    """(j, c^2) for |y| = a [R, G] and group norms n [R, 1]: j in [0, 2^(BITS-1)) counts the positive
    midpoints p1 < p2 < ... (times n) that are <= a; c^2 = q_j, the squared centroid j above the middle."""
    if BITS == 2:
        j0 = a >= p1 * n
        j = j0.to(tl.int32)
        c2 = _pick(j0, q1, q0)
    elif BITS == 3:
        j1 = a >= p2 * n
        j0 = a >= _pick(j1, p3 * n, p1 * n)
        j = j1.to(tl.int32) * 2 + j0.to(tl.int32)
        c2 = _pick(j1, _pick(j0, q3, q2), _pick(j0, q1, q0))
    else:
        j2 = a >= p4 * n
        j1 = a >= _pick(j2, p6 * n, p2 * n)
        j0 = a >= _pick(j2, _pick(j1, p7 * n, p5 * n), _pick(j1, p3 * n, p1 * n))
        j = j2.to(tl.int32) * 4 + j1.to(tl.int32) * 2 + j0.to(tl.int32)
        c2 = _pick(j2, _pick(j1, _pick(j0, q7, q6), _pick(j0, q5, q4)),
                   _pick(j1, _pick(j0, q3, q2), _pick(j0, q1, q0)))
    return j, c2


@triton.jit
def _tie_magnitude(y):
    """|y| for the magnitude search, one ulp smaller below zero: there a >= n * p means |y| > n * p, so a
    value on a negative midpoint keeps the upper index (toward zero), as specs/turboquant.md asks of ties."""
    a = tl.abs(y)
    return tl.where(y < 0, (a.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), a)


@triton.jit
def offset_values(const_ptr, mean_ptr, sink_ptr, head, d, p, cos, sin, ok, D: tl.constexpr):
    """o(p) at dims d [R, C] of rows of KV head ``head`` [R] at positions p [R, 1] (key_offset.key_offset_at):
    const plus the mean's rotate-half pairs (d, d +- D/2) turned by the angle whose cos/sin are given (the
    mean is zero on pairs that do not turn: every pair is computed, no gather); the sink at p == 0."""
    HALF_D: tl.constexpr = D // 2
    at = head[:, None] * D
    mean = tl.load(mean_ptr + at + d, mask=ok[:, None], other=0.0)
    partner = tl.load(mean_ptr + at + (d + HALF_D) % D, mask=ok[:, None], other=0.0)
    turned = tl.load(const_ptr + at + d, mask=ok[:, None], other=0.0) + mean * cos + \
        tl.where(d < HALF_D, -partner, partner) * sin
    return tl.where(p == 0, tl.load(sink_ptr + at + d, mask=ok[:, None], other=0.0), turned)


@triton.jit
def quantize_rows(x_ptr, stride_t, stride_h, slot_ptr, pos_ptr, codes_ptr, norms_ptr, mid_ptr, cent_ptr,
                  const_ptr, mean_ptr, sink_ptr, inv_freq_ptr, first_ptr, second_ptr, inv_sqrt, n_rows,
                  first_tile, tile_step, recent_ptr, recent_rows_ptr, window, H: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, LOG2_G: tl.constexpr,
                  BITS: tl.constexpr, OFFSET: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
                  RECENT: tl.constexpr):
    """Quantize rows (token * H + head) of x into their slots: tiles first_tile, first_tile + tile_step, ...
    below cdiv(n_rows, ROWS). The store kernel's programs each walk their share of the tiles; the decode kernel
    (attention.py) quantizes its sequence's new row alone: ROWS = 1, first_tile = that row, n_rows = it + 1.
    RECENT: also write each row's rotated value before quantization, in recent_ptr's dtype, to its recent window
    ring [rows, window, H, D] at [recent_rows[token], position % window] (recent.py); none where that row is < 0."""
    NG: tl.constexpr = D // G
    HALF: tl.constexpr = 1 << (BITS - 1)
    G2: tl.constexpr = G // 2
    # Per program, before the tile loop (the compiler cannot hoist loads past the stores): the sign
    # patterns of rotation.rotate_rows for each half group and the codebook's positive half.
    flip_lo = sign_masks(first_ptr, G2)
    flip_hi = sign_masks(first_ptr + G2 // 32, G2)
    scale_lo = tl.where(sign_masks(second_ptr, G2) != 0, -inv_sqrt, inv_sqrt)
    scale_hi = tl.where(sign_masks(second_ptr + G2 // 32, G2) != 0, -inv_sqrt, inv_sqrt)
    p1 = _half_entry(mid_ptr, HALF - 1, 1, HALF)  # midpoints[HALF - 1] is the middle one, 0.0
    p2 = _half_entry(mid_ptr, HALF - 1, 2, HALF)
    p3 = _half_entry(mid_ptr, HALF - 1, 3, HALF)
    p4 = _half_entry(mid_ptr, HALF - 1, 4, HALF)
    p5 = _half_entry(mid_ptr, HALF - 1, 5, HALF)
    p6 = _half_entry(mid_ptr, HALF - 1, 6, HALF)
    p7 = _half_entry(mid_ptr, HALF - 1, 7, HALF)
    q0 = _half_entry(cent_ptr, HALF, 0, HALF)
    q1 = _half_entry(cent_ptr, HALF, 1, HALF)
    q2 = _half_entry(cent_ptr, HALF, 2, HALF)
    q3 = _half_entry(cent_ptr, HALF, 3, HALF)
    q4 = _half_entry(cent_ptr, HALF, 4, HALF)
    q5 = _half_entry(cent_ptr, HALF, 5, HALF)
    q6 = _half_entry(cent_ptr, HALF, 6, HALF)
    q7 = _half_entry(cent_ptr, HALF, 7, HALF)
    q0, q1, q2, q3, q4, q5, q6, q7 = q0 * q0, q1 * q1, q2 * q2, q3 * q3, q4 * q4, q5 * q5, q6 * q6, q7 * q7
    for tile in tl.range(first_tile, tl.cdiv(n_rows, ROWS), tile_step, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        slot = tl.load(slot_ptr + rows // H, mask=rows < n_rows, other=-1).to(tl.int64)
        valid = (rows < n_rows) & (slot >= 0)  # a negative slot marks a padding token
        # One [ROWS * NG, G / 2] tile per half group (rg = row * NG + group): Triton gives both the same
        # layout, so the butterfly stage between halves stays inside each thread.
        rg = tile * ROWS * NG + tl.arange(0, ROWS * NG)
        tok = rg // NG // H
        head = rg // NG % H
        ok = (rg // NG < n_rows) & (tl.load(slot_ptr + tok, mask=rg // NG < n_rows, other=-1) >= 0)
        base = tok.to(tl.int64) * stride_t + head * stride_h + rg % NG * G
        c = tl.arange(0, G2)[None, :]
        lo = tl.load(x_ptr + base[:, None] + c, mask=ok[:, None], other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + base[:, None] + G2 + c, mask=ok[:, None], other=0.0).to(tl.float32)
        d_lo = (rg % NG * G)[:, None] + c
        d_hi = d_lo + G2
        if OFFSET == "fixed":  # o(p) = const at every position (the sink is const, the mean 0)
            lo -= tl.load(const_ptr + head[:, None] * D + d_lo, mask=ok[:, None], other=0.0)
            hi -= tl.load(const_ptr + head[:, None] * D + d_hi, mask=ok[:, None], other=0.0)
        if OFFSET == "turned":  # k - o(p): const, mean and sink float32 [H, D], inv_freq [D / 2]
            p = tl.load(pos_ptr + tok, mask=rg // NG < n_rows, other=0).to(tl.float32)[:, None]
            cos_lo, sin_lo = sincos(p * tl.load(inv_freq_ptr + d_lo % (D // 2)), ASM)
            if NG == 1:  # the half groups are RoPE's pairs: one angle for both
                cos_hi, sin_hi = cos_lo, sin_lo
            else:
                cos_hi, sin_hi = sincos(p * tl.load(inv_freq_ptr + d_hi % (D // 2)), ASM)
            lo -= offset_values(const_ptr, mean_ptr, sink_ptr, head, d_lo, p, cos_lo, sin_lo, ok, D)
            hi -= offset_values(const_ptr, mean_ptr, sink_ptr, head, d_hi, p, cos_hi, sin_hi, ok, D)
        n = tl.sqrt(tl.sum(lo * lo + hi * hi, axis=1))[:, None]
        # rotation.rotate_rows in two halves: y = n * rotate(x / n), the rotation being linear
        lo = fwht_rows((lo.to(tl.int32, bitcast=True) ^ flip_lo).to(tl.float32, bitcast=True), ROWS * NG, G2,
                       LOG2_G - 1)
        hi = fwht_rows((hi.to(tl.int32, bitcast=True) ^ flip_hi).to(tl.float32, bitcast=True), ROWS * NG, G2,
                       LOG2_G - 1)
        y_lo = (lo + hi) * scale_lo  # the last butterfly stage, h = G / 2, as the reference orders it
        y_hi = (lo - hi) * scale_hi
        if RECENT:  # rotate(x - o(p)) exactly as the pages get it quantized, in natural column order
            p_ring = tl.load(pos_ptr + tok, mask=ok, other=0)
            ring_row = tl.load(recent_rows_ptr + tok, mask=ok, other=-1).to(tl.int64)
            at = (((ring_row * window + p_ring % window) * H + head) * D)[:, None]
            ring_ok = (ok & (ring_row >= 0))[:, None]  # a negative row: a token the ring does not keep
            tl.store(recent_ptr + at + d_lo, y_lo.to(recent_ptr.dtype.element_ty), mask=ring_ok)
            tl.store(recent_ptr + at + d_hi, y_hi.to(recent_ptr.dtype.element_ty), mask=ring_ok)
        # idx = HALF + j above the middle midpoint (0), HALF - 1 - j below it; a zero group (y == 0,
        # every a >= 0 * mid so j = HALF - 1) compares below +inf and gets (HALF - 1) ^ (HALF - 1) = 0.
        zero = tl.where(n > 0, 0.0, float("inf"))
        j, c2_lo = _magnitude_search(_tie_magnitude(y_lo), n, p1, p2, p3, p4, p5, p6, p7,
                                     q0, q1, q2, q3, q4, q5, q6, q7, BITS)
        idx_lo = j ^ tl.where(y_lo >= zero, HALF, HALF - 1)
        j, c2_hi = _magnitude_search(_tie_magnitude(y_hi), n, p1, p2, p3, p4, p5, p6, p7,
                                     q0, q1, q2, q3, q4, q5, q6, q7, BITS)
        idx_hi = j ^ tl.where(y_hi >= zero, HALF, HALF - 1)
        idx = tl.reshape(tl.permute(tl.join(idx_lo, idx_hi), (0, 2, 1)), (ROWS, D))
        row = (slot // PAGE_SIZE * H + rows % H) * PAGE_SIZE + slot % PAGE_SIZE
        store_indices(idx, codes_ptr + row * (D * BITS // 8), valid, ROWS, D, BITS)
        c_norm = tl.sqrt(tl.sum(c2_lo + c2_hi, axis=1))
        n_flat = tl.reshape(n, (ROWS * NG,))
        stored = tl.where(c_norm > 1e-10, n_flat / c_norm, n_flat)  # zero input: n == 0 gives norm 0
        norm_offs = row[:, None] * NG + tl.arange(0, NG)[None, :]
        tl.store(norms_ptr + norm_offs, tl.reshape(stored, (ROWS, NG)).to(tl.float16), mask=valid[:, None])


@triton.jit
def _store_kernel(k_ptr, k_stride_t, k_stride_h, v_ptr, v_stride_t, v_stride_h, slot_ptr, pos_ptr,
                  k_codes, k_norms, k_mid, k_cent, k_const, k_mean, k_sink, inv_freq, v_codes, v_norms, v_mid, v_cent,
                  first_ptr, second_ptr, inv_sqrt, n_rows, recent_k_ptr, recent_v_ptr, recent_rows_ptr, window,
                  H: tl.constexpr, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  G: tl.constexpr, LOG2_G: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                  K_OFFSET: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr,
                  RECENT: tl.constexpr):
    # K_OFFSET: "none", "fixed" or "turned" (store_turbo_triton's key_offset and key_offset_turns); RECENT: the
    # rows also go to the recent window's rings (store_turbo_triton's recent)
    if USE_PDL:  # StoreLaunch.pdl: scheduled while the previous kernel runs; k and v are its output
        gdc_launch_dependents()  # and the decode after it may be scheduled now
        gdc_wait()
    if tl.program_id(1) == 0:
        quantize_rows(k_ptr, k_stride_t, k_stride_h, slot_ptr, pos_ptr, k_codes, k_norms, k_mid, k_cent, k_const,
                      k_mean, k_sink, inv_freq, first_ptr, second_ptr, inv_sqrt, n_rows, tl.program_id(0),
                      tl.num_programs(0), recent_k_ptr, recent_rows_ptr, window, H, PAGE_SIZE, ROWS, D, G, LOG2_G,
                      K_BITS, K_OFFSET, STAGES, ASM, RECENT)
    else:
        quantize_rows(v_ptr, v_stride_t, v_stride_h, slot_ptr, pos_ptr, v_codes, v_norms, v_mid, v_cent, k_const,
                      k_mean, k_sink, inv_freq, first_ptr, second_ptr, inv_sqrt, n_rows, tl.program_id(0),
                      tl.num_programs(0), recent_v_ptr, recent_rows_ptr, window, H, PAGE_SIZE, ROWS, D, G, LOG2_G,
                      V_BITS, "none", STAGES, ASM, RECENT)


def offset_arguments(key_offset: KeyOffset | None, unused: torch.Tensor) -> tuple:
    """A kernel's const, mean, sink and inv_freq pointers for o(p) (offset_values); ``unused``, any tensor on the
    kernel's device, stands in for each where there is no offset (never read then)."""
    if key_offset is None:
        return (unused,) * 4
    return key_offset.const, key_offset.mean, key_offset.sink, key_offset.inv_freq


def offset_mode(key_offset: KeyOffset | None, turns: bool) -> str:
    """K_OFFSET of quantize_rows and the kernels that share its offsets: "none", "fixed" (o = const) or "turned"."""
    return "none" if key_offset is None else ("turned" if turns else "fixed")


def recent_arguments(recent: RecentWindow | None, rows: torch.Tensor | None, rows_name: str, tokens: int,
                     kv_heads: int, head_dim: int, f32: torch.Tensor, i32: torch.Tensor) -> tuple:
    """A kernel's arguments recent_k_ptr, recent_v_ptr, recent_rows_ptr, window for the recent window (recent.py)
    of ``tokens`` rows of ``kv_heads`` x ``head_dim`` K/V, ``rows`` (named ``rows_name`` in errors) the int32 ring
    row of each; f32 / i32 (on the kernel's device) stand in for the pointers a kernel without RECENT never reads."""
    if recent is None:
        return (f32, f32, i32, 1)
    want = (recent.k.shape[0], recent.size, kv_heads, head_dim)
    for name, t in (("k", recent.k), ("v", recent.v)):
        if tuple(t.shape) != want or not t.is_contiguous() or t.device != f32.device or recent.size < 1:
            raise ValueError(f"recent.{name} must be a contiguous [rows, W >= 1, {kv_heads} KV heads, {head_dim}] "
                             f"tensor on {f32.device} like recent.k {tuple(recent.k.shape)} (RecentWindow.empty makes "
                             f"one), got {tuple(t.shape)} {t.stride()} on {t.device}")
    if rows is None or tuple(rows.shape) != (tokens,) or rows.dtype != torch.int32:
        got = None if rows is None else f"{rows.dtype} {tuple(rows.shape)}"
        raise ValueError(f"a recent window needs {rows_name}: int32, one ring row for each of the {tokens} tokens, "
                         f"got {got}")
    return (recent.k, recent.v, rows, recent.size)


def store_turbo_triton(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                       k_pages: TurboPages, v_pages: TurboPages, signs: tuple[torch.Tensor, torch.Tensor],
                       inv_sqrt: float, key_offset: KeyOffset | None = None, key_offset_turns: bool = True,
                       launch: StoreLaunch | None = None, recent: RecentWindow | None = None,
                       recent_rows: torch.Tensor | None = None) -> None:
    """Quantize k - o(positions) and v, [T, kv_heads, D] (last dim contiguous), into their slots; one launch
    for both. ``key_offset`` (contiguous float32 tensors, TurboKVStore.key_offset); None: the spec's plain format.
    ``key_offset_turns`` False promises o(p) = const everywhere (KeyOffset.turns): no angles computed.
    ``launch``: None takes STORE_LAUNCH.
    ``recent`` with ``recent_rows`` [T] int32 (each token's ring row, or -1): every stored token with a row also
    writes what its pages quantize, unquantized (rotate(k - o(p)), rotate(v) in the ring's dtype), at index p % W
    of its ring row (recent.py). Tokens of one row must not share p % W (they would race): a chunk gives rows
    only to its last W tokens (recent.ring_rows_of_last_tokens).
    """
    launch = launch or STORE_LAUNCH
    num_tokens, heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if recent_rows is not None and recent is None:
        raise ValueError("recent_rows without recent: pass the recent window the rows belong to")
    ring = recent_arguments(recent, recent_rows, "recent_rows", num_tokens, heads, head_dim, k_pages.centroids,
                            slot_mapping)
    n_rows = num_tokens * heads
    if n_rows == 0:
        return
    group = group_size(head_dim)
    most = multiprocessors(k.device) * launch.programs_per_sm if k.device.type == "cuda" else INTERPRETER_PROGRAMS
    rows = launch.small_rows if n_rows <= launch.small_rows * most else launch.rows
    tiles = triton.cdiv(n_rows, rows)
    programs = min(tiles, most)
    options = {} if launch.max_registers is None else {"maxnreg": launch.max_registers}
    options.update(pdl.launch_options(k.device) if launch.pdl else {"USE_PDL": False})
    with timed("turbo_store", k.device):
        _store_kernel[(programs, 2)](
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), slot_mapping, positions,
            k_pages.codes, k_pages.norms, k_pages.midpoints, k_pages.centroids,
            *offset_arguments(key_offset, k_pages.centroids),
            v_pages.codes, v_pages.norms, v_pages.midpoints, v_pages.centroids,
            signs[0], signs[1], inv_sqrt, n_rows, *ring,
            H=heads, PAGE_SIZE=k_pages.codes.shape[2], ROWS=rows, D=head_dim, G=group,
            LOG2_G=group.bit_length() - 1, K_BITS=k_pages.bits, V_BITS=v_pages.bits,
            K_OFFSET=offset_mode(key_offset, key_offset_turns),
            STAGES=launch.stages,
            ASM=inline_ptx(k.device), RECENT=recent is not None, num_warps=launch.num_warps, **options,
        )


def store_turbo(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                k_pages: TurboPages, v_pages: TurboPages, signs: tuple[torch.Tensor, torch.Tensor], inv_sqrt: float,
                key_offset: KeyOffset | None = None, key_offset_turns: bool = True, recent: RecentWindow | None = None,
                recent_rows: torch.Tensor | None = None) -> None:
    """The engine's store: the CUDA C kernel (store_cuda.py) where it runs and the call fills a wave of it (prefill
    chunks), else store_turbo_triton (decode steps: store_cuda.fills_a_wave says why); same contract. With a
    recent window (store_turbo_triton's recent) always the Triton kernel: only it writes the ring."""
    if not (recent is None and fills_a_wave(k.shape[0], k.shape[1], k.shape[2], k.device)
            and store_turbo_cuda(k, v, slot_mapping, positions, k_pages, v_pages, key_offset, key_offset_turns)):
        store_turbo_triton(k, v, slot_mapping, positions, k_pages, v_pages, signs, inv_sqrt, key_offset,
                           key_offset_turns, recent=recent, recent_rows=recent_rows)
