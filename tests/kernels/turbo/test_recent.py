"""The recent window (server/kernels/turbo/recent.py) through TurboKVStore on the CPU: a query reads its last W
positions exactly and the rest from the turbo pages, whatever the chunking."""

from __future__ import annotations

import pytest
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo import recent
from server.kernels.turbo.format import dequantize_reference, quantize_reference
from server.kernels.turbo.key_offset import KeyOffset
from server.kernels.turbo.store import TurboKVStore

PAGE = 4


def make_store(kv_heads: int, head_dim: int, window: int, rows: int = 4, pages: int = 64, kinds=("turbo3", "turbo3")):
    return TurboKVStore(pages, PAGE, kv_heads, head_dim, *kinds, "cpu", torch.float32, recent=(rows, window))


def run_steps(store, q, k, v, steps, tables, rows, scale, prompt_dtype=torch.float32, before_step=None):
    """Feed sequences through the store step by step. ``steps``: per step, a list of (sequence, n new tokens);
    q, k, v: per sequence [L, heads, D]; ``before_step(i)`` runs before step i. Returns each sequence's outputs,
    concatenated over its steps."""
    done = [0] * len(q)
    outs = [[] for _ in q]
    for i, step in enumerate(steps):
        if before_step is not None:
            before_step(i)
        seqs = [s for s, _ in step]
        lens = [n for _, n in step]
        pos = torch.cat([torch.arange(done[s], done[s] + n) for s, n in step])
        slots = torch.cat([tables[s][p // PAGE] * PAGE + p % PAGE for s, n in step
                           for p in [torch.arange(done[s], done[s] + n)]])
        qs = torch.cat([q[s][done[s] : done[s] + n] for s, n in step])
        ks = torch.cat([k[s][done[s] : done[s] + n] for s, n in step])
        vs = torch.cat([v[s][done[s] : done[s] + n] for s, n in step])
        width = max(len(t) for t in tables)
        block_tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            block_tables[i, : len(tables[s])] = tables[s]
        seq_lens = [done[s] + n for s, n in step]
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens_cpu=seq_lens, query_lens_cpu=lens,
            recent_rows=torch.tensor([rows[s] for s in seqs], dtype=torch.int32), prompt_dtype=prompt_dtype,
        )  # fmt: skip
        store.write(ks, vs, slots, pos)
        out = store.attend(qs, meta, scale)
        start = 0
        for s, n in step:
            outs[s].append(out[start : start + n])
            start += n
            done[s] += n
    return [torch.cat(o) for o in outs]


def oracle(q, k, v, kind, window, scale, offset=None):
    """float64: keys and values j > t - W as written, the rest as the turbo format rounds them (its reference,
    quantized here on its own, not read back from the store's pages)."""
    def rounded(x):
        codes, norms = quantize_reference(x, kind)
        return dequantize_reference(codes, norms, kind, x.shape[-1]).double()

    shift = 0.0 if offset is None else offset
    kq, vq = rounded(k - shift) + shift, rounded(v)
    gqa = q.shape[1] // k.shape[1]
    n = q.shape[0]
    t, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    near = (j > t - window) & (j <= t)
    far = j <= t - window
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        kh, g = h // gqa, q[:, h].double()
        scores = torch.where(near, g @ k[:, kh].double().T, g @ kq[:, kh].T) * scale
        probs = torch.softmax(scores.masked_fill(~(near | far), float("-inf")), dim=-1)
        out[:, h] = (probs * near) @ v[:, kh].double() + (probs * far) @ vq[:, kh]
    return out


