"""Errors a client raises."""

from __future__ import annotations


class PagedqError(Exception):
    pass


class DuplicateJobError(PagedqError):
    """A job with this id exists already. `ids` lists the refused ids; `jobs` the ones that were submitted
    (submit_many submits every other job of the batch)."""

    def __init__(self, message: str, ids: list[str], jobs: list | None = None) -> None:
        super().__init__(message)
        self.ids = ids
        self.jobs = jobs or []


class JobNotFound(PagedqError):
    pass


class LeaseLost(PagedqError):
    """A worker wrote to a job it no longer holds."""


class OwnerFull(PagedqError):
    """The API key that submits a job has as many jobs queued or running on the queue as it may (submit.lua)."""


class StreamGap(PagedqError):
    """complete.lua's GAP: the job's event stream holds only `emitted` output tokens, fewer than the worker wrote
    (a failover promoted a replica that lacked the last ones). The worker sends them again, then completes."""

    def __init__(self, message: str, emitted: int) -> None:
        super().__init__(message)
        self.emitted = emitted


class NotReplicated(PagedqError):
    """Durability "replicated": the primary has the write, but fewer replicas than asked confirmed it within the
    timeout (WAIT), so a failover now could lose it. `outcomes`: each call's outcome, as if it had succeeded;
    `acked`: the replicas that confirmed; `ids`: the jobs the calls were about."""

    def __init__(self, message: str, acked: int, needed: int, outcomes: list | None = None,
                 ids: list[str] | None = None) -> None:
        super().__init__(message)
        self.acked, self.needed = acked, needed
        self.outcomes = outcomes or []
        self.ids = ids or []
