"""Where `pagedq serve` queues a job: its lane, its fair-share group and its priority, and what its API key allows.

- Group: with API keys, every job the server submits (completions and Batch API lines) has the key's id as its
  fair-share group (producer.keys: a lane's groups share the workers by weight, `pagedq groups`); on an open
  server (no keys) jobs have no group.
- Lane of a completion request: OpenAI's `service_tier` picks it. "auto" and "default" (or none): the key's lane
  (`lane=` in the key file, interactive if not given; interactive on an open server); "flex": the batch lane;
  "priority": the interactive lane.
- Lane of a Batch API line: always the batch lane. A line whose `service_tier` is "priority" is a line error
  (its request asks for what a batch never gets; nothing is forced silently); "auto", "default" and "flex" run.
- Priority: a key may not ask for a `priority` below its `top_priority` (0 if not given, so a request's priority
  must be >= 0), nor for a lane more urgent than its own (a key with lane=default cannot send service_tier
  "priority"). Such a request gets a 400 invalid_request_error naming the field (`priority` or `service_tier`)
  and the key's allowance: it is refused, never clamped, so that a client learns at once that it does not get
  what it asked for. A request that sends no priority gets the most urgent its key allows, if that is above 0
  (the key's top_priority); a batch line that sends none gets `--batch-priority` (10), or the key's top_priority
  if that is higher. An open server allows any priority and lane (its batch lines stay in the batch lane).
"""

from __future__ import annotations

from producer.keys import LANES
from producer.protocol import JobRequest
from serve.api_keys import INTERACTIVE, ApiKey
from serve.errors import bad_request

BATCH = "batch"
# service_tier -> the lane it asks for; None: the key's own.
TIERS: dict[str, str | None] = {"auto": None, "default": None, "flex": BATCH, "priority": INTERACTIVE}
BATCH_TIERS = ("auto", "default", "flex")


def rank(lane: str) -> int:
    """0 for the most urgent lane."""
    return LANES.index(lane)


def interactive(req: JobRequest, service_tier: str | None, key: ApiKey | None) -> JobRequest:
    """A completion request's job on its lane and group, with its priority checked against the key's allowance
    (a 400 when it asks for more)."""
    own = key.lane if key is not None else INTERACTIVE
    lane = TIERS.get(service_tier or "auto") or own
    update: dict = {"lane": lane, "group": key.id if key is not None else None}
    if key is not None:
        if rank(lane) < rank(key.lane):
            raise bad_request(f"service_tier {service_tier!r} asks for the {lane} lane; this API key may use the "
                              f"{key.lane} lane at most (send service_tier \"auto\")", "service_tier",
                              "service_tier_not_allowed")
        update.update(_priority(req, key.top_priority, max(0, key.top_priority)))
    return req.model_copy(update=update)


def batch_line(req: JobRequest, service_tier: str | None, top_priority: int | None, group: str | None,
               batch_priority: int) -> JobRequest:
    """A Batch API line's job: on the batch lane, in the key's group (`group`, None without keys); its priority
    no more urgent than `top_priority` (None: any), `batch_priority` (or top_priority, if higher) when it sends
    none. A 400 (the line's error) for what it may not ask."""
    if (service_tier or "auto") not in BATCH_TIERS:
        raise bad_request(f"service_tier {service_tier!r} is not allowed in a batch: batch lines run in the batch "
                          f"lane (send {', '.join(BATCH_TIERS)})", "service_tier", "service_tier_not_allowed")
    update: dict = {"lane": BATCH, "group": group}
    floor = batch_priority if top_priority is None else max(batch_priority, top_priority)
    update.update(_priority(req, top_priority, floor))
    return req.model_copy(update=update)


def _priority(req: JobRequest, top: int | None, default: int) -> dict:
    """{"priority": ...} for a request that sent none; {} for one that sent an allowed one; a 400 otherwise."""
    if "priority" not in req.model_fields_set:
        return {"priority": default}
    if top is not None and req.priority < top:
        raise bad_request(f"priority {req.priority} is more urgent than this API key allows: its top_priority is "
                          f"{top} (lower runs first; send {top} or higher)", "priority", "priority_not_allowed")
    return {}
