"""Float64 building blocks the turbo tests check against, written from the spec's definitions alone."""

import math

import torch

from server.kernels.rotation import SIGNS1, SIGNS2


def sylvester(g: int) -> torch.Tensor:
    """H_g by the Kronecker definition H_2n = [[H, H], [H, -H]], float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < g:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotation_matrix64(g: int) -> torch.Tensor:
    """R = D2 H D1 / sqrt(G) with the spec's sign words (bit e % 32 of word e // 32 set -> -1)."""
    d1, d2 = ([-1.0 if (w[e // 32] >> (e % 32)) & 1 else 1.0 for e in range(g)] for w in (SIGNS1, SIGNS2))
    return torch.diag(torch.tensor(d2, dtype=torch.float64)) @ sylvester(g) @ torch.diag(torch.tensor(d1, dtype=torch.float64)) / math.sqrt(g)


def shuffled_tables(seq_lens: list[int], page_size: int, gen: torch.Generator, spare: int = 1) -> tuple[torch.Tensor, int]:
    """Block tables [S, max pages] that give each sequence its pages from a shuffled pool, out of order and never
    contiguous (the case that once read past a buffer in llama.cpp), and the pool's size (``spare`` unused)."""
    pages_needed = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_needed) + spare
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
    for s, n in enumerate(pages_needed):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    return tables, num_pages


def slots_of(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The cache slots of a sequence's ``positions`` through its block-table row."""
    return table[positions // page_size].long() * page_size + positions % page_size
