"""API keys as tenants of `pagedq serve`: each key owns the files, batches and jobs it makes (another key gets
404), the key file (named and hashed keys, reloaded on SIGHUP), per-key rate limits and job caps, and per-key
usage (`pagedq usage`, Prometheus). Real processes: a redis-server, the servers, a worker on a tiny model where
jobs must run; the official `openai` client where it can say it."""

import concurrent.futures
import hashlib
import json
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from faults import wait_for

from producer import Client, wire
from producer.keys import ApiKeyKeys, Keys
from serve.api_keys import KeyFileError, KeyRing, key_id, parse

SECRETS = ("sk-alpha-5f2c91", "sk-bravo-0b7d44", "sk-charlie-9e1a07", "sk-delta-4c3b88")
WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "512",
                "--served-model-name", "tiny")
GOOD = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}?"}],
                             "max_tokens": 3 + i, "temperature": 0}}) for i in range(2)]


def tenants(queue: str) -> tuple[str, ...]:
    """Four keys of the test's own (usage records are per key and the session's Redis keeps them)."""
    return tuple(f"{k}-{queue}" for k in SECRETS)


def sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def wait_status(get, status: str, timeout: float = 60):
    return wait_for(lambda: (lambda b: b.status == status and b)(get()), timeout, f"the batch to be {status}")


def log_of(proc) -> str:
    with open(proc.log.name) as f:
        return f.read()


# ---- the key file ---------------------------------------------------------------------------------------------

def test_key_file_names_hashes_and_limits(tmp_path):
    ka, kb, kc, kd = SECRETS
    keys = parse(f"# tenants\nalpha: {ka} rpm=60\nbravo sha256:{sha256(kb).upper()} tpm=1000 max_jobs=4\n\n{kc}\n")
    assert [(k.name, k.id, k.rpm, k.tpm, k.max_jobs) for k in keys] == [
        ("alpha", key_id(ka), 60, None, None), ("bravo", key_id(kb), None, 1000, 4),
        (key_id(kc), key_id(kc), None, None, None)]  # a key without a name is named by its id
    assert key_id(ka) == sha256(ka)[:16]
    for text, words in [("a b c", "line 1: give `[NAME:] KEY"), (f"bad/name: {ka}", "name is 1-64 characters"),
                        ("a: sk-secret-1\nb: sk-secret-1", "given twice"), ("a: sk-secret-1\na: sk-secret-2",
                                                                            "two keys are named 'a'")]:
        with pytest.raises(KeyFileError, match=re.escape(words)) as e:
            path = tmp_path / "keys"
            path.write_text(text)
            KeyRing([], str(path))
        assert "sk-secret" not in str(e.value)  # an error names the line, never the key
    path = tmp_path / "keys"
    path.write_text(f"alpha: {ka}\n")
    ring = KeyRing([kd], str(path))
    assert ring.identify(ka).name == "alpha" and ring.identify(kd).name == key_id(kd) and ring.identify(kb) is None
    path.write_text(f"bravo sha256:{sha256(kb)}\n")
    assert [k.name for k in ring.reload()] == [key_id(kd), "bravo"] and ring.identify(ka) is None
    path.write_text("oops a b\n")
    with pytest.raises(KeyFileError):
        ring.reload()
    assert ring.identify(kb).name == "bravo"  # a file that does not parse leaves the keys as they were
    path.write_text("")
    assert ring.reload() == (ring.fixed[0],) and ring.enabled and ring.identify(kb) is None  # emptied: not open


# ---- ownership ------------------------------------------------------------------------------------------------

