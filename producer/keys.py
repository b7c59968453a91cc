"""Every Redis key name of a queue, defined here and nowhere else.

All keys of one queue carry the hash tag `{<queue>}`, so a script that touches several of them stays on one
Redis Cluster slot: a cluster scales by queue.
"""

from __future__ import annotations

import re

PREFIX = "pq"
# The one consumer group of every queue's job stream: workers of a queue share its entries.
GROUP = "workers"

_QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def check_queue(queue: str) -> str:
    # Braces would break the hash tag; whitespace and odd characters only make keys hard to type.
    if not isinstance(queue, str) or not _QUEUE_RE.match(queue):
        raise ValueError(f"queue name must be 1-128 characters of [A-Za-z0-9_.:-], got {queue!r}")
    return queue


class Keys:
    """The key names of one queue."""

    def __init__(self, queue: str) -> None:
        self.queue = check_queue(queue)
        self.base = f"{PREFIX}:{{{queue}}}"
        self.jobs = f"{self.base}:jobs"  # stream: one entry per queued job, read by the worker group
        self.dlq = f"{self.base}:dlq"  # stream: jobs given up on (dead letters)
        self.group = GROUP

    def job(self, job_id: str) -> str:
        """Hash: the job's state, lease token, attempts, timestamps."""
        return f"{self.base}:job:{job_id}"

    def events(self, job_id: str) -> str:
        """Stream: the job's token chunks, then one terminal event."""
        return f"{self.base}:events:{job_id}"

    def result(self, job_id: str) -> str:
        """String: the job's final JobResult as JSON, with a TTL."""
        return f"{self.base}:result:{job_id}"
