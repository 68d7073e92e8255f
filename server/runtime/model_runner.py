"""One engine step on the device: flatten the scheduled chunks, run the model, sample.

The batch is flat: the chunks' tokens are concatenated into ``input_ids``/``positions``
and ``AttentionMetadata`` says which rows belong to which sequence (server/kernels/
paged_kv.py). Logits are computed only for rows that need them: each sampling chunk's
last row, and every prompt row of a chunk whose request asked for prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from server.kernels.paged_kv import AttentionMetadata
from server.kernels.timing import timed
from server.runtime.cuda_graphs import maybe_capture_decode_graphs
from server.kernels.host_copy import to_device
from server.runtime.kv_cache import KVCache
from server.runtime.sampler import SamplingTensors, sample, token_logprobs
from server.runtime.scheduler import ScheduledChunk
from server.runtime.sequence import TokenLogprob


@dataclass
class HostBatch:
    """A step's flat batch on the host."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    recent_rows: list[int]  # each sequence's row of a turbo cache's recent window (0 without one)
    block_tables: np.ndarray  # [S, widest block table of the batch] int32
    logit_rows: list[int]  # rows of the flat batch whose logits are computed
    row_starts: list[int]  # first row of each chunk
    ahead_rows: list[int]  # rows whose token the step in flight is sampling (its id here is a placeholder 0)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata


@dataclass
class LaunchedStep:
    """Device tensors of a step whose kernels may still be running."""

    chunks: list[ScheduledChunk]
    row_starts: list[int]
    logits: torch.Tensor | None = None  # [rows with logits, V] float32
    row_of: dict[int, int] = field(default_factory=dict)  # batch row -> row of logits
    sampling: list[int] = field(default_factory=list)  # chunks that sample
    scoring_prompt: list[int] = field(default_factory=list)  # chunks whose prompt logprobs are computed
    sample_logits: torch.Tensor | None = None
    tokens: torch.Tensor | None = None  # [len(sampling)] int64
    # The tokens' copy to pinned host memory, queued right after sampling: a step launched ahead
    # queues behind this one, so reading `tokens` itself would wait for that too.
    tokens_host: torch.Tensor | None = None
    finished: torch.cuda.Event | None = None  # recorded after the step's last kernel (CUDA)

    def finished_already(self) -> bool:
        """Whether a device that runs kernels behind the host (CUDA) has finished the step by now."""
        return self.finished is not None and self.finished.query()


@dataclass
class ChunkResult:
    token: int | None = None  # the next token, when the chunk samples
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[float] | None = None  # of prompt tokens start+1 .. in this chunk


