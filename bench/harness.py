"""A child process for the tests and the benches: started with its output in a log file, waited on until it is up
(its health URL answers 200, or a condition holds), and stopped gracefully, then killed.

`Process` is a `subprocess.Popen`, so a test may still signal, kill or poll it; what it adds is the log (`.log`, an
open file; `.output()`, `.tail()`), the waits, which fail with the log's tail as soon as the process exits instead of
running out their time, and `stop()`.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Loopback only: a proxy named in the environment must not stand between us and a child on 127.0.0.1.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class NotReady(RuntimeError):
    """The process exited, or was not up within its time; the message holds its log's tail."""


def repo_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH: a child runs this checkout's code, wherever from."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether GET url answers 200 now."""
    try:
        with _DIRECT.open(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


class Process(subprocess.Popen):
    """`cmd` started now, its stdout and stderr written to `log` (a path)."""

    def __init__(self, cmd: list[str], log: str | Path, *, env: dict[str, str] | None = None,
                 cwd: str | Path | None = None, name: str | None = None) -> None:
        self.name = name or " ".join(cmd[:4])
        self.log = open(log, "w+")  # noqa: SIM115 (open while the process runs; closed by stop())
        super().__init__(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def output(self) -> str:
        """Everything the process wrote so far."""
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def tail(self, chars: int = 3000) -> str:
        return self.output()[-chars:]

    def wait_until(self, ready: Callable[[], Any], timeout: float, what: str = "ready") -> Any:
        """Poll `ready` until it returns something true, and return that; NotReady if the process exits first or
        `timeout` seconds pass."""
        end = time.monotonic() + timeout
        while True:
            got = ready()
            if got:
                return got
            if self.poll() is not None:
                raise NotReady(f"{self.name} exited with {self.returncode} before it was {what}:\n{self.tail()}")
            if time.monotonic() > end:
                raise NotReady(f"{self.name} was not {what} within {timeout:g} s:\n{self.tail()}")
            time.sleep(0.1)

    def wait_healthy(self, url: str, timeout: float = 60.0) -> Process:
        """Until GET url answers 200 (serve's /health; a worker's metrics port once its model is loaded)."""
        self.wait_until(lambda: answers(url), timeout, f"answering {url}")
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; the log is closed. -> its exit
        status."""
        if self.poll() is None:
            self.terminate()
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self.wait()
        self.log.close()
        return self.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_logged(cmd: list[str], log: str | Path, *, health: str | None = None, timeout: float = 60.0,
                 env: dict[str, str] | None = None, name: str | None = None) -> Process:
    """`cmd` started from the repository root with this checkout first on PYTHONPATH (repo_env), its output in
    `log`; with `health`, returned once that URL answers 200 (stopped, and NotReady raised, if it does not)."""
    p = Process(cmd, log, env=env or repo_env(), cwd=ROOT, name=name)
    if health:
        try:
            p.wait_healthy(health, timeout)
        except NotReady:
            p.stop(5)
            raise
    return p
