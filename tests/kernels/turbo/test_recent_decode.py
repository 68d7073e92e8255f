"""The Triton decode with a recent window (recent.py): positions j > t - W exact from the ring, the rest from pages.

Each case is one decode step as the engine runs it: the history sits in turbo pages (shuffled block tables) and
its last W - 1 positions in the ring (recent_values), the step's token is stored with store_turbo(..., recent=)
(pages and ring), then the decode reads both. Checked against attention_with_recent_reference (which defines the
window) and a float64 oracle built here from the float64-decoded pages plus o(p) (test_key_offset) and the keys
and values as written, for key j exactly when j > t - W. Ring slots that no live position owns (spare rows,
indices of short sequences) hold garbage, so reading the wrong row or index shows.
"""

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.attention import NewTokens, decode_attention_triton
from server.kernels.turbo.quantize import store_turbo
from server.kernels.turbo.recent import RecentWindow, attention_with_recent_reference, recent_values
from server.kernels.turbo.store import TurboKVStore
from test_attention import decode64
from test_decode_key_offset import offset_for
from test_key_offset import PAGE, assert_close, offset64, rope_keys
from turbo_oracle import shuffled_tables, slots_of


def lengths_for(window, *extra):
    """0 (a padding row), 1, 2, W - 1, W, W + 1, page boundaries and ``extra``, each once."""
    return sorted({0, 1, 2, max(1, window - 1), window, window + 1, PAGE, PAGE + 1, *extra})


def decode_step(seq_lens, kv_heads, gqa, head_dim, k_kind, v_kind, window, offset=None, ring_dtype=torch.float32,
                seed=0):
    """(store, recent, meta, q, written k, written v, step k rows, step v rows) after a decode step's store.

    Sequence s holds seq_lens[s] tokens after the step: positions < seq_lens[s] - 1 written before (pages by the
    CPU store, the ring's last W - 1 of them by recent_values), the last one by store_turbo with the ring. A
    seq_len-0 row is a padding row: slot -1, which must store nothing."""
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = shuffled_tables([max(n, 1) for n in seq_lens], PAGE, gen, spare=2)
    store = TurboKVStore(num_pages, PAGE, kv_heads, head_dim, k_kind, v_kind, "cpu", torch.float32)
    if offset is not None:
        store.set_key_offset(offset)
    num_seqs = len(seq_lens)
    rows = torch.randperm(num_seqs + 2, generator=gen)[:num_seqs].to(torch.int32)  # two spare rows
    recent = RecentWindow.empty(num_seqs + 2, window, kv_heads, head_dim, ring_dtype, "cpu")
    recent.k.copy_(torch.randn(recent.k.shape, generator=gen) * 4 + 3)  # garbage wherever no position lives
    recent.v.copy_(torch.randn(recent.v.shape, generator=gen) * 4 - 3)
    keys, values, new_k, new_v, new_slots, new_positions = [], [], [], [], [], []
    for s, n in enumerate(seq_lens):
        if offset is None:
            k, positions = torch.randn(max(n, 1), kv_heads, head_dim, generator=gen) * 2 + 0.5, torch.arange(max(n, 1))
        else:
            k, positions = rope_keys(max(n, 1), kv_heads, head_dim, offset, gen)
        v = torch.randn(max(n, 1), kv_heads, head_dim, generator=gen)
        slots = slots_of(tables[s], positions, PAGE)
        before = max(n - 1, 0)
        if before:
            store.write(k[:before], v[:before], slots[:before], positions[:before])
            near = positions[max(0, before - window + 1) : before]  # the W - 1 positions a step finds in the ring
            recent.k[rows[s].item(), near % window] = recent_values(k[near], near, store.key_offset, ring_dtype)
            recent.v[rows[s].item(), near % window] = recent_values(v[near], near, None, ring_dtype)
        new_k.append(k[-1])
        new_v.append(v[-1])
        new_slots.append(slots[-1].item() if n else -1)
        new_positions.append(max(n - 1, 0))
        keys.append(k[:n])
        values.append(v[:n])
    new_k, new_v = torch.stack(new_k), torch.stack(new_v)
    slot_mapping, positions = torch.tensor(new_slots), torch.tensor(new_positions)
    store_turbo(new_k, new_v, slot_mapping, positions, store.k, store.v, store.signs, store.inv_sqrt, store.key_offset,
                store.offset_turns, recent=recent, recent_rows=rows)
    meta = AttentionMetadata(slot_mapping, tables, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.arange(num_seqs + 1, dtype=torch.int32), list(seq_lens), [1] * num_seqs,
                             recent_rows=rows)
    q = torch.randn(num_seqs, kv_heads * gqa, head_dim, generator=gen)
    step_k = recent_values(new_k, positions, store.key_offset, torch.float32)
    step_v = recent_values(new_v, positions, None, torch.float32)
    return store, recent, meta, q, keys, values, step_k, step_v


