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


def _slots(seq: Sequence) -> int:
    """Batch slots a waiting sequence takes: a group that has not forked yet takes one per continuation."""
    return seq.group.width if seq.group is not None and not seq.group.forked and seq.index == 0 else 1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.by_id: dict[str, Sequence] = {}
        self.finished_running = 0  # finished requests still in `running`, dropped at the next look at it
        self.unforked_slots = 0  # sequences admitted groups will add when they fork (their prompt done)
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
        """How many new requests could join now: free sequence slots not already promised to waiting requests (a
        group promises as many as it runs), limited by free blocks (each new request needs at least one)."""
        self._drop_finished()
        slots = self.max_num_seqs - self._seqs_held() - sum(_slots(s) for s in self.waiting)
        blocks = (self.bm.num_free_blocks - self.watermark
                  - sum(self.bm.blocks_needed(s.num_tokens) for s in self.waiting))
        return max(0, min(slots, blocks))

    def _seqs_held(self) -> int:
        """Running sequences, and those groups that have not forked yet will add when they do."""
        return len(self.running) + self.unforked_slots

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
            if seq.group is not None:  # continuations share blocks, and beams move together: the slow path
                taken, kept = self._schedule_group(i, out, budget)
                if not kept:
                    break
                budget -= taken
                i += len(self._unit(i))
                continue
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
            if not self._make_room(self.bm.blocks_to_write(seq, n), [seq], out):
                break
            self.bm.append(seq, n)
            add_seq(seq)
            add_count(n)
            budget -= n
            i += 1
        # Admitting new work right after a preemption would only cause the next one.
        while not out.preempted and self.waiting and budget > 0:
            taken = self._admit(out, budget)
            if taken is None:
                break
            budget -= taken
        return out

    def _unit(self, i: int) -> list[Sequence]:
        """What is scheduled together from running[i] on: a beam group's live beams (contiguous in running), else
        the one sequence."""
        seq = self.running[i]
        if seq.group is None or not seq.group.is_beam:
            return [seq]
        return self.running[i: i + len(seq.group.seqs)]

    def _schedule_group(self, i: int, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """A group member's share of the step (a beam group's: all its beams) -> (tokens taken, whether the unit is
        still running: False when it was preempted for room)."""
        unit = self._unit(i)
        plan = self._plan(unit, budget)
        need = sum(self.bm.blocks_to_write(s, n) for s, n in plan)
        if not self._make_room(need, unit, out):
            return 0, False
        for s, n in plan:
            self.bm.prepare_write(s, n)
            out.seqs.append(s)
            out.num_new_tokens.append(n)
        return sum(n for _, n in plan), True

    def _plan(self, unit: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Tokens for each sequence of a unit within the budget. Beams sample in the same step or not at all: when
        the budget cannot take every beam's last token, each computes up to its last and waits (recomputing after a
        preemption)."""
        todo = [(s, len(s.token_ids) - s.num_computed_tokens) for s in unit]
        if len(unit) > 1 and sum(n for _, n in todo) > budget:
            todo = [(s, n - 1) for s, n in todo]
        plan = []
        for s, n in todo:
            n = min(n, budget)
            if n > 0:
                plan.append((s, n))
                budget -= n
        return plan

    def _make_room(self, need: int, unit: list[Sequence], out: SchedulerOutput) -> bool:
        """Preempt the latest admitted (a whole group at once) until `need` blocks are free -> False if that took
        the unit itself."""
        while self.bm.num_free_blocks < need:
            victims = self._members(self.running[-1])
            for victim in victims:
                self._unschedule(victim, out)
                self.running.remove(victim)
                self._preempt(victim)
            out.preempted.extend(victims)
            if any(v in unit for v in victims):
                return False
        return True

    @staticmethod
    def _members(seq: Sequence) -> list[Sequence]:
        return list(seq.group.seqs) if seq.group is not None and seq.group.forked else [seq]

    @staticmethod
    def _unschedule(seq: Sequence, out: SchedulerOutput) -> None:
        """Take seq out of this step, where it was scheduled already (a member of a group preempted after it)."""
        for j in range(len(out.seqs) - 1, -1, -1):
            if out.seqs[j] is seq:
                del out.seqs[j], out.num_new_tokens[j]

    def _admit(self, out: SchedulerOutput, budget: int) -> int | None:
        """The head of the waiting queue (a whole group at once) -> tokens it takes, or None if it cannot join."""
        head = self.waiting[0]
        members = [s for s in self.waiting if s.group is head.group] if head.group is not None else [head]
        unforked = head.group is not None and not head.group.forked
        slots = head.group.width if unforked else len(members)
        if self._seqs_held() + slots > self.max_num_seqs:
            return None
        hits = [self.bm.match_prefix(s) for s in members]
        tokens = [max(0, s.num_tokens - len(h) * self.bm.block_size) for s, h in zip(members, hits)]
        # Blocks for what this step can run of each (a long prompt's later chunks take theirs when they run).
        need = sum(self.bm.blocks_needed(len(h) * self.bm.block_size + min(n, budget)) - len(h)
                   for h, n in zip(hits, tokens))
        reclaimed = len({b for h in hits for b in h if self.bm.ref_counts[b] == 0})  # hits sitting in the free list
        # A group that forks later takes a block per other continuation then (a copy of the prompt's last block).
        reserve = self.watermark + (slots - 1 if unforked else 0)
        if self.bm.num_free_blocks - reclaimed < need + reserve:
            return None
        for seq, h in zip(members, hits):
            self.waiting.remove(seq)
            self.bm.allocate(seq, 0, h)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
        if unforked:
            self.unforked_slots += slots - 1
        plan = self._plan(members, budget) if head.group is not None and head.group.is_beam else \
            self._fill(members, budget)
        for seq, n in plan:
            self.bm.append(seq, n)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
        return sum(n for _, n in plan)

    @staticmethod
    def _fill(seqs: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Each sequence's remaining tokens in turn, as far as the budget goes."""
        plan = []
        for seq in seqs:
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        return plan

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """parent's group forked into children (sharing its blocks): they run beside it from now on."""
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        for child in children:
            child.status = Status.RUNNING
        self.unforked_slots -= len(children)

    def replace_beams(self, old: list[Sequence], new: list[Sequence], first: bool) -> None:
        """A beam group's step: its beams `old` (contiguous in running) become `new`, in their place. first: the
        prompt's sequence becomes the beams (the group forks)."""
        at = self.running.index(old[0])
        self.running[at: at + len(old)] = new
        for seq in new:
            seq.status = Status.RUNNING
        if first:
            self.unforked_slots -= len(new) - 1

    def drop(self, seq: Sequence) -> None:
        """A beam the search left behind, or one of a search that ended: its blocks go back now (a running one
        leaves `running` at the next look at it, unless replace_beams took it out first)."""
        if seq.status is Status.RUNNING:
            self.finished_running += 1
        seq.status = Status.FINISHED
        self.bm.free_seq(seq)

    def forget(self, request_id: str) -> None:
        """A group's request ended: its id may come again."""
        self.by_id.pop(request_id, None)

    def add_group(self, seqs: list[Sequence]) -> None:
        """A group's sequences, its first under the request's id."""
        self.add(seqs[0])
        for seq in seqs[1:]:
            self._enqueue(seq)

    def _preempt(self, seq: Sequence) -> None:
        if seq.group is not None and not seq.group.forked:
            self.unforked_slots -= seq.group.width - 1
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
        if seq.group is None:
            self.by_id.pop(seq.request_id, None)
