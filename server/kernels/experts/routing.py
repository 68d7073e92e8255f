"""Group (token, slot) pairs by expert in padded blocks, on the device, without a host sync.

Pair p = t * top_k + j is token t's j-th routed expert. The kernels run one program per
block of ``block_m`` pairs that all belong to one expert (spec "Kernels": tokens sorted by
expert, padded blocks), so each program streams its expert's weights once for the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertBlocks:
    pair_ids: torch.Tensor  # [num_blocks * block_m] int32, pair index or num_pairs (padding)
    block_expert: torch.Tensor  # [num_blocks] int32, expert of each block or -1 (unused block)
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.numel()


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on padded blocks: each expert that has pairs adds at most one partial block."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)  # stable: a token's slots stay in order within an expert
    # scatter_add, not bincount: CUDA bincount reads the max id back to the host (a sync that a
    # CUDA graph capture forbids).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    sorted_e = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    pos = (padded_end - padded)[sorted_e] + rank
    nb = max_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.full((nb * block_m,), num_pairs, dtype=torch.int32, device=dev)
    pair_ids[pos] = order.to(torch.int32)
    starts = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(starts < padded_end[-1:], block_expert, -1).to(torch.int32)
    return ExpertBlocks(pair_ids, block_expert, block_m, num_pairs)


def single_pair_blocks(topk_ids: torch.Tensor, block_m: int) -> ExpertBlocks:
    """One pair per block (the rest padding), in pair order: no sort, two small device ops.

    For decode, where pairs rarely share an expert (moe.use_gemv): a pair's block reads its
    expert's weights on its own, as the one-pair-per-program GEMV body does.
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    pair_ids = torch.full((num_pairs, block_m), num_pairs, dtype=torch.int32, device=flat.device)
    pair_ids[:, 0] = torch.arange(num_pairs, dtype=torch.int32, device=flat.device)
    return ExpertBlocks(pair_ids.reshape(-1), flat.to(torch.int32), block_m, num_pairs)
