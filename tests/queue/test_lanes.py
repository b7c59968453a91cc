"""Priority lanes and fair-share groups at the queue (worker/intake.py) against a real redis-server, without a
model: which jobs a worker's intake reads, in which order, from which stream."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from producer import Client, JobRequest
from producer.groups import GroupSettings, group_view, reset_group, set_group
from producer.keys import GROUP, LANES, Keys
from producer.queue_info import queue_info
from worker.intake import Intake, engine_priority


@pytest.fixture
def client(redis_url, queue):
    c = Client(redis_url, queue=queue)
    yield c
    c.close()


def _intake(rds, queue, worker="w1", floor=10) -> Intake:
    keys = Keys(queue)
    for stream in keys.lane_streams():  # what a worker's setup does
        if not rds.exists(stream) or not rds.xinfo_groups(stream):
            rds.xgroup_create(stream, GROUP, id="0", mkstream=True)
    return Intake(rds, keys, worker, floor)


def _submit(client, n, **fields) -> list[str]:
    return [j.id for j in client.submit_many([JobRequest(prompt="x", **fields) for _ in range(n)])]


def _ids(taken) -> list[str]:
    return [t.fields["id"] for t in taken]


def test_lanes_are_streams_and_a_bare_xadd_to_the_old_name_is_the_default_lane(client, rds, queue):
    keys = Keys(queue)
    urgent = client.submit(prompt="x", lane="interactive")
    grouped = client.submit(prompt="x", lane="batch", group="acme")
    assert rds.xrange(keys.stream("interactive"))[0][1]["id"] == urgent.id
    assert rds.xrange(f"pq:{{{queue}}}:jobs:batch:acme")[0][1]["id"] == grouped.id
    assert rds.smembers(keys.lane_groups("batch")) == {"acme"} == rds.smembers(keys.ready("batch"))
    assert rds.hget(keys.job(grouped.id), "stream") == keys.stream("batch", "acme")
    rds.xadd(keys.jobs, {"id": "bare", "job": json.dumps({"prompt": "x"})})
    taken = _intake(rds, queue).read(10)
    assert [(t.lane, t.group, t.fields["id"]) for t in taken] == [
        ("interactive", None, urgent.id), ("default", None, "bare"), ("batch", "acme", grouped.id)]


def test_an_urgent_lane_is_read_first_and_a_lower_one_keeps_a_floor_share(client, rds, queue):
    batch = _submit(client, 50, lane="batch")
    intake = _intake(rds, queue, floor=4)
    assert _ids(intake.read(2)) == batch[:2]
    urgent = _submit(client, 20, lane="interactive")
    order = [t.lane for _ in range(10) for t in intake.read(2)]
    # Interactive first; once the lanes above took 4 jobs, the next read gives batch one (reads of 2: a batch job
    # after 4 or 5 interactive ones).
    assert order[:4] == ["interactive"] * 4
    runs = "".join("i" if lane == "interactive" else "b" for lane in order)
    assert max(len(run) for run in runs.split("b")) <= 5 and runs.count("b") >= 3, runs
    n = runs.count("i")
    assert _ids(t for t in intake.read(30) if t.lane == "interactive") == urgent[n:]


def test_groups_share_a_lane_by_weight(client, rds, queue):
    keys = Keys(queue)
    for name, weight in (("a", 1), ("b", 2), ("c", 4)):
        set_group(rds, keys, name, GroupSettings(weight=weight))
        _submit(client, 100, lane="batch", group=name)
    intake = _intake(rds, queue)
    got = Counter(t.group for _ in range(21) for t in intake.read(3))
    assert got == {"a": 9, "b": 18, "c": 36}


def test_a_small_group_is_not_held_back_by_a_big_one(client, rds, queue):
    _submit(client, 300, group="big")
    intake = _intake(rds, queue)
    intake.read(5)
    small = _submit(client, 5, group="small")
    taken = [t for _ in range(10) for t in intake.read(1)]
    assert set(small) <= set(_ids(taken))


def test_a_group_at_its_cap_takes_nothing_until_a_job_ends(client, rds, queue):
    keys = Keys(queue)
    set_group(rds, keys, "capped", GroupSettings(max_running=2))
    _submit(client, 5, group="capped")
    free = _submit(client, 5, group="free")
    intake = _intake(rds, queue)
    first = intake.read(10)
    assert Counter(t.group for t in first) == {"capped": 2, "free": 5}
    assert intake.read(10) == []
    done = next(t for t in first if t.group == "capped")
    rds.xack(keys.stream("default", "capped"), GROUP, done.entry)
    assert [t.group for t in intake.read(10)] == ["capped"]
    assert free == _ids(t for t in first if t.group == "free")
    assert reset_group(rds, keys, "capped")


def test_a_drained_group_leaves_the_ready_set_and_an_empty_one_is_pruned(client, rds, queue):
    keys = Keys(queue)
    (job,) = _submit(client, 1, lane="interactive", group="g")
    intake = _intake(rds, queue)
    (taken,) = intake.read(5)
    assert rds.smembers(keys.ready("interactive")) == set()
    assert rds.smembers(keys.lane_groups("interactive")) == {"g"}
    intake.reap(5, idle_ms=60_000)  # it holds the running job: kept
    assert rds.exists(keys.stream("interactive", "g"))
    rds.xack(keys.stream("interactive", "g"), GROUP, taken.entry)
    rds.xdel(keys.stream("interactive", "g"), taken.entry)
    intake.reap(5, idle_ms=60_000)
    assert not rds.exists(keys.stream("interactive", "g"))
    assert rds.smembers(keys.lane_groups("interactive")) == set()
    (again,) = _submit(client, 1, lane="interactive", group="g")
    assert _ids(intake.read(5)) == [again]


def test_a_stalled_job_of_a_group_is_reclaimed_by_another_worker(client, rds, queue):
    (job,) = _submit(client, 1, lane="batch", group="g")
    assert _ids(_intake(rds, queue, "w1").read(1)) == [job]
    other = _intake(rds, queue, "w2")
    assert other.read(1) == []
    (back,) = other.reap(5, idle_ms=0)
    assert (back.lane, back.group, back.fields["id"]) == ("batch", "g", job)


def test_an_idle_intake_wakes_for_a_job_queued_after_its_read(client, rds, queue, redis_url):
    import threading
    import time

    intake = _intake(rds, queue)
    assert intake.read(5, note_wake=True) == []
    timer = threading.Timer(0.3, lambda: _submit(Client(redis_url, queue=queue), 1, lane="batch", group="late"))
    timer.start()
    t0 = time.monotonic()
    intake.wait(10_000)
    assert time.monotonic() - t0 < 5
    assert [t.group for t in intake.read(5)] == ["late"]


def test_engine_priority_orders_by_lane_then_priority():
    keys = [engine_priority(lane, p) for lane in LANES for p in (-(2**31 - 1), 0, 2**31 - 1)]
    assert keys == sorted(keys)


def test_queue_info_and_group_view_count_every_lane_and_group(client, rds, queue):
    keys = Keys(queue)
    set_group(rds, keys, "acme", GroupSettings(weight=3, max_running=4))
    _submit(client, 2, lane="interactive")
    _submit(client, 3, lane="batch", group="acme")
    _submit(client, 1, group="acme")
    intake = _intake(rds, queue)
    intake.read(1, lanes=("batch",))
    info = queue_info(rds, keys)
    assert (info["length"], info["waiting"], info["pending"]) == (6, 5, 1)
    assert info["lanes"]["interactive"]["waiting"] == 2
    assert (info["lanes"]["batch"]["pending"], info["lanes"]["batch"]["groups"]) == (1, 1)
    assert [c["name"] for c in info["consumers"]] == ["w1"]
    acme = next(row for row in group_view(rds, keys) if row["group"] == "acme")
    assert (acme["weight"], acme["max_running"], acme["queued"], acme["running"]) == (3, 4, 3, 1)
    assert acme["lanes"]["batch"] == {"queued": 2, "running": 1}


def test_lane_and_group_are_checked_at_submit(client):
    with pytest.raises(ValueError, match="lane"):
        client.submit(prompt="x", lane="urgent")
    with pytest.raises(ValueError, match="group"):
        client.submit(prompt="x", group="a b")
    with pytest.raises(ValueError, match="group"):
        client.submit(prompt="x", group="{x}")


def test_the_groups_command(client, redis_url, queue):
    from click.testing import CliRunner

    from cli import main

    def cli(*args):
        return CliRunner().invoke(main, ["groups", *args, "--redis-url", redis_url, "--queue", queue])

    out = cli("set", "acme", "--weight", "4", "--max-running", "8")
    assert out.exit_code == 0 and "acme: weight 4, max running 8" in out.output
    _submit(client, 3, lane="batch", group="acme")
    (row,) = json.loads(cli("list", "--json").output)
    assert (row["group"], row["weight"], row["max_running"], row["queued"]) == ("acme", 4, 8, 3)
    table = cli("list").output
    assert "acme" in table and "batch 3+0" in table
    assert cli("set", "a b").exit_code == 2  # not a group name: said, nothing written
    assert cli("reset", "acme").output.strip() == "acme: back to the defaults"
    assert json.loads(cli("list", "--json").output)[0]["weight"] == 1
