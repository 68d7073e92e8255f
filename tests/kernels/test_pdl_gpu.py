"""Programmatic dependent launch (server/kernels/pdl.py) keeps stream order inside a captured decode step.

A kernel launched under PDL is scheduled while the kernel before it still runs; it is correct only if it waits
before it reads what that kernel writes. Here a layer's attention as the engine's decode graph runs it (the qkv
projection, the KV write, the decode and merge kernels, the output projection, all PDL launches where pdl.py is
on) is captured and replayed, and must give bit for bit what the same step computes eagerly with PDL off (every
kernel then waits for the one before it to finish). The step's new key is made to dominate its query's scores,
so a decode that read its page or ring row before the store landed moves the output by O(1).
Run with TURBOSERVE_GPU_TESTS=1 (tests/conftest.py).
"""

import copy

import pytest
import torch

from bench.kernels_turbo import engine_key_offset
from server.kernels import gemv, pdl
from server.kernels.paged_kv import AttentionMetadata, DenseKVStore
from server.kernels.turbo.store import TurboKVStore

pytestmark = pytest.mark.gpu

PAGE, KV_HEADS, Q_HEADS, HEAD_DIM, HIDDEN, WINDOW = 16, 8, 32, 128, 512, 128
SEQ_LENS = [20, 300, 2049]  # the window only; pages and window; several splits (the longest, the launch plan)
MAX_PAGES = -(-max(SEQ_LENS) // PAGE)
NUM_PAGES = len(SEQ_LENS) * MAX_PAGES + 5


def make_store(kind: str):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    if kind == "bf16":
        store = DenseKVStore(NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, dev)
        store.k_pages.normal_(generator=gen)
        store.v_pages.normal_(generator=gen)
        return store
    store = TurboKVStore(NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM, kind, kind, dev, torch.bfloat16,
                         recent=(len(SEQ_LENS), WINDOW))
    store.set_key_offset(engine_key_offset(KV_HEADS, HEAD_DIM, dev, torch.Generator().manual_seed(2), 500000.0, 8))
    for p in (store.k, store.v):
        p.codes.random_(0, 256, generator=gen)
        p.norms.uniform_(8.0, 12.0, generator=gen)
    store.recent.k.normal_(generator=gen)
    store.recent.v.normal_(generator=gen)
    return store


def step_inputs(lens: list[int], seed: int):
    """Metadata of a decode step at these lengths (the same shuffled pages every step), its input rows and the new
    tokens' positions."""
    dev = torch.device("cuda")
    order = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0))
    tables = order[: len(lens) * MAX_PAGES].view(len(lens), MAX_PAGES).to(dev, torch.int32)
    last = torch.tensor(lens, device=dev) - 1
    slots = tables.gather(1, (last // PAGE)[:, None]).long()[:, 0] * PAGE + last % PAGE
    meta = AttentionMetadata(slots, tables, torch.tensor(lens, dtype=torch.int32, device=dev),
                             torch.arange(len(lens) + 1, dtype=torch.int32, device=dev), list(SEQ_LENS),
                             [1] * len(lens), torch.arange(len(lens), dtype=torch.int32, device=dev))
    x = torch.randn(len(lens), HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dev, torch.bfloat16)
    return meta, x, last


def layer(store, meta, x, positions, w_qkv, w_o):
    """qkv projection -> KV write -> attention -> output projection, as a decode step runs one layer."""
    rows = x.shape[0]
    qkv = gemv.skinny_matmul(x, w_qkv)
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(rows, Q_HEADS, HEAD_DIM)
    k = qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM :].view(rows, KV_HEADS, HEAD_DIM)
    store.write(k, v, meta.slot_mapping, positions)
    out = store.attend(q, meta, HEAD_DIM**-0.5)
    return gemv.skinny_matmul(out.reshape(rows, Q_HEADS * HEAD_DIM), w_o)


def weights():
    """qkv weights that make each new key its KV head's first query times 4: it dominates that query's scores."""
    gen = torch.Generator().manual_seed(3)
    w_qkv = torch.randn((Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, generator=gen) * HIDDEN**-0.5
    gqa = Q_HEADS // KV_HEADS
    for h in range(KV_HEADS):
        w_qkv[(Q_HEADS + h) * HEAD_DIM :][:HEAD_DIM] = 4 * w_qkv[h * gqa * HEAD_DIM :][:HEAD_DIM]
    w_o = torch.randn(HIDDEN, Q_HEADS * HEAD_DIM, generator=gen) * (Q_HEADS * HEAD_DIM) ** -0.5
    return w_qkv.cuda().bfloat16(), w_o.cuda().bfloat16()


def cache_state(store) -> list[torch.Tensor]:
    if isinstance(store, DenseKVStore):
        return [store.k_pages, store.v_pages]
    return [store.k.codes, store.k.norms, store.v.codes, store.v.norms, store.recent.k, store.recent.v]


@pytest.mark.parametrize("kind", ["bf16", "turbo3"])
def test_captured_step_under_pdl_matches_eager_without_it(kind, monkeypatch):
    if not pdl.launch_options(torch.device("cuda")).get("USE_PDL"):
        pytest.skip("PDL is off on this device (pdl.py: sm_90+, Triton >= 3.4, TURBOSERVE_PDL unset)")
    graphed = make_store(kind)
    w_qkv, w_o = weights()
    meta, x, positions = step_inputs([n - 2 for n in SEQ_LENS], seed=4)
    layer(graphed, meta, x, positions, w_qkv, w_o)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(graphed, meta, x, positions, w_qkv, w_o)
    eager = copy.deepcopy(graphed)  # a capture runs nothing: both caches as the warm-up step left them
    for step in range(2):
        new_meta, new_x, new_positions = step_inputs([n - 1 + step for n in SEQ_LENS], seed=5 + step)
        for dst, src in zip((meta.slot_mapping, meta.seq_lens, x, positions),
                            (new_meta.slot_mapping, new_meta.seq_lens, new_x, new_positions)):
            dst.copy_(src)
        graph.replay()
        with monkeypatch.context() as m:
            m.setattr(pdl, "launch_options", lambda device: {"USE_PDL": False})
            want = layer(eager, new_meta, new_x, new_positions, w_qkv, w_o)
        torch.cuda.synchronize()
        for got_t, want_t in zip(cache_state(graphed), cache_state(eager)):
            assert torch.equal(got_t, want_t), f"{kind} step {step}: the cache differs after the replay"
        assert torch.equal(out, want), (f"{kind} step {step}: replay under PDL differs from eager without it by "
                                        f"{(out.float() - want.float()).abs().max().item():.3g}")
