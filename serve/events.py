"""Following the event streams of every job a serve process waits on, without a Redis connection per request.

A request does not hold a connection while its job runs: it subscribes to its job's event stream with the reader
of its queue, and that reader runs one blocking XREAD over the event streams of all jobs currently awaited (each
from the last entry id read), handing every entry to the subscriptions of its stream. The set of streams changes
between rounds; a subscription that comes while the reader blocks wakes it (CLIENT UNBLOCK, sent on a second
connection of the reader's own), so that the next round includes the new stream at once rather than after the
block ends.

On a plain Redis one reader serves every queue. On a Redis Cluster a command's keys must share one slot (CROSSSLOT
otherwise) and all keys of a queue sit in the queue's slot: one reader per slot, on a connection to the node that
serves it (found again after any error, so a moved slot is followed).

A streamed request's subscription is bounded (Bound): a client that does not read leaves its job's events piling
up in it, and past the bound it is dropped, its memory freed at once; its stream ends as if the client had left
(serve.disconnect), and the job goes on as it would then.

When Redis goes away, a reader reconnects with backoff and resumes from its last ids (the events are durable); after
`grace_s` without Redis it fails every subscription it serves with the connection's error (serve answers 503, naming
Redis), and serves new ones as soon as Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import redis as redis_lib
from redis.asyncio.connection import AbstractConnection

from producer import flows, wire
from producer.connection import is_cluster
from producer.keys import Keys
from producer.protocol import JobResult, StreamEvent
from serve.metrics import ServeMetrics

log = logging.getLogger("pagedq.serve")

READER_NAME = "pagedq-serve-reader"  # CLIENT SETNAME of the readers' connections (CLIENT LIST shows them)
BLOCK_MS = 5000  # longest XREAD block; a subscription that comes meanwhile wakes the reader instead
READ_COUNT = flows.READ_COUNT  # entries per stream per round
RECONNECT_S = (0.05, 1.0)  # first and longest pause between a reader's attempts to reach Redis again
UNBLOCK_RETRY_S = 0.002  # an UNBLOCK that found the XREAD not yet blocking is sent again after this pause


class Bound(NamedTuple):
    """The most of its job's events a subscription holds for its request: past either, it is dropped."""

    events: int
    bytes: int  # of the events' JSON as read


class Dropped(Exception):
    """The subscription's request let its job's events pile up past their bound."""


class Subscription:
    """One request's view of one job's events: the reader fills its queue, the request reads it."""

    def __init__(self, reader: Reader, key: str, after: str | None, bound: Bound | None = None) -> None:
        self.reader = reader
        self.key = key
        self.after = after  # deliver only entries after this id (None: every entry read for the stream)
        self.bound = bound
        self.queue: asyncio.Queue[tuple[StreamEvent, int] | BaseException] = asyncio.Queue()
        self.held = 0  # bytes of the events in the queue
        self.backlog: list[StreamEvent] = []  # events read before the reader's, when the stream was followed
        self.error: BaseException | None = None  # met by ready(), raised by the next next()
        self.closed = False
        self.dropped = asyncio.Event()  # set when its request fell behind its bound (serve.disconnect ends it)
        self.took = True  # its request took events since the reader's last round (or had no chance to yet)
        self.repeats = flows.Repeats()  # in the order the request takes them: the backlog, then the reader's

    def _take(self, item: tuple[StreamEvent, int] | BaseException) -> StreamEvent:
        self.took = True
        if isinstance(item, BaseException):
            raise item
        ev, size = item
        self.held -= size
        return ev

    async def next(self) -> StreamEvent:
        """The job's next event (the last is terminal); raises the Redis error that ended the reader's wait, or
        Dropped."""
        while True:
            ev = await self._next()
            if self.repeats.fresh(ev):
                return ev

    async def _next(self) -> StreamEvent:
        if self.backlog:
            return self.backlog.pop(0)
        if self.error is not None:
            raise self.error
        if self.closed:
            raise RuntimeError(f"{self.key}: no more events")
        return self._take(await self.queue.get())

    def ready(self) -> list[StreamEvent]:
        """The events that came already, without waiting: a stream writes them in one go (one write, not one
        per token, when a busy server falls behind its readers)."""
        out, self.backlog = self.backlog, []
        while self.error is None and not self.queue.empty():
            try:
                out.append(self._take(self.queue.get_nowait()))
            except BaseException as e:
                self.error = e
        return [ev for ev in out if self.repeats.fresh(ev)]

    def put(self, events: list[tuple[StreamEvent, int]]) -> None:
        """The reader hands on a round's events of the stream (each with its bytes as read). Past its bound, a
        subscription whose request did not read since the previous round is dropped: a request that reads keeps
        up whatever one round brings (up to READ_COUNT events), so it holds at most its bound and one round."""
        for ev, size in events:
            if self.after is None or flows.later(ev.event_id, self.after):
                self.queue.put_nowait((ev, size))
                self.held += size
        bound = self.bound
        if bound is not None and not self.took and (self.queue.qsize() > bound.events or self.held > bound.bytes):
            self._drop()
        self.took = False

    def _drop(self) -> None:
        log.warning("dropped a stream of %s: its client did not read (%d events, %d bytes waited for it)",
                    self.key, self.queue.qsize(), self.held)
        self.error = Dropped(f"{self.key}: the client fell {self.queue.qsize()} events behind")
        while not self.queue.empty():  # what it held is freed now, not when its request ends
            self.queue.get_nowait()
        self.queue.put_nowait(self.error)  # wakes a request waiting on next()
        self.held = 0
        self.close()
        self.dropped.set()
        self.reader.metrics.stream_drops.inc()

    async def result(self) -> JobResult:
        """The job's result: its events read up to the terminal one."""
        while True:
            ev = await self.next()
            if ev.terminal:
                return ev.result

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.remove(self)


