"""Riding through a Redis outage: a restart, a Sentinel failover, a dropped connection.

A Ride wraps each Redis operation of one client call (flows' drivers run every Cmd or Pipe through it). An operation
that fails for want of Redis is sent again, with backoff, until it gets through or the outage has lasted the grace;
then RedisUnavailable names the address and how long it waited. Re-sending the very same operation is what makes
this safe and lossless: a flow's state (the last event id a reader saw, the enqueued_at a submit carries) lives in
the flow, so an XREAD resumes after the last event it yielded and a retried submit can recognise its own job.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import AuthenticationError, AuthorizationError, MaxConnectionsError, ReadOnlyError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.errors import PagedqError

# ConnectionError covers refused connects, resets, LOADING (BusyLoadingError) and MasterNotFoundError (Sentinel has
# no primary yet); READONLY is a demoted primary still answering until the client follows the new one.
OUTAGE = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)
# Also ConnectionErrors to redis-py, but wrong settings or a full pool, not an outage: waiting would only delay
# the answer (a full pool is the caller's own back-pressure, e.g. `pagedq serve` answering 503).
REFUSED = (AuthenticationError, AuthorizationError, MaxConnectionsError)
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0


class RedisUnavailable(PagedqError, RedisConnectionError):
    """Redis stayed unreachable (restart, failover, network) longer than the client's grace. Also a redis-py
    ConnectionError, so code that caught that before still does. `waited`: seconds since the outage began.
    (Here, not in producer.errors, which loads without the redis package.)"""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited


def is_outage(err: BaseException) -> bool:
    """Whether `err` means Redis is away for now (worth waiting for), not that it refuses this client."""
    if not isinstance(err, OUTAGE) or isinstance(err, REFUSED):
        return False
    if isinstance(err.__cause__, TimeoutError):  # a blocking pool's wait for a free connection ran out
        return False
    return "certificate verify failed" not in str(err).lower()  # TLS: redis-py keeps only the message


def outage_in(reply: Any) -> BaseException | None:
    """A pipeline's reply holds errors as values: the first that stands for an outage, if any."""
    if isinstance(reply, list):
        return next((x for x in reply if isinstance(x, BaseException) and is_outage(x)), None)
    return None


class Ride:
    """One client call's retry state. grace: seconds an outage may last (0: fail at once); where: the redacted
    address for errors; deadline: the call's own time.monotonic() end (its timeout), past which it stops too."""

    def __init__(self, grace: float, where: str, deadline: float | None = None) -> None:
        self.grace = grace
        self.where = where
        self.deadline = deadline
        self.retried = False  # an operation was sent again: a write may have landed the first time

    def _pause(self, err: BaseException, since: float, delay: float) -> float:
        """How long to sleep before the next try; raises once the grace (or the call's deadline) is spent."""
        now = time.monotonic()
        waited = now - since
        if waited >= self.grace:
            raise RedisUnavailable(f"Redis at {self.where} unreachable for {waited:.1f} s (the client's grace is "
                                   f"{self.grace:g} s): {err}", waited) from err
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError(f"timed out while Redis at {self.where} was unreachable ({waited:.1f} s so far): "
                               f"{err}") from err
        self.retried = True
        end = since + self.grace if self.deadline is None else min(since + self.grace, self.deadline)
        # Jitter: many clients that lost the same server should not all come back in the same millisecond.
        return max(0.0, min(delay * random.uniform(0.5, 1.0), end - now))

    def _after(self, err: BaseException, since: float | None, delay: float) -> tuple[float, float, float]:
        """A try failed for want of Redis -> (when the outage began, the pause before the next try, the delay
        after that one); raises once the grace or the call's deadline is spent."""
        since = since or time.monotonic()
        return since, self._pause(err, since, delay), min(delay * 2, MAX_DELAY_S)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), sent again through an outage (sync)."""
        since, delay = None, FIRST_DELAY_S
        while True:
            try:
                reply = fn(*args)
                err = outage_in(reply)
                if err is None:
                    return reply
            except OUTAGE as e:
                if not is_outage(e):
                    raise
                err = e
            since, pause, delay = self._after(err, since, delay)
            time.sleep(pause)

    async def acall(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """await fn(*args), sent again through an outage (asyncio)."""
        since, delay = None, FIRST_DELAY_S
        while True:
            try:
                reply = await fn(*args)
                err = outage_in(reply)
                if err is None:
                    return reply
            except OUTAGE as e:
                if not is_outage(e):
                    raise
                err = e
            since, pause, delay = self._after(err, since, delay)
            await asyncio.sleep(pause)


def checked_grace(grace: float) -> float:
    """A client's grace argument, refused with a clear error where it is not seconds >= 0."""
    if grace is None or grace < 0:
        raise ValueError(f"grace must be seconds >= 0 (0: no retries through an outage), got {grace!r}")
    return grace


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def address_of(r: Any) -> str:
    """Where a client connects, for errors (no password): host:port, a Sentinel service, or the client's repr."""
    pool = getattr(r, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service:
        return f"Sentinel service {service!r}"
    kw = getattr(pool, "connection_kwargs", None) or {}
    if kw.get("path"):
        return f"unix:{kw['path']}"
    if kw.get("host"):
        return f"{kw['host']}:{kw.get('port', 6379)}"
    return type(r).__name__
