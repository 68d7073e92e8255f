"""Paged KV storage: the contract between the runtime and the attention kernels.

One store holds one layer's pages. Sequence s owns the pages listed in
``block_tables[s]``; its token t lives in page ``block_tables[s, t // page_size]`` at
offset ``t % page_size``. Nothing may assume that a sequence's pages are contiguous or
ordered in the pool, and no sequence reads another's pages.

A step writes its new K/V first (``store.write``), then attends (``store.attend``): the
queries of sequence s are the last ``q_len`` positions of its ``seq_len`` cached tokens
and attend causally to every cached token up to and including their own position. That
one rule covers decode (q_len 1), whole prefills and chunked prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from server.kernels.backend import use_triton
from server.kernels.host_copy import to_device_together


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset of each new token (< 0: padding, fast stores skip it)
    block_tables: torch.Tensor  # [S, max_pages] int32; entries past a sequence's pages are padding
    seq_lens: torch.Tensor  # [S] int32: cached tokens per sequence after this step's write
    query_start_loc: torch.Tensor  # [S + 1] int32: rows of q that belong to each sequence
    seq_lens_cpu: list[int]  # host copies, so reference paths and launchers never sync
    query_lens_cpu: list[int]
    # [S] int32: each sequence's row of a turbo store's recent window (server/kernels/turbo/recent.py);
    # None where the cache keeps none
    recent_rows: torch.Tensor | None = None
    # What the CPU reference multiplies a prompt chunk's attention in: float32 (the meaning), or bfloat16 where
    # the engine asks for it (a CPU that multiplies bf16 natively; with AMX tiles ~3x faster on a 2048-token prompt)
    prompt_dtype: torch.dtype = torch.float32
    # What step_value built: index tensors every layer of an eager step would otherwise rebuild
    _step_values: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def step_value(self, name: str, build: Callable[[], Any]) -> Any:
        """build(), once per step: a value that depends on this metadata alone (e.g. a prefill's index tensors),
        built by the first layer and shared by the rest. Eager steps only: a captured graph's metadata is
        rewritten in place between replays, so nothing derived from it may be kept."""
        if name not in self._step_values:
            self._step_values[name] = build()
        return self._step_values[name]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)


def select_sequences(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor | slice, AttentionMetadata]:
    """(the rows of q that belong to sequences ``seqs``, the metadata of a step of those sequences alone, in that
    order): a store may attend to a step's groups apart. Consecutive sequences (the scheduler puts a step's decode
    rows first) give their rows as a slice, so that taking them launches nothing."""
    q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.long)
    picked = torch.tensor(seqs, dtype=torch.long)
    starts = q_lens.cumsum(0) - q_lens
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), q_lens[picked].cumsum(0)])
    if all(b == a + 1 for a, b in zip(seqs, seqs[1:])):
        first = int(starts[seqs[0]]) if seqs else 0
        rows = slice(first, first + int(query_start[-1]))
        picked, query_start = to_device_together([picked, query_start], meta.query_start_loc.device)
    else:
        rows = torch.cat([torch.arange(starts[s], starts[s] + q_lens[s]) for s in seqs])
        rows, picked, query_start = to_device_together([rows, picked, query_start], meta.query_start_loc.device)
    # The step's slots where the metadata carries one a row; attention never reads them (stores take theirs in write)
    has_slots = meta.slot_mapping.shape[0] == sum(meta.query_lens_cpu)
    return rows, AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows] if has_slots else meta.slot_mapping[:0],
        block_tables=meta.block_tables[picked],
        seq_lens=meta.seq_lens[picked],
        query_start_loc=query_start.to(meta.query_start_loc.dtype),
        seq_lens_cpu=[meta.seq_lens_cpu[s] for s in seqs],
        query_lens_cpu=[meta.query_lens_cpu[s] for s in seqs],
        recent_rows=None if meta.recent_rows is None else meta.recent_rows[picked],
        prompt_dtype=meta.prompt_dtype,
    )


def decode_rows_apart(meta: AttentionMetadata) -> list[tuple[torch.Tensor | slice, AttentionMetadata]]:
    """[(rows, step)] of a mixed step's chunks, then of its decode rows (one query each): attention takes each group
    through its own kernel, since a prefill kernel spends a whole query tile, and no split of the context, on a
    decode row. Built once a step."""
    return meta.step_value("decode rows apart", lambda: [
        select_sequences(meta, [s for s, n in enumerate(meta.query_lens_cpu) if (n == 1) == decode])
        for decode in (False, True)])  # fmt: skip


class KVLayerStore(Protocol):
    """What the model's attention layer sees of the KV cache."""

    page_size: int

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at the given slots; ``positions`` [T] are the tokens' positions
        (a turbo K store quantizes k minus an offset that depends on them)."""

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, q_heads, head_dim] -> attention output of the same shape and dtype."""


