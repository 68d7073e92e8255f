"""Decode CUDA-graph policy (server/runtime/cuda_graphs.py). Replay itself needs a GPU: bench/dense_gpu_check.py
compares replayed and eager decode steps there."""

from __future__ import annotations

import torch

from server.kernels.paged_kv import DenseKVStore
from server.runtime.cuda_graphs import (
    capture_sizes,
    context_buckets,
    graphs_unavailable_reason,
    maybe_capture_decode_graphs,
)


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for max_num_seqs in range(1, 70):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs, sizes


def test_context_buckets_grow_eightfold_up_to_max_model_len():
    assert context_buckets(100) == [100]
    assert context_buckets(256) == [256]
    assert context_buckets(257) == [256, 257]
    assert context_buckets(8192) == [256, 2048, 8192]
    assert context_buckets(131072) == [256, 2048, 16384, 131072]
    for max_model_len in (1, 255, 2048, 2049, 40000, 1 << 20):
        buckets = context_buckets(max_model_len)
        assert buckets[-1] == max_model_len and buckets == sorted(set(buckets))
        assert all(b <= 8 * a for a, b in zip(buckets, buckets[1:])), buckets


def test_no_graphs_on_cpu_or_when_eager():
    stores = [DenseKVStore(2, 16, 1, 8, torch.float32, "cpu")]
    assert "cpu" in graphs_unavailable_reason(torch.device("cpu"), stores)
    assert maybe_capture_decode_graphs(torch.nn.Identity(), stores, 8, 4, 64, torch.device("cpu")) is None
    assert maybe_capture_decode_graphs(torch.nn.Identity(), stores, 0, 4, 64, torch.device("cpu")) is None


def test_graphs_need_stores_that_declare_themselves_graph_safe():
    class UndeclaredStore:
        page_size = 16

    assert DenseKVStore.cuda_graph_safe
    stores = [DenseKVStore(2, 16, 1, 8, torch.float32, "cpu"), UndeclaredStore()]
    reason = graphs_unavailable_reason(torch.device("cpu"), stores)
    assert "UndeclaredStore" in reason and "cuda_graph_safe" in reason, reason


def test_replay_pads_with_rows_that_touch_no_page(monkeypatch):
    # CUDA graphs need a GPU, but everything around the replay does not: a stand-in "graph" that re-runs the
    # captured call on the static buffers checks the copying, the padding rows (slot -1, seq_len 0) and the
    # launch plan taken from the capture-time hint, on the Triton fast path through the interpreter.
    from server.kernels import paged_kv
    from server.kernels.paged_kv import AttentionMetadata
    from server.runtime.cuda_graphs import DecodeGraphs
    from server.runtime.models import llama, rope
    from tests.models.tiny_llama import tiny_llama

    for module in (paged_kv, llama, rope):
        monkeypatch.setattr(module, "use_triton", lambda t: True)
    model = tiny_llama(vocab_size=50, hidden_size=32, intermediate_size=48, head_dim=8, max_position_embeddings=256,
                       tie_word_embeddings=True)
    page, width, num_pages = 4, 8, 24
    stores = [DenseKVStore(num_pages, page, 2, 8, torch.float32, "cpu") for _ in range(2)]
    for store in stores:
        store.k_pages.normal_()
        store.v_pages.normal_()

    replays = []

    class RerunGraph:
        def __init__(self, key):
            self.key = key

        def replay(self):
            replays.append(self.key)
            graphs.outputs[self.key].copy_(graphs._forward(*self.key))

    graphs = DecodeGraphs(model, stores, 4, width, 256, torch.device("cpu"))
    graphs.context_lens = [8, 16, 32]  # the pages here hold 32 tokens a sequence: three buckets to choose from
    with torch.inference_mode():
        for key in ((n, c) for n in graphs.sizes for c in graphs.context_lens):
            graphs.outputs[key] = graphs._forward(*key)
            graphs.graphs[key] = RerunGraph(key)
        lens = [3, 9, 14]  # three rows replay the size-4 "graph" with one padding row
        tables = torch.tensor([[0, 1, 2, 3, 0, 0, 0, 0], [7, 5, 6, 0, 0, 0, 0, 0], [11, 10, 9, 8, 0, 0, 0, 0]],
                              dtype=torch.int32)  # fmt: skip
        slots = torch.tensor([int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(lens)])
        meta = AttentionMetadata(slots, tables, torch.tensor(lens, dtype=torch.int32),
                                 torch.arange(4, dtype=torch.int32), lens, [1, 1, 1])  # fmt: skip
        ids, positions = torch.tensor([4, 8, 15]), torch.tensor([n - 1 for n in lens])
        before = stores[0].k_pages.clone()
        assert graphs.can_run(3, True, tables.shape[1], 14) and not graphs.can_run(5, True, 8, 14)
        assert not graphs.can_run(3, False, 8, 14) and not graphs.can_run(3, True, 9, 14)
        assert graphs.can_run(3, True, 8, 32) and not graphs.can_run(3, True, 8, 33)
        replayed = graphs.run(ids, positions, meta).clone()
        assert replays == [(4, 16)], f"the longest context 14 replays the 16-token bucket, not {replays}"
        written = (stores[0].k_pages != before).flatten(2).any(-1)  # [pages, page_size]
        eager = model.forward(ids, positions, stores, meta)
    assert replayed.shape == eager.shape == (3, 32)
    assert (replayed - eager).abs().max() <= 1e-4, "replay with a padding row differs from the eager step"
    assert sorted(int(s) for s in written.flatten().nonzero()) == sorted(slots.tolist()), "a padding row wrote"


