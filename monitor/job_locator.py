"""Which queue holds a job id: for the hint when `result`, `status` or `cancel` is pointed at the wrong queue."""

from __future__ import annotations

import re

import redis as redis_lib

from monitor.fleet import known_queues
from producer.connection import is_cluster
from producer.keys import PREFIX, Keys

_KEY_RE = re.compile(r"^" + re.escape(PREFIX) + r":\{(?P<queue>[^}]+)\}:(?:job|result):")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def find_queue_of(r: redis_lib.Redis, job_id: str, not_in: str, scan_limit: int = 100_000) -> str | None:
    """Another queue that knows `job_id`: first the queues workers have served (one EXISTS each), then a SCAN
    bounded by `scan_limit` keys for a queue no worker has served yet."""
    for queue in known_queues(r):
        if queue != not_in and r.exists(Keys(queue).job(job_id), Keys(queue).result(job_id)):
            return queue
    if is_cluster(r):  # a SCAN would visit every node; the registry above is what a cluster gets
        return None
    escaped = _GLOB_SPECIAL.sub(r"\\\1", job_id)
    cursor, looked = 0, 0
    while looked < scan_limit:
        cursor, found = r.scan(cursor, match=f"{PREFIX}:{{*}}:*:{escaped}", count=1000)
        looked += 1000
        for key in found:
            m = _KEY_RE.match(key if isinstance(key, str) else key.decode())
            if m and m["queue"] != not_in:
                return m["queue"]
        if cursor == 0:
            break
    return None
