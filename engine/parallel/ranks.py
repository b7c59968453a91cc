"""Ranks 1..N-1 of a tensor-parallel replica, and rank 0's handle on them.

Rank 0 (the engine the worker runs: scheduler, block manager, sampler) starts the other ranks of its host as
processes of their own; on other hosts `pagedq worker --node-rank K` starts theirs. Each rank loads only its shard
(engine.parallel.shard), joins the process group, and then runs every forward rank 0 tells it to: one step message
(the step's host inputs, broadcast once over gloo) per step, never per layer. Rank 0 alone samples; the other ranks
send it their slice of the logits.

Failure: a rank that cannot load says why to rank 0, which fails its start with that reason. Once running, a
rank that dies stops rank 0 (engine.parallel.shard.fail: one log line, a non-zero exit), and rank 0 dying stops the
others (their pipe to it closes, or their next collective fails).

What a rank runs is given to this module, not imported by it: `runner`, a class built in the rank's process as
runner(config, folder, shard) whose follow_rank0() runs rank 0's steps until it says stop (engine.runner's
ModelRunner, which starts the ranks itself). So the runner imports this module and never the other way round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.parallel.shard import RANK_FAILED_EXIT, Shard, fail

log = logging.getLogger("pagedq.engine")

START_TIMEOUT_S = 600.0  # loading a shard of a large model from a slow disk


class Follower(Protocol):
    def follow_rank0(self) -> None:
        """Run each step rank 0 sends, until it says stop."""


# What a rank builds once it holds its shard: runner(config, folder, shard). A class, so that it pickles by name.
Runner = Callable[[EngineConfig, str, Shard], Follower]


# ---- rank 0's handle on the ranks of its host --------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(config: EngineConfig) -> range:
    """The ranks this host runs: node_rank's share of tensor_parallel_size, in order."""
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


class Ranks:
    """The rank processes one host starts (ranks 1.. of node 0 beside rank 0; every rank of another node)."""

    def __init__(self, config: EngineConfig, folder: str, ranks: range, runner: Runner) -> None:
        """runner: what each rank runs (see the module's docstring)."""
        self.init_method = f"tcp://{config.dist_init_addr or f'127.0.0.1:{_free_port()}'}"
        ctx = mp.get_context("forkserver")
        # The fork server imports torch and the engine once; each rank forks from it in a fraction of a second.
        ctx.set_forkserver_preload([__name__, runner.__module__])
        self.procs: dict[int, mp.Process] = {}
        self.conns: dict[int, Connection] = {}
        self.stopping = False
        level = logging.getLogger().getEffectiveLevel()
        for rank in ranks:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(config, str(folder), rank, self.init_method, theirs, runner, level),
                               name=f"pagedq-tp-rank{rank}", daemon=True)
            with _main_not_reimported():
                proc.start()
            theirs.close()
            self.procs[rank], self.conns[rank] = proc, ours
            log.info("tensor-parallel rank %d: pid %d", rank, proc.pid)

    def wait_ready(self) -> None:
        """Until every rank has loaded its shard; a rank that could not -> ValueError with its reason."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = dict(self.conns)
        while waiting:
            for rank, conn in list(waiting.items()):
                if conn.poll(0.05):
                    try:
                        kind, detail = conn.recv()
                    except EOFError:
                        kind, detail = "error", "it exited"
                    if kind == "error":
                        self.stop(timeout=1.0)
                        raise ValueError(f"tensor-parallel rank {rank} could not start: {detail}")
                    del waiting[rank]
                elif not self.procs[rank].is_alive():
                    code = self.procs[rank].exitcode
                    self.stop(timeout=1.0)
                    raise ValueError(f"tensor-parallel rank {rank} exited with status {code} while starting")
            if time.monotonic() > deadline:
                self.stop(timeout=1.0)
                raise ValueError(f"tensor-parallel ranks {sorted(waiting)} did not load in {START_TIMEOUT_S:.0f} s")

    def watch(self) -> None:
        """From now on a rank that dies stops this process (engine.parallel.shard.fail)."""
        threading.Thread(target=self._watch, name="pagedq-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            self._stop_if_one_died()
            time.sleep(0.2)

    def _stop_if_one_died(self) -> None:
        for rank, proc in self.procs.items():
            if not proc.is_alive() and not self.stopping:
                fail(f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit status {proc.exitcode}: "
                     f"this worker stops; its jobs' leases lapse and another worker resumes them")

    def peer_lost(self, error: str) -> None:
        """A collective failed: say which rank of this host died (its exit is seen a moment after its sockets
        close), or that one elsewhere did, and stop."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            self._stop_if_one_died()
            time.sleep(0.05)
        fail(f"tensor parallelism: a rank on another host is gone ({error}): this worker stops; its jobs' leases "
             f"lapse and another worker resumes them")

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (they were told to stop, or are stopping), then end those that did not."""
        self.stopping = True
        for proc in self.procs.values():
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns.values():
            conn.close()


@contextlib.contextmanager
def _main_not_reimported():
    """multiprocessing re-imports the parent's __main__ in a forked-server child, which reruns any unguarded
    script (`python -m cli worker` among them) there. A rank needs nothing from it: hide it while starting one."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


