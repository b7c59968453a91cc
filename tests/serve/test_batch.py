"""The Batch API: through `pagedq serve` with the official `openai` client, across two serve processes, and
with `pagedq batch` (no server). Real processes: a redis-server, a worker on a tiny model, the servers."""

import json
import time

import httpx
import openai
import pytest
import redis
from click.testing import CliRunner

from cli import main
from producer import Client, flows
from producer.keys import BatchKeys
from serve import batches, files
from serve.config import ServeConfig

WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "512",
                "--served-model-name", "tiny")
FINAL = ("completed", "failed", "expired", "cancelled")


def line(cid: str, content: str, max_tokens: int = 4, url: str = "/v1/chat/completions", **body) -> str:
    b = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
         "temperature": 0, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": b})


GOOD = [line(f"req-{i}", f"Question {i}?", 3 + i) for i in range(4)]
BAD = ["{not json",
       json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),  # no custom_id
       line("tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
       line("wrong-url", "x", url="/v1/embeddings")]


def wait_final(get, timeout: float = 120):
    end = time.monotonic() + timeout
    while True:
        b = get()
        if b.status in FINAL:
            return b
        assert time.monotonic() < end, f"batch still {b.status}"
        time.sleep(0.1)


def check_output(text: str, queue: str, redis_url: str, custom_ids: list[str]) -> None:
    """One line per completed request, with its custom_id, whose text is its job's result."""
    lines = [json.loads(x) for x in text.splitlines()]
    assert [x["custom_id"] for x in lines] == custom_ids
    with Client(redis_url, queue=queue) as c:
        for x in lines:
            resp = x["response"]
            assert resp["status_code"] == 200 and x["error"] is None
            res = c.result(resp["request_id"], timeout=5)
            assert resp["body"]["choices"][0]["message"]["content"] == res.text
            assert resp["body"]["usage"]["completion_tokens"] == len(res.token_ids)


