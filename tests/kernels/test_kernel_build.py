"""Building the CPU kernels once per environment, safely (pagedq_kernels/build.py): a build killed halfway never blocks the
next start, racing starts build once, a held lock is waited for within a bound, and the key tells environments
apart."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedq_kernels import build

ROOT = Path(__file__).resolve().parents[2]

# A worker's start for its kernels (cpu_ops.load: build once under the lock, then load), on a one-file library of
# its own: the lock, the private folder, the kill and the race are build.py's whatever it compiles, and a source that
# takes seconds rather than the real kernels' minutes keeps the suite short. The real sources are built by
# `make setup` (`pagedq kernels build`) and loaded by every test in tests/kernels/test_cpu_kernels.py.
START = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
import torch
from pagedq_kernels import build, cpu_ops
build.SOURCES, build.HEADERS = [Path(sys.argv[2])], []
t = time.monotonic()
why = cpu_ops.load(Path(sys.argv[1]))
assert why is None, why
assert torch.ops.pagedq_build_test.answer() == 42  # the library loaded is whole
print(f"ready cpu after {time.monotonic() - t:.0f} s", flush=True)
"""

SOURCE = """
#include <torch/library.h>

int64_t answer() { return 42; }

TORCH_LIBRARY(pagedq_build_test, m) { m.def("answer() -> int", &answer); }
"""
# The processes that compile a C++ file: g++'s compiler proper, or clang's.
COMPILERS = {"cc1plus", "clang", "clang++"}


def start(root: Path, source: Path) -> subprocess.Popen:
    """What a worker's start does for its kernels, in a process of its own (its own session: a kill reaches the
    compilers it runs too)."""
    return subprocess.Popen([sys.executable, "-c", START, str(root), str(source)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def compiling(session: int) -> bool:
    """Whether a compiler runs in `session` (the build's processes) at this moment."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended
            continue
        comm, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if comm in COMPILERS and int(fields[3]) == session:  # fields: state, ppid, pgrp, session, ...
            return True
    return False


@pytest.mark.slow
def test_a_build_killed_halfway_blocks_no_later_start(tmp_path, monkeypatch):
    if build.missing_tools():
        pytest.fail(f"CI machines can build the kernels: {build.missing_tools()}")
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    monkeypatch.setattr(build, "SOURCES", [source])  # the key of what the starts build
    monkeypatch.setattr(build, "HEADERS", [])
    root = tmp_path / "kernels"
    key = build.build_key()
    first = start(root, source)
    deadline = time.monotonic() + 120
    while not compiling(first.pid):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, f"the first build never started compiling (no {COMPILERS} seen)"
        time.sleep(0.05)
    # Mid-compile: the object half written, torch's lock in the private folder, no library yet.
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    assert any(root.glob(f"cpu-kernels-{key}.tmp-*")) and not build.library(root, key).exists()

    # Two starts at once, as N worker replicas on one cache volume: one builds, the other waits for it.
    racing = [start(root, source), start(root, source)]
    logs = [p.communicate(timeout=900)[0] for p in racing]
    assert [p.returncode for p in racing] == [0, 0], logs
    assert all("ready cpu" in log for log in logs), logs
    assert sum("building the CPU kernels for this CPU" in log for log in logs) == 1, logs
    assert build.library(root, key).exists()
    assert not any(root.glob(f"cpu-kernels-{key}.tmp-*"))  # the killed build's leftovers are gone

    again = start(root, source)  # a later start loads what is there, with no build and no wait
    log = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and "ready cpu" in log and "building" not in log and "waiting" not in log, log


def test_a_held_lock_is_waited_for_within_a_bound(tmp_path, caplog):
    root = tmp_path / "kernels"
    root.mkdir()
    key = build.build_key()
    with open(root / f"cpu-kernels-{key}.lock", "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another process building (a different open file: the lock conflicts)
        with caplog.at_level("INFO", logger="pagedq.kernels"), pytest.raises(build.BuildError) as e:
            build.ensure_built(root, wait_s=1.0)
    assert str(build.folder(root, key)) in str(e.value) and build.WAIT_ENV in str(e.value)
    assert "another process is building the CPU kernels" in caplog.text


def test_the_key_tells_environments_apart(monkeypatch):
    key = build.build_key()
    assert build.build_key() == key  # stable within one environment
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    other_env = build.build_key()
    monkeypatch.undo()
    monkeypatch.setattr(build, "_compiler_identity", lambda: "/usr/bin/g++-99 g++ 99.0")
    other_compiler = build.build_key()
    monkeypatch.undo()
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags: fpu sse2")
    other_cpu = build.build_key()
    assert len({key, other_env, other_compiler, other_cpu}) == 4


def test_kernels_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(build.ROOT_ENV, raising=False)
    assert build.default_root(tmp_path) == tmp_path / "kernels"
    monkeypatch.setenv(build.ROOT_ENV, str(tmp_path / "image"))
    assert build.default_root(tmp_path) == tmp_path / "image"
