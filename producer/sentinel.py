"""Redis behind Sentinel: `redis+sentinel://` URLs, and clients that find the primary through the Sentinels.

    redis+sentinel://[user:password@]host1:26379,host2:26379/<service>[/<db>][?option=value&...]
    rediss+sentinel://...   TLS, to the Sentinels and to the data nodes alike

The user and password are the data nodes' (what `sentinel auth-pass` holds); `sentinel_username` and
`sentinel_password` in the query are the Sentinels' own, when they require one. Other query options are redis-py's
URL options (`socket_timeout`, `ssl_cert_reqs`, `ssl_ca_certs`, ...) and apply to the data nodes' connections; a
port left out is 26379.

The client is a plain redis-py client on a SentinelConnectionPool: each new connection asks the Sentinels for
the current primary, a connection to a primary that was demoted answers READONLY and is dropped, so after a
failover the next retry (redis-py's own, then the caller's) lands on the promoted replica. Nothing is asked at
construction: building a client does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis as redis_lib
import redis.asyncio as aredis
import redis.asyncio.sentinel as asentinel
import redis.sentinel as ssentinel
from redis.connection import parse_url

SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_PORT = 26379
# Options for the Sentinels' own connections, taken from the query (the rest go to the data nodes).
_SENTINEL_AUTH = ("sentinel_username", "sentinel_password")


def is_sentinel_url(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0].lower() in SCHEMES


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL."""

    sentinels: list[tuple[str, int]]
    service: str
    tls: bool
    node_kwargs: dict[str, Any] = field(default_factory=dict)  # the primary's connections (db, auth, options)
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)  # the Sentinels' connections (auth)


def _host_port(item: str, url: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, ""
    if not host:
        raise ValueError(f"Sentinel URL {redact(url)}: an empty host in the Sentinel list")
    try:
        return unquote(host), int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"Sentinel URL {redact(url)}: {item!r} is not host:port") from None


def parse(url: str) -> SentinelURL:
    """Parse a `redis+sentinel://` or `rediss+sentinel://` URL. Raises ValueError saying what is wrong."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): {redact(url)}")
    tls = SCHEMES[scheme]
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = [_host_port(h, url) for h in hosts.split(",") if h.strip()]
    if not sentinels:
        raise ValueError(f"Sentinel URL {redact(url)} names no Sentinel: use "
                         f"redis+sentinel://host1:26379,host2:26379/<service>[/<db>]")
    path = [unquote(p) for p in parts.path.strip("/").split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"Sentinel URL {redact(url)}: the path must be /<service> or /<service>/<db>, "
                         f"the service being the name Sentinel monitors (`sentinel monitor <service> ...`)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    sentinel_kwargs: dict[str, Any] = {}
    for key in _SENTINEL_AUTH:
        values = [v for k, v in query if k == key]
        if values:
            sentinel_kwargs[key.removeprefix("sentinel_")] = values[-1]
    rest = [(k, v) for k, v in query if k not in _SENTINEL_AUTH]
    db = path[1] if len(path) == 2 else "0"
    # redis-py's own URL parser reads the options (their types, TLS included) as it does for a plain URL.
    plain = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}sentinel/{db}"
    node = parse_url(plain + (f"?{urlencode(rest)}" if rest else ""))
    for key in ("host", "port", "connection_class"):
        node.pop(key, None)
    if tls:
        node["ssl"] = True
    return SentinelURL(sentinels, path[0], tls, node, sentinel_kwargs)


def redact(url: str) -> str:
    """The URL without its passwords (the data nodes' and the Sentinels'), fit for logs and errors."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    query = "&".join(f"{k}=***" if k == "sentinel_password" else f"{k}={v}"
                     for k, v in parse_qsl(parts.query, keep_blank_values=True))
    return parts._replace(netloc=f"{userinfo}{at}{hosts}", query=query).geturl()


def _split_kwargs(parsed: SentinelURL, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The primary's connection options (URL, then the caller's kwargs) and the Sentinels' (their socket and TLS
    options follow the primary's, their credentials are their own)."""
    node = {**parsed.node_kwargs, **kwargs}
    if node.pop("ssl", False):
        node["ssl"] = True
    sent = {k: v for k, v in node.items() if k.startswith(("socket_", "ssl"))}
    sent.update(parsed.sentinel_kwargs)
    return node, sent


def _no_primary(service: str, sentinels: list, err: Exception) -> str:
    # redis-py's message holds the repr of every Sentinel client (kilobytes, into every log line of a failover).
    asked = ", ".join(f"{s.get_connection_kwargs().get('host')}:{s.get_connection_kwargs().get('port')}"
                      for s in sentinels)
    silent = str(err).count(" - ")  # redis-py lists each Sentinel that did not answer as "<client> - <error>"
    return (f"Sentinel names no live primary for service {service!r} (asked {asked}; {silent} did not answer): "
            f"a failover in progress, or a wrong service name")


class _Sentinel(ssentinel.Sentinel):
    def discover_master(self, service_name: str) -> tuple:
        try:
            return super().discover_master(service_name)
        except ssentinel.MasterNotFoundError as e:
            err = e
        # Raised outside the except block, so that it has no __context__: the CLI reports an error's root cause.
        raise ssentinel.MasterNotFoundError(_no_primary(service_name, self.sentinels, err))


class _AsyncSentinel(asentinel.Sentinel):
    async def discover_master(self, service_name: str) -> tuple:
        try:
            return await super().discover_master(service_name)
        except asentinel.MasterNotFoundError as e:
            err = e
        # Raised outside the except block, so that it has no __context__: the CLI reports an error's root cause.
        raise asentinel.MasterNotFoundError(_no_primary(service_name, self.sentinels, err))


class SentinelRedis(redis_lib.Redis):
    """A redis-py client of the primary that Sentinel names; `close()` also closes the Sentinel connections."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            for s in self.connection_pool.sentinel_manager.sentinels:
                s.close()


class AsyncSentinelRedis(aredis.Redis):
    """The asyncio twin of SentinelRedis."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            for s in self.connection_pool.sentinel_manager.sentinels:
                await s.aclose()


def connect(url: str, **kwargs: Any) -> SentinelRedis:
    """A sync client of the service's current primary (no I/O until its first command)."""
    parsed = parse(url)
    node, sent = _split_kwargs(parsed, kwargs)
    manager = _Sentinel(parsed.sentinels, sentinel_kwargs=sent)
    return manager.master_for(parsed.service, redis_class=SentinelRedis, **node)


def connect_async(url: str, **kwargs: Any) -> AsyncSentinelRedis:
    """An asyncio client of the service's current primary (no I/O until its first command)."""
    parsed = parse(url)
    node, sent = _split_kwargs(parsed, kwargs)
    manager = _AsyncSentinel(parsed.sentinels, sentinel_kwargs=sent)
    return manager.master_for(parsed.service, redis_class=AsyncSentinelRedis, **node)