def test_engine_decode_steps_through_graph_replays_give_the_eager_tokens(monkeypatch):
    # The runner's graph path (host batch -> pinned-buffer copies -> padded replay) inside a running engine, with
    # the stand-in graph of the test above: greedy tokens must be the eager engine's, padding rows included.
    import sys
    from pathlib import Path

    from server.kernels import paged_kv
    from server.runtime.cuda_graphs import DecodeGraphs
    from server.runtime.sequence import SamplingParams

    sys.path.insert(0, str(Path(__file__).parent))
    from runtime_toy import make_engine, run_all, toy_loaded

    monkeypatch.setattr(paged_kv, "use_triton", lambda t: True)  # graphs read seq_lens on the device
    loaded = toy_loaded()
    requests = {f"r{i}": (p, SamplingParams(max_tokens=5, temperature=0.0)) for i, p in
                enumerate([[5, 6, 7], list(range(10, 21)), [99]])}  # fmt: skip
    eager = make_engine(loaded, max_num_seqs=4)
    expected = run_all(eager, requests)
    eager.shutdown()

    engine = make_engine(loaded, max_num_seqs=4)
    runner = engine.runner
    graphs = DecodeGraphs(loaded.model, runner.kv_cache.stores, 4, runner.max_pages_per_seq, engine.max_model_len,
                          torch.device("cpu"))  # fmt: skip
    replays = []

    class RerunGraph:
        def __init__(self, key):
            self.key = key

        def replay(self):
            replays.append(self.key)
            graphs.outputs[self.key].copy_(graphs._forward(*self.key))

    graphs.context_lens = [13, engine.max_model_len]  # the 11-token prompt outgrows the first bucket mid-decode
    with torch.inference_mode():
        for key in ((n, c) for n in graphs.sizes for c in graphs.context_lens):
            graphs.outputs[key] = graphs._forward(*key)
            graphs.graphs[key] = RerunGraph(key)
    runner.graphs = graphs  # the engine thread is idle until the first submit
    got = run_all(engine, requests)
    engine.shutdown()
    assert {r: f.token_ids for r, f in got.items()} == {r: f.token_ids for r, f in expected.items()}
    assert {(4, 13), (4, engine.max_model_len)} <= set(replays), (
        f"three decoding rows replay the size-4 graph with a padding row, in both context buckets (replays: {replays})"
    )
