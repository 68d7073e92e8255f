"""Pairs grouped by expert in padded blocks: every pair exactly once, in a block of its own expert.

The layout is defined by `align_pairs_reference` (torch) and pinned here by a plain-Python
oracle written from the definition; the one-launch Triton kernel must give the reference's
tensors element for element (run through the interpreter on CPU).
"""

import pytest
import torch

from server.kernels.experts.routing import (
    align_pairs,
    align_pairs_reference,
    align_pairs_triton,
    max_blocks,
)


def layout_oracle(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """(pair_ids, block_expert) from the definition: experts in order, each one's pairs in pair order,
    padded with num_pairs to a multiple of block_m; blocks up to max_blocks unused (-1, all padding)."""
    flat = ids.reshape(-1).tolist()
    pair_ids, block_expert = [], []
    for e in range(num_experts):
        mine = [p for p, x in enumerate(flat) if x == e]
        while len(mine) % block_m:
            mine.append(len(flat))
        pair_ids += mine
        block_expert += [e] * (len(mine) // block_m)
    unused = max_blocks(len(flat), num_experts, block_m) - len(block_expert)
    return pair_ids + [len(flat)] * (unused * block_m), block_expert + [-1] * unused


def _routing(kind: str, tokens: int, top_k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "distinct":  # top-k of a router: distinct experts per token
        return torch.rand((tokens, num_experts), generator=gen).topk(top_k, dim=1).indices
    if kind == "repeats":  # slots may repeat an expert (a token routed twice to one expert)
        return torch.randint(0, num_experts, (tokens, top_k), generator=gen)
    # skewed: most pairs on expert 1, the rest on the last expert; every other expert idle
    ids = torch.full((tokens, top_k), 1)
    ids[torch.rand((tokens, top_k), generator=gen) < 0.2] = num_experts - 1
    return ids


# (routing, tokens, top_k, experts, block_m): one token, odd counts and block sizes, idle experts,
# a non-power-of-two expert count, one expert only, and more pairs than one 4096-pair chunk.
CASES = [
    ("distinct", 1, 8, 64, 16),
    ("repeats", 1, 8, 3, 16),
    ("repeats", 5, 3, 6, 2),
    ("distinct", 37, 4, 100, 3),
    ("repeats", 33, 7, 1, 5),
    ("repeats", 19, 2, 8, 1),
    ("skewed", 300, 2, 8, 64),
    ("distinct", 700, 8, 128, 16),
]


@pytest.mark.parametrize("kind, tokens, top_k, num_experts, block_m", CASES)
def test_reference_layout_matches_the_definition(kind, tokens, top_k, num_experts, block_m):
    ids = _routing(kind, tokens, top_k, num_experts, torch.Generator().manual_seed(tokens))
    got = align_pairs_reference(ids, num_experts, block_m)
    want_pairs, want_blocks = layout_oracle(ids, num_experts, block_m)
    assert got.pair_ids.tolist() == want_pairs, f"pair order differs from the definition for {kind} {ids.shape}"
    assert got.block_expert.tolist() == want_blocks, f"block experts differ from the definition for {kind}"


# int64 ids (torch.topk's) in every case; int32 ids in the small-chunk cases.
ID_CASES = [(*case, torch.int64) for case in CASES] + [(*c, torch.int32) for c in CASES if c[1] * c[2] <= 256]


@pytest.mark.parametrize("kind, tokens, top_k, num_experts, block_m, dtype", ID_CASES)
def test_triton_layout_equals_the_reference_pair_for_pair(kind, tokens, top_k, num_experts, block_m, dtype):
    ids = _routing(kind, tokens, top_k, num_experts, torch.Generator().manual_seed(tokens + 1)).to(dtype)
    want = align_pairs_reference(ids, num_experts, block_m)
    # Freed memory of the outputs' sizes holds a value no output has: an element the kernel never writes
    # cannot pass by holding an earlier call's value.
    poison = [torch.full_like(want.pair_ids, -7), torch.full_like(want.block_expert, -7)]
    del poison
    got = align_pairs_triton(ids, num_experts, block_m)
    assert (got.num_pairs, got.block_m, got.num_blocks) == (want.num_pairs, want.block_m, want.num_blocks)
    bad = (got.pair_ids != want.pair_ids).nonzero().flatten().tolist()
    assert not bad, (f"pair_ids differ at {bad[:8]}: got {got.pair_ids[bad[:8]].tolist()}, "
                     f"want {want.pair_ids[bad[:8]].tolist()}")
    bad = (got.block_expert != want.block_expert).nonzero().flatten().tolist()
    assert not bad, f"block_expert differs at {bad[:8]}: got {got.block_expert[bad[:8]].tolist()}"


def test_triton_layout_follows_a_change_of_one_routed_expert():
    """Mutation check: moving one pair to another expert moves it in the kernel's layout too."""
    ids = _routing("distinct", 9, 4, 16, torch.Generator().manual_seed(5))
    before = align_pairs_triton(ids, 16, 4)
    moved = ids.clone()
    moved[4, 2] = (moved[4, 2] + 1) % 16
    after = align_pairs_triton(moved, 16, 4)
    assert not torch.equal(before.pair_ids, after.pair_ids), "the kernel's layout ignored a changed expert id"
    assert torch.equal(after.pair_ids, align_pairs_reference(moved, 16, 4).pair_ids)


def test_triton_layout_of_no_pairs_is_empty():
    got = align_pairs_triton(torch.empty((0, 8), dtype=torch.int64), 64, 16)
    assert got.num_blocks == 0 and got.pair_ids.numel() == 0


def test_triton_layout_rejects_a_block_of_no_pairs():
    with pytest.raises(ValueError, match="block_m >= 1"):
        align_pairs_triton(torch.zeros((2, 2), dtype=torch.int64), 4, 0)


def test_every_pair_lands_once_in_a_block_of_its_expert():
    ids = torch.tensor([[3, 0], [3, 3], [1, 0], [3, 4], [0, 0]])  # expert 2 idle, token 1 and 4 routed twice
    blocks = align_pairs(ids, num_experts=6, block_m=2)
    flat = ids.reshape(-1)
    pairs = blocks.pair_ids.reshape(-1, 2)
    seen = []
    for b, expert in enumerate(blocks.block_expert.tolist()):
        real = [p for p in pairs[b].tolist() if p < flat.numel()]
        if expert < 0:
            assert not real, f"unused block {b} holds pairs {real}"
            continue
        assert real, f"block {b} of expert {expert} is empty"
        assert all(int(flat[p]) == expert for p in real), f"block {b} mixes experts"
        seen += real
    assert sorted(seen) == list(range(flat.numel()))
    assert blocks.num_blocks == max_blocks(flat.numel(), 6, 2)
    # Within an expert the slots keep token order (stable sort), so results never depend on sort ties.
    three = [p for b, e in enumerate(blocks.block_expert.tolist()) if e == 3 for p in pairs[b].tolist() if p < 10]
    assert three == sorted(three)
