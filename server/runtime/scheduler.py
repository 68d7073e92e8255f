"""Continuous batching: which sequences run this step and how many of their tokens.

Every sequence is the same thing to the scheduler: ``num_computed_tokens`` of its
``num_tokens`` have K/V in the cache, and this step computes the next chunk. A decode is a
chunk of one token; a prefill (or a recompute after preemption) is a longer one. A
sequence samples when its chunk reaches its last token.

Policy, per step, within ``max_num_batched_tokens``: running decodes first (oldest first),
then running prefills, then new admissions from the head of ``waiting`` while pages are
free. When a running sequence needs a page and none is free, the sequence at the back
of this step's queue (the newest prefill, else the newest decode) is preempted: its
pages are freed and it goes back to the head of ``waiting`` to be recomputed.

Async scheduling: while a decode step runs, ``schedule_ahead`` can already schedule the
next one, whose single token per sequence is the one the running step is sampling (still
on the device). It does so only when nothing else would have been scheduled differently:
every running sequence decodes, none waits, none can reach max_tokens in the running
step, the pages are free without preempting, and no sampler needs the token history on
the host (penalties). A sequence that a stop token or string ends in the running step
just wastes its ahead token, as it does today for a stop string seen one step late.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from server.config import EngineConfig
from server.runtime.kv_cache import KVCache
from server.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens)
    num_tokens: int
    ahead: bool = False  # its one token is being sampled by the step in flight (not on the host yet)

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits pick the next token."""
        return self.ahead or self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCache):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name}={getattr(config, name)} must be at least 1: no step could run")
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        pending = deque(decodes + prefills)  # victims are taken from the back
        preempted = False
        while pending and budget > 0:
            seq = pending.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv_cache.can_grow(seq, seq.num_computed_tokens + n):
                victim = pending.pop() if pending else seq
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(self._take(seq, n))
                budget -= n
        # Admit only when nobody was just preempted: the pool is tight, resuming would thrash.
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.kv_cache.can_grow(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._take(seq, n))
            budget -= n
        return chunks

    def schedule_ahead(self, in_flight: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The decode step after ``in_flight``, scheduled before its tokens are known; [] when
        that step could differ from what ``schedule`` will decide once they are (module doc)."""
        seqs = [c.seq for c in in_flight]
        if self.waiting or len(seqs) != len(self.running) or len(seqs) > self.max_num_batched_tokens:
            return []
        for chunk, seq in zip(in_flight, seqs):
            p = seq.params
            if (
                not (chunk.num_tokens == 1 and chunk.samples)
                or seq.finish_reason is not None
                or seq.num_generated_tokens + 2 > p.max_tokens  # the step in flight may be its last
                or p.penalized  # its penalties need the in-flight token on the host
            ):  # fmt: skip
                return []
        new_pages = sum(self.kv_cache.pages_for(s.num_tokens + 1) - len(s.block_table) for s in seqs)
        if new_pages > self.kv_cache.num_free_pages:
            return []
        for seq in seqs:
            self.kv_cache.grow(seq, seq.num_tokens + 1)
        return [ScheduledChunk(seq, seq.num_tokens, 1, ahead=True) for seq in seqs]

    def _take(self, seq: Sequence, n: int) -> ScheduledChunk:
        self.kv_cache.grow(seq, seq.num_computed_tokens + n)
        return ScheduledChunk(seq, seq.num_computed_tokens, n)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the pages, keep the tokens (sequence.py explains why that is exact)."""
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, aborted or failed) and return its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # not there yet if it never left the engine's inbox
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
