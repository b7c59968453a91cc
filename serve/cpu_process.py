"""CPU work of one request that would stall every other, done in a process of its own: a large body's JSON decoding
and validation, and a batch's lines.

A thread does not help here. JSON decoding, pydantic's validation, the lone-surrogate walk and the encodings that
measure a constraint's size all hold the GIL (a single json.loads of a 500 KB schema holds it for tens of ms), so
while a thread reads such a body every stream of the process waits for its next write: measured on a 2-core Zen 4,
a thread left 50 streams' inter-token p99 at 15x its value alone under 8 clients sending such bodies back to back.
In a process the server's event loop only hands over bytes and takes back the parsed request (or the error).

The process is started at the first such piece of work (spawn: a fresh interpreter, none of the server's threads or
connections), one per serve process; it is started again should it die.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from serve.errors import APIError

T = TypeVar("T")
OFF_LOOP_BYTES = 16 * 1024  # a smaller body is read on the event loop: the hop to the process costs more

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()


def _executor() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def _broken(pool: ProcessPoolExecutor) -> APIError:
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None  # the next call starts another
    return APIError(503, "this server's request reader stopped; retry", "server_error", code="reader_restarting")


def call(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in the process, waited for on this thread (a flow's Offload runs it in a thread of its own)."""
    pool = _executor()
    try:
        return pool.submit(fn, *args).result()
    except BrokenProcessPool:
        raise _broken(pool) from None


def post(fn: Callable[..., object], *args: object) -> None:
    """fn(*args) in the process, if it runs, waiting for nothing (tidying up after earlier calls)."""
    with _lock:
        pool = _pool
    if pool is not None:
        with contextlib.suppress(BrokenProcessPool, RuntimeError):  # gone or shut down: nothing of it to tidy
            pool.submit(fn, *args)


async def acall(size: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args) for a body of `size` bytes: on the loop when it is small, else in the process."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    pool = _executor()
    try:
        return await asyncio.wrap_future(pool.submit(fn, *args))
    except BrokenProcessPool:
        raise _broken(pool) from None


def close() -> None:
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
