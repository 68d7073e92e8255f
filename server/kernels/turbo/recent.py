"""The recent window: each sequence's last W tokens kept unquantized beside its turbo pages.

Why: a turbo page spreads its error over every key it holds, and a query leans hardest on the keys
nearest to it. Reading the last W positions exactly removes most of the loss (docs/BENCHMARKS.md
"Quality"), for W rows per running sequence, not per cached token.

Meaning (the reference below defines it): a query at position t reads key and value j exactly when
j > t - W, and from the turbo pages when j <= t - W. The rule depends on t alone, so a chunked prefill
gives the same result at any chunk boundary as a whole one, and a decode step the same as a prefill.

Storage: ``k`` and ``v`` [rows, W, kv_heads, D] in the model's dtype. Sequence s owns ring row
``meta.recent_rows[s]`` (the runtime hands one to each running sequence, as it hands out pages), and
position p lives at ring index p % W there. A row holds what a page quantizes, before quantization:
rotate(k - o(p)) for keys (o the store's key offset, key_offset.py; 0 without one) and rotate(v) for
values, so a decode kernel reads it in the rotated domain it already works in.

Write order: a decode step writes its token before attending (it overwrites position t - W, which
its own query no longer reads exactly). A prefill chunk first reads the ring as the step found it,
for the W - 1 positions before the chunk, and only then writes its last W tokens (exact_rows.py reads,
then the store writes; the reference attends, then write_recent); otherwise a long chunk would
overwrite positions its first queries still read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from server.kernels.host_copy import to_device_together
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.rotation import rotate, rotate_dense
from server.kernels.turbo.format import dequantize_stored, group_size, index_bits, natural_order, stored_order
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at, offset_scores, pair_turns


_QUERY_BLOCK = 128  # the reference's query rows per block (CPU serving runs it; cache-sized scores)


@dataclass
class RecentWindow:
    k: torch.Tensor  # [rows, W, kv_heads, D]: rotate(k - o(p)) of position p at index p % W of its row
    v: torch.Tensor  # [rows, W, kv_heads, D]: rotate(v)

    @property
    def size(self) -> int:
        """W: how many of a sequence's last positions are read exactly."""
        return self.k.shape[1]

    @staticmethod
    def empty(rows: int, size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> RecentWindow:
        shape = (rows, size, kv_heads, head_dim)
        return RecentWindow(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def bytes_per_row(size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one sequence's ring in one layer (K and V)."""
        return 2 * size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def recent_values(x: torch.Tensor, positions: torch.Tensor, key_offset: KeyOffset | None, dtype: torch.dtype) -> torch.Tensor:
    """What the ring stores for x [T, kv_heads, D] at ``positions`` [T]: rotate(x - o(p)) in ``dtype``."""
    x = x.float()
    if key_offset is not None:
        x = x - key_offset_at(key_offset, positions)
    return rotate(x, group_size(x.shape[-1])).to(dtype)


def _query_starts(meta: AttentionMetadata) -> list[int]:
    """Each sequence's first row of q, from the host lengths (query_start_loc lives on the device)."""
    return list(accumulate(meta.query_lens_cpu, initial=0))[:-1]


def ring_rows_of_last_tokens(meta: AttentionMetadata, size: int) -> torch.Tensor:
    """int32 [T]: each of the step's tokens among its sequence's last W positions gets its sequence's ring row
    (meta.recent_rows), the others -1: the earlier tokens of a long chunk would share ring slots with its later
    ones. Built once a step (the store takes it for every layer)."""
    def build() -> torch.Tensor:
        q_lens = torch.tensor(meta.query_lens_cpu)
        seqs = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
        index_in_seq = torch.arange(len(seqs)) - (q_lens.cumsum(0) - q_lens)[seqs]
        keep = (index_in_seq >= (q_lens - size)[seqs]).long()
        seqs, keep = to_device_together([seqs, keep], meta.query_start_loc.device)
        return torch.where(keep.bool(), meta.recent_rows[seqs], -1).to(torch.int32)

    return meta.step_value(f"ring rows of the last {size} tokens", build)


def write_recent(recent: RecentWindow, k_rows: torch.Tensor, v_rows: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """Store the step's ring rows (recent_values of its k and v at ``positions``, [T, kv_heads, D]) for its last W
    positions: the reference body of what the store kernel does with ring_rows_of_last_tokens."""
    rows = ring_rows_of_last_tokens(meta, recent.size)
    keep = rows >= 0
    slots = rows[keep].long() * recent.size + positions[keep] % recent.size
    flat = (-1, *recent.k.shape[2:])
    recent.k.view(flat).index_copy_(0, slots, k_rows[keep].to(recent.k.dtype))
    recent.v.view(flat).index_copy_(0, slots, v_rows[keep].to(recent.v.dtype))


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, kv_heads, group, D] against keys [kv_heads, J, D] -> [kv_heads, group, T, J], one batched matmul (an
    einsum's path costs ~25 us more per call on a CPU, where decode runs several a layer)."""
    t, kv_heads, group, d = q.shape
    return (q.permute(1, 2, 0, 3).reshape(kv_heads, group * t, d) @ keys.transpose(1, 2)).view(kv_heads, group, t, -1)


def _weighted(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs [kv_heads, group, T, J] times values [kv_heads, J, D] -> [T, kv_heads, group, D]."""
    kv_heads, group, t, j = probs.shape
    return (probs.reshape(kv_heads, group * t, j) @ values).view(kv_heads, group, t, -1).permute(2, 0, 1, 3)


def attention_with_recent_reference(q: torch.Tensor, k_pages, v_pages, k_kind: str, v_kind: str,
                                    recent: RecentWindow, step_k_rows: torch.Tensor, step_v_rows: torch.Tensor,
                                    meta: AttentionMetadata, scale: float,
                                    key_offset: KeyOffset | None = None) -> torch.Tensor:
    """The meaning of turbo attention with a recent window, in float32 (a prompt chunk's products in
    ``meta.prompt_dtype``, as paged_kv's reference).

    k_pages / v_pages: TurboPages written with this step's tokens. ``recent``: the ring before this step's
    write (or after a decode step's: the only row that write changes is no longer read exactly).
    step_k_rows / step_v_rows [T, kv_heads, D]: recent_values of this step's k and v, the exact values of its
    own positions. ``key_offset``: o(p) added back to every key (pass it when it varies with p, as the store).

    Computed where the values are stored, in the rotated domain (the CPU serves through this): the rotation R is
    orthogonal, so <q, R^T k> = <R q, k> and sum_j p_j R^T v_j = R^T sum_j p_j v_j. Q is rotated once, the output
    rotated back once, and no cached token is rotated. The pages decode in their stored order (format.stored_order):
    Q is permuted to it for their scores and their part of the output permuted back. The offset's term <q, o(p)> is
    added in the original domain (key_offset.offset_scores). Only the positions some query reads from the pages
    (j <= t - W) are decoded: none while a sequence is at most W long. Q and the output rotate as a CPU does
    (rotation.rotate_dense).
    """
    head_dim, size = q.shape[-1], recent.size
    group = group_size(head_dim)
    page_size, kv_heads = k_pages.codes.shape[2], k_pages.codes.shape[1]
    gqa = q.shape[1] // kv_heads
    k_order = stored_order(index_bits(k_kind), head_dim)
    v_natural = natural_order(index_bits(v_kind), head_dim)
    out = torch.empty_like(q)
    starts, rows_of_seq = _query_starts(meta), meta.recent_rows.tolist()
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        if q_len == 0:
            continue
        first, start = seq_len - q_len, starts[s]
        pages = meta.block_tables[s, : -(-seq_len // page_size)].long()
        positions = torch.arange(seq_len, device=q.device)
        dtype = torch.float32 if q_len == 1 else meta.prompt_dtype

        far = max(seq_len - size, 0)  # positions 0 .. far - 1: the only ones any of the chunk's queries reads paged

        def paged(pages_of, kind):  # [kv_heads, far, D], rotated, stored order: a KV head's keys one matrix
            if not far:  # a short sequence: every position is read exactly (an empty decode still runs ~20 ops)
                return q.new_empty(kv_heads, 0, head_dim, dtype=torch.float32)
            codes, norms = (x[pages[: -(-far // page_size)]].transpose(0, 1).flatten(1, 2)[:, :far]
                            for x in (pages_of.codes, pages_of.norms))
            return dequantize_stored(codes, norms, kind, head_dim)

        exact_from = max(first - size + 1, 0)  # the first position any of the chunk's queries reads exactly

        def exact(ring, step_rows):  # [kv_heads, exact_from.., D]: the ring's rows before the chunk, then the step's
            ring_part = ring[rows_of_seq[s]][positions[exact_from:first] % size]
            return torch.cat((ring_part, step_rows[start : start + q_len])).to(dtype).transpose(0, 1)

        k_quant, v_quant = paged(k_pages, k_kind).to(dtype), paged(v_pages, v_kind).to(dtype)
        k_exact, v_exact = exact(recent.k, step_k_rows), exact(recent.v, step_v_rows)
        turns = pair_turns(key_offset, positions) if key_offset is not None else None
        qs = q[start : start + q_len].float()
        q_rot = rotate_dense(qs, group)
        q_rot, q_stored = q_rot.to(dtype), q_rot[..., k_order].to(dtype)
        for b0 in range(0, q_len, _QUERY_BLOCK):  # blocks of queries: the scores stay cache-sized, causal keys only
            b1 = min(b0 + _QUERY_BLOCK, q_len)
            keys, near_from = first + b1, max(first + b0 - size + 1, 0)
            block_far = max(keys - size, 0)  # from here on j > t - W for every query of the block
            by_kv = lambda x: x[b0:b1].reshape(b1 - b0, kv_heads, gqa, head_dim)  # noqa: E731
            dots = lambda qx, kx: _scores(by_kv(qx), kx).float()  # noqa: E731  [kv, gqa, q, j]
            t = torch.arange(first + b0, first + b1, device=q.device)[:, None]  # [q, 1]
            j = positions[:keys]
            near = j[near_from:] > t - size  # [q, keys - near_from]
            scores = torch.empty(kv_heads, gqa, b1 - b0, keys, device=q.device)  # the where below fills block_far..
            scores[..., :block_far] = dots(q_stored, k_quant[:, :block_far])
            exact_keys = slice(near_from - exact_from, keys - exact_from)
            scores[..., near_from:] = torch.where(near, dots(q_rot, k_exact[:, exact_keys]), scores[..., near_from:])
            if key_offset is not None:
                scores += offset_scores(key_offset, by_kv(qs), j, turns[:keys])
            probs = torch.softmax((scores * scale).masked_fill(j > t, float("-inf")), dim=-1)
            probs_near = probs[..., near_from:] * near
            probs[..., near_from:] *= ~near
            weigh = lambda p, vx: _weighted(p.to(dtype), vx).float()  # noqa: E731
            acc = weigh(probs[..., :block_far], v_quant[:, :block_far])[..., v_natural]
            acc = acc + weigh(probs_near, v_exact[:, exact_keys])
            acc = rotate_dense(acc.reshape(b1 - b0, -1, head_dim), group, inverse=True)
            out[start + b0 : start + b1] = acc.to(q.dtype)
    return out
