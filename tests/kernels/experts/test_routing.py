"""Pairs grouped by expert in padded blocks: every pair exactly once, in a block of its own expert."""

import torch

from server.kernels.experts.routing import align_pairs, max_blocks


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