def test_keys_own_their_files_batches_and_jobs(redis_url, queue, rds, start_serve, tmp_path):
    """No worker: ownership needs none. Key A's file and batch, made on one server, are not found by key B in
    any endpoint, on another server and after a restart; A sees them everywhere."""
    ka, kb, kc, kd = tenants(queue)
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ka}\nbravo sha256:{sha256(kb)}\n")
    one = start_serve(queue, "--api-key-file", str(keyfile))
    two = start_serve(queue, "--api-key-file", str(keyfile))
    a1, b2 = sdk(one, ka), sdk(two, kb)
    f = a1.files.create(file=("in.jsonl", "\n".join(GOOD).encode()), purpose="batch")
    b = a1.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    def invisible_to(c: openai.OpenAI) -> None:
        assert f.id not in [x.id for x in c.files.list()] and b.id not in [x.id for x in c.batches.list()]
        for call in (lambda: c.files.retrieve(f.id), lambda: c.files.content(f.id), lambda: c.files.delete(f.id),
                     lambda: c.batches.retrieve(b.id), lambda: c.batches.cancel(b.id),
                     lambda: c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert e.value.code == "not_found" and e.value.status_code == 404

    def visible_to(c: openai.OpenAI) -> None:
        assert f.id in [x.id for x in c.files.list()] and b.id in [x.id for x in c.batches.list()]
        assert c.files.retrieve(f.id).bytes == f.bytes and c.files.content(f.id).text.startswith(GOOD[0])
        assert c.batches.retrieve(b.id).status in ("in_progress", "cancelling", "cancelled")

    invisible_to(b2)
    invisible_to(sdk(one, kb))
    visible_to(sdk(two, ka))
    # The batch's jobs are A's: their records name A's key id, never a key.
    assert {rds.hget(Keys(queue).job(f"{b.id}-{i}"), wire.F_OWNER) for i in range(2)} == {key_id(ka)}

    # Idempotency-Keys are each key's own: the same one from A and from B makes two jobs, each its key's.
    for key in (ka, kb):
        with pytest.raises(httpx.ReadTimeout):  # no worker: the answer never comes, the job stays
            httpx.post(f"{one}/v1/chat/completions", headers={**bearer(key), "Idempotency-Key": f"same-{queue}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, timeout=1)
    for key in (ka, kb):
        assert rds.hget(Keys(queue).job(f"{key_id(key)}.same-{queue}"), wire.F_OWNER) == key_id(key)

    start_serve.procs[0].kill()  # a restart: a new process knows nothing but Redis
    three = start_serve(queue, "--api-key-file", str(keyfile))
    invisible_to(sdk(three, kb))
    a3 = sdk(three, ka)
    visible_to(a3)
    assert a3.batches.cancel(b.id).status in ("cancelling", "cancelled")
    out = wait_status(lambda: a3.batches.retrieve(b.id), "cancelled")
    invisible_to(sdk(three, kb))  # the error file A's batch made is A's too
    assert a3.files.content(out.error_file_id).text and out.error_file_id in [x.id for x in a3.files.list()]
    with pytest.raises(openai.NotFoundError):
        sdk(three, kb).files.retrieve(out.error_file_id)

    # Without keys, a server is open and sees everything, as before keys existed; what it makes is no key's.
    bare = sdk(start_serve(queue), "unused")
    assert f.id in [x.id for x in bare.files.list()] and bare.batches.retrieve(b.id).id == b.id
    nobodys = bare.files.create(file=("x.jsonl", GOOD[0].encode()), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        a3.files.retrieve(nobodys.id)
    assert a3.files.delete(f.id).deleted and f.id not in [x.id for x in bare.files.list()]


# ---- the key file reloaded on SIGHUP, in every process ---------------------------------------------------------

def test_sighup_reloads_hashed_keys_in_every_worker(queue, start_serve, tmp_path):
    ka, kb, kc, kd = tenants(queue)
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ka}\nbravo sha256:{sha256(kb)}\n")
    base = start_serve(queue, "--api-key-file", str(keyfile), "--workers", "2", "--log-level", "INFO")
    proc = start_serve.procs[-1]

    def codes(key: str) -> set[int]:  # a new connection each: both processes answer
        return {httpx.get(f"{base}/v1/models", headers=bearer(key)).status_code for _ in range(12)}

    def reloads() -> int:
        return log_of(proc).count("API keys reloaded")

    assert codes(ka) == codes(kb) == {200} and codes(kc) == {401}
    keyfile.write_text(f"bravo sha256:{sha256(kb)}\ncharlie: {kc}\n")
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: reloads() == 2, 30, "both server processes to reload")
    assert codes(ka) == {401} and codes(kb) == codes(kc) == {200}
    with pytest.raises(openai.AuthenticationError):
        sdk(base, ka).models.list()

    keyfile.write_text("not a key file\n")  # a broken file: each process says so and keeps its keys
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: log_of(proc).count("API keys not reloaded") == 2, 30, "both processes to refuse the file")
    assert codes(kc) == {200} and proc.poll() is None

    log, metrics = log_of(proc), httpx.get(f"{base}/metrics").text
    assert "(bravo, charlie)" in log and 'key="charlie"' in metrics
    assert not [k for k in (ka, kb, kc) if k in log or k in metrics]  # names, never the keys


# ---- limits ---------------------------------------------------------------------------------------------------

def test_rate_limits_and_the_cap_on_jobs_per_key(redis_url, queue, rds, start_serve, tmp_path):
    """No worker: admitted jobs stay queued. B hits its requests per minute, C its tokens per minute, D its cap
    under a burst spread over two server processes; A is served all along."""
    ka, kb, kc, kd = tenants(queue)
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ka}\nbravo: {kb} rpm=3\ncharlie: {kc} tpm=100\ndelta: {kd} max_jobs=3\n")
    base = start_serve(queue, "--api-key-file", str(keyfile), "--workers", "2", "--model", "tiny")
    msgs = [{"role": "user", "content": "Hi"}]

    assert [httpx.get(f"{base}/v1/models", headers=bearer(kb)).status_code for _ in range(3)] == [200] * 3
    r = httpx.get(f"{base}/v1/models", headers=bearer(kb))
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 20
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "requests", "param": None,
                                 "code": "rate_limit_exceeded"} and "bravo: 3 requests per minute" in r.text
    with pytest.raises(openai.RateLimitError):
        sdk(base, kb).models.list()
    assert all(httpx.get(f"{base}/v1/models", headers=bearer(ka)).status_code == 200 for _ in range(10))

    with pytest.raises(openai.RateLimitError, match="Request too large for key charlie"):
        sdk(base, kc).chat.completions.create(model="tiny", messages=msgs, max_tokens=150)
    with pytest.raises(httpx.ReadTimeout):  # admitted, charged 61 of its 100 tokens, queued
        httpx.post(f"{base}/v1/chat/completions", headers={**bearer(kc), "Idempotency-Key": "c1"},
                   json={"model": "tiny", "messages": msgs, "max_tokens": 60}, timeout=1)
    r = httpx.post(f"{base}/v1/chat/completions", headers=bearer(kc),
                   json={"model": "tiny", "messages": msgs, "max_tokens": 60})
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens" and int(r.headers["retry-after"]) >= 1

    def post(i: int) -> int:
        try:
            return httpx.post(f"{base}/v1/chat/completions", headers={**bearer(kd), "Idempotency-Key": f"d{i}"},
                              json={"model": "tiny", "messages": msgs, "max_tokens": 4}, timeout=3).status_code
        except httpx.ReadTimeout:
            return 0  # admitted: its job waits for a worker

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(post, range(12)))
    assert sorted(codes) == [0] * 3 + [429] * 9, codes
    delta = Keys(queue).owner_jobs(key_id(kd))
    assert rds.zcard(delta) == 3
    queued = [json.loads(f["job"])["id"] for _, f in rds.xrange(Keys(queue).stream("interactive", key_id(kd)))]
    assert sum(j.startswith(key_id(kd)) for j in queued) == 3
    r = httpx.post(f"{base}/v1/chat/completions", headers=bearer(kd), json={"model": "tiny", "messages": msgs})
    assert r.status_code == 429 and r.json()["error"]["code"] == "key_queue_full" and "delta" in r.text
    # A cancelled job leaves the cap at once: the next request finds it ended and settles it.
    with Client(redis_url, queue=queue) as c:
        c.cancel(f"{key_id(kd)}.d{codes.index(0)}")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/chat/completions", headers={**bearer(kd), "Idempotency-Key": "d-next"},
                   json={"model": "tiny", "messages": msgs, "max_tokens": 4}, timeout=1)
    assert rds.zcard(delta) == 3
    with pytest.raises(httpx.ReadTimeout):  # A has no cap
        httpx.post(f"{base}/v1/chat/completions", headers={**bearer(ka), "Idempotency-Key": "a1"},
                   json={"model": "tiny", "messages": msgs, "max_tokens": 4}, timeout=1)
    usage = rds.hgetall(ApiKeyKeys(key_id(kb)).usage)
    assert (usage["name"], usage["requests"], usage["rate_limited"]) == ("bravo", "3", "2")


