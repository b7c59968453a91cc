"""One typed call per Lua script: its keys named, its arguments in order, its reply parsed into a named result.

Sans-IO: building a Call and reading its reply do no I/O. `producer.flows` runs calls (pipelined, loading
scripts that Redis lost) and the sync and asyncio clients and the worker drive those flows. Each script's
header in scripts/ documents the same KEYS, ARGV and replies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from redis.exceptions import ResponseError

from producer import wire
from producer.errors import DuplicateJobError, JobNotFound, LeaseLost, OwnerFull, StreamGap
from producer.keys import DEFAULT_LANE, GROUP, ApiKeyKeys, Keys
from producer.protocol import JobRequest, JobResult, Timings, Usage

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    script: str
    keys: list[str]
    args: list[Any]
    read: Callable[[Any], T]  # the script's reply -> its named result
    job_id: str = ""  # named in the errors an error reply becomes

    def outcome(self, reply: Any) -> T | Exception:
        """The named result, or the exception an error reply stands for (returned, not raised: one failed
        call of a pipeline leaves the others' results usable)."""
        if isinstance(reply, ResponseError):
            return script_error(reply, self.job_id)
        if isinstance(reply, Exception):
            return reply
        return self.read(reply)

    def result(self, reply: Any) -> T:
        out = self.outcome(reply)
        if isinstance(out, Exception):
            raise out
        return out


def script_error(err: ResponseError, job_id: str = "") -> Exception:
    """The typed error for a script's error reply (see the `Error replies` of each script's header)."""
    code = str(err).split(" ", 1)[0]
    if code == wire.ERR_DUPLICATE:
        return DuplicateJobError(f"job id already exists: {job_id}", [job_id])
    if code == wire.ERR_NOT_FOUND:
        return not_found(job_id)
    if code == wire.ERR_LEASE_LOST:
        return LeaseLost(f"job {job_id}: this worker no longer holds it ({err})")
    if code == wire.ERR_GAP:
        return StreamGap(f"job {job_id}: its event stream lacks tokens this worker wrote ({err})",
                         int(str(err).split(" ", 2)[1]))
    if code == wire.ERR_FULL:
        return OwnerFull(str(err).split(" ", 1)[1])
    return err


def not_found(job_id: str) -> JobNotFound:
    return JobNotFound(f"no job {job_id!r} (never submitted, or its keys expired)")


def _same(reply: Any) -> Any:
    return reply


def _done_now(reply: Any) -> bool:
    return int(reply) == 1


# ---- what a producer calls ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Owner:
    """The API key of `pagedq serve` that submits a job, by its key id. With `cap` set, the job also joins the
    key's jobs on its queue (Keys.owner_jobs) as "<job id> <charged>", and is refused (OwnerFull) when the key
    has `cap` of them already (0: no limit); without, it is only named (a batch's job)."""

    key_id: str
    cap: int | None = None
    charged: int = 0  # the tokens its admission took from the key's tokens-per-minute bucket


def owner_member(job_id: str, charged: int) -> str:
    """A job's member in Keys.owner_jobs."""
    return f"{job_id} {charged}"


def parse_owner_member(member: str) -> tuple[str, int]:
    """(job id, tokens charged) of a member of Keys.owner_jobs."""
    job_id, _, charged = member.rpartition(" ")
    return job_id, int(charged)


def lane_keys(keys: Keys, lane: str, group: str | None) -> list[str]:
    """The keys a script that queues a job needs (lib.lua's enqueue): its stream, its lane's groups and ready
    set, the bell."""
    return [keys.stream(lane, group), keys.lane_groups(lane), keys.ready(lane), keys.bell]


def submit(keys: Keys, req: JobRequest, owner: Owner | None = None) -> Call[str]:
    """Create the job and queue it on its lane (and group). Reply: its stream entry id. OwnerFull: the owner's cap
    is reached."""
    names = [keys.job(req.id), keys.result(req.id), *lane_keys(keys, req.lane, req.group)]
    args: list[Any] = [req.id, req.model_dump_json(exclude_defaults=True), repr(time.time()), req.group or ""]
    if owner is not None:
        args.append(owner.key_id)
        if owner.cap is not None:
            names.append(keys.owner_jobs(owner.key_id))
            args += [owner.cap, owner_member(req.id, owner.charged)]
    return Call("submit", names, args, _same, req.id)


def cancel(keys: Keys, job_id: str, ttl: int) -> Call[str]:
    """Reply: "cancelled" (it was queued), "cancelling" (it runs) or its final state, unchanged."""
    res = JobResult(id=job_id, status=wire.CANCELLED, finish_reason="cancelled",
                    timings=Timings(finished_at=time.time()))
    return Call("cancel", [keys.job(job_id), keys.events(job_id), keys.result(job_id), keys.jobs],
                [res.model_dump_json(), ttl], _same, job_id)


def retry(keys: Keys, dlq_entry: str, job_id: str, lane: str = DEFAULT_LANE, group: str | None = None) -> Call[str]:
    """Send a dead letter back to the queue, on its lane and group. Reply: the job's new stream entry id."""
    return Call("retry", [keys.dlq, keys.job(job_id), keys.events(job_id), keys.result(job_id),
                          *lane_keys(keys, lane, group)],
                [dlq_entry, job_id, repr(time.time()), group or ""], _same, job_id)


# ---- what a worker calls ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    """start.lua's reply. outcome "ok": the worker holds the job now; "skip": it must not run it (`state`
    says why; the entry is gone); "busy": another worker's lease on it is live; "dead": dead-lettered;
    "later": it is on its last delivery and must run alone: start it again once the worker runs nothing else."""

    outcome: Literal["ok", "skip", "busy", "dead", "later"]
    attempts: int = 0
    enqueued_at: float | None = None
    emitted: int = 0  # output tokens its event stream holds already: resume after them
    state: str = ""


def _started(reply: Sequence) -> Started:
    kind = reply[0]
    if kind == "ok":
        return Started("ok", int(reply[1]), float(reply[2]) if reply[2] else None, int(reply[3]))
    if kind == "dead":
        return Started("dead", attempts=int(reply[1]))
    if kind == "skip":
        return Started("skip", state=reply[1])
    return Started(kind)


@dataclass(frozen=True)
class Delivery:
    """What a worker needs to start a job it read from a stream, and the stream: its lane's or its group's."""

    job_id: str
    entry: str
    lease: str
    lane: str = DEFAULT_LANE
    group: str | None = None


@dataclass(frozen=True)
class WorkerSettings:
    """The settings of a worker that its scripts need."""

    worker_id: str
    lease_ms: int
    max_attempts: int
    ttl: int
    dlq_cap: int


def start(keys: Keys, d: Delivery, s: WorkerSettings, now: float, alone: bool = False) -> Call[Started]:
    """alone: the worker runs nothing else and takes nothing else while this job runs."""
    j = d.job_id
    return Call("start", [keys.job(j), keys.stream(d.lane, d.group), keys.events(j), keys.result(j), keys.dlq],
                [GROUP, d.entry, d.lease, s.worker_id, s.lease_ms, repr(now), s.max_attempts, s.ttl, s.dlq_cap,
                 int(alone)], _started, j)


# Per job of a publish or renew: its write went through; went through, and a client asked to cancel it;
# refused (the worker lost the job).
Ack = Literal["ok", "cancel", "lost"]
_ACKS: dict[int, Ack] = {0: "ok", 1: "cancel", -1: "lost"}


class Gap(NamedTuple):
    """A publish reply for a chunk past a gap: the stream holds only `emitted` output tokens (a failover lost the
    last ones); nothing was written. The worker sends its chunks again from there."""

    emitted: int


def _acks(reply: Sequence) -> list[Ack | Gap]:
    return [Gap(int(code[0])) if isinstance(code, list) else _ACKS[int(code)] for code in reply]


class Chunk(NamedTuple):
    """One job's new tokens of a step, as a token event. (A tuple: a worker makes one per job per step.)"""

    job_id: str
    lease: str
    offset: int  # output tokens the stream holds before this chunk
    count: int  # tokens in it
    event: str  # the token event as JSON


