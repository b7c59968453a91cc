"""A real primary, its replica and three Sentinels for tests, all on loopback: the Redis that production runs, in
miniature. Debian's redis-server when installed (/usr/bin: the one .ci/run installs; `redis-server --sentinel` is
Sentinel), else the binary worker/redis_server.py picks. Each server has a free port and a folder of its own.

    with SentinelSet() as s:
        s.url                      # redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/pq/0
        s.link.hold()              # the replica stops hearing from the primary (a slow or cut link)
        s.kill_primary()           # SIGKILL; returns the killed server (and drops what the link held)
        s.wait_promoted(old)       # the replica Sentinel promoted
        s.rejoin(old)              # the old primary back, empty, as a replica of the new one

The replica reaches the primary through a small TCP relay of the test's own (Link), so that a test can hold the
replication stream back for a while, the way a slow network or a busy replica does: what the primary writes
meanwhile exists on it alone, and a kill then loses it, as asynchronous replication does in production.
Sentinel "fixes" a replica that replicates from another address than the primary's only after failover-timeout,
which is why that is 3 minutes here (a failover itself does not wait for it).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import redis as redis_lib

from worker.redis_server import RedisServer, find_binary, free_port, stop_process

DEBIAN_BINARY = "/usr/bin/redis-server"
HOST = "127.0.0.1"
# A replica's full sync starts at once (Redis waits 5 s by default for more replicas to share a diskless sync).
NODE_ARGS = ("--repl-diskless-sync-delay", "0")
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # Sentinel's folders: see Sentinel


def server_binary() -> str:
    return DEBIAN_BINARY if os.access(DEBIAN_BINARY, os.X_OK) else find_binary()


class Link:
    """A TCP relay on 127.0.0.1 between a replica and its primary. hold(): stop relaying, both ways (the bytes wait
    in the kernel's buffers); release(): relay again; cut(): close every connection, dropping what was held."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((HOST, 0))
        self.server.listen(8)
        self.port = self.server.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            try:
                b = socket.create_connection((HOST, self.target), timeout=2)
            except OSError:
                a.close()
                continue
            with self.lock:
                self.conns += [a, b]
            threading.Thread(target=self._pump, args=(a, b), name="link-pump", daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while not self.closed:
                self.flowing.wait(0.1)
                if not self.flowing.is_set():
                    continue
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for s in ready:
                    if not self.flowing.is_set():
                        break
                    data = s.recv(65536)
                    if not data:
                        return
                    peers[s].sendall(data)
        except (OSError, ValueError):  # cut: closed under our feet
            return
        finally:
            a.close()
            b.close()

    def hold(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        self.flowing.set()

    def cut(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self) -> None:
        self.closed = True
        self.server.close()
        self.cut()
        self.flowing.set()


class Sentinel:
    """One `redis-server --sentinel` process with a config file of its own (Sentinel rewrites it)."""

    def __init__(self, binary: str, service: str, primary_port: int, quorum: int, down_after_ms: int,
                 failover_timeout_ms: int) -> None:
        self.binary = binary
        # Sentinel fsyncs its config at each state change (a new epoch, a vote): on a busy disk one fsync can stall it
        # for seconds, long enough to lose an election (it is retried only after 2 x failover-timeout) or to enter
        # TILT. A tmpfs, where there is one, makes that instant.
        self.dir = tempfile.TemporaryDirectory(prefix="pagedq-sentinel-", dir=SCRATCH)
        self.port = free_port()
        self.conf = Path(self.dir.name) / "sentinel.conf"
        self.conf.write_text("\n".join([
            f"port {self.port}", f"bind {HOST}", f"dir {self.dir.name}", f"logfile {self.dir.name}/sentinel.log",
            f"sentinel monitor {service} {HOST} {primary_port} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1", ""]))
        self.proc = subprocess.Popen([binary, str(self.conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def client(self) -> redis_lib.Redis:
        return redis_lib.Redis(host=HOST, port=self.port, decode_responses=True, socket_timeout=2,
                               socket_connect_timeout=1)

    def stop(self) -> None:
        stop_process(self.proc, 5)
        self.dir.cleanup()


class SentinelSet:
    def __init__(self, service: str = "pq", sentinels: int = 3, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 180_000, binary: str | None = None) -> None:
        self.binary = binary or server_binary()
        self.service = service
        self.count = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.servers: dict[int, RedisServer] = {}  # port -> the data node on it
        self.sentinels: list[Sentinel] = []
        self.link: Link | None = None  # the first replica's way to the first primary

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self, timeout: float = 30.0) -> SentinelSet:
        try:
            primary = RedisServer(binary=self.binary, args=NODE_ARGS).start()
            self.servers[primary.port] = primary
            self.link = Link(primary.port)
            replica = RedisServer(binary=self.binary, args=[*NODE_ARGS, "--replicaof", HOST, str(self.link.port)]
                                  ).start()
            self.servers[replica.port] = replica
            self.sentinels = [Sentinel(self.binary, self.service, primary.port, self.count // 2 + 1,
                                       self.down_after_ms, self.failover_timeout_ms) for _ in range(self.count)]
            self._wait(lambda: self._linked(primary.port, replica.port), timeout,
                       "the replica in sync and every Sentinel watching both")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, cond, timeout: float, what: str):
        end = time.monotonic() + timeout
        while True:
            try:
                got = cond()
            except redis_lib.RedisError:
                got = None
            if got:
                return got
            if time.monotonic() > end:
                raise RuntimeError(f"timed out after {timeout} s waiting for {what}{self.logs()}")
            time.sleep(0.05)

    def node(self, port: int) -> redis_lib.Redis:
        return redis_lib.Redis(host=HOST, port=port, decode_responses=True, socket_timeout=2,
                               socket_connect_timeout=1)

    def _linked(self, primary: int, replica: int) -> bool:
        r = self.node(replica)
        try:
            info = r.info("replication")
        finally:
            r.close()
        via = self.link.port if self.link is not None and self.link.target == primary else primary
        if info.get("master_link_status") != "up" or int(info.get("master_port", 0)) not in (primary, via):
            return False
        for s in self.sentinels:
            c = s.client()
            try:
                if self._master_port(c) != primary:
                    return False
                replicas = c.execute_command("SENTINEL", "REPLICAS", self.service)
                if not any(int(x["port"]) == replica and "s_down" not in x["flags"] for x in replicas):
                    return False
                # Each Sentinel knows the others: a failover needs a quorum and an elected leader.
                if len(c.execute_command("SENTINEL", "SENTINELS", self.service)) < self.count - 1:
                    return False
            finally:
                c.close()
        return True

    def _master_port(self, c: redis_lib.Redis) -> int:
        return int(c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])

    def primary_port(self) -> int:
        c = self.sentinels[0].client()
        try:
            return self._master_port(c)
        finally:
            c.close()

    @property
    def primary(self) -> RedisServer:
        return self.servers[self.primary_port()]

    def replicas(self) -> list[RedisServer]:
        port = self.primary_port()
        return [s for p, s in self.servers.items() if p != port and s.proc is not None]

    def kill_primary(self) -> RedisServer:
        """SIGKILL the primary: what it had not sent its replica yet is gone (a held link's bytes too)."""
        srv = self.primary
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        if self.link is not None and self.link.target == srv.port:
            self.link.cut()
            self.link.release()
        return srv

    def wait_promoted(self, old: RedisServer, timeout: float = 90.0) -> RedisServer:
        """The server Sentinel promoted in place of `old`, once every Sentinel names it and it acts as primary.
        90 s: a Sentinel starved of CPU for 2 s (a busy 2-core machine, the suite on 2 processes) enters TILT mode
        and acts on nothing for 30 s; the failover follows once it leaves."""
        def promoted() -> int | None:
            ports = set()
            for s in self.sentinels:
                c = s.client()
                try:
                    ports.add(self._master_port(c))
                finally:
                    c.close()
            if len(ports) != 1 or old.port in ports:
                return None
            port = ports.pop()
            r = self.node(port)
            try:
                return port if r.execute_command("ROLE")[0] == "master" else None
            finally:
                r.close()

        return self.servers[self._wait(promoted, timeout, f"a replica promoted in place of port {old.port}")]

    def rejoin(self, old: RedisServer, timeout: float = 30.0) -> None:
        """Start `old` again (empty: no persistence) as a replica of the current primary, as an operator or
        Sentinel itself would, and wait until it is in sync."""
        primary = self.primary_port()
        old.args = [*NODE_ARGS, "--replicaof", HOST, str(primary)]
        old.restart()
        self._wait(lambda: self._linked(primary, old.port), timeout, f"port {old.port} in sync with {primary}")

    def logs(self) -> str:
        out = []
        for s in self.sentinels:
            with contextlib.suppress(OSError):
                out.append(f"\n--- sentinel {s.port}:\n" + (Path(s.dir.name) / "sentinel.log").read_text()[-1500:])
        return "".join(out)

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        self.sentinels = []
        if self.link is not None:
            self.link.close()
        for srv in self.servers.values():
            srv.stop()
        self.servers = {}

    def __enter__(self) -> SentinelSet:
        return self.start() if not self.servers else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
