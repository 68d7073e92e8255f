"""The Triton store kernel picks the spec's nearest centroid in every cell (specs/turboquant.md "Codebook").

Inputs are built in the rotated domain from the spec's definitions (float64): every centroid and a
point just inside each side of every midpoint, on both halves of the codebook, then rotated back
with the float64 rotation matrix. The expected index of each coordinate is the float64 count of
midpoints at or below it, so the test knows the answer without the code under test.
"""

import bisect
import itertools
import math

import pytest
import torch

from server.kernels.rotation import inv_sqrt_group
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.format import RowLayout, unpack_indices
from server.kernels.turbo.quantize import store_turbo_triton
from server.kernels.turbo.store import TurboKVStore
from turbo_oracle import rotation_matrix64

PAGE = 16
MARGIN = 0.05  # of the gap between neighbouring centroids: far above fp16 rounding of the inputs

def cell_probes(bits: int, group: int) -> list[float]:
    """Unit-sphere coordinates: every centroid and, for every midpoint, one point on each side."""
    c = codebook(bits, group).centroids
    probes = list(c)
    for a, b in itertools.pairwise(c):
        middle, gap = (a + b) / 2, b - a
        probes += [middle - MARGIN * gap, middle + MARGIN * gap]
    return probes

def rows_holding(probes: list[float], bits: int, group: int) -> torch.Tensor:
    """Unit vectors [R, G] (float64) that carry the probes; a filler coordinate +-f completes each norm,
    chosen away from every midpoint."""
    mids = codebook(bits, group).midpoints
    rows, current = [], []
    for p in probes + [None]:
        if p is not None and sum(v * v for v in current) + p * p <= 0.6 and len(current) < group // 2:
            current.append(p)
            continue
        while True:  # another centroid-valued coordinate moves a filler that sits near a midpoint
            fill = group - len(current)
            f = math.sqrt((1.0 - sum(v * v for v in current)) / fill)
            if min(abs(f - m) for m in mids) > 1e-3:
                break
            current.append(codebook(bits, group).centroids[-1 - len(current) % 2])
        rows.append(current + [f if i % 2 else -f for i in range(fill)])
        current = [] if p is None else [p]
    return torch.tensor(rows, dtype=torch.float64)