def window_oracle64(q, store, meta, window, scale, exact):
    """Float64 attention of each sequence's query at position n - 1 with a recent window of ``window``: key and
    value j come from exact(s, j) -> (k, v) float64 [len(j), kv_heads, D] (original domain, o(j) included) when
    j > n - 1 - W, else from the float64-decoded pages plus o(j) (test_key_offset's complex RoPE); 0 for a
    seq_len-0 row."""
    kv_heads, head_dim, page = store.num_kv_heads, store.head_dim, store.page_size
    k_pages, v_pages = decode64(store.k, head_dim), decode64(store.v, head_dim)
    gqa = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, n in enumerate(meta.seq_lens_cpu):
        if n == 0:
            continue
        j = torch.arange(n)
        pages, rows = meta.block_tables[s, j // page].long(), j % page
        k, v = k_pages[pages, rows], v_pages[pages, rows]  # [n, kv_heads, D], fresh tensors
        if store.key_offset is not None:
            k = k + offset64(store.key_offset, j)
        near = j > n - 1 - window
        k[near], v[near] = exact(s, j[near])
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[s].double(), k.repeat_interleave(gqa, 1)) * scale, -1)
        out[s] = torch.einsum("hk,khd->hd", probs, v.repeat_interleave(gqa, 1))
    return out


def oracle(q, store, meta, keys, values, window, scale):
    """window_oracle64 with the K / V each sequence wrote as its exact values."""
    return window_oracle64(q, store, meta, window, scale, lambda s, j: (keys[s][j].double(), values[s][j].double()))


def reference(q, store, recent, meta, step_k, step_v, scale):
    """attention_with_recent_reference over the rows with a token (it has no seq_len-0 decode row)."""
    live = torch.tensor([n > 0 for n in meta.seq_lens_cpu])
    n = int(live.sum())
    ref_meta = AttentionMetadata(meta.slot_mapping[live], meta.block_tables[live], meta.seq_lens[live],
                                 torch.arange(n + 1, dtype=torch.int32), [s for s in meta.seq_lens_cpu if s > 0],
                                 [1] * n, recent_rows=meta.recent_rows[live])  # fmt: skip
    out = attention_with_recent_reference(q[live], store.k, store.v, store.k_kind, store.v_kind, recent, step_k[live],
                                          step_v[live], ref_meta, scale, store.key_offset)
    return out, live


CASES = [  # head_dim, gqa, k_kind, v_kind, W, turned pairs (None: no key offset, "all": every pair), splits, block
    (64, 1, "turbo3", "turbo3", 5, None, 1, 64),
    (64, 2, "turbo4", "turbo3", 16, "all", 3, 16),
    (64, 3, "turbo3", "turbo2", 17, 5, 3, 64),
    (128, 4, "turbo4", "turbo3", 17, 16, 3, 64),
    (128, 8, "turbo2", "turbo4", 1, None, 3, 64),
    (128, 1, "turbo3", "turbo3", 5, 8, 1, 64),
]


@pytest.mark.parametrize("head_dim,gqa,k_kind,v_kind,window,pairs,splits,block", CASES)
def test_decode_with_recent_window_matches_reference_and_float64(head_dim, gqa, k_kind, v_kind, window, pairs,
                                                                  splits, block):
    """Lengths 0, 1, 2, W - 1, W, W + 1, page boundaries, and one whose window crosses a split boundary with 3
    splits: 130 at 64-token blocks (splits of 64, boundary 128), 100 at 16-token blocks (splits of 48, 96)."""
    kv_heads = 2 if head_dim == 64 else 1  # the interpreter's time goes with programs; two heads at 64 suffice
    offset = None if pairs is None else offset_for(kv_heads, head_dim, 10000.0, seed=head_dim + window,
                                                   turned_pairs=None if pairs == "all" else pairs)
    seq_lens = lengths_for(window, 130 if block == 64 else 100)
    store, recent, meta, q, keys, values, step_k, step_v = decode_step(seq_lens, kv_heads, gqa, head_dim, k_kind,
                                                                       v_kind, window, offset, seed=gqa + window)
    scale = head_dim**-0.5
    want = oracle(q, store, meta, keys, values, window, scale)
    ref, live = reference(q, store, recent, meta, step_k, step_v, scale)
    assert_close(ref, want[live], 2e-5, "reference vs float64")
    key_offset = store.key_offset if store.offset_turns else None
    got = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt, key_offset,
                                  num_splits=splits, block_n=block, recent=recent)
    assert_close(got[live], ref.double(), 2e-5, f"decode with W={window}, {splits} splits vs reference")
    assert_close(got, want, 2e-5, f"decode with W={window}, {splits} splits vs float64")
    assert torch.equal(got[~live], torch.zeros_like(got[~live])), "a seq_len-0 row attends to nothing: zeros"


