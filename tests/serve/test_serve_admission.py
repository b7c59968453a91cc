"""`pagedq serve` checks cheap before costly: a request's key, size and limits, and its key's admission, come
before its constraint is compiled, and the compile runs off the event loop within a time budget; its verdicts
are remembered in a cache bounded in bytes. Real serve processes (no worker: no request here needs its job to
run), and the checking and caching objects on their own."""

import asyncio
import json
import re
import threading

import httpx
import pytest

from serve import constraints
from serve.checks import Checks
from serve.config import ServeConfig
from serve.cpu_process import OFF_LOOP_BYTES
from serve.errors import APIError
from serve.metrics import ServeMetrics
from serve.verdicts import Verdict, Verdicts, spec_key

KEY = "sk-admission-7c1e"


def schema(fields: int) -> dict:
    """A JSON schema that takes the grammar engine real work (tens of ms here for 280 fields, ~60 KB)."""
    props = {f"field_{i}": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},{i % 7 + 6}}}$"},
        "b": {"type": "integer", "minimum": i}, "c": {"enum": [f"v{i}_{j}" for j in range(5)]}}}
        for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)[: fields // 2]}


BIG = schema(280)  # under the 64 KiB constraint limit (Limits.max_constraint_bytes)
TOO_BIG = schema(2500)  # ~550 KB: its body is read in another process (serve.cpu_process)


def chat(schema_: dict, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema_}}, **extra}


def counter(base: str, name: str) -> float:
    m = re.search(rf"^{name}_total (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def checks_run(base: str) -> float:
    return counter(base, "pagedq_serve_constraint_checks")


def test_cheap_checks_come_before_the_compile(queue, start_serve):
    assert len(json.dumps(BIG, separators=(",", ":"))) < 65_536 < len(json.dumps(TOO_BIG, separators=(",", ":")))
    base = start_serve(queue, "--model", "tiny", "--api-key", KEY, "--key-rpm", "1")
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/v1/chat/completions", json=chat(BIG)).status_code == 401  # no key
    assert httpx.get(f"{base}/v1/models", headers=auth).status_code == 200  # the key's one request a minute
    # Over the constraint's size limit: a 400 before the key's rate is even looked at.
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(TOO_BIG), headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded", r.text
    assert len(r.request.content) > OFF_LOOP_BYTES
    r = httpx.post(f"{base}/v1/chat/completions", content=r.request.content[:-1], headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    # At its rate limit: 429, and the schema was never compiled.
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(BIG), headers=auth)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    assert "Retry-After" in r.headers
    assert checks_run(base) == 0


def test_a_key_at_its_job_cap_compiles_nothing(queue, start_serve):
    base = start_serve(queue, "--model", "tiny", "--api-key", KEY, "--key-max-jobs", "1")
    auth = {"Authorization": f"Bearer {KEY}"}
    # No worker: the first job stays queued. Its client leaves; its Idempotency-Key keeps the job (and the key's
    # one place).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/chat/completions", headers={**auth, "Idempotency-Key": f"hold-{queue}"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, timeout=1.5)
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(BIG), headers=auth)
    assert r.status_code == 429 and r.json()["error"]["code"] == "key_queue_full", r.text
    assert checks_run(base) == 0


def test_a_check_past_its_budget_is_a_400_that_says_so(queue, start_serve):
    base = start_serve(queue, "--model", "tiny", "--constraint-check", "0.001")
    for _ in range(2):
        r = httpx.post(f"{base}/v1/chat/completions", json=chat(BIG))
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "constraint_timeout", r.text
        assert err["param"] == "response_format" and "took longer than 0.001 s" in err["message"]
    # The verdict is remembered: sent again, the spec compiled nothing more.
    assert checks_run(base) == 1 and counter(base, "pagedq_serve_constraint_check_timeouts") == 1


# ---- the check and the cache, on their own ---------------------------------------------------------------------

def _checks(budget_s: float, threads: int = 1, wait_s: float = 10.0) -> tuple[Checks, ServeMetrics]:
    metrics = ServeMetrics()
    cfg = ServeConfig(constraint_check_s=budget_s, constraint_threads=threads)
    return Checks(cfg, metrics, Verdicts(), wait_s=wait_s), metrics


def sample(metrics: ServeMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"{name}_total")


def test_a_slow_compile_times_out_and_a_busy_pool_says_busy(monkeypatch):
    release = threading.Event()

    def slow(kind, spec):
        release.wait(30)
        return ""

    monkeypatch.setattr(constraints, "problem", slow)
    checks, metrics = _checks(0.05, threads=1, wait_s=0.2)

    async def run() -> tuple[APIError, APIError]:
        with pytest.raises(APIError) as timeout:
            await checks.check(("regex", "a+"), "guided_regex")
        # The one thread still runs that compile (Python cannot stop it): the next check waits, then 429.
        with pytest.raises(APIError) as busy:
            await checks.check(("regex", "b+"), "guided_regex")
        return timeout.value, busy.value

    try:
        timeout, busy = asyncio.run(run())
    finally:
        release.set()
        checks.close()
    assert (timeout.status, timeout.code, timeout.param) == (400, "constraint_timeout", "guided_regex")
    assert (busy.status, busy.code) == (429, "server_busy") and "Retry-After" in busy.headers
    assert sample(metrics, "pagedq_serve_constraint_check_timeouts") == 1
    assert sample(metrics, "pagedq_serve_constraint_checks") == 1


def test_verdicts_are_checked_once_per_spec():
    checks, metrics = _checks(30.0, threads=2)

    async def run() -> None:
        await checks.check(("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}}), "tools")
        await checks.check(("json_schema", {"properties": {"a": {"type": "string"}}, "type": "object"}), "tools")
        with pytest.raises(APIError) as bad:
            await checks.check(("regex", "(unclosed"), "guided_regex")
        assert bad.value.code == "invalid_constraint" and bad.value.param == "guided_regex"

    try:
        asyncio.run(run())
    finally:
        checks.close()
    assert sample(metrics, "pagedq_serve_constraint_checks") == 2  # the same schema, keys in another order: one compile


def test_the_cache_stays_within_its_bytes():
    cache = Verdicts(max_entries=1000, max_bytes=1 << 20)
    big = "x" * 100_000  # a long objection, counted in full
    for i in range(100):
        cache.put(spec_key("json_schema", {"n": i, "pad": big}), Verdict("invalid_constraint", big + str(i)))
        assert cache.bytes <= cache.max_bytes
    assert 0 < len(cache) <= 10 and cache.get(spec_key("json_schema", {"n": 99, "pad": big})) is not None
    assert cache.get(spec_key("json_schema", {"n": 0, "pad": big})) is None  # the least recently used went first
    cache.put(b"k" * 32, Verdict("invalid_constraint", "y" * (2 << 20)))  # larger than the whole cache: not kept
    assert cache.get(b"k" * 32) is None and cache.bytes <= cache.max_bytes
    small = Verdicts(max_entries=3)
    for i in range(5):
        small.put(spec_key("regex", str(i)), Verdict())
    assert len(small) == 3
    assert sum(small.get(spec_key("regex", str(i))) is not None for i in range(5)) == 3
