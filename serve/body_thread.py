"""Reading a large request body off the event loop. Parsing and validating a request costs in proportion to its
body (a 500 KB schema: tens of ms of JSON decoding, walks and encoding), time in which every stream of the process
waits; a body past OFF_LOOP_BYTES is read in a thread of its own instead, one at a time, so that it holds the GIL
only during single C calls and the loop runs between them. A smaller one is read on the loop: a thread's hop
costs more than it."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
OFF_LOOP_BYTES = 256 * 1024


class BodyThread:
    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedq-read")

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) for a body of `size` bytes: on the loop, or in the thread when the body is large."""
        if size <= OFF_LOOP_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
