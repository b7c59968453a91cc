"""Noticing that an HTTP client went away while its job runs, so that the job can be cancelled.

Starlette notices a streaming client's disconnect only at the next write (ASGI 2.4), which may be long in coming
while a job waits in the queue; these helpers listen on the ASGI channel instead, the whole time.

A stream the server cuts (its client stopped reading: serve.events drops it) ends the same way: its response
stops where it is and the connection closes (uvicorn logs "ASGI callable returned without completing response":
a write to a client that does not read cannot finish the response).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def _gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first(work: asyncio.Future, receive: Receive, cut: asyncio.Event | None = None) -> bool:
    """Wait for `work`, the client's disconnect or `cut`; True when the client left (or was cut) first (`work` is
    then cancelled, and may still be unwinding: see `_settle`)."""
    listeners = {asyncio.ensure_future(_gone(receive))}
    if cut is not None:
        listeners.add(asyncio.ensure_future(cut.wait()))
    try:
        await asyncio.wait({work, *listeners}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for listener in listeners:
            listener.cancel()
    if work.done() and not (cut is not None and cut.is_set()):
        return False
    work.cancel()
    return True


async def _settle(work: asyncio.Future) -> None:
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work


async def unless_gone(receive: Receive, coro: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, None) when the client disconnected before `coro` finished; else (False, its value)."""
    work = asyncio.ensure_future(coro)
    if await _first(work, receive):
        await _settle(work)
        return True, None
    return False, work.result()


class EventStream(StreamingResponse):
    """Server-sent events; `on_disconnect` runs when the client leaves before the stream's end or `cut` is set
    (the server ends the stream: the client is as good as gone), `on_close` once the response is over, however
    it ended."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, on_disconnect: Callable[[], Awaitable[None]],
                 on_close: Callable[[], None] | None = None, cut: asyncio.Event | None = None, **kw: Any) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)
        self.on_disconnect = on_disconnect
        self.on_close = on_close
        self.cut = cut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._answer(send, receive)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _answer(self, send: Send, receive: Receive) -> None:
        work = asyncio.ensure_future(self.stream_response(send))
        left = await _first(work, receive, self.cut)
        if not left and isinstance(work.exception(), OSError):
            left = True  # the write found the connection closed before the listener heard of it
        elif not left:
            work.result()
        if left:
            # Before waiting for the stream to unwind: however long that takes, the job stops now.
            await self.on_disconnect()
        await _settle(work)
