"""The `pagedq` CLI against a real redis-server."""

import json
import subprocess
import sys

import redis
from click.testing import CliRunner

from worker.cli import main


def run(redis_url, queue, *args, **kw):
    res = CliRunner().invoke(main, [*args], env={"REDIS_URL": redis_url, "PAGEDQ_QUEUE": queue}, **kw)
    return res


def test_submit_status_cancel_result_without_worker(redis_url, queue):
    res = run(redis_url, queue, "status")
    assert res.exit_code == 0 and f"queue {queue}: 0 waiting" in res.output
    res = run(redis_url, queue, "submit", "Hello", "--no-wait", "--id", "cli-1")
    assert res.exit_code == 0 and res.output.strip() == "cli-1"
    res = run(redis_url, queue, "submit", "Hello", "--no-wait", "--id", "cli-1")
    assert res.exit_code != 0 and "already exists" in res.output
    assert run(redis_url, queue, "status").output.startswith(f"queue {queue}: 1 waiting")
    assert run(redis_url, queue, "status", "cli-1").output.strip() == "queued"
    assert run(redis_url, queue, "cancel", "cli-1").output.strip() == "cancelled"
    res = run(redis_url, queue, "result", "cli-1", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["status"] == "cancelled"
    res = run(redis_url, queue, "result", "nope", "--timeout", "1")
    assert res.exit_code != 0 and "no job" in res.output
    res = run(redis_url, queue, "submit", "x", "--max-tokens", "0")
    assert res.exit_code != 0 and "max_tokens" in res.output


def test_submit_with_worker(redis_url, queue, pq_tiny_model, start_worker):
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "4", "--num-kv-blocks", "64", "--max-model-len", "256")
    res = run(redis_url, queue, "submit", "Hello", "--max-tokens", "5", "--temperature", "0", "--json",
              "--timeout", "120")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["status"] == "completed" and out["usage"]["completion_tokens"] <= 5
    res = run(redis_url, queue, "submit", "Hello", "--chat", "--stream", "--max-tokens", "5", "--temperature", "0")
    assert res.exit_code == 0, res.output
    info = json.loads(run(redis_url, queue, "status", "--json").output)
    assert len(info["consumers"]) == 1 and info["pending"] == 0


def test_redis_command():
    p = subprocess.Popen([sys.executable, "-m", "worker", "redis"], stdout=subprocess.PIPE, text=True)
    try:
        url = p.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(url).ping()
    finally:
        p.terminate()
        assert p.wait(10) == 0


def test_demo_on_tiny_model(pq_tiny_model):
    res = subprocess.run([sys.executable, "-m", "worker", "demo", "--model", pq_tiny_model, "--jobs", "3",
                          "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3/3 completed" in res.stdout and "tokens/s" in res.stdout
