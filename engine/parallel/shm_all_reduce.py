"""An all-reduce through shared memory for the CPU ranks of one host, behind Shard.all_reduce.

gloo's all-reduce goes through TCP on loopback: a decode step's dozens of small all-reduces (one row of the hidden
state per sequence) each pay socket round trips (bench.tensor_parallel measures it). Here every rank writes its
tensor into its slot of one shared file, publishes a sequence number, waits until every rank has published the
same one, and sums the slots in rank order (so every rank gets the same bits). Two sets of slots are used in turn:
a rank can only write call k + 2 once every rank has published call k + 1, by which time they have all finished
reading call k, so one wait per call suffices.

The file lives in /dev/shm and is unlinked as soon as every rank has mapped it: nothing is left behind, however
the ranks end. A rank that dies leaves the others waiting here; the watchdogs of engine.parallel.ranks end them.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import torch

FLAG_STRIDE = 8  # int64s between two ranks' sequence numbers: one cache line each


class ShmAllReduce:
    def __init__(self, path: str, rank: int, size: int, capacity: int) -> None:
        """capacity: the largest tensor (bytes) it reduces; larger ones go to the process group."""
        self.rank, self.size, self.capacity = rank, size, capacity
        flags = size * FLAG_STRIDE * 8
        total = flags + 2 * size * capacity
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(total)
        raw = np.memmap(path, dtype=np.uint8, mode="r+", shape=(total,))
        self.flags = raw[:flags].view(np.int64)[::FLAG_STRIDE]
        self.slots = torch.from_numpy(raw[flags:].reshape(2, size, capacity))
        self.seq = 0

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/pagedq-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= self.capacity

    def all_reduce(self, x: torch.Tensor) -> None:
        """x summed over the ranks, in place."""
        self.seq += 1
        nbytes = x.numel() * x.element_size()
        slots = self.slots[self.seq % 2, :, :nbytes]
        slots[self.rank].view(x.dtype).view(x.shape).copy_(x)
        self.flags[self.rank] = self.seq
        flags, seq = self.flags, self.seq
        while flags.min() < seq:
            os.sched_yield()
        x.copy_(slots[0].view(x.dtype).view(x.shape))
        for r in range(1, self.size):
            x.add_(slots[r].view(x.dtype).view(x.shape))
