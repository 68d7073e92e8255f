"""Triton paged attention (server/kernels/dense_attention.py) vs the torch reference vs a float64 oracle.

On CPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay tiny. Inputs are
fp16/fp32: the interpreter's bf16 arithmetic is wrong (shared/ENVIRONMENT.md); bf16 is checked on the GPU.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from server.kernels import paged_kv
from server.kernels.dense_attention import (
    choose_num_splits,
    paged_attention,
    paged_decode,
    paged_prefill,
    write_kv_pages,
)
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore, _page_runs, paged_attention_reference

PAGE = 16
# Context lengths the spec calls out: one token, two, around a page boundary, and a long one.
EDGE_LENS = [1, 2, PAGE - 1, PAGE, PAGE + 1, 100]


def make_batch(seq_lens, query_lens, q_heads, kv_heads, head_dim, dtype, seed=0, extra_pages=3, page=PAGE,
               consecutive=False):  # fmt: skip
    """Random pages in a shuffled pool (sequences own scattered, out-of-order pages; ``consecutive``: each owns
    a run of the pool, as a sequence that grew alone does) and metadata."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page) for n in seq_lens]
    num_pages = sum(pages_per_seq) + extra_pages
    order = torch.arange(num_pages) if consecutive else torch.randperm(num_pages, generator=gen)
    max_pages = max(pages_per_seq + [1]) + 2  # padding columns past each sequence's pages
    block_tables = torch.full((len(seq_lens), max_pages), num_pages - 1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    shape = (num_pages, page, kv_heads, head_dim)
    k_pages = torch.randn(shape, generator=gen).to(dtype)
    v_pages = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [
        int(block_tables[s, t // page]) * page + t % page
        for s, (n, m) in enumerate(zip(seq_lens, query_lens))
        for t in range(n - m, n)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(query_lens),
    )
    return q, k_pages, v_pages, meta


def gather_tokens(pages, slots):
    """[tokens, kv_heads, D] float64 rows of pages at (page, offset) slots."""
    return torch.stack([pages[p, o] for p, o in slots]).double()


def oracle(q, k_pages, v_pages, meta, scale, exact=None):
    """float64, one query at a time, keys gathered token by token through the block table.

    exact = (K rows, V rows, W) as paged_prefill takes them: the query at position t takes key and value j from
    row j - max(0, first - W + 1) of its sequence when j > t - W (its last W positions, itself included), from
    k_pages / v_pages before that."""
    kv_heads, page = k_pages.shape[2], k_pages.shape[1]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        slots = [(int(meta.block_tables[s, t // page]), t % page) for t in range(seq_len)]
        keys, values = gather_tokens(k_pages, slots), gather_tokens(v_pages, slots)
        if exact is not None:
            first_row = max(0, seq_len - q_len - exact[2] + 1)
        for i in range(q_len):
            t = seq_len - q_len + i
            keys_t, values_t = keys[: t + 1].clone(), values[: t + 1].clone()
            if exact is not None:
                near = max(0, t - exact[2] + 1)
                keys_t[near:] = exact[0][s, near - first_row : t + 1 - first_row].double()
                values_t[near:] = exact[1][s, near - first_row : t + 1 - first_row].double()
            for h in range(q.shape[1]):
                logits = keys_t[:, h // group] @ q[row + i, h].double() * scale
                weights = torch.exp(logits - logits.max())
                out[row + i, h] = (weights / weights.sum()) @ values_t[:, h // group]
        row += q_len
    return out


def assert_close(actual, expected, atol, what):
    diff = (actual.double() - expected.double()).abs().max().item()
    assert diff <= atol, f"{what}: max abs difference {diff:.3g} exceeds {atol:.3g}"


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-3


@pytest.mark.parametrize(
    "head_dim,group",
    [(64, 1), (64, 8), (128, 2), (128, 4), (256, 8), (80, 3)],  # 80: a head_dim that is no power of two
)
def test_decode_matches_reference_and_oracle(head_dim, group):
    dtype = torch.float16
    q, k_pages, v_pages, meta = make_batch(EDGE_LENS, [1] * len(EDGE_LENS), 2 * group, 2, head_dim, dtype)
    scale = head_dim**-0.5
    expected = oracle(q, k_pages, v_pages, meta, scale)
    reference = paged_attention_reference(q, k_pages, v_pages, meta, scale)
    fast = paged_attention(q, k_pages, v_pages, meta, scale)
    assert fast.dtype == q.dtype and fast.shape == q.shape
    assert_close(reference, expected, tolerance(dtype), "reference vs float64 oracle")
    assert_close(fast, expected, tolerance(dtype), "Triton decode vs float64 oracle")
    assert_close(fast, reference, tolerance(dtype), "Triton decode vs reference")


@pytest.mark.parametrize("grouped_tokens", [1, 100, 4096])  # no row short enough, some, all
def test_reference_batches_short_decode_rows(monkeypatch, grouped_tokens):
    """Decode rows up to GROUPED_DECODE_TOKENS go through one gather and two batched products, padded to the
    longest of them; longer rows and prompt chunks take the per-sequence path. Every row matches the float64
    oracle, over shuffled pages whose block-table padding points at a page in use."""
    monkeypatch.setattr(paged_kv, "GROUPED_DECODE_TOKENS", grouped_tokens)
    seq_lens, query_lens = [EDGE_LENS[-1], 1, 300, PAGE + 1, 40, PAGE, 2], [1, 1, 1, 1, 9, 1, 1]
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 6, 2, 64, torch.float32)
    group = paged_kv._decode_group(meta, PAGE, q.device)
    expected = {s for s, (n, m) in enumerate(zip(seq_lens, query_lens)) if m == 1 and n <= grouped_tokens}
    assert (set() if group is None else group.sequences) == (expected if len(expected) > 1 else set())
    assert_close(paged_attention_reference(q, k_pages, v_pages, meta, 0.125), oracle(q, k_pages, v_pages, meta, 0.125),
                 1e-5, "reference with a decode group vs float64 oracle")  # fmt: skip


@pytest.mark.parametrize("query_lens", [[1] * len(EDGE_LENS), [1, 2, 3, 16, 1, 40]])
@pytest.mark.parametrize("appended", [0, 2])
def test_reference_over_consecutive_pages_reads_them_as_a_view(monkeypatch, query_lens, appended):
    """Pages that are one run of the pool are read as a view, not gathered: the same answer. ``appended``: each
    sequence's last pages moved elsewhere in the pool, as decode steps beside other sequences append them; a
    decode row then reads its leading run in place and gathers the rest."""
    monkeypatch.setattr(paged_kv, "GROUPED_DECODE_TOKENS", 0)  # every row on its own path
    q, k_pages, v_pages, meta = make_batch(EDGE_LENS, query_lens, 6, 2, 64, torch.float32, consecutive=True,
                                           extra_pages=2 * len(EDGE_LENS))  # fmt: skip
    held = [-(-n // PAGE) for n in EDGE_LENS]
    spare = iter(range(k_pages.shape[0] - 1, sum(held) - 1, -1))  # descending: no two of them make a run
    for s, n in enumerate(held):
        for j in range(max(1, n - appended), n):  # the first page stays: a run of at least one
            meta.block_tables[s, j] = next(spare)
    runs = _page_runs(meta, PAGE)
    assert [run for _, run in runs] == [max(1, n - appended) for n in held]
    assert [first for first, _ in runs] == meta.block_tables[:, 0].tolist()
    assert_close(paged_attention_reference(q, k_pages, v_pages, meta, 0.125), oracle(q, k_pages, v_pages, meta, 0.125),
                 1e-5, "reference over page runs vs float64 oracle")  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 2, 16])
def test_decode_any_split_count_gives_the_same_answer(num_splits):
    # 16 splits of a 1..100-token context leave most splits empty: they must weigh nothing.
    q, k_pages, v_pages, meta = make_batch(EDGE_LENS, [1] * len(EDGE_LENS), 4, 2, 64, torch.float32, seed=1)
    expected = oracle(q, k_pages, v_pages, meta, 0.125)
    fast = paged_decode(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, 0.125, num_splits)
    assert_close(fast, expected, 1e-5, f"decode with {num_splits} splits vs float64 oracle")


def test_decode_padding_row_with_no_context_outputs_zeros():
    # CUDA-graph replays pad the batch with rows of seq_len 0; they must not produce NaN.
    q, k_pages, v_pages, meta = make_batch([5, 1], [1, 1], 2, 1, 64, torch.float32, seed=2)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32)
    for splits in (1, 4):
        out = paged_decode(q, k_pages, v_pages, meta.block_tables, seq_lens, 0.125, splits)
        assert torch.equal(out[1], torch.zeros_like(out[1])), f"padding row with {splits} splits: {out[1]}"
        assert_close(out[0], oracle(q, k_pages, v_pages, meta, 0.125)[0], 1e-5, "real row next to padding")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_mixed_batch_matches_reference_and_oracle(dtype):
    # (cached tokens after the write, queries this step): a whole one-token prompt, a whole prompt
    # crossing a page, a chunk after a prefix, a chunk ending on a page boundary, a decode row in
    # a mixed step, an idle sequence, and a chunk longer than one query tile.
    cases = [(1, 1), (17, 17), (40, 7), (32, 16), (100, 1), (9, 0), (90, 70)]
    seq_lens, query_lens = zip(*cases)
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 8, 2, 64, dtype, seed=3)
    expected = oracle(q, k_pages, v_pages, meta, 0.125)
    reference = paged_attention_reference(q, k_pages, v_pages, meta, 0.125)
    fast = paged_attention(q, k_pages, v_pages, meta, 0.125)
    assert_close(reference, expected, tolerance(dtype), "reference vs float64 oracle")
    assert_close(fast, expected, tolerance(dtype), "Triton prefill vs float64 oracle")


@pytest.mark.parametrize("seq_lens,query_lens", [
    ([700, 40, 17, 90], [1, 23, 1, 70]),  # groups interleaved: their rows gathered
    ([700, 17, 40, 90], [1, 1, 23, 70]),  # decode rows first, as the scheduler orders a step: their rows as slices
])  # fmt: skip
def test_a_mixed_step_takes_its_decode_rows_through_the_decode_kernel(monkeypatch, seq_lens, query_lens):
    # The prefill kernel would spend a 128-query tile, and no split of the context, on each decode row.
    from server.kernels import dense_attention

    seen = []
    for name in ("paged_decode", "paged_prefill"):
        kernel = getattr(dense_attention, name)
        monkeypatch.setattr(dense_attention, name, lambda q, k, v, tables, seq_lens, *a, _name=name, _kernel=kernel:
                            seen.append((_name, seq_lens.tolist())) or _kernel(q, k, v, tables, seq_lens, *a))
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 8, 2, 64, torch.float32, seed=4)
    got = paged_attention(q, k_pages, v_pages, meta, 0.125)
    assert seen == [("paged_prefill", [40, 90]), ("paged_decode", [700, 17])]
    assert_close(got, oracle(q, k_pages, v_pages, meta, 0.125), 1e-5, "mixed step, groups apart, vs float64")


@pytest.mark.parametrize("head_dim,group", [(128, 1), (256, 2)])
def test_prefill_large_heads(head_dim, group):
    q, k_pages, v_pages, meta = make_batch([20, 35], [20, 3], 2 * group, 2, head_dim, torch.float16, seed=4)
    scale = head_dim**-0.5
    fast = paged_attention(q, k_pages, v_pages, meta, scale)
    assert_close(fast, oracle(q, k_pages, v_pages, meta, scale), 3e-3, f"prefill d{head_dim} vs oracle")


def test_chunked_prefill_equals_whole_prefill():
    # The same 50-token prompt attended in chunks 16 + 16 + 18 (each chunk after its prefix is cached)
    # must give the rows the whole-prompt prefill gives.
    q, k_pages, v_pages, meta = make_batch([50], [50], 4, 2, 64, torch.float32, seed=5)
    whole = paged_prefill(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, meta.query_start_loc, 50, 0.125)
    done = 0
    for chunk in (16, 16, 18):
        done += chunk
        part = paged_prefill(
            q[done - chunk : done], k_pages, v_pages, meta.block_tables,
            torch.tensor([done], dtype=torch.int32), torch.tensor([0, chunk], dtype=torch.int32), chunk, 0.125,
        )
        assert_close(part, whole[done - chunk : done], 1e-5, f"chunk ending at token {done} vs whole prefill")


# (cached tokens after the write, queries this step): a prompt longer than one query block, chunks after a
# prefix (one crossing a query block), an idle sequence, a decode row, a chunk crossing a page edge.
WINDOW_CASES = [(70, 70), (130, 66), (9, 0), (200, 1), (41, 23)]


def exact_rows(k_pages, meta, window, seed):
    """Exact K and V rows unlike the far pages, [sequences, max_query_len + W - 1, kv_heads, D] as paged_prefill
    takes them. Rows past each sequence's last position hold NaN: the kernel must not load them, nor read before a
    sequence's first row (the previous sequence's last ones), since P·V would carry a NaN even where p is 0."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(meta.seq_lens_cpu), meta.max_query_len + window - 1, *k_pages.shape[2:])
    k_near, v_near = (torch.randn(shape, generator=gen).to(k_pages.dtype) for _ in range(2))
    for s, (seq_len, q_len) in enumerate(zip(meta.seq_lens_cpu, meta.query_lens_cpu)):
        used = seq_len - max(0, seq_len - q_len - window + 1)
        k_near[s, used:], v_near[s, used:] = float("nan"), float("nan")
    return k_near, v_near


def prefill(q, k_pages, v_pages, meta, scale, exact=None):
    return paged_prefill(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                         meta.max_query_len, scale, exact=exact)


@pytest.mark.parametrize("window", [1, 3, 16, 17, 64, 1000])  # 1000: longer than every sequence
def test_prefill_recent_window_matches_oracle(window):
    seq_lens, query_lens = zip(*WINDOW_CASES)
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 4, 2, 64, torch.float32, seed=10 + window)
    k_near, v_near = exact_rows(k_pages, meta, window, seed=window)
    expected = oracle(q, k_pages, v_pages, meta, 0.125, exact=(k_near, v_near, window))
    fast = prefill(q, k_pages, v_pages, meta, 0.125, exact=(k_near, v_near, window))
    assert_close(fast, expected, 1e-5, f"prefill with recent window {window} vs float64 oracle")


@pytest.mark.parametrize(
    "head_dim,group,page,dtype",
    [(64, 1, 7, torch.float16), (128, 2, PAGE, torch.float16), (128, 4, 7, torch.float32),
     (64, 4, PAGE, torch.float16)],
)
def test_prefill_recent_window_heads_pages_dtypes(head_dim, group, page, dtype):
    window = 17  # not a multiple of the tile or of either page size
    seq_lens, query_lens = zip(*WINDOW_CASES)
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 2 * group, 2, head_dim, dtype, seed=group, page=page)
    k_near, v_near = exact_rows(k_pages, meta, window, seed=head_dim)
    scale = head_dim**-0.5
    expected = oracle(q, k_pages, v_pages, meta, scale, exact=(k_near, v_near, window))
    fast = prefill(q, k_pages, v_pages, meta, scale, exact=(k_near, v_near, window))
    assert fast.dtype == dtype and torch.isfinite(fast).all()
    assert_close(fast, expected, tolerance(dtype), f"d{head_dim} gqa {group} page {page} {dtype} vs float64 oracle")


def test_prefill_recent_window_edge_at_every_offset_within_a_tile():
    # One query per sequence at 64 consecutive positions: the window's edge (t - W) falls at every offset
    # inside a key tile, including exactly on the tile boundaries where the kernel switches page arrays.
    window = 17
    seq_lens = list(range(70, 70 + 64))
    q, k_pages, v_pages, meta = make_batch(seq_lens, [1] * len(seq_lens), 2, 1, 64, torch.float32, seed=30)
    k_near, v_near = exact_rows(k_pages, meta, window, seed=31)
    expected = oracle(q, k_pages, v_pages, meta, 0.125, exact=(k_near, v_near, window))
    fast = prefill(q, k_pages, v_pages, meta, 0.125, exact=(k_near, v_near, window))
    assert_close(fast, expected, 1e-5, "one query at each position 69..132, W 17, vs float64 oracle")


def test_prefill_recent_window_that_covers_everything_reads_only_the_exact_rows():
    # A cross-check that does not go through the oracle: W past every position is the plain kernel on pages
    # holding the exact rows, and a window over garbage far pages must not see them.
    seq_lens, query_lens = zip(*WINDOW_CASES)
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 4, 2, 64, torch.float32, seed=20)
    window = 200
    rows = torch.zeros(len(seq_lens), meta.max_query_len + window - 1, *k_pages.shape[2:])
    k_near, v_near = rows.clone(), rows.clone()
    for s, seq_len in enumerate(seq_lens):  # W past every position: row i is position i
        slots = [(int(meta.block_tables[s, t // PAGE]), t % PAGE) for t in range(seq_len)]
        k_near[s, :seq_len] = gather_tokens(k_pages, slots).float()
        v_near[s, :seq_len] = gather_tokens(v_pages, slots).float()
    far = torch.full_like(k_pages, 300.0)
    assert_close(prefill(q, far, far, meta, 0.125, exact=(k_near, v_near, window)),
                 prefill(q, k_pages, v_pages, meta, 0.125), 1e-6, "W = longest sequence vs plain prefill")


@pytest.mark.parametrize("window", [None, 17])
def test_prefill_d128_chunks_across_query_blocks(window):
    # d128 runs its own tiles (128 queries x 64 keys): chunks longer than a query block, one after a prefix that
    # is a multiple of neither tile, a whole prompt of 150, a short chunk.
    seq_lens, query_lens = zip((300, 200), (150, 150), (41, 23))
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 4, 2, 128, torch.float32, seed=40)
    exact = None if window is None else (*exact_rows(k_pages, meta, window, seed=41), window)
    scale = 128**-0.5
    fast = prefill(q, k_pages, v_pages, meta, scale, exact=exact)
    assert_close(fast, oracle(q, k_pages, v_pages, meta, scale, exact=exact), 1e-5, f"d128 prefill, window {window}")


def test_prefill_recent_window_bad_arguments_are_refused():
    q, k_pages, v_pages, meta = make_batch([5], [5], 2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="W must be an int >= 1"):
        prefill(q, k_pages, v_pages, meta, 0.125, exact=(k_pages, v_pages, 0))
    rows = torch.zeros(1, 5 + 4 - 1, 1, 64)
    prefill(q, k_pages, v_pages, meta, 0.125, exact=(rows, rows, 4))  # the smallest that fits
    with pytest.raises(ValueError, match=r">= 8 rows \(max_query_len \+ W - 1\)"):
        prefill(q, k_pages, v_pages, meta, 0.125, exact=(rows[:, :-1], rows, 4))
    with pytest.raises(ValueError, match="in the pages' dtype"):
        prefill(q, k_pages, v_pages, meta, 0.125, exact=(rows, rows.half(), 4))
    with pytest.raises(ValueError, match="laid out as a page's rows"):
        prefill(q, k_pages, v_pages, meta, 0.125, exact=(rows, torch.zeros(1, 8, 1, 128)[..., :64], 4))
    with pytest.raises(ValueError, match="tuple"):
        prefill(q, k_pages, v_pages, meta, 0.125, exact=(k_pages, v_pages))


def test_write_kv_pages_scatters_and_skips_padding_slots():
    k_pages = torch.zeros(3, PAGE, 2, 64)
    v_pages = torch.zeros(3, PAGE, 2, 64)
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    v = torch.randn(3, 2, 64, dtype=torch.float16)
    slots = torch.tensor([2 * PAGE + 5, -1, 0])
    write_kv_pages(k, v, k_pages, v_pages, slots)
    assert torch.equal(k_pages[2, 5], k[0].float()) and torch.equal(v_pages[2, 5], v[0].float())
    assert torch.equal(k_pages[0, 0], k[2].float()) and torch.equal(v_pages[0, 0], v[2].float())
    written = torch.zeros(3, PAGE, dtype=torch.bool)
    written[2, 5] = written[0, 0] = True
    assert not k_pages[~written].any() and not v_pages[~written].any(), "a padding slot (-1) wrote somewhere"


def test_dense_store_fast_path_matches_reference_path(monkeypatch):
    seq_lens, query_lens = [23, 4], [23, 1]
    q, _, _, meta = make_batch(seq_lens, query_lens, 4, 2, 64, torch.float16, seed=6)
    k = torch.randn(sum(query_lens), 2, 64, dtype=torch.float16)
    v = torch.randn(sum(query_lens), 2, 64, dtype=torch.float16)
    stores = {}
    for fast in (False, True):
        monkeypatch.setattr(paged_kv, "use_triton", lambda t, fast=fast: fast)
        store = DenseKVStore(int(meta.block_tables.max()) + 1, PAGE, 2, 64, torch.float16, "cpu")
        store.write(k, v, meta.slot_mapping, torch.tensor([*range(23), 3]))
        stores[fast] = (store, store.attend(q, meta, 0.125))
    assert torch.equal(stores[True][0].k_pages, stores[False][0].k_pages), "fast write stored different K"
    assert_close(stores[True][1], stores[False][1], 3e-3, "store.attend fast vs reference")


def test_mismatched_heads_are_refused_with_a_clear_message():
    q, k_pages, v_pages, meta = make_batch([3], [1], 3, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(q, k_pages, v_pages, meta, 0.125)


def test_split_count_fills_the_gpu_but_not_with_tiny_splits():
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 1, 10, cpu) == 1  # one tile of work: no split
    assert choose_num_splits(64, 8, 65536, cpu) == 1  # already more programs than the target
    splits = choose_num_splits(1, 1, 65536, cpu)
    assert splits > 1 and splits & (splits - 1) == 0 and math.ceil(65536 / splits) >= 256


def test_prefill_falls_back_to_smaller_tiles_when_the_fastest_does_not_fit(monkeypatch, caplog):
    # A GPU with less shared memory than the fastest tiles need: the kernel build raises OutOfResources, the
    # earlier tiles run instead, the answer is still right, and it is said once, not per call.
    from triton.runtime.errors import OutOfResources

    from server.kernels import dense_attention

    kernel, tried = dense_attention._prefill_kernel, []

    class SmallGpu:
        def __getitem__(self, grid):
            def launch(*args, **options):
                tried.append(options["num_stages"])
                if options["num_stages"] == 3:
                    raise OutOfResources(98560, 65536, "shared memory")
                return kernel[grid](*args, **options)
            return launch

    monkeypatch.setattr(dense_attention, "_prefill_kernel", SmallGpu())
    monkeypatch.setattr(dense_attention, "_unfit_launches", set())
    q, k_pages, v_pages, meta = make_batch([150, 41], [150, 23], 4, 2, 128, torch.float32, seed=50)
    expected = oracle(q, k_pages, v_pages, meta, 0.125)
    with caplog.at_level("WARNING"):
        first, second = (prefill(q, k_pages, v_pages, meta, 0.125) for _ in range(2))
    assert tried == [3, 2, 2]
    assert sum("does not fit" in r.message for r in caplog.records) == 1
    assert_close(first, expected, 1e-5, "fallback tiles vs float64 oracle")
    assert_close(second, expected, 1e-5, "fallback tiles, second call")


def test_reference_takes_prompt_chunks_in_bfloat16_when_asked():
    """meta.prompt_dtype (the engine's choice on a CPU with AMX): a chunk of several queries attends in bfloat16,
    within that rounding of the float64 oracle; a one-query row stays float32, as exact as without it."""
    cases = [(1, 1), (17, 17), (40, 7), (100, 1), (90, 70)]
    seq_lens, query_lens = zip(*cases)
    q, k_pages, v_pages, meta = make_batch(seq_lens, query_lens, 8, 2, 64, torch.float32, seed=4)
    got = paged_attention_reference(q, k_pages, v_pages, dataclasses.replace(meta, prompt_dtype=torch.bfloat16), 0.125)
    expected = oracle(q, k_pages, v_pages, meta, 0.125)
    rounded = oracle(*(x.bfloat16().float() for x in (q, k_pages, v_pages)), meta, 0.125)
    one_query = torch.tensor([n == 1 for n in query_lens for _ in range(n)])
    assert_close(got[one_query], expected[one_query], 1e-5, "one-query rows vs float64 oracle")
    chunk_error = (got[~one_query].double() - expected[~one_query]).abs().max().item()
    assert 1e-4 < chunk_error <= 2e-2, f"chunk rows: {chunk_error:.3g} from the oracle is not bfloat16's rounding"
    assert_close(got[~one_query], rounded[~one_query], 1e-2, "chunk rows vs the oracle of bfloat16-rounded inputs")
