"""producer.connection against a real Redis Cluster (3 masters) and a plain redis-server: which client connect()
builds, the overrides, and the operations pagedq runs (scripts, pipelines, blocking stream reads, the reaper)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aredis
import redis.cluster
from redis.exceptions import NoScriptError, RedisClusterException

from producer import scripts
from producer.connection import (
    ENV_CLUSTER,
    AsyncRedisCluster,
    cluster_override,
    connect,
    connect_async,
    detect_cluster,
    is_cluster,
    socket_timeout_of,
    url_db,
)
from producer.keys import GROUP, Keys

# Two keys of one queue (one slot): what every pagedq script does.
LUA = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[1]); return redis.call('GET', KEYS[2])"


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(ENV_CLUSTER, raising=False)


def other_node(cluster, queue: str) -> str:
    """A node URL that does not hold `queue`: the client must find the owner itself."""
    return next(u for u in cluster.urls if u != cluster.queue_node(queue))


def node_client(cluster, url: str) -> redis.Redis:
    return cluster.client(cluster.urls.index(url))


# ---- which client ---------------------------------------------------------------------------------------------

def test_detects_cluster_from_any_node(redis_cluster):
    for url in redis_cluster.urls:
        assert detect_cluster(url)
        r = connect(url, decode_responses=True)
        try:
            assert isinstance(r, redis.cluster.RedisCluster) and is_cluster(r)
            assert is_cluster(r.pipeline(transaction=False))
        finally:
            r.close()


def test_plain_server_gets_plain_client(redis_url):
    assert not detect_cluster(redis_url)
    r = connect(redis_url, decode_responses=True)
    try:
        assert type(r) is redis.Redis and not is_cluster(r)
        assert r.ping()
    finally:
        r.close()


def test_plain_server_keeps_its_database(redis_server):
    r = connect(redis_server.url.rsplit("/", 1)[0] + "/3")
    try:
        assert r.connection_pool.connection_kwargs["db"] == 3
        assert r.ping()
    finally:
        r.close()


def test_override_argument_and_env(redis_cluster, redis_url, monkeypatch):
    node = redis_cluster.urls[0]
    r = connect(node, cluster=False)
    assert type(r) is redis.Redis  # told so: no probe, a plain client even on a cluster node
    r.close()
    monkeypatch.setenv(ENV_CLUSTER, "0")
    r = connect(node)
    assert type(r) is redis.Redis
    r.close()
    r = connect(node, cluster=True)  # the argument wins over the environment
    assert is_cluster(r)
    r.close()
    monkeypatch.setenv(ENV_CLUSTER, "1")
    with pytest.raises(RedisClusterException):  # a plain server forced into cluster mode: redis-py refuses
        connect(redis_url)
    monkeypatch.setenv(ENV_CLUSTER, "auto")
    assert cluster_override() is None
    monkeypatch.setenv(ENV_CLUSTER, "maybe")
    with pytest.raises(ValueError, match=ENV_CLUSTER):
        connect(node)


def test_cluster_refuses_other_databases_clearly(redis_cluster):
    base = redis_cluster.urls[1].rsplit("/", 1)[0]
    for url, kw in ((base + "/3", {}), (base + "/0?db=2", {}), (base + "/0", {"db": 5})):
        with pytest.raises(ValueError, match=r"database [235].*only database 0"):
            connect(url, **kw)
        with pytest.raises(ValueError, match="only database 0"):
            connect_async(url, **kw)
    r = connect(base, db=0)  # db 0 is fine, though RedisCluster itself refuses any `db` argument
    r.close()


def test_url_db():
    assert url_db("redis://h:1") == 0
    assert url_db("redis://h:1/") == 0
    assert url_db("redis://:pw@h:1/7") == 7
    assert url_db("rediss://h:1/0?db=4") == 4
    assert url_db("redis://h:1/2", {"db": 9}) == 9


def test_password_is_not_in_errors(redis_cluster):
    url = redis_cluster.urls[0].replace("redis://", "redis://:s3cret@").rsplit("/", 1)[0] + "/4"
    with pytest.raises(ValueError) as err:
        connect(url, cluster=True)
    assert "s3cret" not in str(err.value)


def test_socket_timeout_of_every_kind(redis_cluster, redis_url):
    node = redis_cluster.urls[0]
    sync_clients = [connect(node, socket_timeout=3.5), connect(redis_url, socket_timeout=3.5)]
    for r in sync_clients:
        assert socket_timeout_of(r) == 3.5
        r.close()
    assert not hasattr(connect(node), "connection_pool")  # why socket_timeout_of exists

    async def main():
        for r in (connect_async(node, socket_timeout=2.5), connect_async(redis_url, socket_timeout=2.5)):
            assert socket_timeout_of(r) == 2.5
            await r.aclose()

    asyncio.run(main())


def test_sync_cluster_refuses_options_it_would_drop(redis_cluster):
    # redis-py's sync RedisCluster silently drops kwargs outside its allow-list (a TLS floor among them).
    with pytest.raises(TypeError, match="health_check_interval"):
        connect(redis_cluster.urls[0], health_check_interval=10)


# ---- scripts and pipelines ------------------------------------------------------------------------------------

def test_scripts_in_two_slots_on_two_masters_in_one_pipeline(redis_cluster, cluster_queues):
    qa, qb = cluster_queues
    ka, kb = Keys(qa), Keys(qb)
    r = connect(redis_cluster.urls[2], decode_responses=True)
    try:
        sha = r.script_load(LUA)  # on a cluster: every primary
        for url in redis_cluster.urls:  # SCRIPT LOAD reached every primary
            assert node_client(redis_cluster, url).script_exists(sha) == [True]
        pipe = r.pipeline(transaction=False)
        # redis-py before 8 blocks pipe.evalsha on a cluster (why flows send EVALSHA by execute_command); 8 allows it
        pipe.execute_command("EVALSHA", sha, 2, ka.job("1"), ka.result("1"), "a")
        pipe.execute_command("EVALSHA", sha, 2, kb.job("1"), kb.result("1"), "b")
        pipe.execute_command("EVALSHA", "0" * 40, 2, ka.job("2"), ka.result("2"), "x")
        assert pipe.execute(raise_on_error=False)[:2] == ["a", "b"]
        assert node_client(redis_cluster, redis_cluster.queue_node(qb)).get(kb.result("1")) == "b"

        # One master lost its scripts (restart, SCRIPT FLUSH): only its calls answer NOSCRIPT, as replies.
        node_client(redis_cluster, redis_cluster.queue_node(qb)).script_flush()
        pipe = r.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", sha, 2, ka.job("3"), ka.result("3"), "a3")
        pipe.execute_command("EVALSHA", sha, 2, kb.job("3"), kb.result("3"), "b3")
        replies = pipe.execute(raise_on_error=False)
        assert replies[0] == "a3" and isinstance(replies[1], NoScriptError)
        r.script_load(LUA)
        pipe = r.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", sha, 2, kb.job("3"), kb.result("3"), "b3")
        assert pipe.execute(raise_on_error=False) == ["b3"]
    finally:
        r.close()


def test_load_all_gives_pagedq_digests(redis_cluster):
    r = connect(redis_cluster.urls[0], decode_responses=True)
    try:
        scripts.load_all(r)
        shas = [scripts.sha(n) for n in scripts.NAMES]
        for url in redis_cluster.urls:
            assert all(node_client(redis_cluster, url).script_exists(*shas))
    finally:
        r.close()


# ---- streams ----------------------------------------------------------------------------------------------------

def test_blocking_xreadgroup_returns_when_an_entry_arrives(redis_cluster, cluster_queues):
    qa, _ = cluster_queues
    k = Keys(qa)
    r = connect(other_node(redis_cluster, qa), decode_responses=True, socket_timeout=10)
    writer = connect(redis_cluster.urls[0], decode_responses=True)
    try:
        r.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
        with pytest.raises(redis.ResponseError, match="BUSYGROUP"):
            r.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
        timer = threading.Timer(0.3, lambda: writer.xadd(k.jobs, {"id": "j1", "job": "{}"}))
        timer.start()
        t = time.monotonic()
        reply = r.xreadgroup(GROUP, "w1", {k.jobs: ">"}, count=5, block=5000)
        assert time.monotonic() - t < 3
        assert reply[0][0] == k.jobs and reply[0][1][0][1] == {"id": "j1", "job": "{}"}
        timer.join()
        assert r.xreadgroup(GROUP, "w1", {k.jobs: ">"}, count=5, block=50) == []
    finally:
        r.close()
        writer.close()


def test_xautoclaim_takes_over_a_stalled_entry(redis_cluster, cluster_queues):
    _, qb = cluster_queues
    k = Keys(qb)
    r = connect(other_node(redis_cluster, qb), decode_responses=True)
    try:
        r.xgroup_create(k.jobs, GROUP, id="0", mkstream=True)
        entry = r.xadd(k.jobs, {"id": "j1", "job": "{}"})
        assert r.xreadgroup(GROUP, "dead-worker", {k.jobs: ">"}, count=1)[0][1][0][0] == entry
        cursor, claimed = r.xautoclaim(k.jobs, GROUP, "reaper", 0, "0-0", count=10)[:2]
        assert cursor == "0-0" and claimed == [(entry, {"id": "j1", "job": "{}"})]
        assert r.xpending(k.jobs, GROUP)["consumers"] == [{"name": "reaper", "pending": 1}]
        assert r.xack(k.jobs, GROUP, entry) == 1
        assert r.xrange(k.jobs) == r.xrevrange(k.jobs) == [(entry, {"id": "j1", "job": "{}"})]
        assert r.exists(k.jobs, Keys(cluster_queues[0]).jobs) >= 1  # keys of two slots: split by redis-py
    finally:
        r.close()


# ---- asyncio ----------------------------------------------------------------------------------------------------

def test_async_clients(redis_cluster, cluster_queues, redis_url):
    qa, qb = cluster_queues
    ka, kb = Keys(qa), Keys(qb)

    async def main():
        plain = connect_async(redis_url, decode_responses=True)
        assert type(plain) is aredis.Redis and not is_cluster(plain)
        assert await plain.ping()
        await plain.aclose()

        r = connect_async(redis_cluster.urls[0], decode_responses=True)
        assert isinstance(r, AsyncRedisCluster) and is_cluster(r)
        # A burst of first commands on a fresh client: stock redis-py 8.1 fails most of them (AttributeError).
        assert await asyncio.gather(*[r.get(f"pq:{{t{i}}}:probe") for i in range(30)]) == [None] * 30

        sync = connect(redis_cluster.urls[1])
        sha = sync.script_load(LUA)
        sync.close()
        pipe = r.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", sha, 2, ka.job("a"), ka.result("a"), "a")
        pipe.execute_command("EVALSHA", sha, 2, kb.job("b"), kb.result("b"), "b")
        assert await pipe.execute(raise_on_error=False) == ["a", "b"]

        other = connect_async(redis_cluster.urls[2], decode_responses=True)
        assert isinstance(other, AsyncRedisCluster)

        async def later():
            await asyncio.sleep(0.3)
            await other.xadd(kb.events("e"), {"e": "{}"})

        task = asyncio.create_task(later())
        t = time.monotonic()
        reply = await r.xread({kb.events("e"): "0-0"}, count=10, block=5000)
        assert time.monotonic() - t < 3 and reply[0][1][0][1] == {"e": "{}"}
        await task
        await r.aclose()
        await other.aclose()

    asyncio.run(main())


def test_unreachable_server_names_the_override():
    from redis_cluster import cluster_port

    url = f"redis://:pw@127.0.0.1:{cluster_port()}/0"
    with pytest.raises(redis.ConnectionError, match=ENV_CLUSTER) as err:
        connect(url, socket_connect_timeout=1)
    assert ":pw@" not in str(err.value)
    r = connect(url, cluster=False)  # no probe: as lazy as a plain redis-py client
    r.close()
    with pytest.raises(redis.ConnectionError, match=ENV_CLUSTER):
        connect_async(url, socket_connect_timeout=1)