def publish(keys: Keys, chunks: Sequence[Chunk]) -> Call[list[Ack | Gap]]:
    """Reply: an Ack (or a Gap) per chunk, in order."""
    names: list[str] = []
    args: list[Any] = []
    for c in chunks:
        names += (keys.job(c.job_id), keys.events(c.job_id))
        args += (c.lease, c.offset, c.count, c.event)
    return Call("publish", names, args, _acks)


def renew(keys: Keys, s: WorkerSettings, held: Sequence[Delivery]) -> Call[list[Ack]]:
    """Reply: an Ack per held job, in order."""
    names: list[str] = []
    args: list[Any] = [GROUP, s.worker_id, s.lease_ms]
    for d in held:
        names += (keys.job(d.job_id), keys.stream(d.lane, d.group))
        args += (d.lease, d.entry)
    return Call("renew", names, args, _acks)


def complete(keys: Keys, d: Delivery, state: str, result_json: str, ttl: int, chunk: Chunk | None = None,
             tokens: int = 0) -> Call[bool]:
    """End a running job as completed, cancelled or expired, with its last token chunk. `tokens`, without a
    chunk: the output tokens its stream holds. Reply: True, or False when a retried call finds it done
    already. LeaseLost: another worker holds it. StreamGap: its stream lacks tokens (send them again)."""
    j = d.job_id
    return Call("complete", [keys.job(j), keys.events(j), keys.result(j), keys.stream(d.lane, d.group)],
                [d.lease, GROUP, d.entry, state, wire.TERMINAL_EVENT[state], result_json, ttl,
                 chunk.event if chunk else "", chunk.offset if chunk else tokens], _done_now, j)


