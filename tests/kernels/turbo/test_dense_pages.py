"""dense_pages_triton (the Triton interpreter on CPUs) against a float64 oracle written from the spec (centroid times
norm, then R^T) and against its torch body (attention.decoded_pages, and key_offset_at for keys): every index value
at every position, page ids listed out of order, a page's first position 0 (where o(p) is the sink)."""

import pytest
import torch

from bench.kernels_turbo import engine_key_offset
from server.kernels.turbo.attention import decoded_pages
from server.kernels.turbo.codebook import codebook
from server.kernels.turbo.dense_pages import dense_pages_triton
from server.kernels.turbo.format import group_size, pack_indices
from server.kernels.turbo.key_offset import key_offset_at
from server.kernels.turbo.store import TurboKVStore
from turbo_oracle import rotation_matrix64

PAGE, HEADS, NUM_PAGES = 16, 2, 5


def filled_pages(kind: str, head_dim: int, gen: torch.Generator):
    """K pages whose first 2^bits rows hold every index value at every position, the rest random; random norms."""
    pages = TurboKVStore(NUM_PAGES, PAGE, HEADS, head_dim, kind, kind, "cpu", torch.float32).k
    levels = 1 << pages.bits
    rows = NUM_PAGES * HEADS * PAGE
    idx = torch.randint(0, levels, (rows, head_dim), generator=gen, dtype=torch.int32)
    idx[:levels] = (torch.arange(levels)[:, None] + torch.arange(head_dim)[None, :]) % levels
    pages.codes.copy_(pack_indices(idx, pages.bits).view(pages.codes.shape))
    pages.norms.copy_((torch.rand(pages.norms.shape, generator=gen) * 4 + 0.25).half())
    return pages, idx.view(NUM_PAGES, HEADS, PAGE, head_dim)


def oracle(pages, idx: torch.Tensor, page_ids: torch.Tensor, head_dim: int) -> torch.Tensor:
    group = group_size(head_dim)
    centroids = torch.tensor(codebook(pages.bits, group).centroids, dtype=torch.float64)
    rotated = centroids[idx[page_ids].long()].unflatten(-1, (-1, group)) * pages.norms[page_ids].double()[..., None]
    original = (rotated @ rotation_matrix64(group)).flatten(-2)  # a row vector times R is R^T applied to it
    return original.transpose(1, 2)  # [pages, page_size, heads, D]


@pytest.mark.parametrize("kind,head_dim", [("turbo2", 64), ("turbo3", 128), ("turbo4", 128), ("turbo3", 256),
                                           ("turbo4", 64)])
def test_every_code_at_every_position_matches_float64_and_the_torch_body(kind, head_dim):
    gen = torch.Generator().manual_seed(head_dim + len(kind))
    pages, idx = filled_pages(kind, head_dim, gen)
    page_ids = torch.tensor([3, 0, 4, 1], dtype=torch.long)  # out of order; page 2 not listed
    got = dense_pages_triton(pages, page_ids, torch.float32)
    want = oracle(pages, idx, page_ids, head_dim)
    scale = want.abs().max().item()
    assert got.shape == want.shape
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale, "dense pages vs float64"
    torch_body = decoded_pages(pages, kind, page_ids, head_dim, torch.float32)
    assert (got - torch_body).abs().max().item() <= 1e-6 * scale, "dense pages vs decoded_pages"
    half = dense_pages_triton(pages, page_ids, torch.bfloat16)  # one rounding: within a bf16 ulp (the interpreter
    assert half.dtype == torch.bfloat16                         # truncates where GPUs round to nearest)
    assert ((half.float() - got).abs() <= got.abs() * 2**-7).all(), "bf16 output vs float32 output"


@pytest.mark.parametrize("turned_pairs", [None, 8])  # every pair turns, or a partial offset (fixed const elsewhere)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_keys_get_their_offset_back_at_their_positions(turned_pairs, head_dim):
    gen = torch.Generator().manual_seed(turned_pairs or 1)
    pages, idx = filled_pages("turbo3", head_dim, gen)
    offset = engine_key_offset(HEADS, head_dim, "cpu", gen, 500000.0, turned_pairs)
    page_ids = torch.tensor([2, 4, 0], dtype=torch.long)
    page_start = torch.tensor([PAGE * 7, 0, PAGE * 1000], dtype=torch.long)  # the second page starts a sequence
    got = dense_pages_triton(pages, page_ids, torch.float32, offset, page_start)
    positions = (page_start[:, None] + torch.arange(PAGE)).reshape(-1)
    o = key_offset_at(offset, positions).view(len(page_ids), PAGE, HEADS, head_dim)
    want = oracle(pages, idx, page_ids, head_dim) + o.double()
    # o(p)'s angles: sincos.py here, torch's sin/cos in key_offset_at (|angle| up to 16000 rad here)
    assert (got.double() - want).abs().max().item() <= 2e-5 * want.abs().max().item(), "keys with o(p) vs reference"
    # position 0 (page 1's first row) holds the sink, which differs from const + RoPE(0) mean by O(1) here
    sink_gap = (offset.sink - offset.const - offset.mean).abs().max().item()
    assert sink_gap > 1.0 and (got[1, 0].double() - want[1, 0]).abs().max().item() <= 2e-5 * want.abs().max().item()


def test_an_offset_without_page_starts_is_refused():
    pages, _ = filled_pages("turbo3", 128, torch.Generator().manual_seed(0))
    offset = engine_key_offset(HEADS, 128, "cpu", torch.Generator().manual_seed(1), 500000.0, 8)
    with pytest.raises(ValueError, match="page_start"):
        dense_pages_triton(pages, torch.tensor([0]), torch.float32, offset)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["turbo3", "turbo4"])
def test_on_the_gpu_bf16_pages_match_the_torch_body_within_a_rounding(kind):
    """Real sizes on the GPU (compiled, not interpreted): 300 of 400 pages, 8 KV heads, the engine's partial offset."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    pages = TurboKVStore(400, PAGE, 8, 128, kind, kind, dev, torch.bfloat16).k
    pages.codes.copy_(torch.randint(0, 256, pages.codes.shape, generator=gen, dtype=torch.uint8))
    pages.norms.copy_((torch.rand(pages.norms.shape, generator=gen) * 8 + 4).half())
    offset = engine_key_offset(8, 128, dev, gen, 500000.0, 8)
    page_ids = torch.randperm(400, generator=gen)[:300].to(dev)
    page_start = (torch.randperm(300, generator=gen) * PAGE).to(dev)
    got = dense_pages_triton(pages, page_ids, torch.bfloat16, offset, page_start).float()
    positions = (page_start[:, None] + torch.arange(PAGE, device=dev)).reshape(-1)
    want = decoded_pages(pages, kind, page_ids, 128, torch.float32)
    want = want + key_offset_at(offset, positions).view(want.shape)
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-4 * want.abs().max()).all(), "bf16 pages vs the torch body"
