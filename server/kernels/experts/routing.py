"""Group (token, slot) pairs by expert in padded blocks, on the device, without a host sync.

Pair p = t * top_k + j is token t's j-th routed expert. The kernels run one program per
block of ``block_m`` pairs that all belong to one expert (spec "Kernels": tokens sorted by
expert, padded blocks), so each program streams its expert's weights once for the block.

Experts are laid out in expert order, each padded to a multiple of ``block_m``, and within an
expert its pairs keep pair order (a stable sort), so results never depend on sort ties.
`align_pairs_reference` (torch) defines the layout; `_align_pairs_kernel` produces the same
tensors, element for element, in one launch (the torch version is ~20 small ops and a few
hundred microseconds of host time per call on an H200, docs/BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from server.kernels.backend import use_triton
from server.kernels.timing import timed


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
    """topk_ids [tokens, top_k] with values in [0, num_experts) -> the pairs in padded per-expert blocks."""
    if use_triton(topk_ids):
        return align_pairs_triton(topk_ids, num_experts, block_m)
    return align_pairs_reference(topk_ids, num_experts, block_m)


def align_pairs_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
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


def align_pairs_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """align_pairs_reference's tensors from one launch of one program per expert.

    Ids outside [0, num_experts) are not placed in any block (the reference raises on them); the
    kernel never writes outside its outputs whatever the ids.
    """
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"align_pairs needs num_experts >= 1 and block_m >= 1, got {num_experts} and {block_m}")
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    nb = max_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.empty((nb * block_m,), dtype=torch.int32, device=flat.device)
    block_expert = torch.empty((nb,), dtype=torch.int32, device=flat.device)
    if num_pairs:
        # Decode steps (a few dozen pairs) take one small chunk; prefill steps stream the ids in chunks
        # of 4096. Two shapes only, so a server compiles the kernel at most twice per expert count.
        chunk, warps = (256, 4) if num_pairs <= 256 else (4096, 8)
        with timed("experts_align_pairs", flat.device):
            _align_pairs_kernel[(num_experts,)](
                flat, pair_ids, block_expert, num_pairs, num_experts, nb, block_m,
                BINS=triton.next_power_of_2(num_experts + 1), CHUNK=chunk, num_warps=warps,
            )
    return ExpertBlocks(pair_ids, block_expert, block_m, num_pairs)


@triton.jit
def _align_pairs_kernel(ids_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks, block_m,
                        BINS: tl.constexpr, CHUNK: tl.constexpr):
    """Program e: count every expert's pairs, find where expert e's padded run starts, then write e's
    pairs there in pair order, its padding and its blocks' expert; program 0 also fills the unused tail."""
    expert = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    bins = tl.arange(0, BINS)
    # Pass 1: pairs per expert. Ids outside [0, E) (and the masked lanes) go to the spare bin E, which
    # BINS > E leaves in range: the histogram lowering indexes bins by the low bits of the value.
    counts = tl.zeros((BINS,), tl.int32)
    for first in range(0, num_pairs, CHUNK):
        offs = first + lanes
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
        counts += tl.histogram(ids, BINS)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = tl.cumsum(padded, 0)
    run_start = tl.sum(tl.where(bins == expert, padded_end - padded, 0), 0)
    run_pairs = tl.sum(tl.where(bins == expert, counts, 0), 0)
    run_end = tl.sum(tl.where(bins == expert, padded_end, 0), 0)
    # Pass 2: expert e's pairs in pair order (rank = matches before it), so the layout is the stable sort's.
    placed = 0
    for first in range(0, num_pairs, CHUNK):
        offs = first + lanes
        hit = (tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1) == expert).to(tl.int32)
        rank = placed + tl.cumsum(hit, 0) - 1
        tl.store(pair_ids_ptr + run_start + rank, offs, mask=hit != 0)
        placed += tl.sum(hit, 0)
    # The run's padding (fewer than block_m slots) and the expert of each of its blocks.
    for first in range(run_start + run_pairs, run_end, CHUNK):
        offs = first + lanes
        tl.store(pair_ids_ptr + offs, num_pairs, mask=offs < run_end)
    for first in range(run_start // block_m, run_end // block_m, CHUNK):
        offs = first + lanes
        tl.store(block_expert_ptr + offs, expert, mask=offs < run_end // block_m)
    if expert == 0:  # blocks past the last expert's run are unused: padding pairs, expert -1
        used_end = tl.sum(padded, 0)
        for first in range(used_end, num_blocks * block_m, CHUNK):
            offs = first + lanes
            tl.store(pair_ids_ptr + offs, num_pairs, mask=offs < num_blocks * block_m)
        for first in range(used_end // block_m, num_blocks, CHUNK):
            offs = first + lanes
            tl.store(block_expert_ptr + offs, -1, mask=offs < num_blocks)


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
