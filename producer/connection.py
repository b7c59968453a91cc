"""One Redis URL, a plain server, a Redis Cluster or a service behind Sentinel: connect() finds out which and builds
the right redis-py client.

A `redis+sentinel://` (or `rediss+sentinel://`) URL names the Sentinels and the service they monitor
(producer.sentinel): the client finds the primary through them and follows it after a failover. Such a service is
never a cluster, so no probe is made.

Any node's plain `redis://` (or `rediss://`) URL works: a probe asks that node `INFO cluster`. An explicit
`cluster=True/False`, else `$PAGEDQ_REDIS_CLUSTER=1/0`, skips the probe (a proxy that hides the cluster, an ACL
user without INFO, or just one round trip less at start). Nothing is cached between calls: a URL may point at
another deployment tomorrow.

What differs on a cluster (redis-py 8.1, checked against a real 3-master cluster; tests/queue/test_cluster_connection.py):
- Both ClusterPipelines (sync and asyncio) refuse `pipe.evalsha(...)` (and so a Script called with `client=pipe`)
  on the client side: "Calling pipelined function evalsha is blocked when running redis in cluster mode". The same
  command through `pipe.execute_command("EVALSHA", ...)` is routed by its first key and works (flows send it so).
- A fresh asyncio RedisCluster that gets ~20 concurrent first commands fails most of them with AttributeError
  "'NoneType' object has no attribute 'writelines'" (the slot map is learned while they race); connect_async
  returns a subclass that finishes that first discovery before any command goes out.
- A cluster client has no `connection_pool`: `socket_timeout_of` reads the timeout either kind was built with.
- SCRIPT LOAD goes to every primary (redis-py's default for it on a cluster); a node that lost its scripts answers
  NOSCRIPT for its own commands only, as a NoScriptError reply among the others of a pipeline.
- A call whose keys span slots fails on the client before anything is sent, and inside a pipeline it fails the
  whole pipeline (raise_on_error=False or not): keep every call within one queue's keys.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit

import redis as redis_lib
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    ResponseError,
)

from producer import defaults, sentinel

log = logging.getLogger("pagedq.redis")

ENV_CLUSTER = "PAGEDQ_REDIS_CLUSTER"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_AUTO = {"", "auto"}

SyncClient = redis_lib.Redis | scluster.RedisCluster
AsyncClient = aredis.Redis | acluster.RedisCluster
AnyClient = SyncClient | AsyncClient

# Options that configure a connection (not the client object): the probe uses them to reach the node as the real
# client would, TLS and credentials included.
_PROBE_KEYS = ("username", "password", "credential_provider", "socket_connect_timeout", "ssl_keyfile",
               "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data", "ssl_ca_path", "ssl_check_hostname",
               "ssl_password", "ssl_min_version", "ssl_ciphers", "ssl_include_verify_flags",
               "ssl_exclude_verify_flags", "client_name", "protocol")
# The sync RedisCluster passes only these of its extra kwargs on to the node connections and silently drops the
# rest (redis.cluster.REDIS_ALLOWED_KEYS); it also takes its own cluster options. A dropped TLS option would
# quietly weaken the connection, so anything else is refused here instead.
_SYNC_CLUSTER_OWN = ("require_full_coverage", "read_from_replicas", "load_balancing_strategy", "reinitialize_steps",
                     "dynamic_startup_nodes", "cluster_error_retry_attempts", "retry", "url", "address_remap",
                     "cache", "cache_config", "event_dispatcher", "policy_resolver", "startup_nodes",
                     "maint_notifications_config")
PROBE_TIMEOUT = 5.0


def resolve_url(url: str | None = None) -> str:
    """`url`, else $REDIS_URL, else the default (redis://localhost:6379/0)."""
    return url or os.environ.get("REDIS_URL") or defaults.REDIS_URL


def cluster_override(cluster: bool | None = None) -> bool | None:
    """The explicit choice: the argument if given, else $PAGEDQ_REDIS_CLUSTER (1/0, true/false, yes/no, on/off;
    empty or "auto": probe). None means: probe the server."""
    if cluster is not None:
        return bool(cluster)
    raw = os.environ.get(ENV_CLUSTER, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    if raw in _AUTO:
        return None
    raise ValueError(f"${ENV_CLUSTER} must be 1 or 0 (or true/false, yes/no, on/off, auto), got {raw!r}")


def url_db(url: str, kwargs: dict[str, Any] | None = None) -> int:
    """The database number a URL (path `/N` or `?db=N`) or an explicit `db=` kwarg selects; 0 if none."""
    if kwargs and kwargs.get("db") is not None:
        return int(kwargs["db"])
    parts = urlsplit(url)
    query = parse_qs(parts.query).get("db")
    if query:
        return int(query[0])
    path = parts.path.strip("/")
    return int(path) if path.isdigit() else 0


def _probe_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {k: kwargs[k] for k in _PROBE_KEYS if k in kwargs}
    # The probe must not hang a start on a dead host longer than the real client would.
    out.setdefault("socket_connect_timeout", PROBE_TIMEOUT)
    out["socket_timeout"] = kwargs.get("socket_timeout") or PROBE_TIMEOUT
    return out


def _db0(url: str) -> str:
    # SELECT N fails on a cluster node ("SELECT is not allowed in cluster mode"): probe on db 0, judge db after.
    # redis-py lets the URL's db win over a db= kwarg, so the URL itself must change.
    parts = urlsplit(url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "db"])
    return parts._replace(path="/0", query=query).geturl()


def _cluster_from_info(info: dict[str, Any]) -> bool:
    return str(info.get("cluster_enabled", "0")) == "1"


def _refused_probe(url: str, err: Exception) -> RuntimeError:
    return RuntimeError(f"could not find out whether {redact(url)} is a Redis Cluster ({err}); "
                        f"set {ENV_CLUSTER}=1 or 0 (or pass cluster=True/False) to say so")


def _unreachable(url: str, err: Exception) -> redis_lib.ConnectionError:
    # A plain redis-py client connects on its first command, the probe at once: a caller that builds clients
    # before Redis is up needs to know how to skip it.
    return redis_lib.ConnectionError(f"could not ask {redact(url)} whether it is a Redis Cluster ({err}); to "
                                     f"build the client without asking, set {ENV_CLUSTER}=0 or 1 (or pass "
                                     f"cluster=False/True)")


def _no_cluster_probe(err: ResponseError) -> bool:
    # What a server without cluster support answers to CLUSTER commands.
    return "cluster support disabled" in str(err).lower() or "unknown command" in str(err).lower()


def detect_cluster(url: str | None = None, **kwargs: Any) -> bool:
    """Ask the node at `url` whether it runs in cluster mode (one short-lived connection, closed again). A
    Sentinel URL is never a cluster."""
    url, kwargs = _normalize(url, kwargs)
    if sentinel.is_sentinel_url(url):
        return False
    probe = redis_lib.Redis.from_url(_db0(url), **_probe_kwargs(kwargs))
    try:
        try:
            return _cluster_from_info(probe.info("cluster"))
        except (AuthenticationError, AuthenticationWrongNumberOfArgsError):
            raise  # the credentials are wrong: say that, not that the server is unreachable
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            raise _unreachable(url, e) from e
        except NoPermissionError:  # an ACL user without INFO may still have CLUSTER INFO
            try:
                probe.execute_command("CLUSTER", "INFO")
                return True
            except NoPermissionError:
                # A least-privilege user on a plain server is the common case; on a cluster its first command
                # would answer MOVED, so say how to skip the question.
                log.warning("%s: this user may run neither INFO nor CLUSTER INFO; taking it for a plain Redis "
                            "server (set %s=1 if it is a cluster)", redact(url), ENV_CLUSTER)
                return False
            except ResponseError as e:
                if _no_cluster_probe(e):
                    return False
                raise _refused_probe(url, e) from e
    finally:
        probe.close()


def _cluster_kwargs(url: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    db = url_db(url, kwargs)
    if db != 0:
        raise ValueError(f"{redact(url)} selects database {db}, but a Redis Cluster has only database 0: "
                         f"use .../0 (one queue's keys live in one slot, whatever the database)")
    out = dict(kwargs)
    out.pop("db", None)  # RedisCluster refuses `db` even when it is 0
    return out


def _check_sync_cluster_kwargs(kwargs: dict[str, Any]) -> None:
    dropped = sorted(set(kwargs) - set(scluster.REDIS_ALLOWED_KEYS) - set(_SYNC_CLUSTER_OWN))
    if dropped:
        raise TypeError(f"redis-py's RedisCluster would silently ignore {', '.join(dropped)}: "
                        f"not supported on a cluster")


def redact(url: str) -> str:
    """The URL without its password, fit for logs and errors."""
    if sentinel.is_sentinel_url(url):
        return sentinel.redact(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _normalize(url: str | None, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    url = resolve_url(url)
    kwargs = dict(kwargs)
    # ssl=True works for redis-py's cluster clients but a plain client built from a redis:// URL passes it to a
    # plain Connection, which fails with TypeError on the first command: the URL scheme is what both understand.
    if kwargs.pop("ssl", False):
        for plain in ("redis://", "redis+sentinel://"):
            if url.startswith(plain):
                url = "rediss" + url[len("redis"):]
    return url, kwargs


def _decide(url: str, cluster: bool | None, kwargs: dict[str, Any]) -> bool:
    if sentinel.is_sentinel_url(url):
        if cluster:
            raise ValueError(f"{redact(url)} names a service behind Sentinel, which is never a Redis Cluster: "
                             f"drop cluster=True / {ENV_CLUSTER}=1")
        return False
    choice = cluster_override(cluster)
    return detect_cluster(url, **kwargs) if choice is None else choice


def connect(url: str | None = None, *, cluster: bool | None = None, **kwargs: Any) -> SyncClient:
    """A sync client for `url` (None: $REDIS_URL, else the default): `redis.cluster.RedisCluster` when the node
    is part of a cluster, else `redis.Redis`. kwargs go to the client (decode_responses, socket_timeout, TLS
    options, ...). `cluster`: True/False skips the probe (so does $PAGEDQ_REDIS_CLUSTER).
    Raises ValueError for a database other than 0 on a cluster."""
    url, kwargs = _normalize(url, kwargs)
    if not _decide(url, cluster, kwargs):
        if sentinel.is_sentinel_url(url):
            return sentinel.connect(url, **kwargs)
        return redis_lib.Redis.from_url(url, **kwargs)
    ckw = _cluster_kwargs(url, kwargs)
    _check_sync_cluster_kwargs(ckw)
    return scluster.RedisCluster.from_url(url, **ckw)


class AsyncRedisCluster(acluster.RedisCluster):
    """redis.asyncio.cluster.RedisCluster that learns the slot map before its first command is even routed.

    The stock client starts routing and sending commands that arrive concurrently while its first discovery runs,
    and under a burst (20 tasks at once, the first requests of a web app) most fail with AttributeError.
    `initialize()` is idempotent and locked, and a no-op once done."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.initialize()
        return await super().execute_command(*args, **kwargs)


def _make_async(url: str, is_cluster: bool, kwargs: dict[str, Any],
                cluster_class: type[AsyncRedisCluster] = AsyncRedisCluster) -> AsyncClient:
    if not is_cluster:
        if sentinel.is_sentinel_url(url):
            return sentinel.connect_async(url, **kwargs)
        return aredis.Redis.from_url(url, **kwargs)
    # No I/O here: the client learns the slot map on its first command.
    return cluster_class.from_url(url, **_cluster_kwargs(url, kwargs))


def connect_async(url: str | None = None, *, cluster: bool | None = None,
                  cluster_class: type[AsyncRedisCluster] = AsyncRedisCluster, **kwargs: Any) -> AsyncClient:
    """An asyncio client for `url`, built without awaiting (so a sync constructor can call it): the cluster probe,
    when no override says, is one short blocking round trip on a sync connection. Code already inside a running
    event loop pays that round trip once, at construction. `cluster_class`: the client class on a cluster (a
    subclass of AsyncRedisCluster)."""
    url, kwargs = _normalize(url, kwargs)
    return _make_async(url, _decide(url, cluster, kwargs), kwargs, cluster_class)


_CLUSTER_TYPES = (scluster.RedisCluster, acluster.RedisCluster, acluster.ClusterPipeline)


def is_cluster(client: Any) -> bool:
    """Whether `client` (sync or asyncio, a client or one of its pipelines) talks to a Redis Cluster."""
    # The sync ClusterPipeline subclasses the sync RedisCluster; the asyncio one does not subclass its client.
    return isinstance(client, _CLUSTER_TYPES)


def socket_timeout_of(client: Any) -> float | None:
    """The socket timeout (seconds) `client` was built with; None: no timeout. Works for all four client kinds:
    a cluster client has no `connection_pool`, where a plain client keeps its connection kwargs."""
    if isinstance(client, scluster.RedisCluster):
        kw = client.nodes_manager.connection_kwargs
    elif isinstance(client, acluster.RedisCluster):
        kw = client.connection_kwargs
    else:
        kw = client.connection_pool.connection_kwargs
    return kw.get("socket_timeout")
