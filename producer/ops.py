"""What the sync and asyncio clients share: building script arguments and reading replies. No I/O here."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from redis.exceptions import ResponseError

from producer.errors import DuplicateJobError, JobNotFound
from producer.keys import EVENT_FIELD, Keys
from producer.protocol import JobRequest, JobResult, Limits, StreamEvent, Timings

DEFAULT_URL = "redis://localhost:6379/0"
DEFAULT_TTL = 24 * 3600
# Longest single XREAD BLOCK: a client that waits longer loops. It must stay well under the socket timeout
# (redis-py 8 defaults to 5 s), or the read times out before Redis answers.
BLOCK_CHUNK_MS = 2000


def block_chunk_ms(redis) -> int:
    timeout = redis.connection_pool.connection_kwargs.get("socket_timeout")
    return BLOCK_CHUNK_MS if not timeout else max(1, min(BLOCK_CHUNK_MS, int(timeout * 500)))


def redis_url(url: str | None) -> str:
    return url or os.environ.get("REDIS_URL") or DEFAULT_URL


def make_request(request: JobRequest | dict | None, fields: dict[str, Any], limits: Limits) -> JobRequest:
    if request is None:
        req = JobRequest(**fields)
    elif fields:
        raise TypeError("pass a JobRequest or keyword fields, not both")
    elif isinstance(request, JobRequest):
        req = request
    else:
        req = JobRequest.model_validate(request)
    limits.check(req)
    return req


def submit_call(keys: Keys, req: JobRequest) -> tuple[list[str], list[Any]]:
    return ([keys.job(req.id), keys.result(req.id), keys.jobs],
            [req.id, req.model_dump_json(exclude_defaults=True), repr(time.time())])


def is_duplicate(err: BaseException) -> bool:
    return str(err).startswith("DUPLICATE")


def duplicate_error(ids: list[str], jobs: list) -> DuplicateJobError:
    return DuplicateJobError(f"job id already exists: {', '.join(ids)}", ids, jobs)


def submitted(reqs: list[JobRequest], replies: list, make_job: Callable[[str], Any]) -> list:
    """The jobs of a pipelined submit_many; a duplicate id anywhere raises once, naming all of them."""
    jobs, dups = [], []
    for req, reply in zip(reqs, replies, strict=True):
        if isinstance(reply, ResponseError) and is_duplicate(reply):
            dups.append(req.id)
        elif isinstance(reply, Exception):
            raise reply
        else:
            jobs.append(make_job(req.id))
    if dups:
        raise duplicate_error(dups, jobs)
    return jobs


def cancel_call(keys: Keys, job_id: str, ttl: int) -> tuple[list[str], list[Any]]:
    res = JobResult(id=job_id, status="cancelled", finish_reason="cancelled",
                    timings=Timings(finished_at=time.time()))
    return ([keys.job(job_id), keys.events(job_id), keys.result(job_id), keys.jobs],
            [res.model_dump_json(), ttl])


def not_found(job_id: str) -> JobNotFound:
    return JobNotFound(f"no job {job_id!r} (never submitted, or its keys expired)")


def parse_event(entry_id: str, fields: dict) -> StreamEvent:
    ev = StreamEvent.model_validate_json(fields[EVENT_FIELD])
    ev.event_id = entry_id
    return ev


def parse_events(reply: Iterable) -> list[StreamEvent]:
    # XREAD reply: [[stream, [(entry_id, fields), ...]]]
    return [parse_event(eid, f) for _, entries in reply or [] for eid, f in entries]


def result_event(raw: str) -> StreamEvent:
    """A terminal event rebuilt from a stored result, for a subscriber that comes after the events expired."""
    res = JobResult.model_validate_json(raw)
    kind = {"completed": "done", "cancelled": "cancelled"}.get(res.status, "error")
    return StreamEvent(type=kind, result=res)


class Deadline:
    def __init__(self, timeout: float | None, chunk_ms: int = BLOCK_CHUNK_MS) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout
        self.chunk_ms = chunk_ms

    def block_ms(self) -> int:
        """How long the next XREAD may block: at least 1 ms (0 would mean forever)."""
        if self.end is None:
            return self.chunk_ms
        return max(1, min(self.chunk_ms, int((self.end - time.monotonic()) * 1000)))

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end
