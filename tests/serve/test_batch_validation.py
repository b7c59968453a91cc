"""A batch's lines are read off the event loop and each is checked as the live routes check a request: whatever is
wrong with a line (JSON, a lone surrogate, a field, a size limit, a constraint that takes too long to check) is
that line's error line, and the batch goes on with the others; a batch whose reading fails, or whose reader died
midway, is failed with the reason, never left validating."""

import json
import time

import openai
import pytest
import redis

from producer import flows
from producer.keys import BatchKeys
from serve import batch_intake, batch_lines, batches, constraints, cpu_process, files, translate
from serve.config import ServeConfig

WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "512",
                "--served-model-name", "tiny")


def line(cid: str, content: str = "Hi", **body) -> str:
    b = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0,
         **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b})


def test_bad_lines_go_to_the_error_file_and_the_batch_completes(queue, pq_tiny_model, start_worker, start_serve):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    c = openai.OpenAI(base_url=f"{start_serve(queue, '--model', 'tiny')}/v1", api_key="x", max_retries=0)
    bad = {"surrogate": line("surrogate", "half a pair: \ud800"),  # json.dumps writes it as \\ud800
           "field": line("field", temperature="hot"),
           "limit": line("limit", max_tokens=40_000),  # past Limits.max_tokens
           "model": line("model", model="not-served")}
    text = "\n".join([line("good-0", "One?"), *bad.values(), line("good-1", "Two?")])
    assert "\\ud800" in text
    f = c.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.request_counts.total == 6
    end = time.monotonic() + 120
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < end, b.status
        time.sleep(0.2)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 4)
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ["good-0", "good-1"]
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"] for x in out)
    errors = {x["custom_id"]: x["error"] for x in map(json.loads, c.files.content(b.error_file_id).text.splitlines())}
    assert list(errors) == list(bad)
    assert errors["surrogate"]["code"] == "invalid_unicode" and "U+D800" in errors["surrogate"]["message"]
    assert errors["field"]["code"] == "invalid_request_error" and "temperature" in errors["field"]["message"]
    assert errors["limit"]["code"] == "limit_exceeded" and "32768" in errors["limit"]["message"]
    assert errors["model"]["code"] == "model_not_found"


def test_a_surrogate_in_a_custom_id_is_shown_escaped():
    reader = batch_lines.LineReader("batch_x", translate.CHAT, ServeConfig(), 60)
    it = reader.item('{"custom_id": "a\\udc00b", "method": "POST", "url": "/v1/chat/completions"}', "batch_x-0")
    assert it.custom_id == "a\\udc00b" and it.error["code"] == "invalid_unicode"
    ok, text = batch_lines.output_line(it, "batch_x-0", "chat", None)
    assert not ok and text.encode()  # UTF-8 holds it: it can be stored


def test_a_line_nested_too_deep_is_an_error_line():
    reader = batch_lines.LineReader("batch_x", translate.CHAT, ServeConfig(), 60)
    deep = "[" * 100_000 + "]" * 100_000
    chunk = reader.read([line("deep", metadata={"k": "v"}).replace('"v"', deep), line("fine")], 0)
    assert json.loads(chunk.items["0"])["error"]["code"] == "invalid_json" and chunk.jobs == ["1"]


def test_a_constraint_that_takes_too_long_to_check_fails_its_line_only(monkeypatch):
    checked = constraints.problem

    def slow(kind: str, spec: object) -> str:
        if "slow" in json.dumps(spec):
            time.sleep(1)
        return checked(kind, spec)

    monkeypatch.setattr(constraints, "problem", slow)
    reader = batch_lines.LineReader("batch_x", translate.CHAT, ServeConfig(constraint_check_s=0.2), 60)
    lines = [line("slow", guided_regex="slow[a-z]+"), line("quick", guided_regex="[0-9]+"), line("plain")]
    chunk = reader.read(lines, 0)
    reader.close()
    items = {i: batch_lines.Item.from_json(v) for i, v in chunk.items.items()}
    assert items["0"].error["code"] == "constraint_timeout" and "0.2 s" in items["0"].error["message"]
    assert items["1"].request.guided_regex == "[0-9]+" and items["2"].request is not None
    assert chunk.jobs == ["1", "2"] and chunk.errors == 1


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