def wants_prompt_logprobs(chunk: ScheduledChunk) -> bool:
    """The chunk covers prompt positions whose successors' logprobs are still missing
    (after a preemption the recompute does not ask again)."""
    seq = chunk.seq
    return (
        seq.prompt_logprobs is not None
        and len(seq.prompt_logprobs) == chunk.start + 1
        and chunk.start + 1 < seq.num_prompt_tokens
    )


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device, max_model_len: int,
        max_graph_batch: int = 0,  # decode batches up to this size replay CUDA graphs; 0: always eager
        prompt_dtype: torch.dtype = torch.float32,  # of a CPU step's prompt attention (AttentionMetadata)
    ):  # fmt: skip
        self.model = model
        self.prompt_dtype = prompt_dtype
        self.kv_cache = kv_cache
        self.device = device
        self.max_pages_per_seq = kv_cache.pages_for(max_model_len)  # the graphs' block-table width
        self.graphs = maybe_capture_decode_graphs(
            model, kv_cache.stores, max_graph_batch, self.max_pages_per_seq, max_model_len, device
        )
        self.used_cuda_graph = False  # whether the last forward replayed a graph (engine metrics)

    def batch(self, chunks: list[ScheduledChunk]) -> HostBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        row_starts: list[int] = []
        ahead_rows: list[int] = []
        # As wide as this batch needs: the widest (max_model_len) would copy ~1 MB a step at long contexts.
        width = max(len(c.seq.block_table) for c in chunks)
        block_tables = np.zeros((len(chunks), width), dtype=np.int32)
        for i, chunk in enumerate(chunks):
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            first_row = len(ids)
            row_starts.append(first_row)
            if chunk.ahead:
                ahead_rows.append(first_row)
                ids.append(0)
            else:
                ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += self.kv_cache.slots(seq, start, n)
            block_tables[i, : len(seq.block_table)] = seq.block_table.array
            if wants_prompt_logprobs(chunk):
                logit_rows += range(first_row, first_row + n)
            elif chunk.samples:
                logit_rows.append(first_row + n - 1)
        seq_lens = [c.start + c.num_tokens for c in chunks]
        query_lens = [c.num_tokens for c in chunks]
        recent_rows = [c.seq.recent_row or 0 for c in chunks]
        return HostBatch(ids, positions, slots, seq_lens, query_lens, recent_rows, block_tables, logit_rows, row_starts,
                         ahead_rows)  # fmt: skip

    def prepare(self, batch: HostBatch) -> StepInputs:
        """Device tensors of an eager step."""
        t, s = len(batch.ids), len(batch.seq_lens)
        query_start = batch.row_starts + [t]
        # One copy for all 1-D inputs (a copy costs more than its bytes here), from pinned memory: a step
        # scheduled ahead is prepared while the step before it runs, and a copy from pageable memory would
        # wait for that step to finish before this one's kernels are queued. Through numpy: torch.tensor
        # converts a list of ints ~3.7x slower (6,300 ints: 360 against 98 us, CPU).
        host = np.array(batch.ids + batch.positions + batch.slots + batch.seq_lens + batch.recent_rows + query_start,
                        dtype=np.int64)  # fmt: skip
        flat = to_device(torch.from_numpy(host), self.device)
        meta = AttentionMetadata(
            slot_mapping=flat[2 * t : 3 * t],
            block_tables=to_device(torch.from_numpy(batch.block_tables), self.device),
            seq_lens=flat[3 * t : 3 * t + s].to(torch.int32),
            query_start_loc=flat[3 * t + 2 * s :].to(torch.int32),
            seq_lens_cpu=batch.seq_lens,
            query_lens_cpu=batch.query_lens,
            recent_rows=flat[3 * t + s : 3 * t + 2 * s].to(torch.int32),
            prompt_dtype=self.prompt_dtype,
        )
        return StepInputs(flat[:t], flat[t : 2 * t], meta)

    def forward(self, batch: HostBatch, ahead_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The model call; decode-only steps that fit a captured size replay a CUDA graph.
        ``ahead_ids`` (async scheduling): the token ids of ``batch.ahead_rows``, still on the device."""
        every_row_ahead = ahead_ids is not None and len(batch.ahead_rows) == len(batch.ids)
        self.used_cuda_graph = (
            self.graphs is not None
            and (ahead_ids is None or every_row_ahead)
            and self.graphs.can_run(len(batch.ids), batch.is_decode_only, batch.block_tables.shape[1],
                                    max(batch.seq_lens))
        )  # fmt: skip
        if self.used_cuda_graph:
            return self.graphs.run_host(batch.ids, batch.positions, batch.slots, batch.seq_lens, batch.recent_rows,
                                        batch.block_tables, ahead_ids)  # fmt: skip
        inputs = self.prepare(batch)
        if every_row_ahead:
            inputs.input_ids.copy_(ahead_ids)
        elif ahead_ids is not None:
            inputs.input_ids[to_device(torch.tensor(batch.ahead_rows), self.device)] = ahead_ids
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache.stores, inputs.meta)

    def execute(self, chunks: list[ScheduledChunk]) -> list[ChunkResult]:
        return self.collect(self.launch(chunks))

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's kernels (forward, logits, sampling) without waiting for them.
        ``after``: the step in flight that samples the tokens of this step's ahead chunks (chunks
        from Scheduler.schedule_ahead)."""
        batch = self.batch(chunks)
        hidden = self.forward(batch, None if after is None else self._ahead_ids(chunks, after))
        step = LaunchedStep(chunks, batch.row_starts)
        if batch.logit_rows:
            self._logits_and_tokens(step, hidden, batch)
        if self.device.type == "cuda":
            step.finished = torch.cuda.Event()
            step.finished.record()
        return step

    def _logits_and_tokens(self, step: LaunchedStep, hidden: torch.Tensor, batch: HostBatch) -> None:
        """Queue the logits of the rows that need them and the sampling of the chunks that sample."""
        chunks = step.chunks
        if len(batch.logit_rows) < hidden.shape[0]:
            hidden = hidden[to_device(torch.tensor(batch.logit_rows), self.device)]
        with timed("lm_head", self.device):
            step.logits = self.model.compute_logits(hidden)
        step.row_of = {row: i for i, row in enumerate(batch.logit_rows)}
        step.scoring_prompt = [i for i, c in enumerate(chunks) if wants_prompt_logprobs(c)]
        step.sampling = [i for i, c in enumerate(chunks) if c.samples]
        if step.sampling:
            last_rows = [step.row_of[step.row_starts[i] + chunks[i].num_tokens - 1] for i in step.sampling]
            if len(last_rows) < step.logits.shape[0]:  # prompt-logprob rows are in there too
                step.sample_logits = step.logits[to_device(torch.tensor(last_rows), self.device)]
            else:
                step.sample_logits = step.logits
            seqs = [chunks[i].seq for i in step.sampling]
            with timed("sampling", self.device):
                ahead = [chunks[i].ahead for i in step.sampling]
                tensors = SamplingTensors.from_sequences(seqs, step.logits.shape[1], self.device, ahead)
                step.tokens = sample(step.sample_logits, tensors)
            if self.device.type == "cuda":
                step.tokens_host = torch.empty(step.tokens.shape, dtype=step.tokens.dtype, pin_memory=True)
                step.tokens_host.copy_(step.tokens, non_blocking=True)

    def _ahead_ids(self, chunks: list[ScheduledChunk], after: LaunchedStep) -> torch.Tensor:
        """The ahead chunks' token ids in chunk order, from the tokens ``after`` samples (in its own order)."""
        sampled_by = {after.chunks[i].seq: k for k, i in enumerate(after.sampling)}
        picks = [sampled_by[c.seq] for c in chunks if c.ahead]
        if picks == list(range(len(after.sampling))):
            return after.tokens
        return after.tokens[to_device(torch.tensor(picks), self.device)]

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> list[ChunkResult]:
        """Wait for a launched step and read its tokens (and logprobs) back to the host."""
        chunks = step.chunks
        results = [ChunkResult() for _ in chunks]
        if step.tokens is not None:
            seqs = [chunks[i].seq for i in step.sampling]
            logprobs = token_logprobs(step.sample_logits, step.tokens, [s.params.logprobs for s in seqs])
            if step.finished is not None:
                step.finished.synchronize()
            tokens = (step.tokens if step.tokens_host is None else step.tokens_host).tolist()
            for i, token, logprob in zip(step.sampling, tokens, logprobs):
                results[i].token, results[i].logprob = token, logprob
        for i in step.scoring_prompt:
            first = step.row_of[step.row_starts[i]]
            results[i].prompt_logprobs = self._prompt_logprobs(chunks[i], step.logits, first)
        return results

    def _prompt_logprobs(self, chunk: ScheduledChunk, logits: torch.Tensor, first: int) -> list[float]:
        """Logprob of prompt token p+1 given tokens 0..p, for each prompt position p of the chunk."""
        seq = chunk.seq
        n = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1) - chunk.start
        targets = to_device(torch.tensor(seq.prompt_token_ids[chunk.start + 1 : chunk.start + 1 + n]), self.device)
        logprobs = torch.log_softmax(logits[first : first + n], dim=-1)
        return logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
