"""Submits of concurrent requests, sent to Redis together.

Under load the event loop, not Redis, is what a submit waits on: a command holds its pooled connection from its
send until the loop comes round to reading its reply, so when the loop is busy with thousands of streams a pool of
16 connections carries only a few hundred submits a second, and a burst of requests waits past the pool's bound
(429, server busy) while Redis idles. So a queue's submits go out as one pipeline of their scripts: the requests
that submit while a round trip is out wait for it, then go together in the next, one connection for all of them.
A lone request still takes one round trip.
"""

from __future__ import annotations

import asyncio
import contextlib

from producer import AsyncClient, calls, flows
from producer.protocol import JobRequest

MAX_BATCH = 256  # scripts a round trip: a bound on the pipeline's reply, and on what one failure takes with it


class Submits:
    """One queue's submits, batched (AsyncClient.submit's outcome for each: None, or its typed error)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.pending: list[tuple[calls.Call, asyncio.Future]] = []
        self.sending: asyncio.Task | None = None

    async def submit(self, request: JobRequest) -> None:
        """Create the job and queue it, with whatever other requests submit meanwhile (the request's limits are the
        caller's to check). Raises as AsyncClient.submit does: DuplicateJobError, a Redis error of the round trip."""
        done = asyncio.get_running_loop().create_future()
        self.pending.append((calls.submit(self.client.keys, request), done))
        if self.sending is None or self.sending.done():
            self.sending = asyncio.create_task(self._send())
        await done

    async def _send(self) -> None:
        while self.pending:
            # A request that left while waiting (its future cancelled) queues no job: no one would follow it.
            batch = [(call, done) for call, done in self.pending[:MAX_BATCH] if not done.done()]
            del self.pending[:MAX_BATCH]
            if not batch:
                continue
            try:
                outs = await flows.adrive(self.client.redis,
                                          flows.run_calls([call for call, _ in batch], self.client.durability))
            except Exception as e:  # noqa: BLE001 (the round trip's failure is each request's to answer)
                outs = [e] * len(batch)
            for (_, done), out in zip(batch, outs, strict=True):
                if done.done():
                    continue
                if isinstance(out, BaseException):
                    done.set_exception(out)
                else:
                    done.set_result(None)

    async def close(self) -> None:
        if self.sending is not None:
            self.sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sending