def test_a_batch_whose_reading_fails_is_failed_with_the_reason(r, redis_url, queue, monkeypatch):
    def broken(self, lines, first):
        raise RuntimeError("the reader broke")

    monkeypatch.setattr(batch_lines.LineReader, "read", broken)
    monkeypatch.setattr(cpu_process, "call", lambda fn, *args: fn(*args))  # read here, where the patch holds
    cfg = ServeConfig(redis_url=redis_url, queue=queue)
    f = flows.drive(r, files.put("\n".join(line(f"r{i}") for i in range(3)), "in.jsonl", "batch", 600))
    b = flows.drive(r, batches.create(cfg, f["id"], "/v1/chat/completions"))
    assert b["status"] == "failed" and b["failed_at"]
    (err,) = b["errors"]["data"]
    assert err["code"] == "validation_failed" and "RuntimeError: the reader broke" in err["message"]
    assert b["id"] not in r.smembers(BatchKeys.active) and not r.exists(BatchKeys.submitting(b["id"]))


def test_a_batch_whose_reader_died_midway_is_failed_by_the_next(r, redis_url, queue, monkeypatch):
    """The creator dies between two chunks of lines: once its lease lapses, the process that moves the batch on
    fails it (its lines were not all read, so its jobs cannot be submitted)."""
    monkeypatch.setattr(batch_intake, "READ_CHUNK", 2)
    cfg = ServeConfig(redis_url=redis_url, queue=queue)
    f = flows.drive(r, files.put("\n".join(line(f"r{i}") for i in range(5)), "in.jsonl", "batch", 600))
    flow = batches.create(cfg, f["id"], "/v1/chat/completions")
    reply, stored = None, 0
    while stored < 2:  # the batch's hash, then its first chunk of items
        op = flow.send(reply)
        reply = flows.execute(r, op)
        stored += isinstance(op, flows.Pipe) and any(c.name == "hset" for c in op.cmds)
    flow.close()  # the creator is gone
    (batch_id,) = [i for i in r.smembers(BatchKeys.active) if r.hget(BatchKeys.batch(i), "input_file_id") == f["id"]]
    assert flows.drive(r, batches.get(batch_id))["status"] == "validating"  # its lease holds
    r.delete(BatchKeys.submitting(batch_id))  # ... until it lapses
    b = flows.drive(r, batches.get(batch_id))
    assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "validation_interrupted"
    assert batch_id not in r.smembers(BatchKeys.active)


def test_a_batch_whose_jobs_cannot_be_submitted_for_an_hour_is_failed(r, redis_url, queue):
    """Its lines were all read, and every process that took it over failed to submit its jobs for an hour."""
    cfg = ServeConfig(redis_url=redis_url, queue=queue)
    f = flows.drive(r, files.put("\n".join(line(f"r{i}") for i in range(3)), "in.jsonl", "batch", 600))
    flow = batches.create(cfg, f["id"], "/v1/chat/completions")
    reply = None
    while not isinstance(op := flow.send(reply), flows.Pipe) or not any("EVALSHA" in c.args for c in op.cmds):
        reply = flows.execute(r, op)
    flow.close()  # the creator dies as it submits
    (batch_id,) = [i for i in r.smembers(BatchKeys.active) if r.hget(BatchKeys.batch(i), "input_file_id") == f["id"]]
    r.delete(BatchKeys.submitting(batch_id))
    r.hincrby(BatchKeys.batch(batch_id), "created_at", -7200)
    b = flows.drive(r, batches.get(batch_id))
    assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "submission_failed"
