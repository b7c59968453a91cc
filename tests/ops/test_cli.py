"""The `pagedq` CLI against a real redis-server."""

import json
import os
import subprocess
import sys

import pytest
import redis
from click.testing import CliRunner

from cli import main


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
    # The wrong --queue: the job is found where it is (no worker ever served this queue: found by a SCAN).
    res = run(redis_url, queue, "cancel", "cli-1", "--queue", "no-such-queue")
    assert res.exit_code == 5 and f"it is in queue {queue!r}: pass --queue {queue}" in res.output, res.output
    # No worker: the wait times out with one line that says what to do next, and its own exit code.
    res = run(redis_url, queue, "submit", "Hello", "--id", "cli-2", "--timeout", "0.5")
    assert res.exit_code == 4 and "pagedq result cli-2" in res.output and "Traceback" not in res.output, res.output


def test_submit_with_worker(redis_url, queue, pq_tiny_model, start_worker):
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "4", "--num-kv-blocks", "256", "--max-model-len", "2048")
    res = run(redis_url, queue, "submit", "Hello", "--max-tokens", "5", "--temperature", "0", "--json",
              "--timeout", "120")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["status"] == "completed" and out["usage"]["completion_tokens"] <= 5
    res = run(redis_url, queue, "submit", "Hello", "--chat", "--stream", "--max-tokens", "5", "--temperature", "0")
    assert res.exit_code == 0, res.output
    info = json.loads(run(redis_url, queue, "status", "--json").output)
    assert len(info["consumers"]) == 1 and info["pending"] == 0

    # Cancelled while it runs: `result` shows the text made before the cancel, and says it was cancelled. The
    # model's whole context, so that the job outlasts the two commands before the cancel on a loaded machine.
    from producer import Client

    with Client(redis_url, queue=queue) as c:
        job = c.submit(prompt="Count", max_tokens=2000, temperature=0, ignore_eos=True)
        assert next(iter(job.stream(timeout=120))).type == "token"
    res = run(redis_url, queue, "cancel", job.id, "--queue", "elsewhere")  # the worker's queue is registered
    assert res.exit_code == 5 and f"pass --queue {queue}" in res.output, res.output
    assert run(redis_url, queue, "cancel", job.id).exit_code == 0
    res = run(redis_url, queue, "result", job.id, "--timeout", "60")
    final = json.loads(run(redis_url, queue, "result", job.id, "--json").output)
    assert final["status"] == "cancelled" and final["text"]
    assert res.exit_code == 7 and final["text"] in res.output and "cancelled after" in res.output, res.output


def test_unreachable_redis_is_one_line_and_exit_code_3():
    url = "redis://127.0.0.1:1/0"
    for args in (["status"], ["submit", "hi"], ["dlq", "list"], ["result", "x"], ["cancel", "x"],
                 # a model that does not exist: Redis is checked first, before any model is loaded
                 ["worker", "--model", "/no/such/model"]):
        res = CliRunner().invoke(main, args, env={"REDIS_URL": url})
        assert res.exit_code == 3, (args, res.output)
        assert "Redis unreachable" in res.output and "--redis-url" in res.output, (args, res.output)
        assert len(res.output.strip().splitlines()) == 1, (args, res.output)


def test_models_pull_without_torch_names_the_extra(tmp_path):
    # An empty model cache, so the pull must convert, which needs torch: the producer-only install lacks it.
    code = ("import sys; sys.modules['torch'] = None\n"
            "from cli import main; main(['models', 'pull', 'smollm2-135m-instruct'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PAGEDQ_CACHE": str(tmp_path)})
    assert res.returncode == 6, res.stdout + res.stderr
    assert "pip install 'pagedq[worker]'" in res.stderr and "Traceback" not in res.stderr, res.stderr


def _options(cmd, path=()):
    import click

    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _options(sub, (*path, name))
    for p in cmd.params:
        if isinstance(p, click.Option) and p.name not in ("help", "version"):
            yield path, p


def test_every_option_has_help_and_shows_its_env_var():
    bare = [f"{' '.join(path)} {p.opts[0]}" for path, p in _options(main) if not p.help]
    assert not bare, f"options without help text: {bare}"
    for path in {path for path, _ in _options(main)}:
        out = CliRunner().invoke(main, [*path, "--help"]).output
        flat = " ".join(out.split())
        assert flat.count("env var: PAGEDQ_") == sum(1 for x in _options(main) if x[0] == path), (path, out)
    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0 and "pagedq, version" in res.output


def test_redis_command():
    p = subprocess.Popen([sys.executable, "-m", "cli", "redis"], stdout=subprocess.PIPE, text=True)
    try:
        url = p.stdout.readline().strip()
        assert url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(url).ping()
    finally:
        p.terminate()
        assert p.wait(10) == 0


@pytest.mark.slow
def test_demo_on_tiny_model(pq_tiny_model):
    res = subprocess.run([sys.executable, "-m", "cli", "demo", "--model", pq_tiny_model, "--jobs", "3",
                          "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3/3 completed" in res.stdout and "tokens/s" in res.stdout