def test_batch_with_openai_client_and_bad_lines(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    oa = openai.OpenAI(base_url=f"{start_serve(queue, '--model', 'tiny')}/v1", api_key="x", max_retries=0)
    f = oa.files.create(file=("in.jsonl", "\n".join(GOOD[:2] + BAD + GOOD[2:]).encode()), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and oa.files.retrieve(f.id).filename == "in.jsonl"
    assert oa.files.content(f.id).text.startswith(GOOD[0])
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                          metadata={"run": "t1"})
    assert b.status in ("in_progress", "finalizing", "completed") and b.request_counts.total == 8
    b = wait_final(lambda: oa.batches.retrieve(b.id))
    assert b.status == "completed" and b.metadata == {"run": "t1"}
    assert (b.request_counts.completed, b.request_counts.failed) == (4, 4)
    assert b.completed_at and b.in_progress_at and b.finalizing_at
    check_output(oa.files.content(b.output_file_id).text, queue, redis_url, [f"req-{i}" for i in range(4)])
    errors = [json.loads(x) for x in oa.files.content(b.error_file_id).text.splitlines()]
    assert [e["error"]["code"] for e in errors] == ["invalid_json", "missing_custom_id", "unsupported_parameter",
                                                   "invalid_url"]
    assert 'no "auto"' in errors[2]["error"]["message"]  # tools without tool_choice: "auto", refused
    assert b.id in [x.id for x in oa.batches.list(limit=5)]


def test_two_servers_one_restarting(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    """A batch created on one server, which then dies, is completed and read through the other."""
    a = start_serve(queue, "--model", "tiny")
    b = start_serve(queue, "--model", "tiny")
    up = httpx.post(f"{a}/v1/files", data={"purpose": "batch"},
                    files={"file": ("in.jsonl", "\n".join(GOOD).encode())})
    assert up.status_code == 200, up.text
    created = httpx.post(f"{a}/v1/batches", json={"input_file_id": up.json()["id"],
                                                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert created.status_code == 200 and created.json()["status"] == "in_progress"
    start_serve.procs[0].kill()  # mid-batch: no worker has run anything yet
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    oa = openai.OpenAI(base_url=f"{b}/v1", api_key="x", max_retries=0)
    done = wait_final(lambda: oa.batches.retrieve(created.json()["id"]))
    assert done.status == "completed" and done.request_counts.completed == 4 and done.error_file_id is None
    check_output(oa.files.content(done.output_file_id).text, queue, redis_url, [f"req-{i}" for i in range(4)])


def test_cancel_a_batch_nobody_runs(redis_url, queue, start_serve):
    oa = openai.OpenAI(base_url=f"{start_serve(queue)}/v1", api_key="x", max_retries=0)
    f = oa.files.create(file=("in.jsonl", "\n".join(GOOD).encode()), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = oa.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled")
    b = wait_final(lambda: oa.batches.retrieve(b.id))
    assert b.status == "cancelled" and b.cancelled_at and b.output_file_id is None
    errors = [json.loads(x) for x in oa.files.content(b.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == 4
    with Client(redis_url, queue=queue) as c:
        assert {c.status(f"{b.id}-{i}") for i in range(4)} == {"cancelled"}
    r = httpx.get(f"{oa.base_url}batches/batch_nope")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(f"{oa.base_url}batches", json={"input_file_id": "file-nope", "endpoint": "/v1/chat/completions"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"


def test_a_creator_that_died_mid_submit_is_taken_over(redis_url, queue):
    """The creating process dies after storing the batch, before submitting its jobs: once its lease lapses,
    the next reader submits them (with their fixed ids, so nothing runs twice)."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    cfg = ServeConfig(redis_url=redis_url, queue=queue)

    def crash_before_jobs(flow):
        reply = None
        while True:
            op = flow.send(reply)
            if isinstance(op, flows.Pipe) and any("EVALSHA" in c.args for c in op.cmds):
                raise RuntimeError("the creator died")
            reply = flows.execute(r, op)

    f = flows.drive(r, files.put("\n".join(GOOD), "in.jsonl", "batch", 600))
    with pytest.raises(RuntimeError, match="died"):
        crash_before_jobs(batches.create(cfg, f["id"], "/v1/chat/completions"))
    (batch_id,) = [i for i in r.smembers(BatchKeys.active) if r.hget(BatchKeys.batch(i), "input_file_id") == f["id"]]
    assert flows.drive(r, batches.get(batch_id))["status"] == "validating"  # its creator's lease holds
    r.delete(BatchKeys.submitting(batch_id))  # ... until it lapses
    b = flows.drive(r, batches.get(batch_id))
    assert b["status"] == "in_progress" and b["request_counts"]["total"] == 4
    with Client(redis_url, queue=queue) as c:
        assert {c.status(f"{batch_id}-{i}") for i in range(4)} == {"queued"}
    r.close()


def test_batch_cli(redis_url, queue, pq_tiny_model, start_worker, tmp_path):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(GOOD + BAD[:1]) + "\n")
    env = {"REDIS_URL": redis_url, "PAGEDQ_QUEUE": queue}
    run = CliRunner().invoke
    res = run(main, ["batch", "submit", str(src), "--model", "tiny", "--metadata", "who=cli"], env=env)
    assert res.exit_code == 0, res.output
    batch_id = res.output.strip()
    status = json.loads(run(main, ["batch", "status", batch_id], env=env).output)
    assert status["id"] == batch_id and status["request_counts"]["total"] == 5
    res = run(main, ["batch", "wait", batch_id, "--timeout", "120"], env=env)
    assert res.exit_code == 0 and "completed: 4 completed, 1 failed of 5" in res.output, res.output
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    res = run(main, ["batch", "download", batch_id, "-o", str(out), "--errors", str(err)], env=env)
    assert res.exit_code == 0, res.output
    check_output(out.read_text(), queue, redis_url, [f"req-{i}" for i in range(4)])
    assert json.loads(err.read_text())["error"]["code"] == "invalid_json"


def test_serve_on_a_redis_cluster(redis_cluster, cluster_queues, pq_tiny_model, start_worker, start_serve):
    """Jobs live in the queue's slot, each batch's keys in a slot of their own: all of it through one node's
    plain URL."""
    queue = cluster_queues[0]
    url = redis_cluster.urls[-1]
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS, url=url)
    oa = openai.OpenAI(base_url=f"{start_serve(queue, '--model', 'tiny', url=url)}/v1", api_key="x", max_retries=0)
    chat = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.usage.completion_tokens <= 3
    f = oa.files.create(file=("in.jsonl", "\n".join(GOOD[:2] + BAD[:1]).encode()), purpose="batch")
    created = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_final(lambda: oa.batches.retrieve(created.id))
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (2, 1)
    assert [json.loads(x)["custom_id"] for x in oa.files.content(b.output_file_id).text.splitlines()] == \
        ["req-0", "req-1"]


def test_batch_cli_needs_no_http_server_packages():
    import subprocess
    import sys

    code = ("import sys; [sys.modules.__setitem__(m, None) for m in ('fastapi', 'starlette', 'uvicorn')]; "
            "import producer, serve.batch_cli, cli")
    subprocess.run([sys.executable, "-c", code], check=True)
