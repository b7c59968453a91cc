"""Helpers of the tests with real processes: waiting for states (never for time or counts), reading worker
logs, requests and checks of the fault tests."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from producer import JobRequest


def wait_for(cond, timeout: float, what: str):
    """Poll `cond` until it returns something true, and return that: a state, never a duration."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def streaming_on(rds, c, pid: int, reqs) -> list[str]:
    """The jobs that worker `pid` runs now (it holds their lease) and that have streamed tokens already."""
    held = []
    for r in reqs:
        state, worker = rds.hmget(c.keys.job(r.id), "state", "worker")
        if state == "running" and worker and f"-{pid}-" in worker and rds.xlen(c.keys.events(r.id)) >= 1:
            held.append(r.id)
    return held


def started(p) -> bool:
    # Redis 6.2 lists a consumer only once it has read something: the worker's log says when it is ready.
    return " on queue " in log_of(p)


def log_of(p) -> str:
    with open(p.log.name) as f:
        return f.read()


def make_requests(n: int, tag: str, max_tokens: int) -> list[JobRequest]:
    out = []
    for i in range(n):
        # Greedy, seeded sampling, and sampling without a seed (the worker derives one from the id).
        temp, seed = [(0, None), (0.8, 1000 + i), (0.8, None)][i % 3]
        out.append(JobRequest(id=f"{tag}-{i}", prompt=f"Job {i} says", max_tokens=max_tokens, ignore_eos=True,
                              temperature=temp, seed=seed))
    return out


def spread_lanes(reqs: list[JobRequest]) -> list[JobRequest]:
    """The same jobs over every lane, with and without a fair-share group: the guarantees hold on each stream."""
    lanes, groups = ("interactive", "default", "batch"), ("acme", None, "beta")
    return [r.model_copy(update={"lane": lanes[i % 3], "group": groups[i // 3 % 3]}) for i, r in enumerate(reqs)]


def check_all(c, reqs, results, pq_reference, pq_check_stream) -> dict:
    assert len(results) == len(reqs)
    assert all(r.status == "completed" for r in results), [(r.id, r.status, r.error) for r in results
                                                           if r.status != "completed"]
    for r in results:
        pq_check_stream(c, r)
    ref = pq_reference(reqs)
    assert [r.token_ids for r in results] == [x[0] for x in ref]
    assert [r.text for r in results] == [x[1] for x in ref]
    return {"in": len(reqs), "out": len(results), "resumed": sum(r.attempts > 1 for r in results)}


def family(pid: int) -> list[int]:
    """The process and its children (a worker and its publisher process)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return [pid, *map(int, kids)]


def freeze(p) -> list[int]:
    """SIGSTOP a worker and its publisher process, as a host cut off the network would look to Redis."""
    pids = family(p.pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