def _page_runs(meta: AttentionMetadata, page_size: int) -> list[tuple[int, int]]:
    """Each sequence's leading run of pages consecutive in the pool, (first page, pages in it): its K / V there are a
    view of the pool, not a gather. A sequence that grew alone (one chat stream) is one run; one that decodes beside
    others keeps its prompt's run and gathers only the pages appended since. Host block tables only (a device's
    would sync: no runs); once a step."""
    def build() -> list[tuple[int, int]]:
        if meta.block_tables.device.type != "cpu":
            return [(0, 0)] * len(meta.seq_lens_cpu)
        runs = []
        for row, seq_len in zip(meta.block_tables.numpy(), meta.seq_lens_cpu):
            pages = row[: -(-seq_len // page_size)]
            breaks = np.flatnonzero(pages[1:] - pages[:-1] != 1)
            runs.append((int(pages[0]), int(breaks[0]) + 1 if len(breaks) else len(pages)) if len(pages) else (0, 0))
        return runs

    return meta.step_value(f"page runs {page_size}", build)


@dataclass
class _DecodeGroup:
    """A step's short decode rows attended as one batch: their pages gathered by one index."""

    sequences: frozenset[int]  # the step's sequence indices (host)
    rows: torch.Tensor  # [B] their rows of q
    pages: torch.Tensor  # [B, P] long: each row's pages, padding entries 0
    masked: torch.Tensor  # [B, 1, P * page_size] bool: the key positions past each row's seq_len


# Decode rows up to this many cached tokens are attended together: one gather and two batched products a layer
# instead of a set per sequence, whose op overhead took about a third of a step at 8 streams of 32-token contexts
# (embedded model, 2-core CPU). Longer rows keep their own: there the gather's bytes bind, and a batch would pad
# each short row to the longest.
GROUPED_DECODE_TOKENS = 256


def _decode_group(meta: AttentionMetadata, page_size: int, device: torch.device) -> _DecodeGroup | None:
    """The step's decode rows of 1 .. GROUPED_DECODE_TOKENS tokens, where there are two or more; once a step."""
    def build() -> _DecodeGroup | None:
        lens = meta.seq_lens_cpu
        members = [s for s, n in enumerate(meta.query_lens_cpu) if n == 1 and 0 < lens[s] <= GROUPED_DECODE_TOKENS]
        if len(members) < 2:
            return None
        held = torch.tensor([-(-lens[s] // page_size) for s in members])
        n_pages = int(held.max())
        pages = meta.block_tables.cpu()[members, :n_pages].long()
        pages.masked_fill_(torch.arange(n_pages)[None, :] >= held[:, None], 0)
        masked = torch.arange(n_pages * page_size)[None, :] >= torch.tensor([lens[s] for s in members])[:, None]
        rows = torch.tensor(meta.query_start_loc.tolist())[members]
        rows, pages = to_device_together([rows, pages], device)
        return _DecodeGroup(frozenset(members), rows, pages, masked[:, None, :].to(device))

    return meta.step_value(f"decode group {page_size}", build)


def _attend_decode_group(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, g: _DecodeGroup, scale: float
) -> torch.Tensor:
    """[B, q_heads, D] float32: one query a row over its gathered pages, GQA as in paged_attention_reference. The
    pages are gathered KV-head-major, [kv_heads, B, T, D], so that both products are plain batched GEMMs over
    (head, row) with no copy in between."""
    kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    k, v = (x.permute(2, 0, 1, 3)[:, g.pages].flatten(2, 3).to(torch.float32) for x in (k_pages, v_pages))
    qs = q[g.rows].to(torch.float32).view(len(g.rows), kv_heads, -1, head_dim).transpose(0, 1)  # [kv, B, group, D]
    scores = (torch.einsum("hbgd,hbtd->hbgt", qs, k) * scale).masked_fill_(g.masked, float("-inf"))
    return torch.einsum("hbgt,hbtd->hbgd", torch.softmax(scores, dim=-1), v).transpose(0, 1).flatten(1, 2)


def _tokens(pool: torch.Tensor, pages: slice | torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """[kv_heads, count, D] in ``dtype``: the first ``count`` tokens of ``pages`` of a K or V pool (a slice of the pool
    is read as a view, a tensor of page indices gathered)."""
    return pool[pages].flatten(0, 1)[:count].to(dtype).transpose(0, 1)


def _attend_one_query(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """q [kv_heads, group, D] (a KV head's query heads as the rows of one query; one query sees every key) over keys
    and values given in parts [kv_heads, t_i, D], views of the pool where they can be -> [kv_heads, group, D]. Two
    batched products a part over the strided views: SDPA's path for one query took 1.5x as long (6000 tokens, 3 KV
    heads of 64 dims, 2-core CPU: 709 against 483 us)."""
    scores = [torch.einsum("hgd,htd->hgt", q, k) for k in keys]
    probs = torch.softmax((scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)) * scale, dim=-1)
    out = None
    for p, v in zip(probs.split([k.shape[1] for k in keys], dim=-1), values):
        part = torch.einsum("hgt,htd->hgd", p, v)
        out = part if out is None else out + part
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The meaning of paged attention, in float32 (prompt chunks in ``meta.prompt_dtype``).

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] in any float dtype (a
    compressed store passes its pages decoded). GQA: query head h reads KV head
    h // (q_heads // kv_heads).
    """
    page_size, kv_heads, head_dim = k_pages.shape[1], k_pages.shape[2], q.shape[-1]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    runs = _page_runs(meta, page_size)
    grouped = _decode_group(meta, page_size, q.device)
    if grouped is not None:
        out[grouped.rows] = _attend_decode_group(q, k_pages, v_pages, grouped, scale).to(q.dtype)
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        if q_len == 0 or (grouped is not None and s in grouped.sequences):
            continue
        n_pages = -(-seq_len // page_size)
        (first, run), dtype = runs[s], torch.float32 if q_len == 1 else meta.prompt_dtype
        whole = slice(first, first + run) if run == n_pages else meta.block_tables[s, :n_pages].long()
        qs = q[starts[s] : starts[s] + q_len].to(dtype)
        if q_len == 1:
            # A decode row whose pages break after a leading run (it decoded beside others) reads the run in place
            # and gathers only the pages after it.
            parts = [(whole, seq_len)] if run in (0, n_pages) else [
                (slice(first, first + run), run * page_size),
                (meta.block_tables[s, run:n_pages].long(), seq_len - run * page_size)]  # fmt: skip
            keys, values = ([_tokens(x, pages, n, dtype) for pages, n in parts] for x in (k_pages, v_pages))
            o = _attend_one_query(qs.view(kv_heads, group, head_dim), keys, values, scale)
        else:
            # Query i sits at position seq_len - q_len + i and sees the keys up to it. Each query head gets its KV
            # head's keys (a copy), so that the causal case is SDPA's own (its fused CPU kernel): stacking a KV
            # head's query heads as rows (_attend_one_query) needs an explicit mask, which took the unfused path, 5x
            # slower on a 2048-token prompt (2-core CPU, torch 2.13).
            k, v = (_tokens(x, whole, seq_len, dtype).repeat_interleave(group, dim=0)[None] for x in (k_pages, v_pages))
            qs = qs.transpose(0, 1)[None]  # [1, q_heads, q_len, D]: the fused kernel takes 4-D inputs only
            if q_len == seq_len:
                o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
            else:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal, scale=scale)
            o = o[0].transpose(0, 1)
        out[starts[s] : starts[s] + q_len] = o.reshape(q_len, kv_heads * group, head_dim).to(q.dtype)
    return out


class DenseKVStore:
    """Pages of plain floating-point K and V (bf16, f16 or f32)."""

    cuda_graph_safe = True  # the fast write skips slot -1 and decode handles seq_len 0 (runtime/cuda_graphs.py)

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K plus V for one token of one layer."""
        return 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def pages_for_fused_write(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_pages, v_pages) that a projection's epilogue may store a step's k and v into with the same
        meaning as ``write`` (gemv.linear_rope): the decode step then spends no launch on the cache write."""
        return self.k_pages, self.v_pages

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor) -> None:
        if use_triton(k):
            from server.kernels.dense_attention import write_kv_pages  # Triton only where it runs

            return write_kv_pages(k, v, self.k_pages, self.v_pages, slot_mapping)
        self.k_pages.view(-1, *self.k_pages.shape[2:]).index_copy_(0, slot_mapping, k.to(self.k_pages.dtype))
        self.v_pages.view(-1, *self.v_pages.shape[2:]).index_copy_(0, slot_mapping, v.to(self.v_pages.dtype))

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if use_triton(q):
            from server.kernels.dense_attention import paged_attention

            return paged_attention(q, self.k_pages, self.v_pages, meta, scale)
        return paged_attention_reference(q, self.k_pages, self.v_pages, meta, scale)
