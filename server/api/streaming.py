"""Server-sent events, and tying a response's lifetime to its engine sequences."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.api.async_engine import SequenceGroup
from server.api.errors import ApiError

SSE_DONE = "data: [DONE]\n\n"
DISCONNECT_POLL_S = 0.25


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SequenceStreamingResponse(StreamingResponse):
    """An SSE response that aborts its sequences when the client goes away.

    Starlette only notices a disconnect when a send fails (ASGI spec >= 2.4), which for a
    request still waiting in the queue may be long after; so listen for `http.disconnect`
    alongside the stream, always, and abort the group whatever way the response ends.
    """

    def __init__(self, content, group: SequenceGroup):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client closed the connection while we were sending
                    tasks.cancel_scope.cancel()

                tasks.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            self._group.abort()


async def until_disconnect(request: Request, group: SequenceGroup, work: Awaitable):
    """Await `work` (collecting a non-streamed result); a client that leaves first aborts the group."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "The client closed the request.", code="client_closed_request")
        return task.result()
    finally:
        task.cancel()
        group.abort()