class _Followed:
    """A stream the reader reads: the last entry id it read, and who waits on it."""

    __slots__ = ("last", "subs")

    def __init__(self, last: str) -> None:
        self.last = last
        self.subs: set[Subscription] = set()


# connect(relearn) -> a new connection; relearn: after an error, when the slot may have moved.
Connect = Callable[[bool], Awaitable[AbstractConnection]]


class Reader:
    """One blocking XREAD at a time over all followed streams, on one connection; a second one wakes it."""

    def __init__(self, name: str, connect: Connect, metrics: ServeMetrics, grace_s: float,
                 block_ms: int = BLOCK_MS) -> None:
        self.name = name
        self._connect = connect
        self.metrics = metrics
        self.grace_s = grace_s
        self.block_ms = block_ms
        self.streams: dict[str, _Followed] = {}
        self.subscribers = 0
        self._conn: AbstractConnection | None = None
        self._waker: AbstractConnection | None = None
        self._client_id: int | None = None
        self._relearn = False  # the next open follows an error
        self._wanted = asyncio.Event()  # set whenever a stream was added
        self._reading = False  # an XREAD is out
        self._round = 0
        self._waking = False
        self._task: asyncio.Task | None = None

    def start(self) -> Reader:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"pagedq serve reader {self.name}")
        return self

    # ---- subscriptions -----------------------------------------------------------------------------------------

    def add(self, key: str, after: str, bound: Bound | None = None) -> tuple[Subscription, str | None]:
        """Subscribe to stream `key` after entry `after` ("0-0": from its start). Returns the subscription and,
        when the stream is already read past `after` for someone else, the id up to which the caller must read
        the stream itself (the reader delivers what comes after it); else None."""
        followed = self.streams.get(key)
        catch_up = None
        if followed is None:
            followed = self.streams[key] = _Followed(after)
            sub = Subscription(self, key, None, bound)
            self._changed()
        else:
            sub = Subscription(self, key, after, bound)
            if flows.later(followed.last, after):
                catch_up = followed.last
                sub.after = followed.last  # what the reader hands on from now on comes after that
        followed.subs.add(sub)
        self.subscribers += 1
        self.metrics.reader_waiters.labels(self.name).set(self.subscribers)
        return sub, catch_up

    def remove(self, sub: Subscription) -> None:
        followed = self.streams.get(sub.key)
        if followed is None or sub not in followed.subs:
            return
        followed.subs.discard(sub)
        self.subscribers -= 1
        self.metrics.reader_waiters.labels(self.name).set(self.subscribers)
        if not followed.subs:  # an XREAD already out may still return it: _deliver skips streams not followed
            del self.streams[sub.key]

    def _fail_all(self, error: BaseException) -> None:
        for followed in self.streams.values():
            for sub in followed.subs:
                sub.queue.put_nowait(error)
        self.streams.clear()
        self.subscribers = 0
        self.metrics.reader_waiters.labels(self.name).set(0)

    # ---- waking a blocked XREAD --------------------------------------------------------------------------------

    def _changed(self) -> None:
        self._wanted.set()
        if self._reading and not self._waking:
            self._waking = True
            asyncio.get_running_loop().create_task(self._wake(self._round))

    async def _wake(self, round_: int) -> None:
        try:
            # UNBLOCK answers 0 when the XREAD is not (yet, or any more) blocking in Redis: try again until the
            # round ends; the next round includes every stream added meanwhile.
            while self._reading and self._round == round_ and self._waker is not None:
                await self._waker.send_command("CLIENT", "UNBLOCK", self._client_id)
                if await self._waker.read_response():
                    return
                await asyncio.sleep(UNBLOCK_RETRY_S)
        except (redis_lib.RedisError, OSError):  # the reader meets the same trouble and reconnects
            pass
        finally:
            self._waking = False

    # ---- the read loop -----------------------------------------------------------------------------------------

    async def _open(self) -> None:
        conn = await self._connect(self._relearn)
        waker = await self._connect(False)  # the map, relearned or not, is the conn's
        self._relearn = False
        try:
            await conn.send_command("CLIENT", "ID")
            self._client_id = int(await conn.read_response())
        except BaseException:
            await conn.disconnect()
            await waker.disconnect()
            raise
        self._conn, self._waker = conn, waker

    async def _drop(self) -> None:
        conn, waker, self._conn, self._waker = self._conn, self._waker, None, None
        for c in (conn, waker):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.disconnect()

    async def _xread(self, keys: list[str], ids: list[str]) -> Any:
        assert self._conn is not None
        await self._conn.send_command("XREAD", "COUNT", READ_COUNT, "BLOCK", self.block_ms, "STREAMS", *keys, *ids)
        return await self._conn.read_response()

    async def _run(self) -> None:
        pause = RECONNECT_S[0]
        down_since: float | None = None
        while True:
            if not self.streams:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            try:
                if self._conn is None:
                    await self._open()
                keys = list(self.streams)
                ids = [self.streams[k].last for k in keys]
                self._wanted.clear()
                self._reading = True
                start = time.perf_counter()
                try:
                    reply = await self._xread(keys, ids)
                finally:
                    self._reading = False
                    self._round += 1
                self.metrics.reader_round.labels(self.name).observe(time.perf_counter() - start)
                if isinstance(reply, redis_lib.ResponseError):
                    raise reply
                pause, down_since = RECONNECT_S[0], None
                self._deliver(reply)
            except asyncio.CancelledError:
                raise
            except (redis_lib.RedisError, OSError) as e:
                await self._drop()
                self._relearn = True
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since >= self.grace_s:
                    log.warning("reader %s: Redis unreachable for %.1f s (%s): failing %d waiting requests",
                                self.name, now - down_since, e, self.subscribers)
                    self._fail_all(e if isinstance(e, redis_lib.RedisError) else redis_lib.ConnectionError(str(e)))
                    down_since = None
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_S[1])
            except Exception as e:  # never let the reader die with requests waiting on it
                log.exception("reader %s failed", self.name)
                await self._drop()
                self._relearn = True
                self._fail_all(e)

    def _deliver(self, reply: Any) -> None:
        # XREAD's reply: [[stream, [[entry id, [field, value, ...]], ...]], ...] in RESP2, a map of stream -> entries
        # in RESP3; None when the block ended.
        for key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
            followed = self.streams.get(key)
            if followed is None or not entries:
                continue
            followed.last = entries[-1][0]
            events = []
            for entry_id, fields in entries:
                try:
                    data = dict(zip(fields[::2], fields[1::2]))
                    events.append((flows.parse_event(entry_id, data), len(data[wire.EVENT_FIELD])))
                except (ValueError, KeyError, TypeError):
                    log.warning("stream %s: entry %s is no event (%s)", key, entry_id, fields)
            for sub in list(followed.subs):  # a subscription may be dropped on the way
                sub.put(events)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._drop()


