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

Async scheduling: while a step runs, ``schedule_ahead`` can already schedule the next one.
A sequence the running step samples decodes the token being sampled (still on the device);
one whose prompt the running step does not finish goes on with its next chunk, whose tokens
the host has; waiting sequences are admitted as ``schedule`` would. It does so only when
nothing would be scheduled differently once the tokens are known: none can reach max_tokens
in the running step, the pages are free without preempting, no sampler needs the token
history on the host (penalties), and no prompt chunk needs the running one's prompt
logprobs. A sequence that a stop token or string ends in the running step just wastes its
ahead token, as it does today for a stop string seen one step late.
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
        return chunks if preempted else chunks + self._admit(budget)

    def _admit(self, budget: int) -> list[ScheduledChunk]:
        """Chunks of waiting sequences, from the head, while the budget, max_num_seqs and the pages allow."""
        chunks = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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

    def schedule_ahead(self, in_flight: list[ScheduledChunk], prompts: bool = True) -> list[ScheduledChunk]:
        """The step after ``in_flight``, scheduled before its tokens are known; [] when that step
        could differ from what ``schedule`` will decide once they are (module doc). It is the step
        ``schedule`` would take then: decodes first, then prefills, in admission order, within the
        token budget; a sequence the step in flight samples decodes its token still on the device
        (``ahead``), one whose prompt it does not finish goes on with its next prompt chunk.
        ``prompts=False``: only a step of in-flight tokens alone; [] where it would take more."""
        advanced = {}  # seq -> (first position of its next chunk, whether its token there is in flight)
        for chunk in in_flight:
            seq, p = chunk.seq, chunk.seq.params
            if seq.finish_reason is not None:
                return []
            if not chunk.samples:
                if seq.prompt_logprobs is not None:  # the next chunk's prompt logprobs depend on this one's
                    return []
                advanced[seq] = (chunk.start + chunk.num_tokens, False)
            elif seq.num_generated_tokens + 2 > p.max_tokens or p.penalized:  # may be its last; needs the token
                return []
            else:
                advanced[seq] = (seq.num_tokens, True)
        nexts = []  # (seq, start, tokens left, ahead)
        for seq in self.running:
            start, ahead = advanced.get(seq, (seq.num_computed_tokens, False))
            nexts.append((seq, start, (seq.num_tokens + ahead) - start, ahead))
        nexts.sort(key=lambda n: n[2] > 1)  # decodes first; stable: admission order within each
        budget, chunks = self.max_num_batched_tokens, []
        for seq, start, left, ahead in nexts:
            if budget == 0:
                break
            n = min(left, budget)
            chunks.append(ScheduledChunk(seq, start, n, ahead=ahead))
            budget -= n
        admits = bool(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs
        if not prompts and (admits or not all(c.ahead for c in chunks)):
            return []
        new_pages = sum(max(0, self.kv_cache.pages_for(c.start + c.num_tokens) - len(c.seq.block_table))
                        for c in chunks)  # fmt: skip
        if new_pages > self.kv_cache.num_free_pages:  # schedule would preempt
            return []
        for c in chunks:
            self.kv_cache.grow(c.seq, c.start + c.num_tokens)
        return chunks + self._admit(budget)

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
