"""`pagedq serve` on the queue's lanes and fair-share groups (issue 39): completion requests go to the interactive
lane (or their key's lane, or the one `service_tier` asks for), Batch API lines to the batch lane, each job in its
API key's group; a key may not ask for a priority or a lane above its allowance (400, never clamped); and
`--max-queue-depth` counts the lane a request's job would join, so a full batch lane never refuses an interactive
request. Real serve processes without a worker (no job here needs to run), and serve.lanes and the depth check on
their own."""

import asyncio
import json
import re

import httpx
import openai
import pytest

from producer import Client, wire
from producer.keys import BatchKeys, Keys
from producer.protocol import JobRequest
from serve import lanes
from serve.api_keys import ApiKey, KeyFileError, digest, key_id, parse, parse_line
from serve.config import ServeConfig
from serve.errors import APIError
from serve.metrics import ServeMetrics
from serve.queues import Queues

ALPHA, BRAVO = "sk-lanes-alpha-31c7", "sk-lanes-bravo-8d20"
MSGS = [{"role": "user", "content": "Hi"}]


def bearer(key: str | None, idem: str | None = None) -> dict:
    return ({"Authorization": f"Bearer {key}"} if key else {}) | ({"Idempotency-Key": idem} if idem else {})


def queued(base: str, key: str | None, idem: str, **extra) -> None:
    """A request whose job is queued and stays (no worker; an Idempotency-Key keeps it past the client's leaving)."""
    with pytest.raises(httpx.ReadTimeout):
        r = httpx.post(f"{base}/v1/chat/completions", headers=bearer(key, idem),
                       json={"model": "tiny", "messages": MSGS, **extra}, timeout=1)
        pytest.fail(f"answered {r.status_code}: {r.text}")


def refused(base: str, key: str | None, **extra) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", headers=bearer(key), json={"model": "tiny", "messages": MSGS, **extra},
                   timeout=10)
    assert r.status_code in (400, 429), r.text
    return r.json()["error"] | {"status": r.status_code}


def job_of(rds, queue: str, job_id: str) -> tuple[str, JobRequest]:
    """The stream the job is queued on, and its request as queued there."""
    keys = Keys(queue)
    stream = rds.hget(keys.job(job_id), wire.F_STREAM)
    assert stream, f"job {job_id} is not queued"
    entries = [f for _, f in rds.xrange(stream) if f["id"] == job_id]
    assert len(entries) == 1
    return stream, JobRequest.model_validate_json(entries[0]["job"])


