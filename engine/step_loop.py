"""The step loop: schedule and launch a step, feed it the tokens of the step still in flight, land the oldest.

With overlap (the default on CUDA, where a forward only launches kernels) a step is scheduled and launched while
the one before it is still in flight, its sampled tokens fed to the new step's inputs on the device; then the older
step lands: its tokens are written in and what they end is ended (engine.finishing). At most two steps are in
flight, oldest first. All of the landing, and whatever the caller does with the outputs, runs while the device
computes; a request that a step ends by a stop token or stop string was already scheduled into the next one: that
row's token is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.finishing import GONE, Finishing, Landed
from engine.group import Group
from engine.group_steps import GroupSteps
from engine.outputs import RequestOutput
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import SamplingBatch
from engine.runner.step_inputs import Feed
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence, Status
from engine.speculative.verify import Speculator
from engine.stats import StepTimes
from engine.structured.grammars import Grammars

_PLAIN_GREEDY = attrgetter("plain_greedy")


@dataclass
class InFlight:
    """A launched step: who samples, where each token goes in its token_ids, and the tokens (and raw logprobs)
    still on the device, with their copy on the way to the host."""

    samplers: list[Sequence]
    positions: list[int]
    tokens: torch.Tensor
    host: torch.Tensor  # the tokens' host copy (the tokens themselves on a CPU)
    event: object  # marks the copy done on CUDA; None elsewhere
    logprobs: torch.Tensor
    feeds_ahead: bool  # no row needs its token on the host before the next step is sampled (logprobs, penalties)
    beams: list  # per beam group sampled: (group, its rows, the K best candidates: values and flat indices)
    # Speculative decoding: each drafted sampler's draft tokens. Its rows in `tokens` are one per draft and one
    # more, back to back; every other sampler has one row.
    drafts: dict[Sequence, list[int]] | None = None

    def host_tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def row_of(self) -> dict[Sequence, int]:
        return {seq: row for row, seq in enumerate(self.samplers)}


class StepLoop:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, groups: GroupSteps, finishing: Finishing,
                 grammars: Grammars, times: StepTimes, eos_ids: set[int], overlap: bool, constrained: bool = False,
                 speculator: Speculator | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.bm: BlockManager = scheduler.bm
        self.groups = groups
        self.finishing = finishing
        self.grammars = grammars
        self.times = times
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = runner.hf_config.vocab_size
        self.overlap = overlap
        self.in_flight: deque[InFlight] = deque()  # launched steps not yet landed, oldest first (at most two)
        self.last_batch = SchedulerOutput()  # what the latest step ran: for a worker's batch-size metrics
        self.constrained = constrained  # whether a request with a constraint ever came: else no step looks for any
        self.speculator = speculator  # speculative decoding (never with overlap: EngineConfig checks)

    def step(self) -> Landed | None:
        """Run one step -> the step that landed, if any (with overlap: usually the one launched by the call
        before)."""
        if not self.overlap:
            self.launch()
            return self.land()
        if self.in_flight and not self.in_flight[-1].feeds_ahead:  # its tokens are needed on the host first
            landed = self.land()
            self.launch()
            return landed
        launched = self.launch()
        return self.land() if len(self.in_flight) > 1 or not launched else None

    def launch(self) -> bool:
        """Schedule a step and start its forward and sampling -> whether there was anything to run.

        Each sampling request gets a PLACEHOLDER where its token will go (none when that token is its last), so
        the scheduler, the block manager and the next step's inputs see it as one token longer; land writes the
        token in. A request whose token is still in flight takes it, as its next input, from the device."""
        batch = self.last_batch = self.scheduler.schedule()
        if not batch.seqs:
            return False
        self.times.steps += 1
        drafts = self.speculator.attach(batch) if self.speculator is not None else None
        if batch.num_tokens == len(batch.seqs):  # decode only: every sequence samples its next token
            samplers = batch.seqs
        else:
            samplers = [s for s, n in zip(batch.seqs, batch.num_new_tokens)
                        if s.num_computed_tokens + n == len(s.token_ids)]
        samplers, sample_from = self.groups.fork(samplers)
        if drafts and sample_from is not None:  # a group forks this step: its rows are mapped one per sampler
            self.speculator.undo(batch, drafts)
            drafts = None
        sampling = self._sampling(samplers, drafts)
        feed = self._feed(batch) if self.in_flight else None
        self.times.lap("schedule")
        tokens, logprobs, candidates = self.runner.run(batch, sampling, feed, self.bm.take_copies(), sample_from)
        if drafts:
            self.speculator.strip(batch, drafts)
        self._advance(batch)
        positions = self._placeholders(samplers)
        # A constrained row's next mask needs its token advanced through its matcher first.
        feeds_ahead = sampling.allowed is None and (sampling.greedy_only or not any(
            p.needs_logprobs or p.uses_history or p.use_beam_search for p in sampling.params))
        beams = [(samplers[rows[0]].group, rows, found) for (rows, _, _), found in zip(sampling.beams, candidates)]
        host, event = self.runner.to_host(tokens)
        self.in_flight.append(InFlight(samplers, positions, tokens, host, event, logprobs, feeds_ahead, beams,
                                       drafts or None))
        return True

    def _advance(self, batch: SchedulerOutput) -> None:
        """Progress counts at launch: the next step's forward runs after this one on the device. A block it fills
        is committed for sharing once none of its tokens is a placeholder."""
        bm = self.bm
        caching, bs = bm.prefix_caching, bm.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            done = seq.num_computed_tokens = seq.num_computed_tokens + n
            if caching and done // bs > len(seq.block_hashes):
                bm.commit(seq)

    @staticmethod
    def _placeholders(samplers: list[Sequence]) -> list[int]:
        """Where each sampler's token will go; a PLACEHOLDER holds the place, unless the token is its last."""
        positions = []
        add_position = positions.append
        for seq in samplers:
            ids = seq.token_ids
            add_position(len(ids))
            if len(ids) + 1 < seq.max_len and seq.gang is None:
                ids.append(PLACEHOLDER)  # a beam's next token is known only once its step's search lands
        return positions

    def _feed(self, batch: SchedulerOutput) -> Feed | None:
        """The rows of batch whose input is a token of the step in flight, and where it is in that step."""
        prev = self.in_flight[-1]
        if batch.seqs == prev.samplers:  # steady decoding: the same requests in the same order (an identity scan)
            return Feed(None, prev.tokens, None)  # every row
        row_of = prev.row_of()
        sources = np.fromiter((row_of.get(seq, -1) for seq in batch.seqs), np.int64, len(batch.seqs))
        rows = np.flatnonzero(sources >= 0)
        return Feed(rows, prev.tokens, sources[rows]) if len(rows) else None

    def land(self) -> Landed | None:
        """Wait for the oldest step in flight, write its tokens in, and end the requests it finished (their blocks
        are free for the steps scheduled from now on)."""
        if not self.in_flight:
            return None
        step = self.in_flight.popleft()
        tokens = step.host_tokens()  # on an asynchronous device: the wait for the step
        self.times.lap("sample")
        if step.drafts:
            return self._land_verified(step, tokens)
        reasons, hidden, texts, reported = [], [], {}, []
        check, end, finished = self.finishing.check, self.finishing.end, Status.FINISHED  # bound once: per row
        scores = step.logprobs if step.logprobs.numel() else None
        for i, (seq, token, pos) in enumerate(zip(step.samplers, tokens, step.positions)):
            if seq.status is finished or seq.gang is not None:
                # aborted while its step ran, or ended by the step before; a beam moves on with its gang below
                reasons.append(GONE)
                hidden.append(False)
                continue
            ids = seq.token_ids
            if pos < len(ids):
                ids[pos] = token
            else:
                ids.append(token)
            reason, hide, text = check(seq, token, pos)
            if text is not None:
                texts[i] = text
            reasons.append(reason)
            hidden.append(hide)
            if scores is not None and seq.group is not None:
                seq.cumulative_logprob += float(scores[i, token])
            if reason is not None:
                reported += end(seq, reason, hide)
        reported += self._beam_steps(step)
        logprobs = self._logprob_entries(step, tokens) if scores is not None else None
        self.times.lap("update")
        return Landed(step.samplers, step.positions, tokens, reasons, hidden, texts, logprobs, reported)

    def _land_verified(self, step: InFlight, tokens: list[int]) -> Landed:
        """land() for a step with draft tokens: a drafted sequence lands what its drafts gave (1 to k + 1 tokens), a
        row per token, up to the first that ends it; every other sampler as land() does."""
        rows: tuple[list, ...] = ([], [], [], [], [])  # samplers, positions, tokens, reasons, hidden
        texts, reported, entries = {}, [], []
        check, end, finished = self.finishing.check, self.finishing.end, Status.FINISHED
        scores = step.logprobs if step.logprobs.numel() else None
        at = 0
        for seq, pos in zip(step.samplers, step.positions):
            draft = step.drafts.get(seq)
            row, at = at, at + 1 + (len(draft) if draft else 0)
            if seq.status is finished or seq.gang is not None:
                _add_row(rows, seq, pos, tokens[row], GONE, False)
                entries.append(None)
                continue
            new = self.speculator.settle(seq, draft, tokens[row:at]) if draft else [tokens[row]]
            for i, token in enumerate(new):
                ids = seq.token_ids
                if pos + i < len(ids):
                    ids[pos + i] = token
                else:
                    ids.append(token)
                reason, hide, text = check(seq, token, pos + i)
                if text is not None:
                    texts[len(rows[0])] = text
                _add_row(rows, seq, pos + i, token, reason, hide)
                entries.append(_logprob_entry(step.logprobs, row + i, seq.params.logprobs, token)
                               if scores is not None else None)
                if scores is not None and seq.group is not None:
                    seq.cumulative_logprob += float(scores[row + i, token])
                if reason is not None:
                    if draft:  # what it computed up to its last token is a prefix to cache, as without drafts
                        self.speculator.keep(seq, pos + i)
                    reported += end(seq, reason, hide)
                    break
            else:
                if draft:
                    self.speculator.keep(seq, seq.num_computed_tokens)
        reported += self._beam_steps(step)
        self.times.lap("update")
        return Landed(*rows, texts, entries if scores is not None else None, reported)

    def _beam_steps(self, step: InFlight) -> list[RequestOutput]:
        reported = []
        for group, _, (values, indices) in step.beams:
            if group.seqs and group.seqs[0].status is Status.RUNNING:  # not aborted while its step ran
                reported += self.groups.beam_step(group, values.tolist(), indices.tolist(), self.vocab_size)
        return reported

    def _sampling(self, samplers: list[Sequence], drafts: dict[Sequence, list[int]] | None = None) -> SamplingBatch:
        batch = self._sampling_settings(samplers, drafts)
        if drafts:
            samplers = _verify_rows(samplers, drafts)
        if self.constrained:
            self.times.lap("schedule")
            rows = [r for r, s in enumerate(samplers) if s.matcher is not None]
            if rows:
                runs = _draft_runs(samplers, rows)
                bits = (self.grammars.fill_verify(runs) if any(d for _, d in runs)
                        else self.grammars.fill([m for m, _ in runs]))
                batch.allowed = (np.array(rows, dtype=np.int64), bits)
            self.times.lap("mask")
        return batch

    def _sampling_settings(self, samplers: list[Sequence], drafts: dict[Sequence, list[int]] | None
                           ) -> SamplingBatch:
        if all(map(_PLAIN_GREEDY, samplers)):  # the common batch: one argmax, no per-row settings to gather
            return SamplingBatch.greedy()
        rows = _verify_rows(samplers, drafts) if drafts else samplers
        # Each row samples the token at its end: a drafted sequence's rows end at its last token and at each draft.
        ends = _row_ends(samplers, drafts) if drafts else [len(s.token_ids) for s in samplers]
        params = [s.params for s in rows]
        needs_history = any(p.uses_history for p in params)
        return SamplingBatch(
            params=params,
            seeds=[s.seed for s in rows],
            steps=[end - s.num_prompt_tokens for s, end in zip(rows, ends)],
            output_ids=[s.token_ids[s.num_prompt_tokens: end] for s, end in zip(rows, ends)] if needs_history else None,
            prompt_ids=[s.token_ids[: s.num_prompt_tokens] for s in rows] if needs_history else None,
            eos_ids=self.eos_ids,
            beams=self._beam_rows(rows),
        )

    @staticmethod
    def _beam_rows(samplers: list[Sequence]) -> list[tuple[list[int], list[float], int]]:
        """Each beam gang's rows (its beams, in order: the scheduler runs them together), scores, candidates."""
        rows: dict[int, tuple[Group, list[int]]] = {}
        for r, seq in enumerate(samplers):
            if seq.gang is not None:
                rows.setdefault(id(seq.gang), (seq.gang, []))[1].append(r)
        return [(r, g.beams.scores, g.beams.candidates) for g, r in rows.values()]

    @staticmethod
    def _logprob_entries(step: InFlight, tokens: list[int]) -> list[list | None]:
        """Per sampled row: [(logprob of its token, {token: logprob} of its top N)], or None where not asked.
        Read before the next step launches, so reading them does not wait for that step."""
        return [_logprob_entry(step.logprobs, row, seq.params.logprobs, token)
                for row, (seq, token) in enumerate(zip(step.samplers, tokens))]


