"""CUDA graphs for decode-only steps.

A decode step of a small model is hundreds of tiny kernels; launching them from Python
costs more than running them. So the model forward of a decode batch is captured once per
batch size in ``capture_sizes`` and replayed: the step's inputs are copied into static
buffers, the batch is padded up to the next captured size, and the graph runs.

Padding rows must be harmless: their slot is -1 (the fast KV write stores nothing) and their
seq_len is 0 (decode attention returns zeros for them), so they never touch a page.

A decode kernel plans its launch from the longest context the host metadata names: the
flash-decoding splits and partial buffers, and for turbo KV which kernel runs (Triton for short
work, CUDA C for long: TurboKVStore.attend). So each batch size is captured once per context
bucket (``context_buckets``) with that bucket as the hint, and a replay takes the smallest bucket
that holds the batch's longest context. One hint of ``max_model_len`` runs the longest plan at
every length: turbo3 at batch 1, 2K context, graphs planned for 64K, 23.8 us a layer of attention
against 11.8 for the Triton decode a 2K plan picks (H200, bench/turbo_b1_sweep.py --plan, 11:06
UTC 2026-11-30). Dense bf16 decode cuts its splits per sequence on the device and showed no gain
from the buckets (docs/BENCHMARKS.md, 02:55 UTC).

A KV store opts in with a class attribute ``cuda_graph_safe = True``, which promises exactly
that: a negative slot writes nothing, a row with seq_len 0 reads nothing and stays finite, and
launch shapes depend on the host metadata only, never on the values of ``seq_lens``; a launch
planned for a longest context L is correct for every batch whose contexts are at most L.

A replay's inputs arrive in two host-to-device copies (one int64 buffer: ids, positions, slots;
one int32 buffer: seq_lens, recent-window rows, block tables) from pinned memory straight into the buffers the graphs
read: each separate copy or fill costs host time, and without async scheduling the device idles
through it (an H200 profile of the 8B batch-1 runner loop: ~0.26 ms of a 4.5 ms step between the
tokens reaching the host and the next replay).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from server.kernels.backend import use_triton
from server.kernels.paged_kv import AttentionMetadata, KVLayerStore

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every multiple of 16 up to max_num_seqs (padding wastes < 16 rows)."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def context_buckets(max_model_len: int, shortest: int = 256, step: int = 8) -> list[int]:
    """Launch-planning context lengths of the captures: 256, 2048, 16384, ... and max_model_len.

    Steps of 8x keep every replayed plan within 8x of the context it serves, at 3-5 captures
    per batch size for 8K-128K models.
    """
    buckets = []
    while shortest < max_model_len:
        buckets.append(shortest)
        shortest *= step
    return buckets + [max_model_len]


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
    """Captured ``model.forward`` of decode batches, keyed by (batch size, context bucket); ``run`` replays
    the smallest that fits."""

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
        self.context_lens = context_buckets(max_model_len)
        largest = self.sizes[-1]
        pinned = device.type == "cuda"
        self._host64 = torch.zeros(3, largest, dtype=torch.int64, pin_memory=pinned)
        self._host32 = torch.zeros(largest * (2 + max_pages_per_seq), dtype=torch.int32, pin_memory=pinned)
        self._host64[2] = -1  # padding rows write no slot
        self._inputs64 = self._host64.to(device, copy=True)
        self._inputs32 = self._host32.to(device, copy=True)
        self.input_ids, self.positions, self.slot_mapping = self._inputs64
        self.seq_lens = self._inputs32[:largest]
        self.recent_rows = self._inputs32[largest : 2 * largest]  # padding rows: row 0, never read or written
        self.block_tables = self._inputs32[2 * largest :].view(largest, max_pages_per_seq)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        # Recorded after each copy out of the host buffers: the next fill waits for it.
        self._copied = torch.cuda.Event() if pinned else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _meta(self, n: int, context_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:n],
            seq_lens=self.seq_lens[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens_cpu=[context_len] * n,  # launch-planning hint only: the graph serves every length up to it
            query_lens_cpu=[1] * n,
            recent_rows=self.recent_rows[:n],
        )

    def _forward(self, n: int, context_len: int) -> torch.Tensor:
        return self.model.forward(self.input_ids[:n], self.positions[:n], self.stores, self._meta(n, context_len))

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so the smaller graphs fit in the memory pool the largest one reserved.
        # The static slots are all -1 and seq_lens 0 here: capture writes and reads no page.
        pool, start = torch.cuda.graph_pool_handle(), time.perf_counter()
        for key in sorted(((n, c) for n in self.sizes for c in self.context_lens), reverse=True):
            self._forward(*key)  # warm-up outside the capture: Triton compiles, the allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (batch sizes %s x longest contexts %s) in %.1f s", len(self.graphs),
                 self.sizes, self.context_lens, time.perf_counter() - start)

    def can_run(self, num_rows: int, decode_only: bool, table_width: int, longest_context: int) -> bool:
        return (0 < num_rows <= self.sizes[-1] and decode_only and table_width <= self.block_tables.shape[1]
                and longest_context <= self.context_lens[-1])  # fmt: skip

    def context_bucket(self, longest_context: int) -> int:
        """The context bucket a replay for this longest context takes (check ``can_run`` first)."""
        return next(c for c in self.context_lens if c >= longest_context)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch given as device tensors (tests, benches)."""
        recent_rows = [0] * len(meta.seq_lens_cpu) if meta.recent_rows is None else meta.recent_rows.tolist()
        return self.run_host(input_ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(), meta.seq_lens_cpu,
                             recent_rows, meta.block_tables.cpu().numpy())  # fmt: skip

    def run_host(
        self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int], recent_rows: list[int],
        block_tables: np.ndarray, device_ids: torch.Tensor | None = None,  # [n] token ids still on the device: replace input_ids
    ) -> torch.Tensor:  # fmt: skip
        """Hidden states [n, hidden] of a decode batch given on the host (check ``can_run`` first)."""
        n, width = len(input_ids), block_tables.shape[1]
        size = next(s for s in self.sizes if s >= n)
        context_len = self.context_bucket(max(seq_lens))
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffers (done long ago;
            # an event never recorded returns at once)
        host64, host32 = self._host64.numpy(), self._host32.numpy()
        host64[:, :n] = (input_ids, positions, slots)
        host64[:2, n:size], host64[2, n:size] = 0, -1
        largest = self.sizes[-1]
        host32[:n], host32[n:size] = seq_lens, 0
        host32[largest : largest + n], host32[largest + n : largest + size] = recent_rows, 0
        host32[2 * largest :].reshape(largest, -1)[:n, :width] = block_tables  # columns past width: never read
        used32 = 2 * largest + size * self.block_tables.shape[1]
        self._inputs64.copy_(self._host64, non_blocking=True)
        self._inputs32[:used32].copy_(self._host32[:used32], non_blocking=True)
        if device_ids is not None:
            self._inputs64[0, :n].copy_(device_ids)
        if self._copied is not None:
            self._copied.record()
        self.graphs[size, context_len].replay()
        return self.outputs[size, context_len][:n]


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
