"""The synchronous client: what a web app uses to enqueue jobs and read their tokens and results."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import redis as redis_lib
from redis.exceptions import ResponseError

from producer import ops
from producer.keys import Keys
from producer.protocol import JobRequest, JobResult, Limits, StreamEvent
from producer.scripts import Scripts


class Client:
    """`Client(url, queue="default")`. url None: $REDIS_URL, else redis://localhost:6379/0."""

    def __init__(self, url: str | None = None, queue: str = "default", *, redis: redis_lib.Redis | None = None,
                 limits: Limits | None = None, result_ttl: int = ops.DEFAULT_TTL) -> None:
        self.redis = redis or redis_lib.Redis.from_url(ops.redis_url(url), decode_responses=True)
        self.keys = Keys(queue)
        self.limits = limits or Limits()
        self.result_ttl = result_ttl
        self.scripts = Scripts(self.redis)
        self.block_chunk_ms = ops.block_chunk_ms(self.redis)

    def submit(self, request: JobRequest | dict | None = None, /, **fields: Any) -> Job:
        """Enqueue one job: `submit(prompt=..., max_tokens=64)`, `submit(messages=[...])` or
        `submit(JobRequest(...))`. Raises DuplicateJobError when a job with this id exists."""
        req = ops.make_request(request, fields, self.limits)
        keys, args = ops.submit_call(self.keys, req)
        try:
            self.scripts.submit(keys, args)
        except ResponseError as e:
            if ops.is_duplicate(e):
                raise ops.duplicate_error([req.id], []) from None
            raise
        return Job(self, req.id)

    def submit_many(self, requests: Iterable[JobRequest | dict]) -> list[Job]:
        """Enqueue many jobs in one pipelined round trip. Duplicates are refused one by one: every other job
        is submitted, then DuplicateJobError lists the refused ids (and carries the submitted jobs)."""
        reqs = [ops.make_request(r, {}, self.limits) for r in requests]
        pipe = self.redis.pipeline(transaction=False)
        for req in reqs:
            keys, args = ops.submit_call(self.keys, req)
            self.scripts.submit(keys, args, client=pipe)
        replies = pipe.execute(raise_on_error=False)
        return ops.submitted(reqs, replies, lambda job_id: Job(self, job_id))

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def status(self, job_id: str) -> str:
        state = self.redis.hget(self.keys.job(job_id), "state")
        if state:
            return state
        raw = self.redis.get(self.keys.result(job_id))
        if raw:
            return JobResult.model_validate_json(raw).status
        raise ops.not_found(job_id)

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job's result; blocks on its event stream (XREAD BLOCK), no polling.
        Raises TimeoutError after `timeout` seconds, JobNotFound for an unknown id."""
        r, k = self.redis, self.keys
        raw = r.get(k.result(job_id))
        if raw:
            return JobResult.model_validate_json(raw)
        last = "0-0"
        tail = r.xrevrange(k.events(job_id), count=1)
        if tail:
            ev = ops.parse_event(*tail[0])
            if ev.terminal:
                return ev.result
            last = ev.event_id
        elif not r.exists(k.job(job_id)):
            raise ops.not_found(job_id)
        deadline = ops.Deadline(timeout, self.block_chunk_ms)
        while True:
            reply = r.xread({k.events(job_id): last}, count=1000, block=deadline.block_ms())
            for ev in ops.parse_events(reply):
                last = ev.event_id
                if ev.terminal:
                    return ev.result
            if deadline.expired():
                raise TimeoutError(f"job {job_id} has no result after {timeout} s")

    def stream(self, job_id: str, timeout: float | None = None, after: str = "0-0") -> Iterator[StreamEvent]:
        """Yield the job's events from the start of its stream (or after event id `after`): token chunks,
        then one terminal event ("done", "error" or "cancelled") that carries the result."""
        r, k = self.redis, self.keys
        if after == "0-0" and not r.exists(k.events(job_id)):
            raw = r.get(k.result(job_id))
            if raw:
                yield ops.result_event(raw)
                return
            if not r.exists(k.job(job_id)):
                raise ops.not_found(job_id)
        deadline = ops.Deadline(timeout, self.block_chunk_ms)
        last = after
        while True:
            reply = r.xread({k.events(job_id): last}, count=1000, block=deadline.block_ms())
            for ev in ops.parse_events(reply):
                last = ev.event_id
                yield ev
                if ev.terminal:
                    return
            if deadline.expired():
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")

    def cancel(self, job_id: str) -> str:
        """Cancel a job. Returns "cancelled" (it was queued), "cancelling" (it runs; the worker stops it soon),
        or its terminal state unchanged."""
        keys, args = ops.cancel_call(self.keys, job_id, self.result_ttl)
        try:
            return self.scripts.cancel(keys, args)
        except ResponseError as e:
            if str(e).startswith("NOT_FOUND"):
                raise ops.not_found(job_id) from None
            raise

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Job:
    """A handle on one submitted job."""

    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def status(self) -> str:
        return self.client.status(self.id)

    def result(self, timeout: float | None = None) -> JobResult:
        return self.client.result(self.id, timeout)

    def stream(self, timeout: float | None = None, after: str = "0-0") -> Iterator[StreamEvent]:
        return self.client.stream(self.id, timeout, after)

    def cancel(self) -> str:
        return self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"Job({self.id!r})"
