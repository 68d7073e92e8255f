"""Bridge from the engine thread to asyncio: one queue per HTTP request.

The engine calls `on_output` from its own thread; `loop.call_soon_threadsafe` hands each output
to the event loop (DESIGN.md, "One request, end to end"). A request with several sequences
(n > 1, or several prompts) shares one queue, outputs tagged with the sequence's index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from server.runtime.engine import RequestOutput
from server.runtime.sequence import SamplingParams

ENGINE_WATCH_S = 1.0  # how often a waiting request checks that the engine loop still runs


class SequenceGroup:
    """The sequences of one HTTP request, submitted together and aborted together."""

    def __init__(self, engine, request_id: str):
        self._engine = engine
        self._request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | None] = asyncio.Queue()
        self._unfinished: set[int] = set()
        self._aborted = False
        self._watch: asyncio.TimerHandle | None = None

    def _sequence_id(self, index: int) -> str:
        return f"{self._request_id}-{index}"

    def submit(self, sequences: list[tuple[list[int], SamplingParams]]) -> None:
        """Submit every sequence or none: engine rejections (RequestRejected, EngineOverloaded)
        propagate after the sequences already submitted are aborted."""
        try:
            for index, (prompt_ids, params) in enumerate(sequences):
                self._engine.submit(self._sequence_id(index), prompt_ids, params, self._callback(index))
                self._unfinished.add(index)
        except BaseException:
            self.abort()
            raise
        self._watch = self._loop.call_later(ENGINE_WATCH_S, self._watch_engine)

    def _watch_engine(self) -> None:
        """A loop that died (a bug outside its step's error handling) never finishes its sequences:
        fail them here rather than leave the client waiting forever."""
        if not self._unfinished or self._aborted:
            return
        if self._engine.is_alive():
            self._watch = self._loop.call_later(ENGINE_WATCH_S, self._watch_engine)
            return
        for index in sorted(self._unfinished):
            self._queue.put_nowait((index, _engine_stopped(self._sequence_id(index))))

    def _callback(self, index: int):
        def on_output(output: RequestOutput) -> None:  # runs on the engine thread
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, output))
            except RuntimeError:
                pass  # the event loop has closed (server shutting down): nobody is listening
        return on_output

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) as they arrive, until every sequence has finished."""
        while self._unfinished:
            item = await self._queue.get()
            if item is None:  # aborted
                return
            index, output = item
            if index not in self._unfinished:  # the watch failed it while its real end was queued
                continue
            if output.finished:
                self._unfinished.discard(index)
            yield index, output

    def abort(self) -> None:
        """Abort whatever has not finished (client gone, or a sibling failed); idempotent.
        `outputs()` ends at once, whether or not the engine reports the aborted sequences."""
        if self._watch is not None:
            self._watch.cancel()
        if self._aborted or not self._unfinished:
            return
        self._aborted = True
        for index in sorted(self._unfinished):
            self._engine.abort(self._sequence_id(index))
        self._queue.put_nowait(None)


def _engine_stopped(request_id: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, token_ids=[], text="", logprobs=None, prompt_logprobs=None,
                         finished=True, finish_reason="error", error="the engine loop stopped", num_prompt_tokens=0,
                         num_generated_tokens=0)