def fail(keys: Keys, d: Delivery, result_json: str, ttl: int) -> Call[bool]:
    """End a running job as failed. Reply as complete's."""
    j = d.job_id
    return Call("fail", [keys.job(j), keys.events(j), keys.result(j), keys.stream(d.lane, d.group)],
                [d.lease, GROUP, d.entry, result_json, ttl], _done_now, j)


@dataclass(frozen=True)
class Released:
    """release.lua's reply: "queued" (back in the stream as `entry`) or "dead" (after `attempts`)."""

    outcome: Literal["queued", "dead"]
    entry: str = ""
    attempts: int = 0


def _released(reply: Sequence) -> Released:
    if reply[0] == "dead":
        return Released("dead", attempts=int(reply[1]))
    return Released("queued", entry=reply[1])


def release(keys: Keys, d: Delivery, s: WorkerSettings, mode: str, error_type: str, message: str
            ) -> Call[Released]:
    """Give a held job back to the queue: mode wire.HANDBACK (draining) or wire.RETRY (it failed; dead-lettered
    once it used up its attempts)."""
    j = d.job_id
    stream, *lane = lane_keys(keys, d.lane, d.group)
    return Call("release", [keys.job(j), stream, keys.events(j), keys.result(j), keys.dlq, *lane],
                [GROUP, d.entry, d.lease, mode, error_type, message, s.max_attempts, s.ttl, s.dlq_cap,
                 s.worker_id, d.group or ""], _released, j)


def remove_consumer(keys: Keys, worker_id: str, min_idle_ms: int, stream: str | None = None) -> Call[bool]:
    """Delete the consumer of a worker that is gone from a stream's group (default: `jobs`): only if it holds no
    pending entry there, was idle `min_idle_ms` and has no heartbeat record. Reply: True when it was deleted."""
    return Call("remove_consumer", [stream or keys.jobs, keys.worker(worker_id)], [GROUP, worker_id, min_idle_ms],
                _done_now)


def _entries(reply: Sequence | None) -> list[tuple[str, dict]]:
    """XREADGROUP's entries as Lua returns them (field lists) -> (entry id, fields) pairs."""
    return [(entry, dict(zip(f[::2], f[1::2], strict=True))) for entry, f in reply or ()]


