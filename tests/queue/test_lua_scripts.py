"""Every Lua script: linted (no globals: Redis refuses a script that assigns one), and every branch of every
script executed, both ways, against a real redis-server.

Branch coverage: the test runs instrumented copies of the scripts, where each `if COND then` records whether
COND held; the cases below drive each script through its typed call in producer.calls, so the replies are read
the way the clients and the worker read them. The last test checks that every condition went both ways.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from producer import calls, scripts, wire
from producer.errors import DuplicateJobError, JobNotFound, LeaseLost, OwnerFull, StreamGap
from producer.keys import GROUP, ApiKeyKeys, BatchKeys, Keys
from producer.protocol import JobRequest, Usage

# One process runs the whole file, in order (`make test`'s --dist loadgroup): the coverage is in that process's Redis,
# and the last test reads it.
pytestmark = pytest.mark.xdist_group("lua_scripts")

SCRIPTS = Path(scripts.__file__).parent / "scripts"
COVERAGE_KEY = "pqtest:lua-coverage"
_COND = re.compile(r"\b(if|elseif)\s+(.*?)\s+then\b")
_COV_FN = (f"local function __cov(id, v) redis.call('HINCRBY', '{COVERAGE_KEY}', id .. (v and ':T' or ':F'), 1) "
           "return v end\n")


def _instrument(name: str) -> tuple[str, list[str]]:
    """The source of `name` as Redis runs it (lib.lua + the script) with each condition recorded, and the ids
    of its conditions ("file:line")."""
    out, ids = [_COV_FN], []
    for file in ("lib", name):
        for n, line in enumerate((SCRIPTS / f"{file}.lua").read_text().splitlines(), 1):
            if line.lstrip().startswith("--"):
                out.append(line)
                continue
            cid = f"{file}:{n}"

            def wrap(m: re.Match, cid: str = cid) -> str:
                ids.append(cid)
                return f"{m.group(1)} __cov('{cid}', {m.group(2)}) then"

            out.append(_COND.sub(wrap, line))
    return "\n".join(out) + "\n", ids


def all_conditions() -> set[str]:
    return {f"{cid}:{way}" for name in scripts.NAMES for cid in _instrument(name)[1] for way in "TF"}


@pytest.fixture(scope="module")
def run(redis_url):
    """run(call) -> the call's outcome (named result or typed error), through the instrumented script."""
    import redis

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    sources = {name: _instrument(name)[0] for name in scripts.NAMES}

    def go(call: calls.Call):
        try:
            reply = r.eval(sources[call.script], len(call.keys), *call.keys, *call.args)
        except ResponseError as e:
            reply = e
        return call.outcome(reply)

    yield go
    r.close()


SETTINGS = calls.WorkerSettings("w1", lease_ms=60_000, max_attempts=2, ttl=600, dlq_cap=100)


class Queue:
    """A fresh queue and the steps of a job's life, as a producer and a worker take them."""

    def __init__(self, rds, run, name: str) -> None:
        self.r, self.run, self.k = rds, run, Keys(name)
        rds.xgroup_create(self.k.jobs, GROUP, id="0", mkstream=True)

    def submit(self, job_id: str, **fields) -> str:
        return self.run(calls.submit(self.k, JobRequest(id=job_id, prompt="hi", **fields)))

    def read(self) -> list[tuple[str, dict]]:
        reply = self.r.xreadgroup(GROUP, SETTINGS.worker_id, {self.k.jobs: ">"}, count=100)
        return reply[0][1] if reply else []

    def start(self, job_id: str, entry: str, settings: calls.WorkerSettings = SETTINGS, alone: bool = False
              ) -> tuple:
        d = calls.Delivery(job_id, entry, f"lease-{time.monotonic_ns()}")
        return d, self.run(calls.start(self.k, d, settings, time.time(), alone))

    def running(self, job_id: str) -> calls.Delivery:
        entry = self.submit(job_id)
        self.read()
        d, started = self.start(job_id, entry)
        assert started.outcome == "ok"
        return d

    def chunk(self, d: calls.Delivery, offset: int, n: int = 1) -> calls.Chunk:
        return calls.Chunk(d.job_id, d.lease, offset, n, '{"type":"token","text":"x","token_ids":[5]}')

    def state(self, job_id: str) -> str | None:
        return self.r.hget(self.k.job(job_id), wire.F_STATE)