# ---- usage ----------------------------------------------------------------------------------------------------

def test_usage_counts_the_tokens_of_each_keys_jobs(redis_url, queue, pq_tiny_model, start_worker, start_serve,
                                                  tmp_path):
    ka, kb, kc, kd = tenants(queue)
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ka}\nbravo: {kb}\n")
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    base = start_serve(queue, "--api-key-file", str(keyfile), "--model", "tiny", "--key-tpm", "100000")
    a, b = sdk(base, ka), sdk(base, kb)
    msgs = [{"role": "user", "content": "Hello there"}]
    jobs = {"alpha": [], "bravo": []}

    chat = a.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    jobs["alpha"].append(chat.id.split("-", 1)[1])
    chunks = list(a.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, stream=True))
    jobs["alpha"].append(chunks[0].id.split("-", 1)[1])
    f = a.files.create(file=("in.jsonl", "\n".join(GOOD).encode()), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    jobs["alpha"] += [f"{batch.id}-{i}" for i in range(2)]
    comp = b.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4)
    jobs["bravo"].append(comp.id.split("-", 1)[1])
    # B's client leaves after the first chunk, with an Idempotency-Key: its job runs on, and a sweep counts it.
    body = {"model": "tiny", "messages": msgs, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60,
                      headers={**bearer(kb), "Idempotency-Key": f"left-{queue}"}) as r:
        next(r.iter_lines())
    jobs["bravo"].append(f"{key_id(kb)}.left-{queue}")

    with Client(redis_url, queue=queue) as c:
        results = {name: [c.result(j, timeout=60) for j in ids] for name, ids in jobs.items()}
    assert all(res.status == "completed" for rs in results.values() for res in rs)
    assert a.batches.retrieve(batch.id).status in ("in_progress", "finalizing", "completed")

    def report() -> dict:
        out = subprocess.run([sys.executable, "-m", "cli", "usage", "--redis-url", redis_url, "--json"],
                             capture_output=True, text=True, check=True).stdout
        return {row["key"]: row for row in json.loads(out)}

    rows = wait_for(lambda: (lambda r: r["alpha"]["jobs"] == 4 and r["bravo"]["jobs"] == 2 and r)(report()), 60,
                    "every job to be counted")
    metrics = httpx.get(f"{base}/metrics").text
    for name, rs in results.items():
        prompt = sum(res.usage.prompt_tokens for res in rs)
        completion = sum(res.usage.completion_tokens for res in rs)
        row = rows[name]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion), (name, row)
        assert row["total_tokens"] == prompt + completion and row["key_id"] == key_id(ka if name == "alpha" else kb)
        assert f'pagedq_serve_key_prompt_tokens_total{{key="{name}"}} {float(prompt)}' in metrics
        assert f'pagedq_serve_key_completion_tokens_total{{key="{name}"}} {float(completion)}' in metrics
        assert f'pagedq_serve_key_jobs_total{{key="{name}"}} {float(len(rs))}' in metrics
    assert results["bravo"][1].usage.completion_tokens == 40
    assert 'pagedq_serve_key_requests_total{key="alpha",status="200"}' in metrics
    table = subprocess.run([sys.executable, "-m", "cli", "usage", "--redis-url", redis_url], capture_output=True,
                           text=True, check=True).stdout
    assert table.splitlines()[0].split() == ["KEY", "KEY", "ID", "REQUESTS", "LIMITED", "JOBS", "PROMPT",
                                             "COMPLETION", "TOTAL"]
    assert any(line.split()[:2] == ["alpha", key_id(ka)] for line in table.splitlines())
    # Every job was settled: none of A's or B's is still counted against its cap.
    with Client(redis_url, queue=queue) as c:
        assert [c.redis.zcard(Keys(queue).owner_jobs(key_id(k))) for k in (ka, kb)] == [0, 0]
