"""Tensor parallelism: which slice of the model a rank holds, and the collectives between the ranks.

One model replica runs over `size` ranks (Megatron-style): each holds a slice of the attention heads, of the MLP's
intermediate features and of the vocabulary; the column-parallel projections (QKV, gate/up) need no communication,
each row-parallel one (o_proj, down) ends in one all-reduce, the vocab-parallel embedding in one more, and the
logits of the sampled rows are gathered on rank 0, which alone samples. With size 1 every collective is a no-op and
every slice is the whole tensor, so the single-device path is this one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("pagedq.engine")

RANK_FAILED_EXIT = 3  # the exit status of a worker whose tensor-parallel rank died or lost its peers
# A collective that waits this long is a hung peer, not a slow step (a dead one is seen at once: its sockets close).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
_failing = threading.Lock()


def fail(reason: str) -> None:
    """Stop this process at once with one line that says why: a replica missing a rank can compute nothing more,
    and its jobs are safer with their leases lapsing (another worker resumes them) than with a drain that waits on
    collectives which never return."""
    if _failing.acquire(blocking=False):
        log.critical("%s", reason)
        logging.shutdown()
    os._exit(RANK_FAILED_EXIT)


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank holds: query heads [q_start, q_start + q_count) and KV heads likewise (one KV
    head, replicated on several ranks, where the model has fewer KV heads than ranks)."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def split_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSplit:
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads: "
                         f"choose a size that does")
    per_rank = num_heads // size
    if num_kv_heads % size == 0:
        kv_count = num_kv_heads // size
        return HeadSplit(rank * per_rank, per_rank, rank * kv_count, kv_count)
    if size % num_kv_heads == 0:  # each KV head serves size / num_kv_heads ranks, whose query heads all read it
        return HeadSplit(rank * per_rank, per_rank, rank * num_kv_heads // size, 1)
    raise ValueError(f"tensor_parallel_size {size} and the model's {num_kv_heads} KV heads: one must divide the "
                     f"other (KV heads are split, or replicated when there are fewer than ranks)")


@dataclass
class Shard:
    """This rank's place in the replica, and its collectives. `group` carries the forward's all-reduces (gloo on a
    CPU, NCCL on CUDA); `control`, always gloo, carries the step messages from rank 0 (host arrays)."""

    rank: int = 0
    size: int = 1
    init_method: str | None = None  # tcp://host:port of the rendezvous
    device: str = "cpu"
    before_join: Callable[[], None] | None = None  # what a rank does before it joins the group (the launcher's)
    # What rank 0 does when a collective fails (the launcher's: name the rank that died); then it stops.
    on_peer_lost: Callable[[str], None] | None = None
    # CPU ranks of one host: the largest tensor (bytes) reduced through shared memory (engine.parallel.shm_all_reduce)
    # rather than gloo's sockets; 0: never.
    shm_bytes: int = 0
    group: object | None = None
    control: object | None = None
    # Seconds in each kind of collective on this rank (CPU: they are synchronous, so this is their cost).
    comm_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _joined: bool = field(default=False, repr=False)
    shm: object | None = field(default=None, repr=False)

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def span(self, total: int, what: str) -> slice:
        """This rank's even slice of `total` features (the MLP's intermediate ones)."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {total} {what}")
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def vocab_span(self, vocab: int) -> tuple[int, int]:
        """(first row, rows per rank) of the vocab-parallel embedding and logits: rows padded to a multiple of the
        size, the padding rows zero and dropped after the gather."""
        per_rank = -(-vocab // self.size)
        return self.rank * per_rank, per_rank

    def join(self) -> None:
        """Join the process group of the replica (the rendezvous at init_method)."""
        if not self.parallel or self._joined:
            return
        if self.before_join is not None:
            self.before_join()
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=self.init_method, rank=self.rank, world_size=self.size,
                                timeout=COLLECTIVE_TIMEOUT)
        self.group = dist.group.WORLD
        self.control = self.group if backend == "gloo" else dist.new_group(backend="gloo")
        self._joined = True
        if self.shm_bytes:
            self._map_shared_memory()

    def _map_shared_memory(self) -> None:
        """Rank 0 makes the file, every rank maps it, then rank 0 unlinks it (the mappings stay)."""
        from engine.parallel.shm_all_reduce import ShmAllReduce

        name = torch.zeros(256, dtype=torch.uint8)
        if self.rank == 0:
            path = ShmAllReduce.new_path()
            self.shm = ShmAllReduce(path, 0, self.size, self.shm_bytes)
            name[: len(path)] = torch.frombuffer(bytearray(path.encode()), dtype=torch.uint8)
        self.broadcast(name)
        if self.rank:
            path = bytes(name[name > 0].tolist()).decode()
            self.shm = ShmAllReduce(path, self.rank, self.size, self.shm_bytes)
        dist.barrier(group=self.control)
        if self.rank == 0:
            os.unlink(path)

    def leave(self) -> None:
        if self._joined:
            self._joined = False
            dist.destroy_process_group()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place: the end of a row-parallel layer."""
        if self.shm is not None and self.shm.fits(x):
            start = time.perf_counter()
            self.shm.all_reduce(x)
            self.comm_s["shm_all_reduce"] += time.perf_counter() - start
        elif self.parallel:
            self._collective(dist.all_reduce, x, group=self.group)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV cache's block count: the block tables index every rank's)."""
        if not self.parallel:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_logits(self, local: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Each rank's vocabulary slice of the logits [rows, vocab / size] -> the whole [rows, vocab] on rank 0
        (None elsewhere): only rank 0 samples."""
        if not self.parallel:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        self._collective(dist.gather, local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab] if parts is not None else None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """rank 0's t on every rank (the step message), in place."""
        self._collective(dist.broadcast, t, src=0, group=self.control)
        return t

    def _collective(self, collective, /, *args, **kwargs) -> None:
        start = time.perf_counter()
        try:
            collective(*args, **kwargs)
        except RuntimeError as e:  # a peer is gone: its sockets closed mid-collective
            error = str(e).splitlines()[0].split(". ")[0]
            if self.on_peer_lost is not None:
                self.on_peer_lost(error)
            who = "a tensor-parallel rank" if self.rank == 0 else "rank 0"
            fail(f"tensor parallelism: {who} is gone ({error}): rank {self.rank} stops")
        self.comm_s[collective.__name__] += time.perf_counter() - start
