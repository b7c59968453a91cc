"""Iteration-level scheduling, vLLM v1 style, with vLLM's priority policy.

Every step is one forward over a mixed batch under a token budget and a sequence cap: running requests first
(a decode token each, or the next chunk of a long prompt), then waiting requests admitted in Sequence.sort_key
order (priority, then deadline, then arrival) while blocks and budget allow.

Preemption is by recompute: a request's blocks are freed and it goes back to the queue, ahead of later arrivals of
its urgency, to be prefilled again later with its prompt and the tokens it has generated so far. The victim is
always the least urgent running request (the highest Sequence.priority_key; among equals, the most recently
admitted), a unit (Sequence.unit) whole: a beam search's beams together, any other sequence alone (each
continuation of a sampling request too, engine.group). It happens
- when a running request needs a block and none is free;
- with preempt_for_priority, when the head of the queue cannot join (sequence cap or free blocks) and running
  requests are strictly less urgent than it: as many of them as it takes, if that is enough, and it joins in the
  same step. A request of equal or higher urgency is never preempted for it.
Without preempt_for_priority the victim is simply the most recently admitted, and only memory preempts.
After a preemption, only a request more urgent than one still running joins in that step: any other would be the
next victim.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Per row, the draft tokens (speculative decoding) among its new tokens, whose logits are sampled too: the
    # verify step. Empty: none in the step.
    num_drafts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


_sort_key = attrgetter("sort_key")
_slots = attrgetter("slots")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preempt_for_priority: bool = True) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preempt_for_priority = preempt_for_priority
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # in admission order: among equally urgent, the last is preempted first
        self.by_id: dict[str, Sequence] = {}
        self.finished_running = 0  # finished requests still in `running`, dropped at the next look at it
        self.unforked_slots = 0  # sequences admitted groups will add when they fork (their prompt done)
        # Blocks kept free at admission so running requests can grow a while before anyone is preempted;
        # without it a full pool admits a request only to preempt it again a step later.
        self.watermark = block_manager.num_blocks // 100
        self.on_finish: Callable[[Sequence], None] | None = None  # told of every sequence that leaves the engine

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
        slots = self.max_num_seqs - self._seqs_held() - sum(map(_slots, self.waiting))
        blocks = (self.bm.num_free_blocks - self.watermark
                  - sum(self.bm.blocks_needed(s.num_tokens) for s in self.waiting))
        return max(0, min(slots, blocks))

    def num_preemptible(self, priority_key: tuple[int, float]) -> int:
        """Running sequences strictly less urgent than a request of priority_key: what it may preempt to join."""
        if not self.preempt_for_priority:
            return 0
        running = Status.RUNNING
        return sum(1 for s in self.running if s.priority_key > priority_key and s.status is running)

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
            if seq.group is not None:  # it may write into a block it shares (copy on write), or step in a gang
                i, taken = self._schedule_unit(i, out, budget)
                budget -= taken
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
            i, kept = self._make_room(self.bm.blocks_to_write(seq, n), [seq], out, i)
            if not kept:  # it was the least urgent: the next one is at i now
                continue
            self.bm.append(seq, n)
            add_seq(seq)
            add_count(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0:
            taken = self._admit(out, budget)
            if taken is None:
                break
            budget -= taken
        return out

    def _unit(self, i: int) -> list[Sequence]:
        """What steps together from running[i] on: a beam gang's live beams (contiguous in running), else the one
        sequence."""
        gang = self.running[i].gang
        return self.running[i: i + len(gang.seqs)] if gang is not None else [self.running[i]]

    def _schedule_unit(self, i: int, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """A shared-block sequence's share of the step (a beam gang's: all its beams) -> (where in running the next
        unit is, tokens taken): preemptions for room may have moved it, or taken this unit itself."""
        unit = self._unit(i)
        plan = self._plan(unit, budget)
        need = sum(self.bm.blocks_to_write(s, n) for s, n in plan)
        i, kept = self._make_room(need, unit, out, i)
        if not kept:
            return i, 0
        for s, n in plan:
            self.bm.prepare_write(s, n)
            out.seqs.append(s)
            out.num_new_tokens.append(n)
        return i + len(unit), sum(n for _, n in plan)

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

    def _make_room(self, need: int, unit: list[Sequence], out: SchedulerOutput, i: int) -> tuple[int, bool]:
        """Preempt the least urgent (a unit whole) until `need` blocks are free for `unit`, which starts at
        running[i] -> (where it starts now, whether it is still running: False if it was the least urgent)."""
        while self.bm.num_free_blocks < need:
            victims = self.running[self._victim()].unit
            i -= self._evict(victims, out, i)
            if any(v in unit for v in victims):
                return i, False
        return i, True

    def _victim(self) -> int:
        """Where in running the next victim of memory pressure is: the least urgent, among equals the latest."""
        running = self.running
        if not self.preempt_for_priority:
            return len(running) - 1
        return max(range(len(running)), key=lambda j: (running[j].priority_key, j))

    def _evict(self, victims: list[Sequence], out: SchedulerOutput, i: int) -> int:
        """Preempt victims (taken out of this step where scheduled already) -> how many were before running[i]."""
        before = 0
        for victim in victims:
            j = self.running.index(victim)
            before += j < i
            del self.running[j]
            self._unschedule(victim, out)
            self._preempt(victim)
        out.preempted.extend(victims)
        return before

    @staticmethod
    def _unschedule(seq: Sequence, out: SchedulerOutput) -> None:
        """Take seq out of this step, where it was scheduled already (a beam of a gang preempted after it)."""
        for j in range(len(out.seqs) - 1, -1, -1):
            if out.seqs[j] is seq:
                del out.seqs[j], out.num_new_tokens[j]

    def _admit(self, out: SchedulerOutput, budget: int) -> int | None:
        """The head of the waiting queue (its unit whole), less urgent running requests preempted for it where that
        makes room -> tokens it takes, or None if it cannot join."""
        head = self.waiting[0]
        members = [s for s in head.unit if s.status is Status.WAITING]
        slots = sum(map(_slots, members))
        lack_slots = self._seqs_held() + slots - self.max_num_seqs
        # Checked before the prefix lookups below: a full batch of equals asks this every step.
        if (lack_slots > 0 or out.preempted) and not self._outranks(head):
            return None
        hits = [self.bm.match_prefix(s) for s in members]
        # A group that forks later takes a block per other continuation then (a copy of the prompt's last block).
        lack_blocks = self._lack_blocks(hits, [s.num_tokens for s in members], slots - len(members), budget)
        if lack_slots > 0 or lack_blocks > 0:
            victims = self._victims(head.priority_key, hits, lack_slots, lack_blocks) \
                if self.preempt_for_priority else None
            if victims is None:
                return None
            for unit in victims:
                self._evict(unit, out, 0)
        return self._join(members, hits, out, budget)

    def _outranks(self, head: Sequence) -> bool:
        """Whether head may preempt: some running request is strictly less urgent."""
        key = head.priority_key
        return self.preempt_for_priority and any(s.priority_key > key for s in self.running)

    def _lack_blocks(self, hits: list[list[int]], lengths: list[int], reserve: int, budget: int) -> int:
        """Free blocks that sequences of these lengths and prefix hits lack to join now, keeping the watermark and
        `reserve` more free (0 or less: none)."""
        bs = self.bm.block_size
        # Blocks for what this step can run of each (a long prompt's later chunks take theirs when they run).
        need = sum(self.bm.blocks_needed(len(h) * bs + min(max(0, n - len(h) * bs), budget)) - len(h)
                   for h, n in zip(hits, lengths))
        reclaimed = len({b for h in hits for b in h if self.bm.ref_counts[b] == 0})  # hits sitting in the free list
        return need + self.watermark + reserve - (self.bm.num_free_blocks - reclaimed)

    def _victims(self, key: tuple[int, float], hits: list[list[int]], slots: int, blocks: int
                 ) -> list[list[Sequence]] | None:
        """The running units (Sequence.unit) strictly less urgent than `key`, least urgent first (among equals the
        latest), that free `slots` sequence slots and `blocks` blocks -> None if all of them would not. Blocks that
        others share stay taken, and prefix hits of the request to join do not count: it takes those itself."""
        running, ref_counts = self.running, self.bm.ref_counts
        order = sorted((j for j, s in enumerate(running) if s.priority_key > key),
                       key=lambda j: (running[j].priority_key, j), reverse=True)
        hit = {b for h in hits for b in h}
        held: Counter[int] = Counter()
        units, taken = [], set()
        for j in order:
            if slots <= 0 and blocks <= 0:
                break
            if running[j] in taken:
                continue
            unit = running[j].unit
            taken.update(unit)
            units.append(unit)
            slots -= sum(map(_slots, unit))
            for block in (b for s in unit for b in s.block_table):
                held[block] += 1
                if held[block] == ref_counts[block] and block not in hit:
                    blocks -= 1
        return units if slots <= 0 and blocks <= 0 else None

    def _join(self, members: list[Sequence], hits: list[list[int]], out: SchedulerOutput, budget: int) -> int:
        """Admit members (the head of the queue, its unit whole) with their prefix hits -> tokens they take."""
        for seq, h in zip(members, hits):
            self.waiting.remove(seq)
            self.bm.allocate(seq, 0, h)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
        self.unforked_slots += sum(map(_slots, members)) - len(members)
        plan = self._plan(members, budget) if members[0].gang is not None else self._fill(members, budget)
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
        if self.on_finish is not None:
            self.on_finish(seq)

    def forget(self, request_id: str) -> None:
        """A group's request ended: its id may come again."""
        self.by_id.pop(request_id, None)

    def add_group(self, seqs: list[Sequence]) -> None:
        """A group's sequences, its first under the request's id."""
        self.add(seqs[0])
        for seq in seqs[1:]:
            self._enqueue(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.unforked_slots -= seq.slots - 1
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
        if self.on_finish is not None:
            self.on_finish(seq)
        if seq.group is None:
            self.by_id.pop(seq.request_id, None)
