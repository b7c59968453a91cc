"""Who moves a batch on: one process at a time, the holder of the batch's lease (producer/scripts/lease.lua),
which renews it while it holds it; another takes over once it lapses (its holder died, or lost Redis for longer
than LEASE_MS). A batch has two: BatchKeys.submitting, held while its lines are validated and its jobs
submitted, and BatchKeys.sweeper, held by the process that records its jobs' ends and writes its output files
(serve.progress). Sans-IO flows (producer.flows).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterable

from producer import calls, flows
from producer.flows import Cmd, Flow

LEASE_MS = 10_000  # a holder that did not renew for this long is presumed gone
# A batch's creator renews its lease between chunks of lines, and a chunk may take long on a busy machine (slow
# constraints take up to their time budget): its lease lasts longer, or a live creator would be taken over.
CREATOR_LEASE_MS = 60_000
TAKE_CHUNK = 500  # leases taken or renewed per round trip


class LeaseLost(Exception):
    """Another process holds the lease now: this one stops what it was doing with the batch."""


def new_token() -> str:
    """A holder's token, naming its host and process: whoever reads a lease sees who holds it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Holder:
    """One holder of leases: a serve process's sweeper (for as long as it runs), a batch's creator, `pagedq batch
    wait`."""

    def __init__(self, ms: int = LEASE_MS) -> None:
        self.token = new_token()
        self.ms = ms  # how long its leases last unrenewed; within one long step, renewed every third of it
        self._renewed: dict[str, float] = {}  # lease key -> when this holder last took or renewed it (monotonic)

    def claim(self, key: str) -> Cmd:
        """The command that takes a lease no one can hold yet (a new batch's), to send with others."""
        self._renewed[key] = time.monotonic()
        return Cmd("set", (key, self.token), {"nx": True, "px": self.ms})

    def take(self, keys: Iterable[str]) -> Flow:
        """Take or renew each of `keys`; returns those this holder holds now."""
        keys = list(keys)
        held = []
        for s in range(0, len(keys), TAKE_CHUNK):
            part = keys[s:s + TAKE_CHUNK]
            outs = yield from flows.run_calls([calls.lease(k, self.token, self.ms) for k in part])
            for k, ok in zip(part, outs, strict=True):
                if isinstance(ok, Exception):
                    raise ok
                if ok:
                    held.append(k)
                    self._renewed[k] = time.monotonic()
                else:
                    self._renewed.pop(k, None)
        return held

    def keep(self, key: str) -> Flow:
        """Renew `key` if it is due (a step that takes long keeps its lease); LeaseLost when another holds it."""
        if time.monotonic() - self._renewed.get(key, float("-inf")) < self.ms / 3000:
            return
        if not (yield from self.take([key])):
            raise LeaseLost(f"{key} is held by another process now")

    def give_up(self, key: str) -> Flow:
        """Let another take `key` at once (nothing if another holds it)."""
        self._renewed.pop(key, None)
        yield from flows.run_call(calls.lease(key, self.token, 0))