def _logprob_entry(logprobs: torch.Tensor, row: int, n: int | None, token: int) -> list | None:
    """[(logprob of token, {token: logprob} of the top n)] from a step's row, or None where n is None."""
    if n is None:
        return None
    lp = logprobs[row]
    top = {}
    if n:
        values, ids = lp.topk(min(n, lp.numel()))
        top = dict(zip(ids.tolist(), values.tolist()))
    return [(float(lp[token]), top)]


def _add_row(rows: tuple[list, ...], seq: Sequence, pos: int, token: int, reason: str | None, hidden: bool) -> None:
    for column, value in zip(rows, (seq, pos, token, reason, hidden)):
        column.append(value)


def _verify_rows(samplers: list[Sequence], drafts: dict[Sequence, list[int]]) -> list[Sequence]:
    """The sampled rows of a step with draft tokens, by sequence: a drafted one's once per draft and once more."""
    rows = []
    for seq in samplers:
        draft = drafts.get(seq)
        rows += [seq] * (1 + len(draft)) if draft else [seq]
    return rows


def _row_ends(samplers: list[Sequence], drafts: dict[Sequence, list[int]]) -> list[int]:
    """Per row of _verify_rows, where the token it samples goes: a drafted sequence's tokens hold its drafts now, and
    its rows sample after its last token and after each draft."""
    ends = []
    for seq in samplers:
        size, draft = len(seq.token_ids), drafts.get(seq)
        ends += range(size - len(draft), size + 1) if draft else [size]
    return ends


def _draft_runs(samplers: list[Sequence], rows: list[int]) -> list[tuple[object, list[int]]]:
    """(matcher, draft) per constrained sequence of a step's sampled rows. A drafted one has a row per draft token
    and one more, back to back (_verify_rows), and its drafts are still the last of its tokens (the forward has not
    run: Speculator.strip takes them out after); any other has one row and no draft."""
    runs, i = [], 0
    while i < len(rows):
        seq = samplers[rows[i]]
        n = 1
        while i + n < len(rows) and samplers[rows[i + n]] is seq:
            n += 1
        runs.append((seq.matcher, seq.token_ids[len(seq.token_ids) - n + 1:]))
        i += n
    return runs
