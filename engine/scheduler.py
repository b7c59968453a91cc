"""Iteration-level scheduling, vLLM v1 style.

Every step is one forward over a mixed batch under a token budget and a sequence cap: running requests first
(a decode token each, or the next chunk of a long prompt), then waiting requests admitted while blocks and budget
allow. When a running request needs a block and none is free, the most recently admitted request is preempted
by recompute: its blocks are freed and it goes back to the head of the queue, to be prefilled again later with its
prompt and the tokens it has generated so far.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def _sort_key(seq: Sequence) -> tuple[int, int]:
    return seq.sort_key


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.by_id: dict[str, Sequence] = {}
        self.finished_running = 0  # finished requests still in `running`, dropped at the next look at it
        # Blocks kept free at admission so running requests can grow a while before anyone is preempted;
        # without it a full pool admits a request only to preempt it again a step later.
        self.watermark = block_manager.num_blocks // 100

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.by_id:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        self.by_id[seq.request_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def _drop_finished(self) -> None:
        # finish() only marks a running request: removing each one from the list at once would cost the
        # whole list per finished request, and a step can finish hundreds.
        if self.finished_running:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
            self.finished_running = 0

    @property
    def num_running(self) -> int:
        self._drop_finished()
        return len(self.running)

    def has_unfinished(self) -> bool:
        self._drop_finished()
        return bool(self.waiting or self.running)

    def num_admittable(self) -> int:
        """How many new requests could join now: free sequence slots not already promised to waiting requests,
        limited by free blocks (each new request needs at least one)."""
        self._drop_finished()
        slots = self.max_num_seqs - len(self.running) - len(self.waiting)
        blocks = (self.bm.num_free_blocks - self.watermark
                  - sum(self.bm.blocks_needed(s.num_tokens) for s in self.waiting))
        return max(0, min(slots, blocks))

    def schedule(self) -> SchedulerOutput:
        self._drop_finished()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        bs = self.bm.block_size
        running = self.running
        add_seq, add_count = out.seqs.append, out.num_new_tokens.append  # bound once: this loop runs per sequence
        while i < len(running) and budget > 0:
            seq = running[i]
            done = seq.num_computed_tokens
            n = len(seq.token_ids) - done
            if n == 0:  # its last token is still in flight (overlapped steps): nothing to run until it lands
                i += 1
                continue
            if n > budget:
                n = budget
            if done + n <= len(seq.block_table) * bs:  # its blocks hold it: the common decode
                add_seq(seq)
                add_count(n)
                budget -= n
                i += 1
                continue
            while not self.bm.can_append(seq, n):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.bm.append(seq, n)
                add_seq(seq)
                add_count(n)
                budget -= n
                i += 1
                continue
            break
        # Admitting new work right after a preemption would only cause the next one.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget)
            if not self.bm.can_allocate(seq, n, hits, self.watermark):
                break
            self.waiting.pop(0)
            self.bm.allocate(seq, n, hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_seq(seq)
        seq.num_preemptions += 1
        self._enqueue(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave the engine now (finished or aborted): blocks go back at once."""
        seq.finish_reason = reason
        if seq.status == Status.RUNNING:
            self.finished_running += 1
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.bm.free_seq(seq)
        self.by_id.pop(seq.request_id, None)
