"""The client side of the protocol as sans-IO flows: generators that yield Redis operations and receive their
replies, shared by the sync client, the asyncio client and the worker. `drive` (sync) and `adrive` (asyncio)
run a flow against a client; nothing else in the clients differs.

A flow yields a Cmd (one Redis command), a Pipe (commands in one round trip, errors as values), an Emit (a
stream event for the caller) or an Offload (work for the CPU, which `adrive` runs in a thread: an event loop
that drives a flow must not stall on it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

from producer import scripts, wire
from producer.calls import Call, not_found
from producer.durability import Durability
from producer.errors import DuplicateJobError
from producer.keys import Keys
from producer.protocol import JobRequest, JobResult, StreamEvent

# Longest single XREAD BLOCK: a client that waits longer loops. It must stay well under the socket timeout
# (redis-py 8 defaults to 5 s), or the read times out before Redis answers.
BLOCK_CHUNK_MS = 2000
READ_COUNT = 1000


@dataclass(frozen=True)
class Cmd:
    name: str  # a redis-py client method
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Pipe:
    cmds: list[Cmd]


@dataclass(frozen=True)
class Emit:
    event: StreamEvent


@dataclass(frozen=True)
class Offload:
    """fn(*args), whose value is the reply: run in a thread by the asyncio drivers, in place by the sync ones."""

    fn: Callable[..., Any]
    args: tuple = ()


Flow = Generator[Any, Any, Any]


# ---- running script calls ----------------------------------------------------------------------------------

def _evalsha(call: Call) -> Cmd:
    # Through execute_command: a sync cluster pipeline refuses its evalsha() method but routes this by key.
    return Cmd("execute_command", ("EVALSHA", scripts.sha(call.script), len(call.keys), *call.keys, *call.args))


def run_calls(calls: Sequence[Call], durability: Durability | None = None) -> Flow:
    """Run `calls` in one round trip. Returns each call's outcome: its named result or its error. With durability
    "replicated" the round trip ends with WAIT, and NotReplicated (which carries the outcomes) is raised when
    fewer replicas than asked confirmed the writes."""
    wait = [Cmd("execute_command", durability.wait_args())] if durability and durability.replicated else []
    replies = list((yield Pipe([*(_evalsha(c) for c in calls), *wait])))
    acked = replies.pop() if wait else None
    missing = [i for i, x in enumerate(replies) if isinstance(x, NoScriptError)]
    if missing:
        # Redis restarted or its scripts were flushed: NOSCRIPT means nothing of that call ran, so it is safe
        # to load the scripts and run those calls again.
        for name in sorted({calls[i].script for i in missing}):
            yield Cmd("script_load", (scripts.source(name),))
        # The second WAIT covers the first round trip's writes too: a replica confirms an offset, not a write.
        again = list((yield Pipe([*(_evalsha(calls[i]) for i in missing), *wait])))
        acked = again.pop() if wait else None
        for i, x in zip(missing, again, strict=True):
            replies[i] = x
    outs = [c.outcome(x) for c, x in zip(calls, replies, strict=True)]
    done = [c.job_id for c, o in zip(calls, outs, strict=True) if not isinstance(o, Exception)]
    if wait and done:  # an error reply wrote nothing: nothing to confirm
        durability.check(acked, outs, [i for i in done if i])
    return outs


def run_call(call: Call, durability: Durability | None = None) -> Flow:
    """Run one call; its error reply is raised as a typed error."""
    (out,) = yield from run_calls([call], durability)
    if isinstance(out, Exception):
        raise out
    return out


def is_own(call: Call, retried: bool) -> Flow:
    """Whether the job a submit call names is the one this very call stored (its reply was lost to an outage):
    the stored enqueued_at is the call's own, or, after a retry this flow's ride made, the queued payload is the
    same. Without one the call may still have been sent twice: redis-py re-sends a command on a dropped
    connection by itself (its default Retry), unseen here; only the call's own enqueued_at tells that apart from
    another submit of the id."""
    job, payload, enqueued_at = call.keys[0], call.args[1], call.args[2]
    at, entry_id, stream = yield Cmd("hmget", (job, ["enqueued_at", "entry", "stream"]))
    if at is not None and at == enqueued_at:
        return True
    if not (retried and entry_id and stream):  # no retry of ours, or off its stream already: only enqueued_at tells
        return False
    entry = yield Cmd("xrange", (stream, entry_id, entry_id))
    return bool(entry) and entry[0][1].get("job") == payload


def submit(call: Call[str], durability: Durability | None = None, ride: Any = None) -> Flow:
    """Submit one job. A DUPLICATE that is this call's own job (sent again through an outage) is success: the job
    id is the idempotency key."""
    try:
        return (yield from run_call(call, durability))
    except DuplicateJobError:
        if not (yield from is_own(call, _retried(ride))):
            raise
        return call.job_id


def _retried(ride: Any) -> bool:
    return ride is not None and ride.retried


def submit_many(calls: Sequence[Call[str]], durability: Durability | None = None, ride: Any = None) -> Flow:
    """Submit jobs in one round trip; a duplicate id anywhere raises once, naming all of them (not those that are
    this round trip's own jobs, sent again through an outage)."""
    outs = yield from run_calls(calls, durability)
    for i, (c, o) in enumerate(zip(calls, outs, strict=True)):
        if isinstance(o, DuplicateJobError) and (yield from is_own(c, _retried(ride))):
            outs[i] = c.job_id
    dups = [c.job_id for c, o in zip(calls, outs, strict=True) if isinstance(o, DuplicateJobError)]
    for o in outs:
        if isinstance(o, Exception) and not isinstance(o, DuplicateJobError):
            raise o
    if dups:
        raise DuplicateJobError(f"job id already exists: {', '.join(dups)}", dups,
                                [c.job_id for c, o in zip(calls, outs, strict=True) if not isinstance(o, Exception)])
    return [c.job_id for c in calls]


# ---- reading a job ------------------------------------------------------------------------------------------

def make_request(request: JobRequest | dict | None, fields: dict[str, Any]) -> JobRequest:
    if request is None:
        return JobRequest(**fields)
    if fields:
        raise TypeError("pass a JobRequest or keyword fields, not both")
    return request if isinstance(request, JobRequest) else JobRequest.model_validate(request)


def parse_event(entry_id: str, fields: dict) -> StreamEvent:
    ev = StreamEvent.model_validate_json(fields[wire.EVENT_FIELD])
    ev.event_id = entry_id
    if (offset := fields.get(wire.OFFSET_FIELD)) is not None:
        ev.offset = int(offset)
    return ev


class Repeats:
    """A live reader's memory of the tokens it has had, by offset. A failover to a replica that lacked a job's last
    chunks makes the worker write them again, under new entry ids after those the reader saw on the old primary:
    without this, the reader would yield those tokens twice. (Entries without an offset pass: older workers.)"""

    def __init__(self) -> None:
        self.next = 0  # the offset of the first token not yet had

    def fresh(self, ev: StreamEvent) -> bool:
        if ev.offset is None or ev.type != wire.EV_TOKEN:
            return True
        if ev.offset < self.next:
            return False
        self.next = ev.offset + len(ev.token_ids)
        return True


def parse_events(reply: Iterable | None) -> list[StreamEvent]:
    # XREAD reply: [[stream, [(entry_id, fields), ...]]]
    return [parse_event(eid, f) for _, entries in reply or [] for eid, f in entries]


def result_event(raw: str) -> StreamEvent:
    """A terminal event rebuilt from a stored result, for a subscriber that comes after the events expired."""
    res = JobResult.model_validate_json(raw)
    return StreamEvent(type=wire.TERMINAL_EVENT.get(res.status, wire.EV_ERROR), result=res)


class Deadline:
    def __init__(self, timeout: float | None, chunk_ms: int = BLOCK_CHUNK_MS) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout
        self.chunk_ms = chunk_ms

    def block_ms(self) -> int:
        """How long the next XREAD may block: at least 1 ms (0 would mean forever)."""
        if self.end is None:
            return self.chunk_ms
        return max(1, min(self.chunk_ms, int((self.end - time.monotonic()) * 1000)))

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def later(entry_id: str, than: str) -> bool:
    """Whether stream entry id `entry_id` comes after `than` ("<ms>-<seq>", or "<ms>")."""
    def key(x: str) -> tuple[int, int]:
        ms, _, seq = x.partition("-")
        return int(ms), int(seq or 0)

    try:
        return key(entry_id) > key(than)
    except ValueError:  # not an entry id: XREAD says so, in its own words
        return True


def status(keys: Keys, job_id: str) -> Flow:
    state = yield Cmd("hget", (keys.job(job_id), wire.F_STATE))
    if state:
        return state
    raw = yield Cmd("get", (keys.result(job_id),))
    if raw:
        return JobResult.model_validate_json(raw).status
    raise not_found(job_id)


def _follow(keys: Keys, job_id: str, after: str, deadline: Deadline, waiting: str) -> Flow:
    """Emit the job's events after `after` until the terminal one; TimeoutError at the deadline."""
    last, repeats = after, Repeats()
    while True:
        reply = yield Cmd("xread", ({keys.events(job_id): last},),
                          {"count": READ_COUNT, "block": deadline.block_ms()})
        for ev in parse_events(reply):
            last = ev.event_id
            if repeats.fresh(ev):
                yield Emit(ev)
                if ev.terminal:
                    return
        if deadline.expired():
            raise TimeoutError(f"job {job_id} {waiting}")


def result(keys: Keys, job_id: str, timeout: float | None, chunk_ms: int) -> Flow:
    """The job's result: its result key, else the end of its event stream (blocking XREAD, no polling)."""
    raw = yield Cmd("get", (keys.result(job_id),))
    if raw:
        return JobResult.model_validate_json(raw)
    last = "0-0"
    tail = yield Cmd("xrevrange", (keys.events(job_id),), {"count": 1})
    if tail:
        ev = parse_event(*tail[0])
        if ev.terminal:
            return ev.result
        last = ev.event_id
    elif not (yield Cmd("exists", (keys.job(job_id),))):
        raise not_found(job_id)
    follow = _follow(keys, job_id, last, Deadline(timeout, chunk_ms), f"has no result after {timeout} s")
    reply = None
    while True:
        op = follow.send(reply)
        if isinstance(op, Emit):
            reply = None
            if op.event.terminal:
                return op.event.result
        else:
            reply = yield op


def stream(keys: Keys, job_id: str, timeout: float | None, after: str, chunk_ms: int, choice: int | None = None
           ) -> Flow:
    """Emit the job's events from the start of its stream (or after event id `after`): token chunks, then one
    terminal event that carries the result. choice: only that continuation's token chunks (a job with several)."""
    flow = _stream(keys, job_id, timeout, after, chunk_ms)
    return flow if choice is None else _choice_only(flow, choice)


def _choice_only(flow: Flow, choice: int) -> Flow:
    """flow without the token events of other continuations than `choice`."""
    reply = None
    while True:
        try:
            op = flow.send(reply)
        except StopIteration as stop:
            return stop.value
        other = isinstance(op, Emit) and op.event.type == "token" and op.event.index != choice
        reply = None if other else (yield op)


def stream_start(keys: Keys, job_id: str, after: str = "0-0") -> Flow:
    """Where a reader of the job's events starts: the entry id after which to follow its event stream, a terminal
    event rebuilt from its stored result (its events expired first, or it never streamed), or None: nothing
    comes after `after` (a reader that reconnects after the end). JobNotFound for no such job."""
    if not (yield Cmd("exists", (keys.events(job_id),))):
        raw = yield Cmd("get", (keys.result(job_id),))
        if raw:
            return result_event(raw)
        if not (yield Cmd("exists", (keys.job(job_id),))):
            raise not_found(job_id)
    elif after != "0-0":
        tail = yield Cmd("xrevrange", (keys.events(job_id),), {"count": 1})
        if tail and parse_event(*tail[0]).terminal and not later(tail[0][0], after):
            return None
    return after


def _stream(keys: Keys, job_id: str, timeout: float | None, after: str, chunk_ms: int) -> Flow:
    start = yield from stream_start(keys, job_id, after)
    if isinstance(start, StreamEvent):
        yield Emit(start)
    elif start is not None:
        yield from _follow(keys, job_id, start, Deadline(timeout, chunk_ms), f"did not finish within {timeout} s")


# ---- drivers ------------------------------------------------------------------------------------------------

def execute(r, op: Cmd | Pipe | Offload) -> Any:
    if isinstance(op, Offload):
        return op.fn(*op.args)
    if isinstance(op, Pipe):
        pipe = r.pipeline(transaction=False)
        for c in op.cmds:
            getattr(pipe, c.name)(*c.args, **c.kwargs)
        return pipe.execute(raise_on_error=False)
    return getattr(r, op.name)(*op.args, **op.kwargs)


def drive_iter(r, flow: Flow, ride: Any = None) -> Iterator[StreamEvent]:
    """Run a flow on a sync client, yielding what it emits; returns the flow's value. ride (producer.ride.Ride):
    each operation is sent again through a Redis outage."""
    reply = None
    while True:
        try:
            op = flow.send(reply)
        except StopIteration as stop:
            return stop.value
        if isinstance(op, Emit):
            reply = None
            yield op.event
        else:
            reply = execute(r, op) if ride is None else ride.call(execute, r, op)


def drive(r, flow: Flow, ride: Any = None) -> Any:
    """Run a flow that emits nothing on a sync client; returns its value."""
    it = drive_iter(r, flow, ride)
    try:
        while True:
            next(it)
    except StopIteration as stop:
        return stop.value


async def aexecute(r, op: Cmd | Pipe | Offload) -> Any:
    if isinstance(op, Offload):
        return await asyncio.to_thread(op.fn, *op.args)
    if isinstance(op, Pipe):
        pipe = r.pipeline(transaction=False)
        for c in op.cmds:
            getattr(pipe, c.name)(*c.args, **c.kwargs)
        return await pipe.execute(raise_on_error=False)
    return await getattr(r, op.name)(*op.args, **op.kwargs)


async def adrive_iter(r, flow: Flow, ride: Any = None) -> AsyncIterator[StreamEvent]:
    """Run a flow on an asyncio client, yielding what it emits."""
    reply = None
    while True:
        try:
            op = flow.send(reply)
        except StopIteration:
            return
        if isinstance(op, Emit):
            reply = None
            yield op.event
        else:
            reply = await (aexecute(r, op) if ride is None else ride.acall(aexecute, r, op))


async def adrive(r, flow: Flow, ride: Any = None) -> Any:
    """Run a flow that emits nothing on an asyncio client; returns its value."""
    reply = None
    while True:
        try:
            op = flow.send(reply)
        except StopIteration as stop:
            return stop.value
        reply = await (aexecute(r, op) if ride is None else ride.acall(aexecute, r, op))
