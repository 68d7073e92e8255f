"""The fused write on the GPU (store.py "Fused write"): real sizes, bf16 K/V, many splits, a CUDA graph.

The store with TURBOSERVE_FUSED_TURBO_STORE off (store kernel, then decode) is the reference: after each step the
pages must be bit-identical and the outputs equal up to the decode's own run-to-run rounding. Here the new token's
program runs among 30-130 others of its sequence, so a store that another program read, or that its own threads
read before it landed, shows. Run with TURBOSERVE_GPU_TESTS=1 (tests/conftest.py).
"""

import copy

import pytest
import torch

from bench.kernels_turbo import engine_key_offset
from server.kernels.paged_kv import AttentionMetadata
from server.kernels.turbo.store import CUDA_DECODE_MIN_WORK, TurboKVStore

pytestmark = pytest.mark.gpu

PAGE, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 8, 16, 128


def stores(k_kind, v_kind, seq_lens, seed):
    """(fused store, unfused store) with the same random context in shuffled pages, the partial key offset."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // PAGE) for n in seq_lens) + 3
    store = TurboKVStore(pages, PAGE, KV_HEADS, HEAD_DIM, k_kind, v_kind, dev, torch.bfloat16)
    store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, dev, gen, 500000.0, 16))
    for p in (store.k, store.v):
        p.codes.random_(0, 256)
        p.norms.uniform_(8.0, 12.0)
    order = torch.randperm(pages, generator=gen).to(dev, torch.int32)
    tables = torch.zeros(len(seq_lens), max(-(-n // PAGE) for n in seq_lens), dtype=torch.int32, device=dev)
    used = 0
    for s, n in enumerate(seq_lens):
        tables[s, : -(-n // PAGE)] = order[used : used + -(-n // PAGE)]
        used += -(-n // PAGE)
    plain = copy.deepcopy(store)
    store.fuse_store, plain.fuse_store = True, False
    return store, plain, tables


def decode_step(tables, seq_lens, seed, padding=0):
    """Metadata, q, k, v, positions of a decode step (``padding`` extra rows: slot -1, seq_len 0)."""
    dev = tables.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    lens = torch.tensor(list(seq_lens) + [0] * padding, dtype=torch.int32, device=dev)
    rows = len(seq_lens) + padding
    last = (lens - 1).clamp(min=0).long()
    table = torch.cat([tables, tables[:1].expand(padding, -1)]) if padding else tables
    slots = table.gather(1, (last // PAGE)[:, None]).long()[:, 0] * PAGE + last % PAGE
    slots = torch.where(lens > 0, slots, -1)
    meta = AttentionMetadata(slots, table, lens, torch.arange(rows + 1, dtype=torch.int32, device=dev),
                             [max(seq_lens)] * rows, [1] * rows)
    bf = {"device": dev, "dtype": torch.bfloat16, "generator": gen}
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, **bf)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, **bf) * 2
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, **bf)
    return meta, q, k, v, last


def assert_same(fused, plain, got, want, what):
    for name in ("k", "v"):
        a, b = getattr(fused, name), getattr(plain, name)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.norms, b.norms), f"{what}: {name} pages differ"
    # The same decode but for the store: a token read before it landed moves a short row's output by O(1)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-3 * want.float().abs().max().item(), f"{what}: outputs differ by {err:.3g}"


@pytest.mark.parametrize("k_kind,v_kind", [("turbo3", "turbo3"), ("turbo4", "turbo2")])
@pytest.mark.parametrize("seq_lens", [[16400], [2049, 17, 16, 1], [3000, 33], [16400, 16400]])  # the last: CUDA C
def test_fused_steps_match_the_unfused_store(k_kind, v_kind, seq_lens):
    fused, plain, tables = stores(k_kind, v_kind, seq_lens, seed=len(seq_lens))
    for step in range(3):  # the same pages, tokens at seq_len - 1 of successive steps
        lens = [n - 2 + step for n in seq_lens]
        lens = [max(n, 1) for n in lens]
        meta, q, k, v, positions = decode_step(tables, lens, seed=step, padding=1)
        for store in (fused, plain):
            store.write(k, v, meta.slot_mapping, positions)
        got, want = fused.attend(q, meta, HEAD_DIM**-0.5), plain.attend(q, meta, HEAD_DIM**-0.5)
        assert_same(fused, plain, got, want, f"{seq_lens} step {step}")
        assert not got[-1].any(), "the padding row comes out zero"


def test_a_captured_write_and_attend_replays_the_fused_store():
    assert 2 * KV_HEADS * 4033 < CUDA_DECODE_MIN_WORK, "the Triton decode must run: it is what fuses"
    fused, plain, tables = stores("turbo3", "turbo3", [4040, 1040], seed=11)
    meta, q, k, v, positions = decode_step(tables, [4033, 1033], seed=0)  # planned for 4033 tokens
    plan = meta.seq_lens_cpu
    for store in (fused, plain):  # compiles outside the capture
        store.write(k, v, meta.slot_mapping, positions)
        store.attend(q, meta, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.write(k, v, meta.slot_mapping, positions)
        out = fused.attend(q, meta, 0.1)
    assert fused._pending is None
    for step, lens in enumerate(([3990, 990], [3991, 991], [4000, 1000])):
        m, q2, k2, v2, p2 = decode_step(tables, lens, seed=step + 1)
        for dst, src in zip((meta.slot_mapping, meta.seq_lens, q, k, v, positions),
                            (m.slot_mapping, m.seq_lens, q2, k2, v2, p2)):
            dst.copy_(src)
        graph.replay()
        plain.write(k2, v2, m.slot_mapping, p2)
        want = plain.attend(q2, AttentionMetadata(m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc,
                                                  plan, m.query_lens_cpu), 0.1)
        assert_same(fused, plain, out, want, f"graph replay {step}")