def metric(base: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


# ---- the key file and the rules, on their own -------------------------------------------------------------------

def test_key_file_lane_and_top_priority():
    a, b = parse(f"alpha: {ALPHA} rpm=5\nbravo: {BRAVO} lane=default top_priority=-10 max_jobs=2\n")
    assert (a.lane, a.top_priority, a.rpm) == ("interactive", 0, 5)  # the defaults
    assert (b.lane, b.top_priority, b.max_jobs) == ("default", -10, 2)
    assert parse_line(f"c: {ALPHA} lane=batch top_priority=7").top_priority == 7
    for line, words in [(f"x: {ALPHA} lane=urgent", "lane= must be one of interactive, default, batch, got 'urgent'"),
                        (f"x: {ALPHA} top_priority=high", "top_priority= must be an integer"),
                        (f"x: {ALPHA} top_priority=1.5", "top_priority= must be an integer"),
                        (f"x: {ALPHA} top_priority=99999999999", "top_priority= must be an integer"),
                        (f"x: {ALPHA} lane=", "lane= must be one of")]:
        with pytest.raises(KeyFileError, match=re.escape(words)) as e:
            parse(f"# keys\n{line}\n", "keys")
        assert str(e.value).startswith("keys, line 2: ") and ALPHA not in str(e.value)


def test_lane_rules():
    req = JobRequest(prompt="x")
    alpha = ApiKey("alpha", digest(ALPHA))
    bravo = ApiKey("bravo", digest(BRAVO), lane="default", top_priority=-10)
    late = ApiKey("late", digest("sk-late"), lane="batch", top_priority=5)
    # Completions: the key's lane, or the service_tier's within what the key may; the key's id as the group.
    for key, tier, lane in [(alpha, None, "interactive"), (alpha, "auto", "interactive"), (alpha, "flex", "batch"),
                            (alpha, "priority", "interactive"), (bravo, "default", "default"),
                            (bravo, "flex", "batch"), (late, None, "batch"), (None, None, "interactive"),
                            (None, "flex", "batch"), (None, "priority", "interactive")]:
        out = lanes.interactive(req, tier, key)
        assert (out.lane, out.group) == (lane, key.id if key else None), (key, tier)
    assert lanes.interactive(req, None, late).priority == 5  # none sent: the most urgent the key allows
    assert lanes.interactive(req, None, bravo).priority == 0
    assert lanes.interactive(JobRequest(prompt="x", priority=-10), None, bravo).priority == -10
    assert lanes.interactive(JobRequest(prompt="x", priority=-99), None, None).priority == -99  # open: anything
    with pytest.raises(APIError) as e:
        lanes.interactive(JobRequest(prompt="x", priority=-11), None, bravo)
    assert (e.value.status, e.value.param, e.value.code) == (400, "priority", "priority_not_allowed")
    assert "top_priority is -10" in e.value.message
    for key, tier in [(bravo, "priority"), (late, "priority")]:
        with pytest.raises(APIError) as e:
            lanes.interactive(req, tier, key)
        assert (e.value.status, e.value.param) == (400, "service_tier") and f"the {key.lane} lane" in e.value.message

    # Batch lines: the batch lane always, --batch-priority unless the line sends an allowed one.
    out = lanes.batch_line(req, None, 0, alpha.id, 10)
    assert (out.lane, out.group, out.priority) == ("batch", alpha.id, 10)
    assert lanes.batch_line(req, "flex", None, None, 10).lane == "batch"
    assert lanes.batch_line(req, None, 20, alpha.id, 10).priority == 20  # the key's floor is above the default
    assert lanes.batch_line(JobRequest(prompt="x", priority=-5), "default", -5, alpha.id, 10).priority == -5
    with pytest.raises(APIError, match="top_priority is 0"):
        lanes.batch_line(JobRequest(prompt="x", priority=-1), None, 0, alpha.id, 10)
    with pytest.raises(APIError, match="not allowed in a batch"):
        lanes.batch_line(req, "priority", None, None, 10)


# ---- through a server -------------------------------------------------------------------------------------------

def test_keyed_requests_land_on_their_lanes_and_groups(redis_url, queue, rds, start_serve, tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ALPHA}\nbravo: {BRAVO} lane=default top_priority=-10\n")
    base = start_serve(queue, "--model", "tiny", "--api-key-file", str(keyfile))
    keys, ka, kb = Keys(queue), key_id(ALPHA), key_id(BRAVO)

    queued(base, ALPHA, "a1")
    stream, req = job_of(rds, queue, f"{ka}.a1")
    assert stream == keys.stream("interactive", ka) and (req.lane, req.group, req.priority) == ("interactive", ka, 0)
    assert ka in rds.smembers(keys.lane_groups("interactive"))
    queued(base, ALPHA, "a2", service_tier="flex")
    assert job_of(rds, queue, f"{ka}.a2")[0] == keys.stream("batch", ka)
    queued(base, ALPHA, "a3", service_tier="priority", priority=4)
    assert job_of(rds, queue, f"{ka}.a3")[1].priority == 4

    # bravo: the default lane, priorities down to -10.
    queued(base, BRAVO, "b1", priority=-10)
    stream, req = job_of(rds, queue, f"{kb}.b1")
    assert stream == keys.stream("default", kb) and (req.group, req.priority) == (kb, -10)
    queued(base, BRAVO, "b2", service_tier="default")
    assert job_of(rds, queue, f"{kb}.b2")[0] == keys.stream("default", kb)

    # Over the allowance: a 400 that names the field and the key's allowance, nothing queued.
    e = refused(base, ALPHA, priority=-1)
    assert (e["status"], e["param"], e["code"], e["type"]) == (400, "priority", "priority_not_allowed",
                                                               "invalid_request_error")
    assert "priority -1" in e["message"] and "top_priority is 0" in e["message"]
    e = refused(base, BRAVO, priority=-11)
    assert e["param"] == "priority" and "top_priority is -10" in e["message"]
    e = refused(base, BRAVO, service_tier="priority")
    assert (e["status"], e["param"], e["code"]) == (400, "service_tier", "service_tier_not_allowed")
    assert "default lane" in e["message"]
    e = refused(base, ALPHA, service_tier="scale")
    assert (e["status"], e["param"]) == (400, "service_tier")
    r = httpx.post(f"{base}/v1/completions", headers=bearer(ALPHA), json={"model": "tiny", "prompt": "x",
                                                                         "priority": -3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    # The official client says so too.
    with pytest.raises(openai.BadRequestError, match="top_priority"):
        openai.OpenAI(base_url=f"{base}/v1", api_key=ALPHA, max_retries=0).chat.completions.create(
            model="tiny", messages=MSGS, extra_body={"priority": -5})

    # A batch: every line in the batch lane and the key's group; lines that ask for more are line errors.
    lines = [{"model": "tiny", "messages": MSGS}, {"model": "tiny", "messages": MSGS, "priority": -1},
             {"model": "tiny", "messages": MSGS, "service_tier": "priority"},
             {"model": "tiny", "messages": MSGS, "service_tier": "flex", "priority": 3}]
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
                     for i, b in enumerate(lines))
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key=ALPHA, max_retries=0)
    f = oa.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "in_progress" and b.request_counts.failed == 2
    for i, priority in ((0, 10), (3, 3)):
        stream, req = job_of(rds, queue, f"{b.id}-{i}")
        assert stream == keys.stream("batch", ka) and (req.lane, req.group, req.priority) == ("batch", ka, priority)
    errors = {i: json.loads(rds.hget(BatchKeys.items(b.id), str(i)))["error"] for i in (1, 2)}
    assert errors[1]["code"] == "priority_not_allowed" and "top_priority is 0" in errors[1]["message"]
    assert errors[2]["code"] == "service_tier_not_allowed"
    assert metric(base, 'pagedq_serve_jobs_submitted_total{lane="batch"}') == 3  # a2 and the batch's two
    assert metric(base, 'pagedq_serve_jobs_submitted_total{lane="interactive"}') == 2
    oa.batches.cancel(b.id)


def test_open_server_lanes(queue, rds, start_serve):
    """No keys: any priority and lane, no group; batch lines still in the batch lane."""
    base = start_serve(queue, "--model", "tiny")
    keys = Keys(queue)
    queued(base, None, f"{queue}-o1", priority=-50)
    stream, req = job_of(rds, queue, f"{queue}-o1")
    assert stream == keys.stream("interactive") and (req.group, req.priority) == (None, -50)
    queued(base, None, f"{queue}-o2", service_tier="flex")
    assert job_of(rds, queue, f"{queue}-o2")[0] == keys.stream("batch")
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    line = {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": MSGS, "priority": -7}}
    f = oa.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    stream, req = job_of(rds, queue, f"{b.id}-0")
    assert stream == keys.stream("batch") and (req.group, req.priority) == (None, -7)
    oa.batches.cancel(b.id)


def test_full_batch_lane_never_refuses_interactive(queue, rds, start_serve, tmp_path):
    """--max-queue-depth 2: a batch of three lines fills the batch lane past it; interactive requests still go in,
    a request for the batch lane (service_tier flex) gets 429, and so does one once the interactive lane is full."""
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ALPHA}\n")
    base = start_serve(queue, "--model", "tiny", "--max-queue-depth", "2", "--retry-after", "2",
                       "--api-key-file", str(keyfile))
    keys, ka = Keys(queue), key_id(ALPHA)
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key=ALPHA, max_retries=0)
    text = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "tiny", "messages": MSGS}}) for i in range(3))
    f = oa.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "in_progress" and rds.xlen(keys.stream("batch", ka)) == 3

    queued(base, ALPHA, "i1")  # the interactive lane holds nothing yet: in
    e = refused(base, ALPHA, service_tier="flex")
    assert (e["status"], e["code"]) == (429, "queue_full") and "batch lane" in e["message"]
    queued(base, ALPHA, "i2")  # one job in the interactive lane, the limit is 2: in
    e = refused(base, ALPHA)  # two now
    assert (e["status"], e["code"]) == (429, "queue_full") and "interactive lane" in e["message"]
    assert metric(base, f'pagedq_serve_queue_full_total{{lane="batch",queue="{queue}"}}') == 1
    assert metric(base, f'pagedq_serve_queue_full_total{{lane="interactive",queue="{queue}"}}') == 1
    assert metric(base, 'pagedq_serve_refused_total{reason="queue_full"}') == 2
    oa.batches.cancel(b.id)


