"""Redis behind Sentinel (redis+sentinel:// URLs), durability "replicated", and the eviction check: URL parsing without
a server, then a real primary, replica and three Sentinels (tests/redis_sentinel.py) and plain servers with the
settings under test, all on loopback. The failovers themselves are in test_fault_failover.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import redis
from click.testing import CliRunner

from producer import AsyncClient, Client
from producer import sentinel as psentinel
from producer.connection import connect, connect_async, detect_cluster, redact
from producer.durability import Durability, check_replicas, eviction_policy, eviction_warning, online_replicas
from producer.errors import NotReplicated

# ---- URLs, no server -------------------------------------------------------------------------------------------


def test_parse_sentinel_urls():
    p = psentinel.parse("redis+sentinel://h1:26380,h2/pq")
    assert p.sentinels == [("h1", 26380), ("h2", 26379)] and p.service == "pq" and not p.tls
    assert p.node_kwargs == {"db": 0} and p.sentinel_kwargs == {}
    p = psentinel.parse("rediss+sentinel://app:s%40cret@[::1]:5000,10.0.0.2:26379/jobs/3"
                        "?sentinel_password=sp&socket_timeout=2.5&ssl_cert_reqs=none")
    assert p.sentinels == [("::1", 5000), ("10.0.0.2", 26379)] and p.service == "jobs" and p.tls
    assert p.node_kwargs == {"username": "app", "password": "s@cret", "db": 3, "socket_timeout": 2.5,
                             "ssl_cert_reqs": "none", "ssl": True}
    assert p.sentinel_kwargs == {"password": "sp"}
    assert redact("rediss+sentinel://app:s%40cret@h1/jobs?sentinel_password=sp") == \
        "rediss+sentinel://app:***@h1/jobs?sentinel_password=***"


@pytest.mark.parametrize("url, needle", [
    ("redis+sentinel://h1:26379/", "the path must be /<service>"),
    ("redis+sentinel://h1/a/b/c", "the path must be /<service>"),
    ("redis+sentinel://h1/pq/x", "the path must be /<service>"),
    ("redis+sentinel://h1:port/pq", "is not host:port"),
    ("redis+sentinel:///pq", "names no Sentinel"),
])
def test_bad_sentinel_urls(url, needle):
    with pytest.raises(ValueError, match="Sentinel URL") as e:
        psentinel.parse(url)
    assert needle in str(e.value)


@pytest.mark.slow
def test_a_sentinel_url_builds_a_client_without_io():
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/pq/2"  # nothing listens there
    assert not detect_cluster(url)
    r = connect(url, decode_responses=True)
    assert isinstance(r, psentinel.SentinelRedis) and r.connection_pool.connection_kwargs["db"] == 2
    with pytest.raises(redis.ConnectionError, match="Sentinel names no live primary for service 'pq'"):
        r.ping()
    r.close()
    a = connect_async(url)
    assert isinstance(a, psentinel.AsyncSentinelRedis)
    asyncio.run(a.aclose())
    with pytest.raises(ValueError, match="never a Redis Cluster"):
        connect(url, cluster=True)


def test_durability_settings(monkeypatch):
    assert not Durability.of(None).replicated
    monkeypatch.setenv("PAGEDQ_DURABILITY", "replicated")
    monkeypatch.setenv("PAGEDQ_DURABILITY_TIMEOUT_MS", "250")
    assert Durability.of(None) == Durability("replicated", 1, 250)
    assert Durability.of("async") == Durability("async", 1, 250)
    with pytest.raises(ValueError, match="durability must be one of async, replicated"):
        Durability("quorum")
    with pytest.raises(ValueError, match="at least 1"):
        Durability("replicated", 0)


# ---- a primary, a replica, three Sentinels ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def sentinels():
    from redis_sentinel import SentinelSet

    with SentinelSet() as s:
        yield s


def test_clients_through_sentinel(sentinels, queue):
    with Client(sentinels.url, queue=queue, durability="replicated") as c:
        job = c.submit(prompt="hi", max_tokens=4)
        assert c.status(job.id) == "queued"
        assert online_replicas(c.redis) == 1 and check_replicas(c.redis, c.durability) is None
        # The replica has it: a submit returns once a replica has confirmed it.
        replica = sentinels.node(sentinels.replicas()[0].port)
        assert replica.hget(c.keys.job(job.id), "state") == "queued"
        replica.close()

    async def go():
        async with AsyncClient(sentinels.url, queue=queue, durability="replicated") as a:
            j = await a.submit(prompt="hello", max_tokens=4)
            return await a.status(j.id), await a.cancel(j.id)

    assert asyncio.run(go()) == ("queued", "cancelled")


def test_replicated_submit_without_a_replica_answering(sentinels, queue):
    """The replica's link held: the primary has the job, no replica confirms it in time: NotReplicated, naming it."""
    c = Client(sentinels.url, queue=queue, durability=Durability("replicated", 1, 200))
    sentinels.link.hold()
    try:
        with pytest.raises(NotReplicated, match=r"job held-1: the primary has it, but 0 of 1 replicas") as e:
            c.submit(id="held-1", prompt="hi", max_tokens=4)
        assert e.value.ids == ["held-1"] and e.value.acked == 0 and e.value.outcomes
        assert c.status("held-1") == "queued"  # on the primary, unconfirmed
        # async does not wait for replicas
        Client(sentinels.url, queue=queue, redis=c.redis).submit(id="held-2", prompt="hi", max_tokens=4)
    finally:
        sentinels.link.release()
    c.close()