def expected_indices(u: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    mids = codebook(bits, group).midpoints
    return torch.tensor([[bisect.bisect_right(mids, v) for v in row] for row in u.tolist()], dtype=torch.int32)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,kind", [(64, "turbo2"), (64, "turbo4"), (128, "turbo3"), (128, "turbo4")])
def test_every_cell_and_both_sides_of_every_midpoint(head_dim, kind, dtype):
    layout = RowLayout(kind, head_dim)
    bits, group = layout.bits, layout.group
    u = rows_holding(cell_probes(bits, group), bits, group)  # [R, G] unit rows, rotated domain
    gen = torch.Generator().manual_seed(head_dim + bits)
    u = u[:, torch.randperm(group, generator=gen)]  # probes at every position
    u = torch.cat([u, -u])  # and their mirror images: the negative half of the codebook
    scale = torch.rand(len(u), 1, generator=gen, dtype=torch.float64) * 20 + 0.5
    x = (u * scale) @ rotation_matrix64(group)  # R^T applied to each row: the unrotated input
    tokens = len(x)
    store = TurboKVStore(-(-tokens // PAGE) + 1, PAGE, 1, head_dim, kind, kind, "cpu", torch.float32)
    slots = torch.randperm(store.k.codes.shape[0] * PAGE, generator=gen)[:tokens]
    k = x.to(dtype).reshape(tokens, 1, head_dim)

    store_turbo_triton(k, k, slots, torch.arange(tokens), store.k, store.v, store.signs, inv_sqrt_group(group))
    got = unpack_indices(store.k.codes[slots // PAGE, 0, slots % PAGE], bits, head_dim)
    want = expected_indices(u, bits, group)
    wrong = (got != want).nonzero().tolist()
    assert not wrong, f"{len(wrong)} coordinates in the wrong cell, first (row, position): {wrong[:5]}"
    c = torch.tensor(codebook(bits, group).centroids, dtype=torch.float64)
    norm_want = scale.squeeze(1) / c[want.long()].norm(dim=1)  # ||x|| / ||c||
    norm_got = store.k.norms[slots // PAGE, 0, slots % PAGE, 0].double()
    assert torch.allclose(norm_got, norm_want, rtol=2e-3, atol=0), (norm_got - norm_want).abs().max()

def test_a_zero_group_beside_a_nonzero_one_gets_index_and_norm_zero():
    """head_dim 256 = two groups: the zero group must not borrow anything from its neighbour."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 2, 256, generator=gen)
    x[:, 0, :128] = 0.0  # first group of head 0
    x[:, 1, 128:] = 0.0  # second group of head 1
    store = TurboKVStore(2, PAGE, 2, 256, "turbo4", "turbo3", "cpu", torch.float32)
    slots = torch.tensor([3, 17, 4, 30, 9])

    store_turbo_triton(x, x, slots, torch.arange(5), store.k, store.v, store.signs, store.inv_sqrt)
    for pages in (store.k, store.v):
        idx = unpack_indices(pages.codes[slots // PAGE, :, slots % PAGE], pages.bits, 256)
        norms = pages.norms[slots // PAGE, :, slots % PAGE]
        assert idx[:, 0, :128].eq(0).all() and idx[:, 1, 128:].eq(0).all(), "a zero group must store index 0"
        assert norms[:, 0, 0].eq(0).all() and norms[:, 1, 1].eq(0).all(), "a zero group must store norm 0"
        assert norms[:, 0, 1].gt(0).all() and norms[:, 1, 0].gt(0).all()
        assert idx[:, 0, 128:].ne(0).any() and idx[:, 1, :128].ne(0).any()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_an_exact_tie_goes_to_the_upper_index_on_both_sides(sign):
    """specs/turboquant.md: a tie goes to the upper index. With G = 64 every step is exact in float32 for this
    input (dyadic values; 1/sqrt(64) = 1/8; norm 4), so the rotated coordinates land exactly on midpoints
    +-0.5 * n of a codebook whose midpoints are set to -0.5, 0, 0.5: +0.5 -> index 3, -0.5 -> index 1
    (toward zero), 0 -> index 2."""
    import dataclasses

    u = torch.zeros(1, 64, dtype=torch.float64)
    u[0, [3, 40]] = 0.5 * sign
    u[0, [10, 50]] = -0.5 * sign
    x = (4.0 * u) @ rotation_matrix64(64)  # entries 0, +-0.5, +-1: exact
    store = TurboKVStore(2, PAGE, 1, 64, "turbo2", "turbo2", "cpu", torch.float32)
    pages = dataclasses.replace(store.k, midpoints=torch.tensor([-0.5, 0.0, 0.5]))
    slots = torch.tensor([5])
    k = x.float().reshape(1, 1, 64)
    store_turbo_triton(k, k, slots, torch.arange(1), pages, store.v, store.signs, inv_sqrt_group(64))
    got = unpack_indices(pages.codes[0, 0, 5], 2, 64)
    want = torch.full((64,), 2, dtype=torch.int32)
    want[[3, 40]] = 3 if sign > 0 else 1
    want[[10, 50]] = 1 if sign > 0 else 3
    assert torch.equal(got.flatten().int(), want), got


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors reach Triton through the interpreter, which "
                    "tests/conftest.py turns on only on machines without a GPU")
def test_the_engine_store_takes_the_triton_kernel_where_cuda_c_cannot_run():
    """quantize.store_turbo: CPU tensors (and head dims the CUDA kernel does not take) go to store_turbo_triton."""
    from server.kernels.turbo.quantize import store_turbo
    from server.kernels.turbo.store_cuda import store_turbo_cuda, supports

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 128, generator=gen)
    slots, positions = torch.tensor([4, -1, 17]), torch.arange(3)
    assert not supports(x, x, slots, positions)
    assert store_turbo_cuda(x, x, slots, positions, None, None) is False  # refused before touching the pages
    ours = TurboKVStore(2, PAGE, 2, 128, "turbo3", "turbo4", "cpu", torch.float32)
    triton = TurboKVStore(2, PAGE, 2, 128, "turbo3", "turbo4", "cpu", torch.float32)
    store_turbo(x, x, slots, positions, ours.k, ours.v, ours.signs, ours.inv_sqrt)
    store_turbo_triton(x, x, slots, positions, triton.k, triton.v, triton.signs, triton.inv_sqrt)
    for a, b in ((ours.k, triton.k), (ours.v, triton.v)):
        assert a.codes.any() and torch.equal(a.codes, b.codes) and torch.equal(a.norms, b.norms)


def _cuda_case(head_dim, k_kind, v_kind, offset_kind, dtype, tokens, heads, gen):
    """(max index mismatch share, max norm relative error, writes outside the slots) of store_turbo_cuda against
    format.quantize_reference of k - o(p) and v; k and v are views into one qkv tensor, as the engine's are."""
    from server.kernels.turbo.format import quantize_reference
    from server.kernels.turbo.key_offset import KeyOffset, key_offset_at
    from server.kernels.turbo.store_cuda import store_turbo_cuda

    device = torch.device("cuda")
    store = TurboKVStore(-(-tokens // PAGE) * 2, PAGE, heads, head_dim, k_kind, v_kind, device, dtype)
    half = head_dim // 2
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    mean, const, sink = (torch.randn(heads, head_dim, generator=gen) * 3 for _ in range(3))
    if offset_kind == "fixed":
        store.set_key_offset(KeyOffset.fixed(const.to(device), inv_freq.to(device)))
    elif offset_kind.startswith("partial"):
        count = int(offset_kind[7:] or 5)
        pairs = torch.stack([torch.randperm(half, generator=gen)[:count] for _ in range(heads)]).int()
        turn = torch.zeros(heads, half, dtype=torch.bool).scatter_(1, pairs.long(), True).repeat(1, 2)
        store.set_key_offset(KeyOffset(*(t.to(device) for t in (const * ~turn, mean * turn, sink, inv_freq, pairs))))
    positions = torch.randperm(4 * tokens, generator=gen)[:tokens]
    positions[1] = 0  # the sink's position
    positions = positions.to(device)
    offsets = (torch.zeros(tokens, heads, head_dim, device=device) if store.key_offset is None
               else key_offset_at(store.key_offset, positions))
    qkv = torch.randn(tokens, 3 * heads, head_dim, generator=gen).to(device) * 2
    qkv[:, heads : 2 * heads] += offsets
    qkv[4, 2 * heads :] = 0.0  # a zero row of V
    qkv = qkv.to(dtype)
    k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    slots = torch.randperm(store.k.codes.shape[0] * PAGE, generator=gen)[:tokens]
    slots[2] = -1  # padding
    slots = slots.to(device)
    assert store_turbo_cuda(k, v, slots, positions, store.k, store.v, store.key_offset, store.offset_turns)
    keep = slots >= 0
    worst = [0.0, 0.0, False]
    for pages, kind, x in ((store.k, k_kind, k.float() - offsets), (store.v, v_kind, v.float())):
        codes, norms = quantize_reference(x[keep], kind)
        s = slots[keep]
        got = unpack_indices(pages.codes[s // PAGE, :, s % PAGE], pages.bits, head_dim)
        want = unpack_indices(codes, pages.bits, head_dim)
        same = (got == want).reshape(*got.shape[:-1], norms.shape[-1], -1).all(-1)
        got_norms = pages.norms[s // PAGE, :, s % PAGE].float()
        rel = ((got_norms - norms.float()).abs() / norms.float().clamp_min(1e-6))[same]
        written = torch.zeros(pages.codes.shape[0] * PAGE, dtype=torch.bool, device=device)
        written[s] = True
        stray = pages.codes.transpose(1, 2).reshape(-1, heads * pages.codes.shape[3])[~written].ne(0).any().item()
        worst = [max(worst[0], (got != want).float().mean().item()), max(worst[1], rel.max().item()), worst[2] or stray]
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,k_kind,v_kind,offset_kind,dtype", [
    (128, "turbo3", "turbo3", "partial", torch.bfloat16), (128, "turbo3", "turbo3", "partial16", torch.bfloat16),
    (128, "turbo4", "turbo2", "fixed", torch.float16), (128, "turbo2", "turbo4", "none", torch.bfloat16),
    (256, "turbo4", "turbo3", "partial", torch.float16), (256, "turbo3", "turbo2", "none", torch.bfloat16),
    (128, "turbo3", "turbo3", "fixed", torch.bfloat16), (128, "turbo4", "turbo4", "none", torch.float16),
    (256, "turbo2", "turbo2", "fixed", torch.bfloat16),
])
def test_the_cuda_store_matches_the_reference_quantizer(head_dim, k_kind, v_kind, offset_kind, dtype):
    """Odd token and head counts (a last warp item part full), a padding slot, a zero row, the sink's position,
    K and V as strided views: indices as the reference's (a value within an ulp or two of a midpoint may differ),
    norms to fp16 rounding, nothing written outside the slots. K and V of one kind with no turned pairs take the
    one-body launch (store_cuda.default_launch), the others two bodies."""
    from server.kernels import nvrtc

    if not nvrtc.cuda_kernels_enabled(torch.device("cuda")):
        pytest.skip("CUDA C kernels are switched off here (nvrtc.cuda_kernels_enabled)")
    gen = torch.Generator().manual_seed(head_dim + len(offset_kind))
    mismatch, norm_err, stray = _cuda_case(head_dim, k_kind, v_kind, offset_kind, dtype, 77, 3, gen)
    assert mismatch < 1e-3 and norm_err < 1e-3 and not stray, (mismatch, norm_err, stray)


@pytest.mark.gpu
def test_the_cuda_store_leaves_more_turned_pairs_than_it_takes_to_triton():
    from server.kernels.turbo.key_offset import KeyOffset
    from server.kernels.turbo.store_cuda import MAX_PAIRS, supports

    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device="cuda")
    slots = positions = torch.arange(4, device="cuda")
    zeros = torch.zeros(2, 128, device="cuda")
    turned = KeyOffset.turned(zeros, zeros, torch.ones(64, device="cuda"))
    few = KeyOffset(zeros, zeros, zeros, torch.ones(64, device="cuda"), turned.pairs[:, :MAX_PAIRS].contiguous())
    assert not supports(x, x, slots, positions, turned, True)
    assert supports(x, x, slots, positions, turned, False)  # a fixed offset turns nothing
    assert supports(x, x, slots, positions, few, True) == supports(x, x, slots, positions)


def test_decode_steps_store_through_triton_and_prefill_chunks_through_cuda_c(monkeypatch):
    """store_cuda.fills_a_wave: the CUDA C store only where its items (32 tokens of one head) fill the resident
    warps of every SM (H200: 132 SMs x 12 warps, K and V sharing them), since an item costs a warp the same time
    with 1 real token as with 32 (the 09:19 UTC e2e measurement in its docstring)."""
    from server.kernels.turbo import store_cuda

    monkeypatch.setattr(store_cuda, "multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    one_wave_of_items = 132 * 12 // 2
    for batch in (1, 32, 256):  # a decode step: one token per sequence
        assert not store_cuda.fills_a_wave(batch, 8, 128, cuda)
    assert store_cuda.fills_a_wave(8192, 8, 128, cuda)  # a prefill chunk
    tokens = 32 * one_wave_of_items // 8  # 8 heads of one group each
    assert store_cuda.fills_a_wave(tokens, 8, 128, cuda)
    assert not store_cuda.fills_a_wave(tokens - 32, 8, 128, cuda)
    assert store_cuda.fills_a_wave(tokens // 2, 8, 256, cuda), "two groups per head: twice the items"
    assert not store_cuda.fills_a_wave(8192, 8, 128, torch.device("cpu"))
