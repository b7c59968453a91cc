"""Reading back what earlier deliveries of a job streamed, so that this one continues it seamlessly."""

from __future__ import annotations

import redis as redis_lib

from producer.keys import Keys
from producer.wire import EVENT_FIELD, read_token_event


def read_output(r: redis_lib.Redis, keys: Keys, job_id: str) -> list[list]:
    """What the job's event stream holds of each continuation (its token events, in order) -> [index, token ids,
    text, finish reason if the continuation ended] per continuation, by index (RunningJob.resumed)."""
    ids: dict[int, list[int]] = {}
    parts: dict[int, list[str]] = {}
    ended: dict[int, str] = {}
    last = "-"
    while True:
        entries = r.xrange(keys.events(job_id), min=last, count=1000)
        if last != "-":
            entries = entries[1:]  # XRANGE's min is inclusive
        if not entries:
            return [[i, ids[i], "".join(parts[i]), ended.get(i)] for i in sorted(ids)]
        for eid, fields in entries:
            ev = read_token_event(fields[EVENT_FIELD])
            if ev is not None:
                ids.setdefault(ev.index, []).extend(ev.token_ids)
                parts.setdefault(ev.index, []).append(ev.text)
                if ev.finish_reason:
                    ended[ev.index] = ev.finish_reason
            last = eid