# ---- a rank --------------------------------------------------------------------------------------------------

def cpu_threads(config: EngineConfig) -> int:
    """Intra-op threads of one rank: --cpu-threads-per-rank, or this host's cores shared evenly by its ranks."""
    if config.cpu_threads_per_rank:
        return config.cpu_threads_per_rank
    per_node = config.tensor_parallel_size // config.nnodes
    return max(1, len(os.sched_getaffinity(0)) // per_node)


def pin(config: EngineConfig, rank: int) -> None:
    """Pin this process to its own cores where the host has enough for every local rank; ranks on shared cores
    would preempt one another between the all-reduces."""
    threads = cpu_threads(config)
    torch.set_num_threads(threads)
    cores = sorted(os.sched_getaffinity(0))
    local = rank - local_ranks(config).start
    if len(cores) >= threads * (local + 1):
        try:
            os.sched_setaffinity(0, cores[local * threads: (local + 1) * threads])
        except OSError as e:  # a container that forbids it: run unpinned
            log.info("rank %d not pinned: %s", rank, e)


def rank_device(config: EngineConfig, rank: int) -> str:
    """A rank's device: on CUDA, its own GPU (the host's local ranks on consecutive GPUs from config.device's)."""
    if not config.device.startswith("cuda"):
        return config.device
    first = int(config.device.partition(":")[2] or 0)
    return f"cuda:{first + rank - local_ranks(config).start}"


def _watch_parent(conn: Connection) -> None:
    """Exit once rank 0 is gone (its end of the pipe closes), even while this rank waits outside a collective."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        os._exit(RANK_FAILED_EXIT)


def rank_main(config: EngineConfig, folder: str, rank: int, init_method: str, conn: Connection | None,
              runner: Runner, log_level: int = logging.INFO) -> None:
    """A rank's process: load the shard (`runner` builds it and joins the group), run rank 0's steps until it says
    stop."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    # Ctrl-C in a terminal, or a SIGTERM to the process group, is for rank 0, which drains and then stops the rank;
    # a rank ending on its own would look like a crash to it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = dataclasses.replace(config, device=rank_device(config, rank))
    pin(config, rank)
    shard = Shard(rank, config.tensor_parallel_size, init_method, config.device)
    if conn is not None:
        shard.before_join = lambda: conn.send(("ready", ""))
    try:
        follower = runner(config, folder, shard)
    except Exception as e:  # the reason goes to rank 0, which fails its start with it
        log.exception("rank %d could not start", rank)
        if conn is not None:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    if conn is not None:
        threading.Thread(target=_watch_parent, args=(conn,), daemon=True).start()
    follower.follow_rank0()
    shard.leave()


def serve_node(config: EngineConfig, folder: str, runner: Runner) -> int:
    """`pagedq worker --node-rank K` (K > 0): run this host's ranks of the replica whose rank 0 is at
    dist_init_addr, until they exit -> the exit status."""
    ranks = Ranks(config, folder, local_ranks(config), runner)
    ranks.stopping = True  # no watchdog here: each rank's own exit says how it went
    codes = []
    for proc in ranks.procs.values():
        proc.join()
        codes.append(proc.exitcode)
    return next((c for c in codes if c), 0)