def test_replicated_on_a_server_without_replicas(redis_url, queue):
    r = connect(redis_url)
    try:
        assert "has 0: attach one" in check_replicas(r, Durability("replicated"))
    finally:
        r.close()
    with Client(redis_url, queue=queue, durability=Durability("replicated", 1, 50)) as c, \
            pytest.raises(NotReplicated, match="0 of 1 replicas confirmed it within 50 ms"):
        c.submit(prompt="hi", max_tokens=4)


def test_the_cli_through_sentinel(sentinels, queue):
    from cli import main

    res = CliRunner().invoke(main, ["submit", "--redis-url", sentinels.url, "--queue", queue, "--no-wait", "hi"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["status", "--redis-url", sentinels.url, "--queue", queue, "--json"])
    info = json.loads(res.output)
    assert info["waiting"] == 1 and info["redis"]["maxmemory_policy"] == "noeviction"
    assert info["redis"]["warning"] is None


def _worker(url: str, queue: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`pagedq worker` that is expected to refuse to start (before it loads a model: the model does not exist)."""
    return subprocess.run([sys.executable, "-m", "cli", "worker", "--redis-url", url, "--queue", queue, "--model",
                           "/nonexistent-model", "--device", "cpu", *flags], capture_output=True, text=True,
                          timeout=timeout)


def test_a_replicated_worker_refuses_a_primary_without_replica(redis_url, queue):
    res = _worker(redis_url, queue, "--durability", "replicated")
    assert res.returncode == 1
    assert "durability replicated needs 1 replica(s) attached to the primary and in sync, and it has 0" in res.stderr


# ---- eviction -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evicting():
    from worker.redis_server import RedisServer

    with RedisServer(args=["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]) as srv:
        yield srv


def test_an_evicting_redis_is_said_loudly(evicting, queue, pq_tiny_model, start_worker):
    from faults import log_of, started, wait_for

    r = connect(evicting.url)
    policy = eviction_policy(r)
    r.close()
    assert policy == {"maxmemory_policy": "allkeys-lru", "maxmemory": 100 * 2**20}
    assert "not noeviction" in eviction_warning(policy)
    # The worker says so at start, and runs.
    w = start_worker(queue, pq_tiny_model, url=evicting.url)
    wait_for(lambda: started(w), 120, "the worker")
    assert "maxmemory-policy is allkeys-lru (maxmemory 104857600 bytes), not noeviction" in log_of(w)
    assert "Starting anyway (--strict refuses)" in log_of(w)
    # So does `pagedq status`.
    from cli import main

    res = CliRunner().invoke(main, ["status", "--redis-url", evicting.url, "--queue", queue])
    assert res.exit_code == 0 and res.output.startswith("WARNING: Redis maxmemory-policy is allkeys-lru")


def test_an_evicting_redis_is_refused_under_strict(evicting, queue):
    res = _worker(evicting.url, queue, "--strict")
    assert res.returncode == 1
    assert "maxmemory-policy is allkeys-lru" in res.stderr and "Refusing to start (--strict)" in res.stderr
