"""Constraint checks of the live routes, off the event loop: compiling a large schema takes long (up to seconds), so a
request's check runs last of serve's checks, after its key was admitted (a rate-limited key pays nothing to have a
schema compiled), in one of `constraint_threads` threads, within `constraint_check_s`. A check that runs longer is
a 400 that says so, and that verdict is remembered like any other (serve.verdicts), so sending the spec again
compiles nothing. Python cannot stop a thread: the late compile finishes in its thread, which the next checks wait
for. The grammar engine releases the GIL while it compiles, so the event loop streams on meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from serve import constraints
from serve.config import ServeConfig
from serve.constraints import INVALID, refusal
from serve.errors import APIError
from serve.metrics import ServeMetrics
from serve.verdicts import FINE, VERDICTS, Verdict, Verdicts, spec_key

TIMEOUT = "constraint_timeout"
WAIT_S = 10.0  # a check waits this long for a free thread, then 429: the server is busy, the spec is not at fault


class Checks:
    """The checks of one serve process: off the event loop, constraint_threads at once, each within
    constraint_check_s."""

    def __init__(self, config: ServeConfig, metrics: ServeMetrics, verdicts: Verdicts = VERDICTS,
                 wait_s: float = WAIT_S) -> None:
        self.budget_s = config.constraint_check_s
        self.retry_after_s = config.retry_after_s
        self.metrics = metrics
        self.verdicts = verdicts
        self.wait_s = wait_s
        self.pool = concurrent.futures.ThreadPoolExecutor(config.constraint_threads,
                                                          thread_name_prefix="pagedq-constraint")

    async def check(self, constraint: tuple[str, Any] | None, param: str | None) -> None:
        """Raise the 400 of a constraint the grammar engine refuses or that takes too long to check."""
        if constraint is None:
            return
        kind, spec = constraint
        key = spec_key(kind, spec)
        verdict = self.verdicts.get(key)
        if verdict is None:
            verdict = await self._compile(kind, spec)
            self.verdicts.put(key, verdict)
        err = refusal(verdict, kind, param or "request")
        if err is not None:
            raise err

    async def _compile(self, kind: str, spec: Any) -> Verdict:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def run() -> tuple[str, float]:
            loop.call_soon_threadsafe(started.set)
            start = time.perf_counter()
            return constraints.problem(kind, spec), time.perf_counter() - start

        job = self.pool.submit(run)
        try:
            await asyncio.wait_for(started.wait(), self.wait_s)
        except asyncio.TimeoutError:
            if job.cancel():
                self.metrics.refused.labels("constraint_busy").inc()
                raise APIError(429, f"every constraint check thread of this server stayed busy for {self.wait_s} s; "
                               "retry later", "rate_limit_exceeded", code="server_busy",
                               headers={"Retry-After": str(self.retry_after_s)}) from None
        self.metrics.constraint_checks.inc()
        try:
            # Measured by the thread as well: a compile that overran its budget is refused however late the
            # event loop came round to see it end.
            found, took = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), self.budget_s)
        except asyncio.TimeoutError:
            took = None
        if took is None or took > self.budget_s:
            self.metrics.constraint_timeouts.inc()
            return Verdict(TIMEOUT, f"checking the {kind} constraint took longer than {self.budget_s:g} s; "
                                    "send a simpler one")
        return Verdict(INVALID, found) if found else FINE

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