@pytest.fixture
def q(rds, run, queue) -> Queue:
    return Queue(rds, run, queue)


def test_luacheck(tmp_path):
    """No globals, no unused or shadowed locals, in each script as Redis runs it."""
    exe = shutil.which("luacheck")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("luacheck is missing: .ci/run installs Debian's lua-check")
        pytest.skip("luacheck not installed (apt-get install lua-check)")
    for name in scripts.NAMES:
        (tmp_path / f"{name}.lua").write_text(scripts.source(name))
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([exe, "--no-color", "--config", str(root / ".luacheckrc"), *sorted(
        str(p) for p in tmp_path.glob("*.lua"))], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_scripts_run_in_redis_unmodified(rds):
    """The instrumented copies stand for the real ones: the real ones load, and every condition is found."""
    for name in scripts.NAMES:
        assert rds.script_load(scripts.source(name)) == scripts.sha(name)
    assert len(all_conditions()) > 50


# ---- submit ----

def test_submit(q):
    entry = q.submit("a")
    assert q.state("a") == wire.QUEUED and q.r.hget(q.k.job("a"), wire.F_ENTRY) == entry
    assert isinstance(q.run(calls.submit(q.k, JobRequest(id="a", prompt="x"))), DuplicateJobError)
    q.r.set(q.k.result("gone"), "{}")  # finished, its hash expired first: still a duplicate
    assert isinstance(q.run(calls.submit(q.k, JobRequest(id="gone", prompt="x"))), DuplicateJobError)


def test_submit_with_an_owner(q):
    key = "0123456789abcdef"
    jobs = q.k.owner_jobs(key)

    def submit(job_id: str, cap: int | None, owner: str = key):
        return q.run(calls.submit(q.k, JobRequest(id=job_id, prompt="x"), calls.Owner(owner, cap, charged=7)))

    submit("batch-line", None)  # named only: a batch's job
    assert q.r.hget(q.k.job("batch-line"), wire.F_OWNER) == key and not q.r.exists(jobs)
    submit("free", 0)  # no cap
    submit("capped", 2)
    assert sorted(map(calls.parse_owner_member, q.r.zrange(jobs, 0, -1))) == [("capped", 7), ("free", 7)]
    full = submit("third", 2)
    assert isinstance(full, OwnerFull) and "has 2 jobs queued or running (the limit is 2)" in str(full)
    assert not q.r.exists(q.k.job("third")) and q.r.xlen(q.k.jobs) == 3  # nothing written
    assert isinstance(submit("free", 2), DuplicateJobError)  # a retry is a duplicate, whatever the cap
    q.r.zrem(jobs, "free 7")  # ended, settled
    submit("third", 2)
    submit("nobody", None, owner="")  # an empty owner names none
    assert q.r.hget(q.k.job("nobody"), wire.F_OWNER) is None


# ---- start ----

def test_start_ok_busy_duplicate_and_finished(q):
    entry = q.submit("a")
    q.read()
    d, started = q.start("a", entry)
    assert started.outcome == "ok" and started.attempts == 1 and started.emitted == 0
    assert started.enqueued_at is not None
    _, again = q.start("a", entry)  # a reclaim while the lease lives
    assert again.outcome == "busy"
    _, dup = q.start("a", "0-1")  # a second entry of a running job
    assert dup == calls.Started("skip", state="duplicate")
    assert q.run(calls.fail(q.k, d, '{"id":"a","status":"failed"}', 60)) is True
    _, late = q.start("a", entry)  # a stale delivery of a finished job
    assert late == calls.Started("skip", state=wire.FAILED)


def test_start_adopts_a_hand_made_entry(q):
    entry = q.r.xadd(q.k.jobs, {wire.ENTRY_JOB: '{"prompt":"hi"}'})
    _, started = q.start(entry, entry)
    assert started.outcome == "ok" and started.attempts == 1 and q.state(entry) == wire.RUNNING


def test_start_after_a_lapsed_lease_then_dead_letter(q):
    quick = calls.WorkerSettings("w1", lease_ms=1, max_attempts=2, ttl=600, dlq_cap=100)
    entry = q.submit("a")
    q.read()
    assert q.start("a", entry, quick)[1].attempts == 1
    time.sleep(0.01)
    # The lease lapsed: its last delivery after a failed one runs alone, not beside other jobs.
    assert q.start("a", entry, quick)[1] == calls.Started("later")
    assert q.start("a", entry, quick, alone=True)[1].attempts == 2
    time.sleep(0.01)
    _, third = q.start("a", entry, quick)
    assert third == calls.Started("dead", attempts=2)
    dead = q.r.xrange(q.k.dlq)
    assert len(dead) == 1 and dead[0][1]["error"] == "max_attempts" and dead[0][1][wire.ENTRY_JOB]
    assert q.state("a") == wire.FAILED and q.r.xlen(q.k.jobs) == 0


# ---- publish, renew ----

def test_publish(q):
    d = q.running("a")
    assert q.run(calls.publish(q.k, [q.chunk(d, 0)])) == ["ok"]
    assert q.run(calls.publish(q.k, [q.chunk(d, 0)])) == ["ok"]  # a retry: written before, not again
    assert q.r.xlen(q.k.events("a")) == 1
    assert q.run(calls.publish(q.k, [q.chunk(d, 5)])) == [calls.Gap(1)]  # a gap: the stream holds 1 token
    q.run(calls.cancel(q.k, "a", 60))
    assert q.run(calls.publish(q.k, [q.chunk(d, 1)])) == ["cancel"]
    stale = calls.Delivery("a", d.entry, "someone-else")
    assert q.run(calls.publish(q.k, [q.chunk(stale, 2)])) == ["lost"]


def test_renew(q):
    d = q.running("a")
    stale = calls.Delivery("a", d.entry, "someone-else")
    assert q.run(calls.renew(q.k, SETTINGS, [d, stale])) == ["ok", "lost"]


# ---- complete, fail ----

def test_complete(q):
    d = q.running("a")
    res = '{"id":"a","status":"completed"}'
    stale = calls.Delivery("a", d.entry, "someone-else")
    assert isinstance(q.run(calls.complete(q.k, stale, wire.COMPLETED, res, 60)), LeaseLost)
    assert q.run(calls.complete(q.k, d, wire.COMPLETED, res, 60, q.chunk(d, 0))) is True
    assert q.run(calls.complete(q.k, d, wire.COMPLETED, res, 60, q.chunk(d, 0))) is False  # a retry
    assert isinstance(q.run(calls.complete(q.k, d, wire.CANCELLED, res, 60)), LeaseLost)
    events = [f[wire.EVENT_FIELD] for _, f in q.r.xrange(q.k.events("a"))]
    assert len(events) == 2 and '"done"' in events[1]
    assert q.state("a") == wire.COMPLETED and q.r.xlen(q.k.jobs) == 0 and q.r.get(q.k.result("a")) == res
    assert q.r.xpending(q.k.jobs, GROUP)["pending"] == 0


def test_complete_when_the_last_chunk_was_written_before(q):
    d = q.running("a")
    q.run(calls.publish(q.k, [q.chunk(d, 0)]))
    assert q.run(calls.complete(q.k, d, wire.COMPLETED, "{}", 60, q.chunk(d, 0))) is True
    assert q.r.xlen(q.k.events("a")) == 2  # the chunk once, then the terminal event


def test_complete_after_a_gap(q):
    """A stream that lost its last tokens (a failover) refuses the end until they are written again."""
    d = q.running("a")
    q.run(calls.publish(q.k, [q.chunk(d, 0)]))
    gap = q.run(calls.complete(q.k, d, wire.COMPLETED, "{}", 60, q.chunk(d, 3)))
    assert isinstance(gap, StreamGap) and gap.emitted == 1
    gap = q.run(calls.complete(q.k, d, wire.COMPLETED, "{}", 60, tokens=2))  # no last chunk: all its tokens
    assert isinstance(gap, StreamGap) and gap.emitted == 1
    assert q.state("a") == wire.RUNNING and q.r.xlen(q.k.events("a")) == 1  # nothing written
    assert q.run(calls.publish(q.k, [q.chunk(d, 1, 2)])) == ["ok"]
    assert q.run(calls.complete(q.k, d, wire.COMPLETED, "{}", 60, q.chunk(d, 3))) is True
    assert q.r.xlen(q.k.events("a")) == 4


def test_fail(q):
    d = q.running("a")
    stale = calls.Delivery("a", d.entry, "someone-else")
    assert isinstance(q.run(calls.fail(q.k, stale, "{}", 60)), LeaseLost)
    assert q.run(calls.fail(q.k, d, "{}", 60)) is True
    assert q.run(calls.fail(q.k, d, "{}", 60)) is False
    d2 = q.running("b")
    q.run(calls.complete(q.k, d2, wire.COMPLETED, "{}", 60))
    assert isinstance(q.run(calls.fail(q.k, d2, "{}", 60)), LeaseLost)


# ---- cancel ----

def test_cancel(q):
    assert isinstance(q.run(calls.cancel(q.k, "nope", 60)), JobNotFound)
    q.submit("queued")
    assert q.run(calls.cancel(q.k, "queued", 60)) == "cancelled"
    assert q.run(calls.cancel(q.k, "queued", 60)) == wire.CANCELLED  # terminal: unchanged
    assert q.r.xlen(q.k.jobs) == 0
    q.running("running")
    assert q.run(calls.cancel(q.k, "running", 60)) == "cancelling"
    # A queued job whose hash lost its entry (written by hand): cancelled all the same.
    q.r.hset(q.k.job("bare"), mapping={wire.F_STATE: wire.QUEUED})
    assert q.run(calls.cancel(q.k, "bare", 60)) == "cancelled"
    # On another lane's stream: cancelled, its entry left for the worker that reads it to skip.
    q.run(calls.submit(q.k, JobRequest(id="urgent", prompt="x", lane="interactive")))
    assert q.run(calls.cancel(q.k, "urgent", 60)) == "cancelled"
    assert q.r.xlen(q.k.stream("interactive")) == 1 and q.state("urgent") == wire.CANCELLED


# ---- release ----

def test_release_handback_retry_and_dead(q):
    d = q.running("a")
    stale = calls.Delivery("a", d.entry, "someone-else")
    assert isinstance(q.run(calls.release(q.k, stale, SETTINGS, wire.HANDBACK, "h", "h")), LeaseLost)
    back = q.run(calls.release(q.k, d, SETTINGS, wire.HANDBACK, "handback", "draining"))
    assert back.outcome == "queued" and q.state("a") == wire.QUEUED
    assert q.r.hget(q.k.job("a"), wire.F_HANDBACKS) == "1"
    q.read()
    d, started = q.start("a", back.entry)
    assert started.attempts == 2  # two deliveries, one handed back: one counts
    again = q.run(calls.release(q.k, d, SETTINGS, wire.RETRY, "worker_error", "boom"))
    assert again.outcome == "queued"
    q.read()
    assert q.start("a", again.entry)[1].outcome == "later"
    d, started = q.start("a", again.entry, alone=True)
    dead = q.run(calls.release(q.k, d, SETTINGS, wire.RETRY, "worker_error", "boom"))
    assert dead == calls.Released("dead", attempts=3)
    assert q.state("a") == wire.FAILED and q.r.xrange(q.k.dlq)[0][1]["error"] == "worker_error"


def test_release_when_the_entry_is_gone(q):
    for mode in (wire.HANDBACK, wire.RETRY):
        d = q.running(mode)
        q.r.xdel(q.k.jobs, d.entry)
        assert q.run(calls.release(q.k, d, SETTINGS, mode, "x", "y")).outcome == "dead"
    errors = sorted(f["error"] for _, f in q.r.xrange(q.k.dlq))
    assert errors == ["entry_lost", "x"]
    assert all(f[wire.ENTRY_JOB] == "" for _, f in q.r.xrange(q.k.dlq))


# ---- retry (a dead letter back to the queue) ----

def test_retry(q):
    assert isinstance(q.run(calls.retry(q.k, "0-1", "a")), JobNotFound)
    empty = q.r.xadd(q.k.dlq, {"id": "a", wire.ENTRY_JOB: ""})
    with pytest.raises(ResponseError, match=wire.ERR_NO_PAYLOAD):
        raise q.run(calls.retry(q.k, empty, "a"))
    full = q.r.xadd(q.k.dlq, {"id": "a", wire.ENTRY_JOB: '{"prompt":"hi"}'})
    q.running("a")
    with pytest.raises(ResponseError, match=wire.ERR_BUSY):
        raise q.run(calls.retry(q.k, full, "a"))
    q.r.hset(q.k.job("a"), wire.F_STATE, wire.FAILED)
    entry = q.run(calls.retry(q.k, full, "a"))
    assert q.state("a") == wire.QUEUED and q.r.hget(q.k.job("a"), wire.F_ENTRY) == entry
    assert q.r.hget(q.k.job("a"), wire.F_ATTEMPTS) == "0"


def test_retry_to_a_group(q):
    dead = q.r.xadd(q.k.dlq, {"id": "g", wire.ENTRY_JOB: '{"prompt":"hi","lane":"batch","group":"acme"}'})
    entry = q.run(calls.retry(q.k, dead, "g", "batch", "acme"))
    assert q.r.xrange(q.k.stream("batch", "acme"))[0][0] == entry
    assert q.r.smembers(q.k.ready("batch")) == {"acme"} and q.r.xlen(q.k.bell) == 1


# ---- take and prune (a worker's intake: lanes and groups) ----

def test_take_and_prune(q):
    take = functools.partial(calls.take, q.k, "w1")
    assert q.run(take("batch", "nobody", 5)) == []  # no stream: nothing, and not ready
    assert q.run(take("interactive", None, 5)) == []
    q.run(calls.submit(q.k, JobRequest(id="a", prompt="x", lane="batch", group="acme")))
    q.run(calls.submit(q.k, JobRequest(id="b", prompt="x", lane="batch", group="acme")))
    (first,) = q.run(take("batch", "acme", 1))  # makes the group's consumer group; one left: still ready
    assert first[1]["id"] == "a" and q.r.smembers(q.k.ready("batch")) == {"acme"}
    (second,) = q.run(take("batch", "acme", 5))  # drained: leaves the ready set
    assert second[1]["id"] == "b" and q.r.smembers(q.k.ready("batch")) == set()
    q.r.xgroup_create(q.k.stream("batch"), GROUP, id="0", mkstream=True)
    assert q.run(take("batch", None, 5)) == []  # a lane's own stream: no ready set to keep
    assert q.run(calls.prune(q.k, "batch", "acme")) is False  # holds its two running jobs
    q.r.xdel(q.k.stream("batch", "acme"), first[0], second[0])
    assert q.run(calls.prune(q.k, "batch", "acme")) is True
    assert not q.r.exists(q.k.stream("batch", "acme")) and q.r.smembers(q.k.lane_groups("batch")) == set()


# ---- remove_consumer (a gone worker leaves the group) ----

def test_remove_consumer_only_when_gone(q):
    def remove(name: str, min_idle_ms: int = 0, keys: Keys = q.k) -> bool:
        return q.run(calls.remove_consumer(keys, name, min_idle_ms))

    q.submit("a")
    q.read()  # SETTINGS' worker now holds a pending entry
    q.r.xgroup_createconsumer(q.k.jobs, GROUP, "idle")
    assert not remove("idle", keys=Keys(f"{q.k.queue}-none"))  # no such group
    q.r.set(q.k.worker("idle"), "{}")
    assert not remove("idle")  # its heartbeat is live
    q.r.delete(q.k.worker("idle"))
    assert not remove(SETTINGS.worker_id)  # it holds a job
    assert not remove("idle", min_idle_ms=10**9)  # active lately
    assert not remove("nobody")
    assert remove("idle")
    assert [c["name"] for c in q.r.xinfo_consumers(q.k.jobs, GROUP)] == [SETTINGS.worker_id]


# ---- set_if (a batch's status moves only forward) ----

def test_set_if(q, queue):
    key = BatchKeys.batch(f"b-{queue}")
    q.r.hset(key, "status", "in_progress")
    assert not q.run(calls.set_if(key, "status", ("validating",), {"status": "in_progress", "in_progress_at": 1}))
    assert q.r.hgetall(key) == {"status": "in_progress"}
    assert q.run(calls.set_if(key, "status", ("validating", "in_progress"), {"status": "cancelling",
                                                                             "cancelling_at": 5}))
    assert q.r.hgetall(key) == {"status": "cancelling", "cancelling_at": "5"}


# ---- lease (one process moves a batch on) and reserve (an API key's budgets) ----

def test_lease(q, queue):
    key = BatchKeys.sweeper(f"b-{queue}")
    assert q.run(calls.lease(key, "one", 60_000)) and q.r.get(key) == "one"  # free: taken
    assert not q.run(calls.lease(key, "two", 60_000)) and q.r.get(key) == "one"  # held by another
    q.r.pexpire(key, 10)
    assert q.run(calls.lease(key, "one", 60_000)) and q.r.pttl(key) > 10_000  # renewed
    assert not q.run(calls.lease(key, "two", 0)) and q.r.get(key) == "one"  # only its holder gives it up
    assert q.run(calls.lease(key, "one", 0)) and not q.r.exists(key)
    assert not q.run(calls.lease(key, "one", 0))  # nothing to give up
    q.r.set(key, "one", px=1)
    time.sleep(0.01)
    assert q.run(calls.lease(key, "two", 60_000)) and q.r.get(key) == "two"  # lapsed: taken over


def test_reserve(q, queue):
    k = ApiKeyKeys(hashlib.sha256(queue.encode()).hexdigest()[:16])
    now = time.time()

    def reserve(item: str, size: int, cap: int, expires_at: float = now + 60) -> calls.Reservation:
        return q.run(calls.reserve(k.files, item, size, cap, int(expires_at), now))

    assert reserve("a", 60, 100) == calls.Reservation(True, 60)
    assert reserve("b", 50, 100) == calls.Reservation(False, 60)  # past the cap: nothing written
    assert reserve("a", 60, 100) == calls.Reservation(True, 60)  # held already: counted once
    assert reserve("b", 40, 100) == calls.Reservation(True, 100)
    assert reserve("c", 10, 0) == calls.Reservation(True, 110)  # no cap: counted all the same
    q.r.zadd(k.files, {calls.budget_member("old", 500): now - 5})  # expired: it leaves first
    assert reserve("d", 1, 0) == calls.Reservation(True, 111) and q.r.zcard(k.files) == 4
    q.r.zrem(k.files, calls.budget_member("a", 60))  # deleted: its room is free
    assert reserve("e", 60, 111).ok and not reserve("f", 1, 111).ok


# ---- limit (an API key's rate limits and usage) ----

def test_limit(q, queue):
    k = ApiKeyKeys(hashlib.sha256(queue.encode()).hexdigest()[:16])

    def admit(rpm: int, tpm: int, tokens: int) -> calls.Admission:
        return q.run(calls.admit(k, rpm, tpm, tokens))

    assert admit(0, 0, 50).ok and not q.r.exists(k.limits)  # no limits: counted, no bucket
    assert all(admit(2, 100, 30).ok for _ in range(2))  # a full bucket: two requests, 60 tokens
    no = admit(2, 100, 30)  # a request back in 30 s at 2 a minute; the tokens in less
    assert not no.ok and not no.never and 0 < no.wait_ms <= 30_000 and no.limit == "requests"
    no = admit(0, 100, 41)  # 40 tokens left: one more comes in 0.6 s
    assert not no.ok and 0 < no.wait_ms <= 600 and no.limit == "tokens"
    no = admit(2, 100, 100)  # both short; the tokens take longer (36 s)
    assert not no.ok and no.wait_ms > 30_000 and no.limit == "tokens"
    no = admit(2, 100, 45)  # both short; the request takes longer
    assert not no.ok and no.wait_ms > 25_000 and no.limit == "requests"
    assert admit(0, 100, 40).ok
    never = admit(0, 100, 101)
    assert never == calls.Admission(False, 0, "tokens", True)
    usage = q.r.hgetall(k.usage)
    assert (usage["requests"], usage["rate_limited"]) == ("4", "5")
    # Settling: two jobs charged 60 tokens used 25; 35 go back. A refund past a full bucket stops at full.
    assert q.run(calls.settle(k, 2, 100, 35, 2, Usage(prompt_tokens=10, completion_tokens=15, cached_tokens=3)))
    assert float(q.r.hget(k.limits, "tok")) >= 35
    assert q.run(calls.settle(k, 2, 100, 500, 1, Usage(prompt_tokens=1)))
    assert float(q.r.hget(k.limits, "tok")) == 100
    assert q.run(calls.settle(k, 2, 100, -150, 1, Usage()))  # used more than charged: in debt
    assert not admit(0, 100, 1).ok
    assert admit(0, 100, 0).ok  # a request that is charged no tokens (a file's) still passes
    assert q.run(calls.settle(k, 2, 0, 5, 1, Usage()))  # no token limit: only counted
    assert q.run(calls.settle(k, 2, 100, 0, 1, Usage(completion_tokens=2)))  # nothing to give back
    usage = q.r.hgetall(k.usage)
    assert {f: usage[f] for f in ("jobs", "prompt_tokens", "completion_tokens", "cached_tokens")} == \
        {"jobs": "6", "prompt_tokens": "11", "completion_tokens": "17", "cached_tokens": "3"}
    assert 0 < q.r.pttl(k.limits) <= 3_600_000


def test_every_branch_ran_both_ways(rds):
    """Runs last in this file: the cases above took every condition of every script both ways."""
    seen = set(rds.hkeys(COVERAGE_KEY))
    missing = sorted(all_conditions() - seen)
    assert not missing, f"conditions never taken that way: {missing}"


def test_wire_names_match_the_scripts():
    """Every hash field (of a job, or of an API key), state and error code the scripts spell is declared in
    producer.wire."""
    fields, states, errors = set(), set(), set()
    for src in _sources():
        for call in re.findall(r"'(HSET|HMGET|HGET|HDEL|HINCRBY)',\s*[^,]+,\s*([^)]*)\)", src):
            fields |= {f for f in re.findall(r"'([a-z_]+)'", call[1])}
        states |= set(re.findall(r"state [~=]= '([a-z]+)'", src))
        errors |= set(re.findall(r"error_reply\('([A-Z_]+) ", src))
    fields -= set(wire.STATES)  # HSET's values: the states it sets
    declared = {*wire.JOB_FIELDS, *wire.LIMIT_FIELDS, *wire.USAGE_COUNTERS}
    assert fields <= declared, fields - declared
    assert states <= set(wire.STATES), states - set(wire.STATES)
    assert errors == set(wire.ERRORS), errors ^ set(wire.ERRORS)


def _sources() -> Iterator[str]:
    for name in scripts.NAMES:
        yield scripts.source(name)


def test_protocol_doc_is_current():
    """PROTOCOL.md's script reference is the scripts' headers (`python3 -m producer.protocol_doc` renews it),
    and the page names every state, hash field, event type and error code of producer.wire."""
    from producer import protocol_doc

    doc = protocol_doc.DOC.read_text()
    assert protocol_doc.render(doc) == doc, "PROTOCOL.md is stale: run python3 -m producer.protocol_doc"
    names = [*wire.STATES, *wire.JOB_FIELDS, *wire.DLQ_FIELDS, *wire.ERRORS, wire.EV_TOKEN, wire.EV_DONE,
             wire.EV_ERROR, wire.EV_CANCELLED, wire.ENTRY_ID, wire.ENTRY_JOB, wire.EVENT_FIELD, *wire.LIMIT_FIELDS,
             wire.USAGE_NAME, *wire.USAGE_COUNTERS]
    assert [n for n in names if f"`{n}`" not in doc] == []
