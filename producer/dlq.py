"""The dead-letter stream of a queue: jobs given up on, with the reason. List, send back, purge."""

from __future__ import annotations

from producer import calls, flows
from producer.errors import JobNotFound
from producer.keys import Keys


def list_dead(r, keys: Keys, count: int = 100) -> list[dict]:
    """The newest `count` dead letters, newest first: {entry, id, error, reason, attempts, worker, at, job}."""
    return [{"entry": eid, **fields} for eid, fields in r.xrevrange(keys.dlq, count=count)]


def retry_dead(r, keys: Keys, job_id: str) -> str:
    """Send job `job_id` back to the queue from its newest dead letter; returns its new stream entry id."""
    # The stream is capped, so this scan is bounded.
    for eid, fields in r.xrevrange(keys.dlq):
        if fields.get("id") == job_id:
            return flows.drive(r, flows.run_call(calls.retry(keys, eid, job_id)))
    raise JobNotFound(f"no dead letter for job {job_id!r}")


def purge_dead(r, keys: Keys) -> int:
    """Delete every dead letter; returns how many there were."""
    n = r.xlen(keys.dlq)
    r.delete(keys.dlq)
    return n