def test_decode_with_recent_window_head_dim_256():
    window = 5
    store, recent, meta, q, keys, values, *_ = decode_step([1, 5, 6, 33], 1, 2, 256, "turbo3", "turbo4", window,
                                                           seed=7)
    want = oracle(q, store, meta, keys, values, window, 256**-0.5)
    got = decode_attention_triton(q, store.k, store.v, meta, 256**-0.5, store.signs, store.inv_sqrt, num_splits=2,
                                  recent=recent)
    assert_close(got, want, 2e-5, "head_dim 256 vs float64")


def test_decode_with_half_queries_and_a_half_ring_errs_within_fp16_rounding():
    """fp16 queries and ring (the GPU case): ring rows become fp16 mma operands like the decoded tiles. Against the
    float32 reference over what the ring holds (the step's rows rounded to fp16 too) the error is the fp16 operands'
    alone."""
    window, head_dim = 16, 128
    offset = offset_for(1, head_dim, 500000.0, seed=3, turned_pairs=8)
    store, recent, meta, q, _, _, step_k, step_v = decode_step([3, 17, 40], 1, 4, head_dim, "turbo3", "turbo3",
                                                               window, offset, torch.float16, seed=9)
    q = q.half()
    ref, _ = reference(q.float(), store, recent, meta, step_k.half().float(), step_v.half().float(), head_dim**-0.5)
    got = decode_attention_triton(q, store.k, store.v, meta, head_dim**-0.5, store.signs, store.inv_sqrt,
                                  store.key_offset, num_splits=2, recent=recent)
    assert got.dtype == torch.float16
    assert_close(got, ref.double(), 2e-3 * ref.abs().max().item(), "fp16 decode with a fp16 ring vs reference")


def test_window_covering_everything_reads_no_page_and_window_one_reads_only_the_new_token_exactly():
    """W >= seq_len: every key exact, so zeroed pages change nothing; W = 1: only the new token is exact, so the
    result moves when the pages are zeroed."""
    for window, pages_matter in ((40, False), (1, True)):
        store, recent, meta, q, *_ = decode_step([7, 33], 1, 2, 64, "turbo3", "turbo3", window, seed=11)
        scale = 64**-0.5
        before = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt,
                                         recent=recent)
        store.k.codes.zero_()
        store.k.norms.zero_()
        after = decode_attention_triton(q, store.k, store.v, meta, scale, store.signs, store.inv_sqrt, recent=recent)
        assert (not torch.equal(before, after)) == pages_matter, f"W={window}"


def test_recent_window_arguments_are_checked():
    store, recent, meta, q, *_ = decode_step([3, 9], 1, 2, 64, "turbo3", "turbo3", 4, seed=13)
    args = (q, store.k, store.v, meta, 1.0, store.signs, store.inv_sqrt)
    new = NewTokens(q[:, :1], q[:, :1], meta.slot_mapping, meta.seq_lens - 1, None, False)
    with pytest.raises(ValueError, match="new_tokens"):
        decode_attention_triton(*args, new_tokens=new, recent=recent)
    no_rows = AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                meta.seq_lens_cpu, meta.query_lens_cpu)
    with pytest.raises(ValueError, match="meta.recent_rows"):
        decode_attention_triton(q, store.k, store.v, no_rows, 1.0, store.signs, store.inv_sqrt, recent=recent)
    with pytest.raises(ValueError, match="recent.v must be"):
        decode_attention_triton(*args, recent=RecentWindow(recent.k, recent.v[:, :2]))
