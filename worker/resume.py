"""Reading back what earlier deliveries of a job streamed, so that this one continues it seamlessly."""

from __future__ import annotations

import json

import redis as redis_lib

from producer.keys import Keys
from producer.wire import EVENT_FIELD


def read_output(r: redis_lib.Redis, keys: Keys, job_id: str) -> tuple[list[int], str]:
    """The output token ids and text the job's event stream holds (its token events, in order)."""
    ids: list[int] = []
    parts: list[str] = []
    last = "-"
    while True:
        entries = r.xrange(keys.events(job_id), min=last, count=1000)
        if last != "-":
            entries = entries[1:]  # XRANGE's min is inclusive
        if not entries:
            return ids, "".join(parts)
        for eid, fields in entries:
            ev = json.loads(fields[EVENT_FIELD])
            if ev.get("type") == "token":
                ids.extend(ev.get("token_ids", []))
                parts.append(ev.get("text", ""))
            last = eid