class EventReaders:
    """The readers of one serve process: one on a plain Redis, one per followed slot on a cluster."""

    def __init__(self, redis: Any, metrics: ServeMetrics, grace_s: float, block_ms: int = BLOCK_MS,
                 bound: Bound | None = None) -> None:
        self.redis = redis  # the process's client (pool): short commands, and where the readers' settings come from
        self.metrics = metrics
        self.grace_s = grace_s
        self.block_ms = block_ms
        self.bound = bound  # of a bounded subscription's queue
        self.cluster = is_cluster(redis)
        self._readers: dict[int | None, Reader] = {}
        # The cluster client's slot map is one for all readers: relearning it from several at once shares its
        # startup connection between them and fails ("Redis Cluster cannot be connected"), so one at a time.
        self._slot_map = asyncio.Lock()

    def _reader(self, key: str) -> Reader:
        slot = self.redis.keyslot(key) if self.cluster else None
        reader = self._readers.get(slot)
        if reader is None:
            name = "redis" if slot is None else f"slot {slot}"
            connect = self._connect_plain if slot is None else self._connect_slot(slot)
            reader = self._readers[slot] = Reader(name, connect, self.metrics, self.grace_s, self.block_ms).start()
        return reader

    def _settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kw = dict(kwargs)
        # The XREAD blocks up to block_ms: the socket must wait longer than that for its answer.
        kw["socket_timeout"] = self.block_ms / 1000 + max(5.0, kw.get("socket_timeout") or 0)
        kw["client_name"] = READER_NAME
        return kw

    async def _connect_plain(self, relearn: bool) -> AbstractConnection:
        pool = self.redis.connection_pool
        conn = pool.connection_class(**self._settings(pool.connection_kwargs))
        await conn.connect()
        return conn

    def _connect_slot(self, slot: int) -> Connect:
        async def connect(relearn: bool) -> AbstractConnection:
            # After an error the slot may have moved: learn the map again before connecting. Only then: relearning
            # marks every connection of the shared client for reconnect, and requests in flight on them failed
            # ("Connection closed by server") when each new reader relearned it on its first connect under load.
            async with self._slot_map:
                if relearn or not self.redis.nodes_manager.slots_cache:
                    await self.redis.nodes_manager.initialize()
                node = self.redis.nodes_manager.get_node_from_slot(slot)
            conn = node.connection_class(**self._settings(node.connection_kwargs))
            await conn.connect()
            return conn

        return connect

    async def subscribe(self, keys: Keys, job_id: str, fresh: bool = False, after: str = "0-0",
                        bounded: bool = False) -> Subscription:
        """Follow job `job_id`'s events after entry `after` (from the start by default). `fresh`: the job was
        just submitted, so its stream needs no look first; otherwise a job whose events expired answers with its
        stored result, and JobNotFound is raised for no such job. `bounded`: its queue holds at most the
        readers' bound (a stream's, whose client may stop reading; a whole answer's request reads as they come)."""
        key = keys.events(job_id)
        start: str | StreamEvent | None = after
        if not fresh:
            start = await flows.adrive(self.redis, flows.stream_start(keys, job_id, after))
        reader = self._reader(key)
        if not isinstance(start, str):  # nothing to follow: the stored end, or nothing at all
            sub = Subscription(reader, key, None)
            sub.closed = True
            sub.backlog = [start] if start is not None else []
            return sub
        sub, catch_up = reader.add(key, start, self.bound if bounded else None)
        if catch_up is not None:
            try:
                low = "-" if start == "0-0" else f"({start}"
                sub.backlog = [flows.parse_event(eid, f) for eid, f in await self.redis.xrange(key, low, catch_up)]
            except BaseException:
                sub.close()
                raise
        return sub

    def waiting(self) -> int:
        return sum(r.subscribers for r in self._readers.values())

    async def close(self) -> None:
        for reader in self._readers.values():
            await reader.close()
        self._readers.clear()

