"""CUDA graphs for decode-only steps.

A decode step of a small model is hundreds of tiny kernels; launching them from Python
costs more than running them. So the model forward of a decode batch is captured once per
batch size in ``capture_sizes`` and replayed: the step's inputs are copied into static
buffers, the batch is padded up to the next captured size, and the graph runs.

Padding rows must be harmless: their slot is -1 (the fast KV write stores nothing) and their
seq_len is 0 (decode attention returns zeros for them), so they never touch a page. Graphs
are captured with a context-length hint of ``max_model_len`` because the decode kernel
picks its split count at capture time and the graph replays at every length
(server/kernels/dense_attention.py computes split ranges on the device).

A KV store opts in with a class attribute ``cuda_graph_safe = True``, which promises exactly
that: a negative slot writes nothing, a row with seq_len 0 reads nothing and stays finite, and
launch shapes depend on the host metadata only, never on the values of ``seq_lens``.
"""

from __future__ import annotations

import logging

import torch

from server.kernels.backend import use_triton
from server.kernels.paged_kv import AttentionMetadata, KVLayerStore

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every multiple of 16 up to max_num_seqs (padding wastes < 16 rows)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def graphs_unavailable_reason(device: torch.device, stores: list[KVLayerStore]) -> str | None:
    """Why decode steps must run eagerly here, or None when they can be captured."""
    unsafe = next((type(s).__name__ for s in stores if not getattr(s, "cuda_graph_safe", False)), None)
    if unsafe is not None:
        return f"CUDA graphs are off: {unsafe} does not declare cuda_graph_safe (see this module's docstring)"
    if device.type != "cuda":
        return f"no CUDA graphs on {device.type}"
    if not use_triton(torch.empty(0, device=device)):
        return "CUDA graphs need the Triton kernels (reference kernels sync with the host)"
    return None


class DecodeGraphs:
    """Captured ``model.forward`` of decode batches; ``run`` replays the smallest that fits."""

    def __init__(
        self,
        model: torch.nn.Module,
        stores: list[KVLayerStore],
        max_num_seqs: int,
        max_pages_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ):
        self.model, self.stores, self.device = model, stores, device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_pages_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:n],
            seq_lens=self.seq_lens[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens_cpu=[self.max_model_len] * n,  # launch-planning hint only: the graph serves every length
            query_lens_cpu=[1] * n,
        )

    def _forward(self, n: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:n], self.positions[:n], self.stores, self._meta(n))

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so the smaller graphs fit in the memory pool the largest one reserved.
        # The static slots are all -1 and seq_lens 0 here: capture writes and reads no page.
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            self._forward(n)  # warm-up outside the capture: Triton compiles, the allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._forward(n)
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        n = input_ids.shape[0]
        return (
            0 < n <= self.sizes[-1]
            and meta.is_decode_only
            and len(meta.query_lens_cpu) == n
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch (check ``can_run`` first)."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].zero_()
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:n]


def maybe_capture_decode_graphs(
    model: torch.nn.Module,
    stores: list[KVLayerStore],
    max_num_seqs: int,
    max_pages_per_seq: int,
    max_model_len: int,
    device: torch.device,
) -> DecodeGraphs | None:
    """Captured decode graphs up to ``max_num_seqs`` rows, or None (logged why). 0 rows: enforce_eager."""
    reason = "CUDA graphs are off (enforce_eager)" if max_num_seqs < 1 else graphs_unavailable_reason(device, stores)
    if reason is not None:
        log.info("%s; decode steps run eagerly", reason)
        return None
    graphs = DecodeGraphs(model, stores, max_num_seqs, max_pages_per_seq, max_model_len, device)
    graphs.capture()
    return graphs
