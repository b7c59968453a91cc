"""Which queued jobs a worker reads next, and from which stream.

Lanes (producer.keys.LANES) are read most urgent first. A lower lane has a floor share: once the lanes above it
took `floor` jobs while it waited, its next job comes first, so a steady stream of interactive jobs slows a batch
down but never stops it. Inside a lane, the lane's own stream (jobs without a group) and each group's stream
share by weight with stride scheduling: each takes its next job in the order of its pass (jobs taken / weight),
and a group that comes back after a pause joins at the lane's current pass, not with credit saved up. A group
at its max_running (counted over every worker: its streams' pending entries) takes nothing until one ends.

Every worker runs this over its own intake, so N workers share by the same weights. The unit is a job: jobs of
one size share tokens by the weights too; a group of longer jobs gets more tokens per job.

Spread: with other live workers that have room (from their heartbeats), a worker reads no more than its fair share
of the load: ceil((waiting + pending on the workers with room) / their number), less what it holds already. So a
burst on idle workers splits evenly, while a lone worker still takes the whole burst into one batch. Jobs it leaves
for the others are taken anyway once nobody has read any of them for SPREAD_GRACE_S (a worker whose heartbeat
outlives its loop, or one the host starves of CPU while this one computes).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import redis as redis_lib

from producer import calls
from producer.groups import GroupSettings
from producer.keys import GROUP, LANES, Keys
from worker.pipeline import run_calls

log = logging.getLogger("pagedq.worker")
SETTINGS_TTL_S = 2.0  # how soon a change made with `pagedq groups` reaches every worker's intake
DEFAULT_FLOOR = 10
# Round trips one read may take: every round but the last finds at least one stream drained (a lane's own stream,
# whose backlog is not known before it is read, or a group's); what is left after these waits for the next read.
MAX_ROUNDS = 6

FLEET_TTL_S = 1.0  # how long the live workers read from their heartbeats are trusted
# How long jobs left for other workers may wait, with none of them read meanwhile, before this one takes them anyway.
# Not shorter: on a small host a worker that starts computing its share can starve an idle peer of CPU for a while.
SPREAD_GRACE_S = 2.0
SPREAD_WAIT_MS = 100  # an idle worker that left jobs for others looks again this soon

Source = tuple[str, str | None]  # a stream, as (lane, group); group None: the lane's own stream
LANE_SPAN = 2**32  # wider than JobRequest.priority's range: the engine orders by lane first, then priority


def engine_priority(lane: str, priority: int) -> int:
    """The priority the engine orders (and preempts) by: a job of a more urgent lane comes before every job of a
    lower one, whatever their own priorities."""
    return LANES.index(lane) * LANE_SPAN + priority


@dataclass(frozen=True)
class Taken:
    """A job read from a stream (not started yet)."""

    lane: str
    group: str | None
    entry: str
    fields: dict | None  # None: the entry was deleted while pending (a reclaim found only its id)


class Intake:
    def __init__(self, r, keys: Keys, worker_id: str, floor: int = DEFAULT_FLOOR) -> None:
        if floor < 1:
            raise ValueError(f"the lane floor must be at least 1 job, got {floor}")
        self.r = r
        self.keys = keys
        self.worker_id = worker_id
        self.floor = floor
        self.passes: dict[Source, float] = {}
        self.lane_pass = dict.fromkeys(LANES, 0.0)  # the pass of the lane's last pick: where a returning group joins
        self.behind = dict.fromkeys(LANES, 0)  # jobs the lanes above took since this lane last took one
        self.settings: dict[str, GroupSettings] = {}
        self.settings_until = -math.inf
        self.wake_ids: list[str] | None = None
        self.reap_cursors: dict[str, str] = {}
        self.fleet: list[dict] = []  # the live workers' heartbeat records
        self.fleet_until = -math.inf
        self.seen_groups: dict[str, set[str]] = {lane: set() for lane in LANES}  # ready at the last look
        self.deferred_since: float | None = None  # when this worker began leaving waiting jobs to others
        self.deferred_waiting = 0  # the jobs waiting at its last look then: fewer now means some were read since

    # ---- reading -------------------------------------------------------------------------------------------

    def read(self, room: int, lanes: tuple[str, ...] = LANES, note_wake: bool = False,
             spread: bool = False) -> list[Taken]:
        """Up to `room` jobs from `lanes`. note_wake: also note where every stream ends now, for wait().
        spread: read no more than this worker's fair share while other workers have room (see the top)."""
        streams = self._spread_streams() if spread and room > 0 and len(self._live()) > 1 else []
        extra = [cmd for s in streams for cmd in (("xlen", (s,)), ("xpending", (s, GROUP)))]
        ready, replies = self._look(lanes, note_wake, extra)
        if streams:
            room = self._fair(room, replies)
        elif spread:
            self.deferred_since = None
        running = self._running(ready)
        taken: list[Taken] = []
        offered: Counter[str] = Counter()
        for round_ in range(MAX_ROUNDS):  # each next round gives what drained streams left over to the others
            plan = self._plan(room - len(taken), lanes, ready, running, floor=round_ == 0)
            if not plan:
                break
            got = self._take(plan)
            taken += got
            counts = Counter((t.lane, t.group) for t in got)
            running.update(t.group for t in got if t.group is not None)
            for (lane, group), n in plan.items():
                offered[lane] += n
                if counts[(lane, group)] < n:  # drained: out of this read, and its unused turns given back
                    ready[lane].discard(group)
                    self.passes[(lane, group)] -= (n - counts[(lane, group)]) / self._weight(group)
            if len(got) == sum(plan.values()):
                break
        self._note_lanes(taken, lanes, offered)
        return taken

    def _look(self, lanes: tuple[str, ...], note_wake: bool,
              extra: list[tuple[str, tuple]]) -> tuple[dict[str, set[str | None]], list]:
        """Per lane, the streams that may hold unread jobs: its own, and its ready groups'; and the replies to the
        `extra` commands ((method, args) each), sent in the same round trip."""
        refresh = time.monotonic() >= self.settings_until
        pipe = self.r.pipeline(transaction=False)
        for method, args in extra:
            getattr(pipe, method)(*args)
        if note_wake:  # before the reads: a job queued after them rings after these ids
            for stream in self._wake_streams():
                pipe.xrevrange(stream, count=1)
        for lane in lanes:
            pipe.smembers(self.keys.ready(lane))
        if refresh:
            pipe.hgetall(self.keys.groups)
        replies = pipe.execute(raise_on_error=False)
        extra_replies, replies = replies[:len(extra)], replies[len(extra):]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if note_wake:
            n = len(self._wake_streams())
            self.wake_ids = [last[0][0] if last else "0-0" for last in replies[:n]]
            replies = replies[n:]
        if refresh:
            self.settings = {g: GroupSettings.parse(v) for g, v in replies.pop().items()}
            self.settings_until = time.monotonic() + SETTINGS_TTL_S
        for lane, members in zip(lanes, replies, strict=True):
            self.seen_groups[lane] = set(members)
        return {lane: {None, *members} for lane, members in zip(lanes, replies, strict=True)}, extra_replies

    # ---- spreading over workers ----------------------------------------------------------------------------

    def _live(self) -> list[dict]:
        """The queue's live workers' heartbeat records, read at most once per FLEET_TTL_S."""
        if time.monotonic() >= self.fleet_until:
            ids = self.r.zrange(self.keys.workers, 0, -1)
            records = self.r.mget([self.keys.worker(i) for i in ids]) if ids else []
            self.fleet = [json.loads(rec) for rec in records if rec]
            self.fleet_until = time.monotonic() + FLEET_TTL_S
        return self.fleet

    def _spread_streams(self) -> list[str]:
        """The streams whose backlog the spread counts: the lanes' own and the groups ready at the last look (a
        group that turned ready since is counted from the next read on)."""
        return [*self.keys.lane_streams(),
                *(self.keys.stream(lane, g) for lane in LANES for g in sorted(self.seen_groups[lane]))]

    def _fair(self, room: int, replies: list) -> int:
        """How many of `room` this worker may read now: its fair share of the load over the workers with room."""
        waiting, held = 0, Counter()
        for length, summary in zip(replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception) or isinstance(summary, Exception):  # no group yet: none read it
                waiting += 0 if isinstance(length, Exception) else length
                continue
            waiting += max(0, length - int(summary["pending"]))
            for c in summary.get("consumers") or []:
                held[c["name"]] += int(c["pending"])
        others = [w["id"] for w in self._live() if w.get("id") != self.worker_id and not w.get("draining")
                  and held[w.get("id")] < int(w.get("max_num_seqs") or 1)]
        if waiting == 0 or not others:
            self.deferred_since = None
            return room
        share = math.ceil((waiting + held[self.worker_id] + sum(held[w] for w in others)) / (len(others) + 1))
        limit = min(room, max(0, share - held[self.worker_id]))
        if limit >= min(room, waiting):  # leaves nothing waiting that this worker could take
            self.deferred_since = None
            return room
        now = time.monotonic()
        if self.deferred_since is None or waiting < self.deferred_waiting:  # first deferral, or jobs were read
            self.deferred_since = now
        elif now - self.deferred_since >= SPREAD_GRACE_S:  # the others did not take them: take them here
            return room
        self.deferred_waiting = waiting
        return limit

    def _running(self, ready: dict[str, set[str | None]]) -> Counter[str]:
        """Jobs running now (over every worker) of each ready group that has a cap."""
        capped = sorted({g for groups in ready.values() for g in groups
                         if g is not None and self._settings(g).max_running is not None})
        if not capped:
            return Counter()
        pipe = self.r.pipeline(transaction=False)
        for g in capped:
            for lane in LANES:
                pipe.xpending(self.keys.stream(lane, g), GROUP)
        replies = pipe.execute(raise_on_error=False)
        running: Counter[str] = Counter()
        for i, g in enumerate(capped):
            running[g] = sum(int(x["pending"]) for x in replies[i * len(LANES):(i + 1) * len(LANES)]
                             if not isinstance(x, Exception))
        return running

    def _plan(self, room: int, lanes: tuple[str, ...], ready: dict[str, set[str | None]], running: Counter[str],
              floor: bool) -> Counter[Source]:
        """How many jobs to read from each stream: the floor's turns first (floor), then lane by lane."""
        plan: Counter[Source] = Counter()
        for lane in lanes[1:] if floor else ():
            if room > 0 and self.behind[lane] >= self.floor and self._pick(lane, ready[lane], running, plan):
                room -= 1
        for lane in lanes:
            while room > 0 and self._pick(lane, ready[lane], running, plan):
                room -= 1
        return plan

    def _pick(self, lane: str, streams: set[str | None], running: Counter[str], plan: Counter[Source]) -> bool:
        """One more job for the lane's stream of least pass that may take one; False when none may."""
        best, best_pass = None, math.inf
        for group in sorted(streams, key=lambda g: (g is not None, g or "")):
            if group is not None and not self._has_room(group, running, plan):
                continue
            p = max(self.passes.get((lane, group), 0.0), self.lane_pass[lane])
            if p < best_pass:
                best, best_pass = group, p
        if best_pass == math.inf:
            return False
        self.lane_pass[lane] = best_pass
        self.passes[(lane, best)] = best_pass + 1 / self._weight(best)
        plan[(lane, best)] += 1
        return True

    def _has_room(self, group: str, running: Counter[str], plan: Counter[Source]) -> bool:
        cap = self._settings(group).max_running
        return cap is None or running[group] + sum(plan[(lane, group)] for lane in LANES) < cap

    def _take(self, plan: Counter[Source]) -> list[Taken]:
        sources = list(plan)
        outs = run_calls(self.r, [calls.take(self.keys, self.worker_id, lane, group, plan[(lane, group)])
                                  for lane, group in sources], retries=0)
        taken = []
        for (lane, group), out in zip(sources, outs, strict=True):
            if isinstance(out, Exception):
                log.error("intake: reading %s failed: %s", self.keys.stream(lane, group), out)
                continue
            taken += [Taken(lane, group, entry, fields) for entry, fields in out]
        return taken

    def _note_lanes(self, taken: list[Taken], lanes: tuple[str, ...], offered: Counter[str]) -> None:
        """The floor's count: a lane that took a job, or had none to take, is not behind."""
        got = Counter(t.lane for t in taken)
        above = 0
        for lane in LANES:
            if got[lane] or (lane in lanes and offered[lane] and not got[lane]):
                self.behind[lane] = 0
            else:
                self.behind[lane] += above
            above += got[lane]

    def _settings(self, group: str | None) -> GroupSettings:
        return self.settings.get(group, GroupSettings()) if group is not None else GroupSettings()

    def _weight(self, group: str | None) -> int:
        return self._settings(group).weight

    # ---- waiting, reclaiming -------------------------------------------------------------------------------

    def _wake_streams(self) -> list[str]:
        return [self.keys.bell, *self.keys.lane_streams()]

    def wait(self, block_ms: int) -> None:
        """Block until a job may have been queued after the last read(note_wake=True), or block_ms passed."""
        if self.wake_ids is None:
            return
        streams = dict(zip(self._wake_streams(), self.wake_ids, strict=True))
        self.wake_ids = None
        if self.deferred_since is not None:  # jobs wait for other workers: look again soon in case they do not
            block_ms = min(block_ms, SPREAD_WAIT_MS)
        self.r.xread(streams, count=1, block=block_ms)

    def reap(self, room: int, idle_ms: int) -> list[Taken]:
        """Take over up to `room` jobs whose holder stopped renewing (crashed, frozen, cut off) for idle_ms, from
        every stream; drop the groups' streams that hold nothing."""
        pipe = self.r.pipeline(transaction=False)
        for lane in LANES:
            pipe.smembers(self.keys.lane_groups(lane))
        sources: list[Source] = [(lane, None) for lane in LANES]
        sources += [(lane, g) for lane, groups in zip(LANES, pipe.execute(), strict=True) for g in sorted(groups)]
        pipe = self.r.pipeline(transaction=False)
        for lane, group in sources:
            pipe.xpending(self.keys.stream(lane, group), GROUP)
            pipe.xlen(self.keys.stream(lane, group))
        replies = pipe.execute(raise_on_error=False)
        # A pass at or below its lane's joins there anyway: forgetting it keeps this map to the groups seen lately.
        self.passes = {src: p for src, p in self.passes.items() if p > self.lane_pass[src[0]]}
        taken: list[Taken] = []
        empty = []
        for (lane, group), pending, length in zip(sources, replies[::2], replies[1::2], strict=True):
            if group is not None and length == 0:
                empty.append((lane, group))
            if room > len(taken) and not isinstance(pending, Exception) and int(pending["pending"]):
                taken += self._reclaim(lane, group, room - len(taken), idle_ms)
        if empty:
            run_calls(self.r, [calls.prune(self.keys, lane, group) for lane, group in empty], retries=0)
        if taken:
            log.info("reaper: reclaimed %d stalled jobs", len(taken))
        return taken

    def _reclaim(self, lane: str, group: str | None, room: int, idle_ms: int) -> list[Taken]:
        stream = self.keys.stream(lane, group)
        try:
            reply = self.r.xautoclaim(stream, GROUP, self.worker_id, idle_ms, self.reap_cursors.get(stream, "0-0"),
                                      count=room)
        except redis_lib.ResponseError:  # the stream went (pruned) between the look and the claim
            return []
        self.reap_cursors[stream] = reply[0]
        return [Taken(lane, group, entry, fields) for entry, fields in reply[1]]