def take(keys: Keys, worker_id: str, lane: str, group: str | None, count: int) -> Call[list[tuple[str, dict]]]:
    """Read up to `count` jobs no worker has read yet from a lane's or a group's stream. Reply: (entry id, fields)
    pairs; a group's stream found drained leaves the lane's ready set."""
    return Call("take", [keys.stream(lane, group), keys.ready(lane)], [GROUP, worker_id, count, group or ""],
                _entries)


def prune(keys: Keys, lane: str, group: str) -> Call[bool]:
    """Drop a group's stream from its lane when it holds no job. Reply: True when it was dropped."""
    return Call("prune", [keys.stream(lane, group), keys.lane_groups(lane), keys.ready(lane)], [group], _done_now)


# ---- the Batch API's store ----------------------------------------------------------------------------------

def set_if(key: str, field: str, allowed: Sequence[str], values: dict[str, Any]) -> Call[bool]:
    """Set `values` in hash `key` only while its `field` holds one of `allowed`. Reply: True when they were set."""
    args: list[Any] = [field, len(allowed), *allowed]
    for name, value in values.items():
        args += (name, value)
    return Call("set_if", [key], args, _done_now)


def lease(key: str, token: str, ms: int) -> Call[bool]:
    """Take or renew the lease `key` for `token`, for `ms` milliseconds (0: give it up). Reply: True when the
    token holds it now (or gave it up), False when another token holds it."""
    return Call("lease", [key], [token, ms], _done_now)


# ---- the API keys of `pagedq serve` -------------------------------------------------------------------------

@dataclass(frozen=True)
class Admission:
    """limit.lua's reply to "admit": `ok`, else refused by `limit` ("requests" or "tokens") for `wait_ms`
    (`never`: the charge is more than the key's tokens per minute, so no wait helps)."""

    ok: bool
    wait_ms: int = 0
    limit: str = ""
    never: bool = False


def _admission(reply: Sequence) -> Admission:
    code, wait = int(reply[0]), int(reply[1])
    return Admission(code == 1, wait, reply[2] if len(reply) > 2 else "", code == -1)


def admit(keys: ApiKeyKeys, rpm: int, tpm: int, tokens: int) -> Call[Admission]:
    """Take one request and `tokens` from the key's buckets (0 per minute: no limit), if they hold them."""
    return Call("limit", [keys.limits, keys.usage], ["admit", rpm, tpm, tokens], _admission)


def settle(keys: ApiKeyKeys, rpm: int, tpm: int, give_back: int, jobs: int, usage: Usage) -> Call[bool]:
    """Count what `jobs` ended jobs of the key used (`usage`, their sum), and give `give_back` tokens (what they
    were charged minus what they used; negative: take) back to its bucket. The same limits as admit's."""
    return Call("limit", [keys.limits, keys.usage],
                ["settle", rpm, tpm, give_back, jobs, usage.prompt_tokens, usage.completion_tokens,
                 usage.cached_tokens], lambda reply: int(reply[0]) == 1)


@dataclass(frozen=True)
class Reservation:
    """reserve.lua's reply: `ok` (the item holds room now), and `total`, the sizes of the budget's items summed
    (with this one when ok, without it when refused)."""

    ok: bool
    total: int


def budget_member(item_id: str, size: int) -> str:
    """An item's member in a budget (ApiKeyKeys.files, ApiKeyKeys.batches)."""
    return f"{item_id} {size}"


def budget_item(member: str) -> str:
    """The item id of a budget's member."""
    return member.rpartition(" ")[0]


def reserve(budget: str, item_id: str, size: int, cap: int, expires_at: int, now: float) -> Call[Reservation]:
    """Take room for `size` of item `item_id` in `budget` until `expires_at` (unix s), unless the items there
    would pass `cap` (0: no cap)."""
    return Call("reserve", [budget], [repr(now), cap, budget_member(item_id, size), size, expires_at],
                lambda reply: Reservation(int(reply[0]) == 1, int(reply[1])))
