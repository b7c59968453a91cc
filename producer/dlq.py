"""The dead-letter stream of a queue: jobs given up on, with the reason. List, send back, purge."""

from __future__ import annotations

import json

from producer import calls, flows
from producer.errors import JobNotFound
from producer.keys import DEFAULT_LANE, Keys, check_group, check_lane


def list_dead(r, keys: Keys, count: int = 100) -> list[dict]:
    """The newest `count` dead letters, newest first: {entry, id, error, reason, attempts, worker, at, job}."""
    return [{"entry": eid, **fields} for eid, fields in r.xrevrange(keys.dlq, count=count)]


def retry_dead(r, keys: Keys, job_id: str) -> str:
    """Send job `job_id` back to the queue from its newest dead letter; returns its new stream entry id."""
    # The stream is capped, so this scan is bounded.
    for eid, fields in r.xrevrange(keys.dlq):
        if fields.get("id") == job_id:
            lane, group = _lane_of(fields.get("job", ""))
            return flows.drive(r, flows.run_call(calls.retry(keys, eid, job_id, lane, group)))
    raise JobNotFound(f"no dead letter for job {job_id!r}")


def _lane_of(payload: str) -> tuple[str, str | None]:
    """The lane and group a dead job was queued on, from its JobRequest JSON: it goes back there. A payload that
    does not say (or does not parse: it fails again, with its reason) goes to the default lane."""
    try:
        job = json.loads(payload)
        lane, group = job.get("lane", DEFAULT_LANE), job.get("group")
        return check_lane(lane), None if group is None else check_group(group)
    except (ValueError, AttributeError):
        return DEFAULT_LANE, None


def purge_dead(r, keys: Keys) -> int:
    """Delete every dead letter; returns how many there were."""
    n = r.xlen(keys.dlq)
    r.delete(keys.dlq)
    return n