def shuffled_tables(lengths, pages=64, seed=0):
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    tables, used = [], 0
    for n in lengths:
        count = -(-n // PAGE)
        tables.append(order[used : used + count])
        used += count
    return tables


@pytest.mark.parametrize("head_dim,kv_heads,gqa", [(64, 1, 1), (64, 2, 3), (128, 1, 4)])
@pytest.mark.parametrize("window", [1, 5, 8])
@pytest.mark.parametrize("query_block", [128, 3])  # 3: the reference's query blocks end inside chunks and windows
def test_a_query_reads_its_last_w_positions_exactly_and_the_rest_from_pages(head_dim, kv_heads, gqa, window,
                                                                            query_block, monkeypatch):
    monkeypatch.setattr(recent, "_QUERY_BLOCK", query_block)
    torch.manual_seed(head_dim + window + gqa)
    n = 23  # crosses pages of 4 and windows of 5 and 8 at odd places
    q, k, v = (torch.randn(n, h, head_dim) for h in (kv_heads * gqa, kv_heads, kv_heads))
    store = make_store(kv_heads, head_dim, window)
    scale = head_dim**-0.5
    (out,) = run_steps(store, [q], [k], [v], [[(0, 9)], [(0, 1)], [(0, 6)], [(0, 7)]], shuffled_tables([n]), [2], scale)
    want = oracle(q, k, v, "turbo3", window, scale)
    assert (out.double() - want).abs().max() < 1e-4


def test_chunking_does_not_change_the_result_and_batches_mix_prefill_with_decode():
    torch.manual_seed(0)
    head_dim, kv_heads, gqa, window = 64, 2, 2, 6
    lengths = [19, 11]
    q = [torch.randn(n, kv_heads * gqa, head_dim) for n in lengths]
    k = [torch.randn(n, kv_heads, head_dim) for n in lengths]
    v = [torch.randn(n, kv_heads, head_dim) for n in lengths]
    tables = shuffled_tables(lengths)
    scale = head_dim**-0.5
    whole = run_steps(make_store(kv_heads, head_dim, window), q, k, v, [[(0, 19), (1, 11)]], tables, [0, 3], scale)
    steps = [[(0, 10)], [(0, 1), (1, 7)], [(0, 1), (1, 1)], [(1, 3), (0, 7)]]  # prefill beside decode, both ways
    chunked = run_steps(make_store(kv_heads, head_dim, window), q, k, v, steps, tables, [1, 0], scale)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    decoded = run_steps(make_store(kv_heads, head_dim, window), q, k, v,
                        [[(0, 1), (1, 1)]] * 11 + [[(0, 1)]] * 8, tables, [2, 1], scale)  # fmt: skip
    for a, b in zip(whole, decoded):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_prompt_chunks_multiply_in_the_prompt_dtype_and_decode_rows_in_float32():
    """meta.prompt_dtype bfloat16 (a CPU that multiplies it natively): a chunk's products round to bf16 and stay
    within bf16's error of the oracle; one-token rows stay float32, equal to a float32 run's."""
    torch.manual_seed(5)
    head_dim, kv_heads, gqa, window, n = 64, 2, 2, 5, 23
    q, k, v = (torch.randn(n, h, head_dim) for h in (kv_heads * gqa, kv_heads, kv_heads))
    steps, tables, scale = [[(0, 12)], [(0, 1)], [(0, 1)], [(0, 9)]], shuffled_tables([n]), head_dim**-0.5
    (f32,), (bf16,) = (run_steps(make_store(kv_heads, head_dim, window), [q], [k], [v], steps, tables, [1], scale,
                                 prompt_dtype=dtype) for dtype in (torch.float32, torch.bfloat16))
    want = oracle(q, k, v, "turbo3", window, scale)
    chunks = torch.cat((torch.arange(12), torch.arange(14, n)))
    assert (f32.double() - want).abs().max() < 1e-4
    assert not torch.equal(bf16[chunks], f32[chunks]), "the chunks' products must be bfloat16"
    assert (bf16[chunks].double() - want[chunks]).abs().max() < 3e-2
    assert torch.equal(bf16[12:14], f32[12:14]), "decode rows stay float32"


def test_a_window_longer_than_the_sequence_reads_everything_exactly():
    torch.manual_seed(1)
    n, head_dim = 13, 64
    q, k, v = torch.randn(n, 2, head_dim), torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
    (out,) = run_steps(make_store(1, head_dim, 16), [q], [k], [v], [[(0, 5)], [(0, 8)]], shuffled_tables([n]), [0], 0.1)
    scores = torch.einsum("qhd,kd->hqk", q.double(), k[:, 0].double()) * 0.1
    probs = torch.softmax(scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf")), dim=-1)
    exact = torch.einsum("hqk,kd->qhd", probs, v[:, 0].double())
    assert (out.double() - exact).abs().max() < 1e-5


@pytest.mark.parametrize("n,read", [(8, False), (9, True)])
def test_only_positions_read_from_the_pages_are_decoded(n, read):
    """A decode step at length n with W = 8 reads positions j <= n - 1 - W from the pages: none at n = 8, position 0
    at n = 9. NaN norms on every page before that step poison its output exactly when a page is read."""
    torch.manual_seed(6)
    head_dim, window = 64, 8
    q, k, v = torch.randn(n, 2, head_dim), torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
    steps, tables = [[(0, n - 1)], [(0, 1)]], shuffled_tables([n])

    def run(before_step=None):
        store = make_store(1, head_dim, window)

        def poison(i):
            if i == 1:
                for pages in (store.k, store.v):
                    pages.norms.fill_(float("nan"))

        (out,) = run_steps(store, [q], [k], [v], steps, tables, [0], 0.125, before_step=poison if before_step else None)
        return out[-1]

    clean, poisoned = run(), run(before_step=True)
    assert clean.isfinite().all()
    if read:
        assert poisoned.isnan().any()
    else:
        assert torch.equal(poisoned, clean)


def test_keys_lose_the_stores_offset_in_the_window_as_in_the_pages():
    torch.manual_seed(2)
    n, head_dim, window = 14, 64, 4
    const = 3 * torch.randn(1, head_dim)
    offset = KeyOffset(const=const, mean=torch.zeros(1, head_dim), sink=const.clone(),
                       inv_freq=torch.ones(head_dim // 2), pairs=torch.zeros(1, 0, dtype=torch.int32))  # fmt: skip
    store = make_store(1, head_dim, window)
    store.set_key_offset(offset)
    q, k, v = torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim) + const, torch.randn(n, 1, head_dim)
    (out,) = run_steps(store, [q], [k], [v], [[(0, 6)], [(0, 1)], [(0, 7)]], shuffled_tables([n]), [3], 0.125)
    want = oracle(q, k, v, "turbo3", window, 0.125, offset=const)
    assert (out.double() - want).abs().max() < 1e-4


def test_a_long_chunk_leaves_exactly_its_last_w_positions_in_the_ring():
    torch.manual_seed(3)
    head_dim, window, n = 64, 5, 17
    store = make_store(1, head_dim, window, rows=3)
    q, k, v = torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
    run_steps(store, [q], [k], [v], [[(0, n)]], shuffled_tables([n]), [1], 0.125)
    from server.kernels.rotation import rotate_reference

    ring = rotate_reference(store.recent.v[1], head_dim, inverse=True)  # [W, 1, D]: position p at p % W
    for p in range(n - window, n):
        torch.testing.assert_close(ring[p % window], v[p], rtol=0, atol=1e-5)
    assert not store.recent.v[0].any() and not store.recent.v[2].any()  # other sequences' rows untouched


def test_attend_without_the_steps_write_or_rows_is_refused():
    store = make_store(1, 64, 4)
    meta = AttentionMetadata(torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                             torch.tensor([0, 1], dtype=torch.int32), [1], [1])  # fmt: skip
    with pytest.raises(ValueError, match="recent_rows"):
        store.attend(torch.randn(1, 1, 64), meta, 1.0)


@pytest.mark.parametrize("key_offset", [False, True])
def test_the_dense_prefill_over_decoded_pages_and_exact_rows_matches_the_reference(key_offset):
    """The GPU's prefill path (exact_rows.py, then attention_over_decoded_pages with them: dense_attention's
    two-source prefill) run through the Triton interpreter, against the reference, on a batch of a prefill chunk
    beside a decode row."""
    from server.kernels.turbo.attention import attention_over_decoded_pages
    from server.kernels.turbo.exact_rows import exact_rows_triton
    from server.kernels.turbo.recent import attention_with_recent_reference, recent_values

    torch.manual_seed(4)
    head_dim, kv_heads, gqa, window = 64, 2, 2, 6
    lengths = [21, 9]
    q = [torch.randn(n, kv_heads * gqa, head_dim) for n in lengths]
    k = [torch.randn(n, kv_heads, head_dim) + 2 for n in lengths]
    v = [torch.randn(n, kv_heads, head_dim) for n in lengths]
    tables, rows = shuffled_tables(lengths), [3, 1]
    store = make_store(kv_heads, head_dim, window)
    offset = None
    if key_offset:
        offset = KeyOffset(const=torch.randn(kv_heads, head_dim), mean=torch.zeros(kv_heads, head_dim),
                           sink=torch.randn(kv_heads, head_dim), inv_freq=torch.rand(head_dim // 2),
                           pairs=torch.zeros(kv_heads, 0, dtype=torch.int32))  # fmt: skip
        store.set_key_offset(offset)  # the sink differs from const: o(p) varies, attention adds it back
    run_steps(store, q, k, v, [[(0, 12), (1, 8)]], tables, rows, 0.125)
    # The step under test: 9 more tokens of sequence 0, one of sequence 1; its pages stored, the ring not yet.
    pos = torch.cat([torch.arange(12, 21), torch.tensor([8])])
    slots = torch.cat([tables[0][p // PAGE] * PAGE + p % PAGE for p in [torch.arange(12, 21)]]
                      + [tables[1][8 // PAGE : 8 // PAGE + 1] * PAGE + 8 % PAGE])  # fmt: skip
    ks, vs, qs = torch.cat([k[0][12:], k[1][8:]]), torch.cat([v[0][12:], v[1][8:]]), torch.cat([q[0][12:], q[1][8:]])
    store.write(ks, vs, slots, pos)
    store._flush()
    block_tables = torch.zeros(2, max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    meta = AttentionMetadata(slots, block_tables, torch.tensor(lengths, dtype=torch.int32),
                             torch.tensor([0, 9, 10], dtype=torch.int32), lengths, [9, 1],
                             recent_rows=torch.tensor(rows, dtype=torch.int32))  # fmt: skip
    k_rows = recent_values(ks, pos, store.key_offset, torch.float32)
    v_rows = recent_values(vs, pos, None, torch.float32)
    added = store.key_offset if store.offset_turns else None
    assert key_offset == (added is not None)
    exact = exact_rows_triton(ks, vs, store.recent, meta, store.key_offset, store.offset_turns, torch.float32)
    fast = attention_over_decoded_pages(qs, store.k, store.v, "turbo3", "turbo3", meta, 0.125, added, fast=True,
                                        page_dtype=torch.float32, exact=(*exact, window))  # fmt: skip
    want = attention_with_recent_reference(qs, store.k, store.v, "turbo3", "turbo3", store.recent, k_rows, v_rows,
                                           meta, 0.125, added)  # fmt: skip
    torch.testing.assert_close(fast, want, rtol=0, atol=2e-4)


def test_a_long_chunk_writes_only_its_last_w_tokens_each_to_its_own_slot():
    from server.kernels.turbo.recent import RecentWindow, ring_rows_of_last_tokens, write_recent

    lengths, q_lens, rows, window = [20, 7, 3], [12, 1, 3], [2, 0, 1], 5
    meta = AttentionMetadata(torch.zeros(16, dtype=torch.long), torch.zeros(3, 5, dtype=torch.int32),
                             torch.tensor(lengths, dtype=torch.int32), torch.tensor([0, 12, 13, 16], dtype=torch.int32),
                             lengths, q_lens, recent_rows=torch.tensor(rows, dtype=torch.int32))  # fmt: skip
    # Sequence 0: positions 15..19 are q rows 7..11 (row 2); sequence 1: position 6 is row 12 (row 0); sequence 2:
    # positions 0..2 are rows 13..15 (row 1).
    assert ring_rows_of_last_tokens(meta, window).tolist() == [-1] * 7 + [2] * 5 + [0] + [1] * 3
    positions = torch.cat([torch.arange(8, 20), torch.tensor([6]), torch.arange(3)])
    ring = RecentWindow.empty(3, window, 1, 4, torch.float32, "cpu")
    values = positions.float()[:, None, None].expand(16, 1, 4)  # each token's row holds its position
    write_recent(ring, values, -values, positions, meta)
    expected = torch.full((3, window), 0.0)
    for row, p in [(2, p) for p in range(15, 20)] + [(0, 6)] + [(1, p) for p in range(3)]:
        expected[row, p % window] = p
    assert ring.k[..., 0, 0].tolist() == expected.tolist()
    assert ring.v[..., 0, 0].tolist() == (-expected).tolist()


def test_a_decode_step_on_the_fast_path_stores_pages_and_window_in_one_launch_before_the_kernel(monkeypatch):
    """The dispatch of TurboKVStore.attend on a GPU, with the kernels replaced by recorders (their own tests check
    them): the step's token goes to the pages and the window first, then a decode that reads the window."""
    from server.kernels.turbo import store as store_module

    calls = []
    monkeypatch.setattr(store_module, "use_triton", lambda t: True)
    monkeypatch.setattr(store_module, "store_turbo", lambda *a, **kw: calls.append(("store", kw)))
    monkeypatch.setattr(store_module, "decode_attention_cuda", lambda *a, **kw: calls.append(("cuda", kw)))
    monkeypatch.setattr(store_module, "decode_attention_triton",
                        lambda q, *a, **kw: calls.append(("triton", kw)) or torch.zeros_like(q))  # fmt: skip
    monkeypatch.setattr(store_module, "CUDA_DECODE_MIN_WORK", 1)  # the CUDA C kernel is asked first (and declines)
    store = make_store(1, 64, 4)
    meta = AttentionMetadata(torch.tensor([5]), torch.tensor([[0, 1]], dtype=torch.int32),
                             torch.tensor([6], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), [6], [1],
                             recent_rows=torch.tensor([2], dtype=torch.int32))  # fmt: skip
    store.write(torch.randn(1, 1, 64), torch.randn(1, 1, 64), meta.slot_mapping, torch.tensor([5]))
    store.attend(torch.randn(1, 1, 64), meta, 0.125)
    assert [name for name, _ in calls] == ["store", "cuda", "triton"]
    assert calls[0][1]["recent"] is store.recent and calls[0][1]["recent_rows"] is meta.recent_rows
    assert calls[1][1]["recent"] is store.recent
    assert calls[2][1]["recent"] is store.recent and calls[2][1]["new_tokens"] is None


def test_a_mixed_step_on_the_fast_path_stores_once_between_the_exact_rows_and_the_decode(monkeypatch):
    """A chunk beside a decode row, the kernels replaced by recorders: the chunk's exact rows read the ring as the
    step found it, then one store launch takes the whole step (pages, and the ring rows of each sequence's last
    tokens), then the chunk attends over its pages and the decode row goes to the decode kernel; each output lands
    in its own rows."""
    from server.kernels.turbo import store as store_module

    calls = []
    monkeypatch.setattr(store_module, "use_triton", lambda t: True)
    monkeypatch.setattr(store_module, "exact_rows_triton", lambda k, v, recent, meta, *a: calls.append(
        ("exact", k.shape[0], meta.seq_lens_cpu)) or (torch.zeros(1), torch.zeros(1)))  # fmt: skip
    monkeypatch.setattr(store_module, "store_turbo", lambda k, *a, **kw: calls.append(
        ("store", k.shape[0], kw["recent_rows"].tolist())))  # fmt: skip
    monkeypatch.setattr(store_module, "attention_over_decoded_pages", lambda q, k, v, kk, vk, meta, *a, **kw: calls.append(
        ("chunk attention", q.shape[0], meta.seq_lens_cpu)) or torch.full_like(q, 1.0))  # fmt: skip
    monkeypatch.setattr(store_module, "decode_attention_triton", lambda q, k, v, meta, *a, **kw: calls.append(
        ("decode", q.shape[0], meta.seq_lens_cpu)) or torch.full_like(q, 2.0))  # fmt: skip
    store = make_store(1, 64, 4)
    # Sequence 0 decodes its 7th token; sequence 1 prefills positions 0..4 (window 4: the last four get ring rows).
    meta = AttentionMetadata(torch.tensor([6, 16, 17, 18, 19, 20]), torch.tensor([[0, 0], [1, 0]], dtype=torch.int32),
                             torch.tensor([7, 5], dtype=torch.int32), torch.tensor([0, 1, 6], dtype=torch.int32),
                             [7, 5], [1, 5], recent_rows=torch.tensor([3, 1], dtype=torch.int32))  # fmt: skip
    store.write(torch.randn(6, 1, 64), torch.randn(6, 1, 64), meta.slot_mapping, torch.tensor([6, 0, 1, 2, 3, 4]))
    out = store.attend(torch.randn(6, 1, 64), meta, 0.125)
    assert calls == [("exact", 5, [5]), ("store", 6, [3, -1, 1, 1, 1, 1]), ("chunk attention", 5, [5]),
                     ("decode", 1, [7])]  # fmt: skip
    assert out[0].eq(2.0).all() and out[1:].eq(1.0).all()