def test_lane_depth_counts_the_lanes_groups(redis_url, queue):
    """Queues.depth: the lane's own stream plus its groups' streams, not the other lanes'; read again after
    DEPTH_CACHE_S, and in between the figure read plus what this process queued."""
    with Client(redis_url, queue=queue) as c:
        c.submit(prompt="a", lane="batch")
        c.submit(prompt="b", lane="batch", group="g1")
        c.submit(prompt="c", lane="batch", group="g2")
        c.submit(prompt="d", lane="interactive", group="g1")
        c.submit(prompt="e")  # the default lane

        async def go():
            q = Queues(ServeConfig(redis_url=redis_url, queue=queue, max_queue_depth=3), ServeMetrics())
            try:
                client = q.client(queue)
                depths = [await q.depth(client.keys, lane) for lane in ("interactive", "default", "batch")]
                await q.check_depth(client, "interactive")
                with pytest.raises(APIError) as e:
                    await q.check_depth(client, "batch")
                assert (e.value.status, e.value.code) == (429, "queue_full")
                c.submit(prompt="f", lane="interactive", group="g3")
                cached = await q.depth(client.keys, "interactive")
                q.submitted(client, "interactive")
                counted = await q.depth(client.keys, "interactive")
                await asyncio.sleep(0.6)
                fresh = await q.depth(client.keys, "interactive")
                return depths, cached, counted, fresh
            finally:
                await q.close()

        depths, cached, counted, fresh = asyncio.run(go())
    assert depths == [1, 1, 3]
    assert (cached, counted, fresh) == (1, 2, 2)
