"""Decode CUDA-graph policy (server/runtime/cuda_graphs.py). Replay itself needs a GPU: bench/dense_gpu_check.py
compares replayed and eager decode steps there."""

from __future__ import annotations

import torch

from server.kernels.paged_kv import DenseKVStore
from server.runtime.cuda_graphs import capture_sizes, graphs_unavailable_reason, maybe_capture_decode_graphs


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for max_num_seqs in range(1, 70):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs, sizes


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
