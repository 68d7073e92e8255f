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
for the W - 1 positions before the chunk, and writes its last W tokens after attending; otherwise a
long chunk would overwrite positions its first queries still read.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from server.kernels.host_copy import to_device
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.rotation import rotate, rotate_reference
from server.kernels.turbo.format import dequantize_reference, group_size
from server.kernels.turbo.key_offset import KeyOffset, key_offset_at


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


def _on_device(parts: list[list[torch.Tensor]], device: torch.device) -> list[torch.Tensor]:
    """Host index tensors on ``device``, each list of parts concatenated, in one copy that does not wait for the GPU
    (host_copy.py): prefill runs this per layer."""
    flat = to_device(torch.cat([t for pieces in parts for t in pieces]), device)
    return list(flat.split([sum(map(len, pieces)) for pieces in parts]))


def written_tokens(meta: AttentionMetadata, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of q, their ring slots row * W + p % W) of the tokens a step leaves in the ring: each sequence's
    last W positions of this step (earlier ones of a long chunk would be overwritten by later ones)."""
    tokens, positions, seqs = [], [], []
    for s, (start, seq_len, q_len) in enumerate(zip(_query_starts(meta), meta.seq_lens_cpu, meta.query_lens_cpu)):
        p = torch.arange(max(seq_len - q_len, seq_len - size), seq_len)
        tokens.append(start + p - (seq_len - q_len))
        positions.append(p)
        seqs.append(torch.full_like(p, s))
    tokens, positions, seqs = _on_device([tokens, positions, seqs], meta.query_start_loc.device)
    return tokens, meta.recent_rows[seqs].long() * size + positions % size  # ring rows read where they live


def write_recent(recent: RecentWindow, k_rows: torch.Tensor, v_rows: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the step's ring rows (recent_values of its k and v, [T, kv_heads, D]) for its last W positions."""
    tokens, slots = written_tokens(meta, recent.size)
    flat = (-1, *recent.k.shape[2:])
    recent.k.view(flat).index_copy_(0, slots, k_rows[tokens].to(recent.k.dtype))
    recent.v.view(flat).index_copy_(0, slots, v_rows[tokens].to(recent.v.dtype))


def attention_with_recent_reference(q: torch.Tensor, k_pages, v_pages, k_kind: str, v_kind: str,
                                    recent: RecentWindow, step_k_rows: torch.Tensor, step_v_rows: torch.Tensor,
                                    meta: AttentionMetadata, scale: float,
                                    key_offset: KeyOffset | None = None) -> torch.Tensor:
    """The meaning of turbo attention with a recent window, in float32.

    k_pages / v_pages: TurboPages written with this step's tokens. ``recent``: the ring before this step's
    write (or after a decode step's: the only row that write changes is no longer read exactly).
    step_k_rows / step_v_rows [T, kv_heads, D]: recent_values of this step's k and v, the exact values of its
    own positions. ``key_offset``: o(p) added back to every key (pass it when it varies with p, as the store).
    """
    head_dim, size = q.shape[-1], recent.size
    group = group_size(head_dim)
    page_size, kv_heads = k_pages.codes.shape[2], k_pages.codes.shape[1]
    gqa = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts, rows_of_seq = _query_starts(meta), meta.recent_rows.tolist()
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        if q_len == 0:
            continue
        first = seq_len - q_len
        pages = meta.block_tables[s, : -(-seq_len // page_size)].long()
        positions = torch.arange(seq_len, device=q.device)
        offset = key_offset_at(key_offset, positions) if key_offset is not None else 0.0

        def paged(pages_of, kind):  # [seq_len, kv_heads, D] in the original domain
            x = dequantize_reference(pages_of.codes[pages], pages_of.norms[pages], kind, head_dim)
            return x.transpose(1, 2).reshape(-1, kv_heads, head_dim)[:seq_len]

        def exact(ring, step_rows):  # ring rows before the chunk, the step's own after it
            rows = ring[rows_of_seq[s]][positions % size].float()
            rows[first:] = step_rows[starts[s] : starts[s] + q_len].float()
            return rotate_reference(rows, group, inverse=True)

        k_quant, v_quant = paged(k_pages, k_kind) + offset, paged(v_pages, v_kind)
        k_exact, v_exact = exact(recent.k, step_k_rows) + offset, exact(recent.v, step_v_rows)
        qs = q[starts[s] : starts[s] + q_len].float()
        t = torch.arange(first, seq_len, device=q.device)[None, :, None]  # [1, q_len, 1]
        j = positions[None, None, :]
        near = j > t - size
        heads = lambda x: x.repeat_interleave(gqa, dim=1)  # noqa: E731  [seq_len, q_heads, D]
        scores = torch.where(near, torch.einsum("qhd,khd->hqk", qs, heads(k_exact)),
                             torch.einsum("qhd,khd->hqk", qs, heads(k_quant))) * scale
        probs = torch.softmax(scores.masked_fill(j > t, float("-inf")), dim=-1)
        out[starts[s] : starts[s] + q_len] = (
            torch.einsum("hqk,khd->qhd", probs * near, heads(v_exact))
            + torch.einsum("hqk,khd->qhd", probs * ~near, heads(v_quant))
        ).to(q.dtype)
    return out


def exact_pages(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, meta: AttentionMetadata, recent: RecentWindow,
                step_k_rows: torch.Tensor, step_v_rows: torch.Tensor,
                key_offset: KeyOffset | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages shaped as the decoded pages k, v [pages, page_size, kv_heads, D] (original domain, keys with o(p) back
    when ``key_offset`` is given; addressed through ``tables``, meta's sequences) holding the exact values at every
    position a query of this step reads exactly: [first query - W + 1, seq_len) of each sequence, from the ring
    as the step found it before the chunk and from the step's rows (recent_values) in it. The other rows are
    zero: the dense prefill (dense_attention.paged_prefill ``exact``) reads them only where its mask drops them,
    so they need only be finite."""
    page_size, size, device = k.shape[1], recent.size, k.device
    ring_pos, ring_seqs, step_pos, step_seqs, step_tokens = [], [], [], [], []
    for s, (start, seq_len, q_len) in enumerate(zip(_query_starts(meta), meta.seq_lens_cpu, meta.query_lens_cpu)):
        first = seq_len - q_len
        before = torch.arange(max(0, first - size + 1) if q_len else first, first)
        ring_pos.append(before)
        ring_seqs.append(torch.full_like(before, s))
        step_pos.append(torch.arange(first, seq_len))
        step_seqs.append(torch.full((q_len,), s))
        step_tokens.append(torch.arange(start, start + q_len))
    positions, seqs, step_tokens = _on_device([ring_pos + step_pos, ring_seqs + step_seqs, step_tokens], device)
    slots = tables[seqs, positions // page_size].long() * page_size + positions % page_size
    n_ring = sum(map(len, ring_pos))
    ring_slots = meta.recent_rows[seqs[:n_ring]].long() * size + positions[:n_ring] % size
    group = group_size(k.shape[-1])
    out = []
    for pages, ring, rows in ((k, recent.k, step_k_rows), (v, recent.v, step_v_rows)):
        flat_ring = ring.view(-1, *ring.shape[2:])
        values = rotate(torch.cat([flat_ring[ring_slots], rows[step_tokens]]).float(), group, inverse=True)
        if pages is k and key_offset is not None:
            values = values + key_offset_at(key_offset, positions)
        exact = torch.zeros_like(pages)
        exact.view(-1, *pages.shape[2:])[slots] = values.to(pages.dtype)
        out.append(exact)
    return out[0], out[1]
