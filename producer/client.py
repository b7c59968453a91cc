"""The synchronous client: what a web app uses to enqueue jobs and read their tokens and results.
A thin shell over producer.flows, which it shares with the asyncio client."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import redis as redis_lib

from producer import calls, defaults, flows
from producer.connection import connect, is_cluster, redact, resolve_url, socket_timeout_of
from producer.durability import Durability
from producer.keys import Keys
from producer.protocol import JobRequest, JobResult, Limits, StreamEvent
from producer.ride import Ride, address_of, checked_grace, deadline_of


def block_chunk_ms(r) -> int:
    """The longest XREAD BLOCK this client's socket timeout allows."""
    timeout = socket_timeout_of(r)
    return flows.BLOCK_CHUNK_MS if not timeout else max(1, min(flows.BLOCK_CHUNK_MS, int(timeout * 500)))


def durability_for(r, durability: Durability | str | None) -> Durability:
    """The client's durability (None: $PAGEDQ_DURABILITY, else async); "replicated" is refused on a cluster."""
    d = Durability.of(durability)
    if d.replicated and is_cluster(r):
        raise ValueError("durability replicated is not supported on a Redis Cluster (WAIT cannot follow a queue's "
                         "scripts to their node): use a primary with replicas behind Sentinel, or async")
    return d


class Client:
    """`Client(url, queue="default")`. url None: $REDIS_URL, else redis://localhost:6379/0. A Redis Cluster is
    found out from any node's URL; `redis+sentinel://host1:26379,host2:26379/<service>` finds the primary through
    Sentinel. durability "replicated" (None: $PAGEDQ_DURABILITY, else "async"): a submit or cancel returns once a
    replica has it, else raises NotReplicated. grace (default 30): seconds a call rides through a Redis restart or
    failover, retrying with backoff, before it raises RedisUnavailable; 0: at once (docs/clients.md)."""

    def __init__(self, url: str | None = None, queue: str = defaults.QUEUE, *, redis: redis_lib.Redis | None = None,
                 limits: Limits | None = None, result_ttl: int = defaults.RESULT_TTL_S,
                 durability: Durability | str | None = None, grace: float = defaults.RIDE_GRACE_S) -> None:
        self.redis = redis if redis is not None else connect(url, decode_responses=True)
        self.keys = Keys(queue)
        self.limits = limits or Limits()
        self.result_ttl = result_ttl
        self.block_chunk_ms = block_chunk_ms(self.redis)
        self.durability = durability_for(self.redis, durability)
        self.grace = checked_grace(grace)
        self.where = redact(resolve_url(url)) if redis is None else address_of(self.redis)

    def _ride(self, timeout: float | None = None) -> Ride:
        """A fresh retry state for one call; `timeout`: the call's own, which an outage does not extend."""
        return Ride(self.grace, self.where, deadline_of(timeout))

    def _run(self, flow: flows.Flow, ride: Ride | None = None) -> Any:
        return flows.drive(self.redis, flow, ride or self._ride())

    def _request(self, request: JobRequest | dict | None, fields: dict[str, Any]) -> JobRequest:
        req = flows.make_request(request, fields)
        self.limits.check(req)
        return req

    def submit(self, request: JobRequest | dict | None = None, /, **fields: Any) -> Job:
        """Enqueue one job: `submit(prompt=..., max_tokens=64)`, `submit(messages=[...])` or
        `submit(JobRequest(...))`. Raises DuplicateJobError when a job with this id exists. Rides through a Redis
        outage of up to `grace` seconds: a retry that finds this call's own job stored is success."""
        req = self._request(request, fields)
        ride = self._ride()
        self._run(flows.submit(calls.submit(self.keys, req), self.durability, ride), ride)
        return Job(self, req.id)

    def submit_many(self, requests: Iterable[JobRequest | dict]) -> list[Job]:
        """Enqueue many jobs in one pipelined round trip. Duplicates are refused one by one: every other job
        is submitted, then DuplicateJobError lists the refused ids (and carries the submitted jobs)."""
        reqs = [self._request(r, {}) for r in requests]
        try:
            ride = self._ride()
            ids = self._run(flows.submit_many([calls.submit(self.keys, r) for r in reqs], self.durability, ride),
                            ride)
        except calls.DuplicateJobError as e:
            e.jobs = [Job(self, i) for i in e.jobs]
            raise
        return [Job(self, i) for i in ids]

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def status(self, job_id: str) -> str:
        return self._run(flows.status(self.keys, job_id))

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Wait for the job's result; blocks on its event stream (XREAD BLOCK), no polling.
        Raises TimeoutError after `timeout` seconds, JobNotFound for an unknown id; keeps waiting through a Redis
        outage within both `timeout` and the client's grace."""
        return self._run(flows.result(self.keys, job_id, timeout, self.block_chunk_ms), self._ride(timeout))

    def stream(self, job_id: str, timeout: float | None = None, after: str = "0-0", choice: int | None = None
               ) -> Iterator[StreamEvent]:
        """Yield the job's events from the start of its stream (or after event id `after`): token chunks,
        then one terminal event ("done", "error" or "cancelled") that carries the result. A job with several
        continuations (n > 1) interleaves theirs, each event's `index` saying which; `choice` keeps one."""
        return flows.drive_iter(self.redis, flows.stream(self.keys, job_id, timeout, after, self.block_chunk_ms,
                                                         choice), self._ride(timeout))

    def cancel(self, job_id: str) -> str:
        """Cancel a job. Returns "cancelled" (it was queued), "cancelling" (it runs; the worker stops it soon),
        or its terminal state unchanged."""
        return self._run(flows.run_call(calls.cancel(self.keys, job_id, self.result_ttl), self.durability))

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

    def stream(self, timeout: float | None = None, after: str = "0-0", choice: int | None = None
               ) -> Iterator[StreamEvent]:
        return self.client.stream(self.id, timeout, after, choice)

    def cancel(self) -> str:
        return self.client.cancel(self.id)

    def __repr__(self) -> str:
        return f"Job({self.id!r})"
