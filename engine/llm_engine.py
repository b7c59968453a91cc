"""LLMEngine: add requests, step, read outputs. One continuous batch over a paged KV cache."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import math
import random
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from engine.beam_search import BeamSearch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import NO_TOKEN, Detokenizer
from engine.group import Group, child_seed
from engine.group_steps import GroupSteps
from engine.outputs import RequestOutput
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import SamplingBatch
from engine.runner.step_inputs import Feed
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence, Status
from engine.stats import StepTimes
from engine.structured.grammars import Compiled, Grammars
from engine.weights.loader import resolve_model

log = logging.getLogger("pagedq.engine")
_PLAIN_GREEDY = attrgetter("plain_greedy")
GONE = "gone"  # a landed row that makes no output: its request ended while the step ran
SELF_CHECK_ID = "pagedq-self-check"
SELF_CHECK_STEPS = 8


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

    def host_tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def row_of(self) -> dict[Sequence, int]:
        return {seq: row for row, seq in enumerate(self.samplers)}


@dataclass
class Compiling:
    """A request whose constraint is still compiling: it joins the scheduler (admit) once its matcher exists."""

    seq: Sequence
    future: Future
    admit: Callable[[], None]


@dataclass
class Landed:
    """A step whose tokens are written in: what its outputs are built from."""

    samplers: list[Sequence]
    positions: list[int]
    tokens: list[int]
    reasons: list[str | None]  # finish reason per row, or GONE
    texts: dict[int, str]  # new text by row, for requests with stop strings (decoded when the token landed)
    logprobs: list[list | None] | None
    reported: list[RequestOutput]  # groups that ended and report their continuations whole


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        self.model_name = config.model
        folder = resolve_model(config.model, config.cache_dir)
        from transformers import AutoTokenizer, GenerationConfig

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.runner = ModelRunner(config, folder)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.hf_config.vocab_size
        self.eos_token_ids = self._eos_ids(folder, GenerationConfig)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner.tables = self.block_manager.tables
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.preempt_for_priority)
        self.groups = GroupSteps(self.scheduler, self.block_manager,
                                 lambda prompt, stop: Detokenizer(self.tokenizer, prompt, stop))
        self.rng = random.Random(config.seed)
        self.times = StepTimes()
        self.runner.times = self.times
        self.last_batch = SchedulerOutput()  # what the latest step ran: for a worker's batch-size metrics
        self.overlap = config.overlap_steps if config.overlap_steps is not None else self.runner.device.type == "cuda"
        self.in_flight: deque[InFlight] = deque()  # launched steps not yet landed, oldest first (at most two)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.compiling: dict[str, Compiling] = {}
        self.constrained = False  # whether a request with a constraint ever came: else no step looks for matchers
        self.refused: list[tuple[str, str]] = []  # (request id, why): constraints that failed to compile
        # The model, tokenizer and cache bookkeeping live as long as the engine: out of the collector's sight,
        # full collections no longer walk them every time requests come and go.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # at exit everything must be collectable again (native bindings check)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel replica (nothing to do on one device)."""
        self.runner.close()

    def _eos_ids(self, folder, GenerationConfig) -> set[int]:
        ids = None
        with contextlib.suppress(OSError):
            ids = GenerationConfig.from_pretrained(folder).eos_token_id
        if ids is None:
            ids = getattr(self.runner.hf_config, "eos_token_id", None)
        if ids is None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        deadline: float | None = None,
        resume_token_ids: list[int] | None = None,
        resume_text: str = "",
        resume: dict[int, tuple[list[int], str, str | None]] | None = None,
    ) -> None:
        """Queue a request. Bad input raises ValueError and leaves the engine as it was.

        priority: lower runs first; deadline (unix seconds, or None: after any deadline) orders requests of equal
        priority, earliest first. A request more urgent by (priority, deadline) than running ones preempts them
        when the batch is full (EngineConfig.preempt_for_priority). The deadline is not enforced: a request runs on
        past it until the caller aborts it.

        resume_token_ids / resume_text: output already generated and streamed elsewhere (a crashed worker's job).
        The prompt and those tokens are prefilled, then generation goes on where it stopped; with greedy or seeded
        sampling the rest equals an uninterrupted run, and new_text continues right after resume_text.
        resume: the same per continuation of a request with several that stream (n > 1): index -> (token ids, text,
        finish reason if it had ended). Continuations that report only at the end (beam search, best_of > n) start
        afresh: nothing of theirs was streamed.
        """
        params = params or SamplingParams()
        params.validate()
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt is empty: give at least one character")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids or [])
        if not ids:
            raise ValueError("prompt is empty: it encodes to no tokens")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but this model runs at most {self.max_model_len} tokens in all "
                f"(prompt + output): shorten the prompt"
            )
        if request_id in self.scheduler.by_id or request_id in self.compiling:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._check_fits(params, len(ids))
        choices = dict(resume or {})
        if resume_token_ids:
            choices[0] = (list(resume_token_ids), resume_text, None)
        if not params.streams:
            choices = {}
        for index, (tokens, _, reason) in choices.items():
            self._check_resumed(index, tokens, len(ids), params, done=reason is not None)
        seq = Sequence(request_id, ids, params, priority, seed=self.rng.getrandbits(63),
                       eos_ids=frozenset(self.eos_token_ids), max_model_len=self.max_model_len, deadline=deadline)
        seq.detok = Detokenizer(self.tokenizer, ids, params.stop)
        if params.width == 1:
            self._resume(seq, *choices.get(0, ([], "", None))[:2])
            self._admit(seq, lambda: self.scheduler.add(seq))
            return
        group = seq.group = Group(request_id, params, [seq])
        if params.use_beam_search:
            group.beams = BeamSearch(params.width, len(ids), seq.max_len, seq.stop_ids, params.length_penalty,
                                     params.early_stopping)
        if not choices:
            self._admit(seq, lambda: self.scheduler.add(seq))
            return
        # Continuations streamed before (a crashed worker's): each goes on from its own tokens, none shared.
        members = [seq] + [seq.fork(i, child_seed(seq.seed, i)) for i in range(1, params.width)]
        for member in members:
            member.detok = Detokenizer(self.tokenizer, ids, params.stop)
            tokens, text, reason = choices.get(member.index, ([], "", None))
            self._resume(member, tokens, text)
            if reason is not None:
                member.finish_reason, member.status = reason, Status.FINISHED
        group.seqs = [m for m in members if m.finish_reason is None]
        group.done = [m for m in members if m.finish_reason is not None]
        if not group.seqs:
            raise ValueError("resume: every continuation had ended: the request is already complete")
        group.unreported = len(group.seqs)
        group.forked = True
        self._admit(seq, lambda: self.scheduler.add_group(group.seqs))

    def _check_fits(self, params: SamplingParams, prompt_len: int) -> None:
        """ValueError, naming the field, for a request this engine could never run: a stop token past the
        vocabulary, or more sequences than a batch holds, or more KV blocks than the cache has (it would wait, or be
        preempted by itself, for ever)."""
        vocab = self.vocab_size
        bad = next((t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad!r} is not a token of this model: give ids in [0, {vocab})")
        width, field = params.width, params.width_field
        if width > self.config.max_num_seqs:
            raise ValueError(f"{field} is {width}: this engine runs at most {self.config.max_num_seqs} sequences at "
                             f"once (max_num_seqs), so the request could never start")
        need = self._blocks_at_most(width, prompt_len, params.max_tokens)
        if need > self.num_total_blocks:
            raise ValueError(f"{field} is {width} with max_tokens {params.max_tokens}: its continuations may need "
                             f"{need} KV blocks, and this engine's cache holds {self.num_total_blocks}: lower "
                             f"{field} or max_tokens")

    def _blocks_at_most(self, width: int, prompt_len: int, max_tokens: int) -> int:
        """KV blocks a request of `width` sequences holds at its longest: the prompt's full blocks, shared, and each
        sequence's own from there."""
        bs = self.config.block_size
        longest = min(prompt_len + max_tokens, self.max_model_len)
        shared = prompt_len // bs
        return shared + width * (-(-longest // bs) - shared)

    def _admit(self, seq: Sequence, admit: Callable[[], None]) -> None:
        """Hand a new request to the scheduler (admit), once its constraint, if any, is compiled. A compile already
        done (the constraint seen before) is taken now, and its error raised; a new one is waited for by step()."""
        constraint = seq.params.constraint
        if constraint is None:
            admit()
            return
        self.constrained = True
        future = self.grammars.compile(constraint)
        if not future.done():
            self.compiling[seq.request_id] = Compiling(seq, future, admit)
            return
        self._attach(seq, future.result())
        admit()

    @staticmethod
    def _attach(seq: Sequence, compiled: Compiled) -> None:
        """Give the request's sequences their matchers, advanced past any output they resume with. ValueError
        (the grammar engine's message) where the constraint did not compile."""
        if compiled.error:
            raise ValueError(f"invalid {seq.params.constraint.kind} constraint: {compiled.error}")
        members = seq.group.seqs if seq.group is not None and seq.group.forked else [seq]
        for member in members:
            member.matcher = compiled.new_matcher()
            output = member.output_token_ids
            if output and not member.matcher.consume_tokens(output):
                raise ValueError(f"the output to resume from does not fit the constraint: "
                                 f"{member.matcher.get_error()}")

    def _admit_compiled(self) -> None:
        """Requests whose constraint finished compiling join the scheduler, or are refused (self.refused). When
        nothing else runs, wait a little for a compile rather than spin."""
        if not self.scheduler.has_unfinished() and not self.in_flight:
            wait([c.future for c in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        for request_id, pending in list(self.compiling.items()):
            if not pending.future.done():
                continue
            del self.compiling[request_id]
            try:
                self._attach(pending.seq, pending.future.result())
            except ValueError as e:
                log.info("request %s refused: %s", request_id, e)
                self.refused.append((request_id, str(e)))
                continue
            pending.admit()

    def pop_refused(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests refused since the last call: their constraint did not compile. They
        are no longer in the engine and make no outputs."""
        refused, self.refused = self.refused, []
        return refused

    def _check_resumed(self, index: int, tokens: list[int], prompt_len: int, params: SamplingParams, done: bool
                       ) -> None:
        if not 0 <= index < params.n:
            raise ValueError(f"resume: continuation {index} does not exist (n={params.n})")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in tokens):
            raise ValueError(f"resume_token_ids must be integers in [0, {self.vocab_size})")
        full = len(tokens) >= params.max_tokens or prompt_len + len(tokens) >= self.max_model_len
        if full and not done:
            raise ValueError("resume_token_ids leave no room for another token: the request is already complete")

    @staticmethod
    def _resume(seq: Sequence, tokens: list[int], text: str) -> None:
        if tokens:
            seq.token_ids.extend(tokens)
            seq.detok.resume(tokens, text)

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its KV blocks are free when this returns. False if it was not in the engine."""
        if self.compiling.pop(request_id, None) is not None:
            return True
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return False
        if seq.group is None:
            self.scheduler.finish(seq, "abort")
            return True
        for member in {id(m): m for m in [seq, *seq.group.seqs]}.values():
            if member.status is not Status.FINISHED:
                self.scheduler.finish(member, "abort")
        seq.group.seqs = []
        self.scheduler.forget(request_id)
        return True

    def reset(self) -> list[str]:
        """Drop every request and every step in flight, after a step raised: whatever that step left half done (a
        table, a placeholder token, a group's beams) goes with fresh bookkeeping, and the KV cache is all free.
        Returns the ids of the requests dropped; they make no more outputs, and may be added again."""
        dropped = list(dict.fromkeys([*self.scheduler.by_id, *self.compiling]))
        self.in_flight.clear()
        self.compiling.clear()
        self.refused = []
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.runner.forget_steps(self.block_manager.tables)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.preempt_for_priority)
        self.groups = GroupSteps(self.scheduler, self.block_manager, self.groups.detokenizer)
        self.last_batch = SchedulerOutput()
        return dropped

    def landed(self, request_id: str) -> int | None:
        """Output tokens the request's furthest sequence has landed (resumed ones included), or None if it is not in
        the engine. A step that raised may have landed some of its tokens: they count."""
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return 0 if request_id in self.compiling else None
        members = [seq] if seq.group is None else [seq, *seq.group.seqs, *seq.group.done]
        return max(m.num_output_tokens - (m.token_ids[-1] == PLACEHOLDER) for m in members)

    def self_check(self) -> str | None:
        """Run one tiny greedy request alone, on an empty engine -> None if it passed, else its error. A step that
        fails on this too has no request to blame: the device, the model or the engine is broken."""
        if self.has_unfinished_requests():
            raise RuntimeError("self_check runs on an empty engine")
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        try:
            self.add_request(SELF_CHECK_ID, prompt_token_ids=[0], params=params)
            for _ in range(SELF_CHECK_STEPS):
                if not self.has_unfinished_requests():
                    return None
                self.step()
            return f"a {params.max_tokens}-token request did not finish in {SELF_CHECK_STEPS} steps"
        except Exception as e:  # noqa: BLE001 (any error is the answer)
            return f"{type(e).__name__}: {e}"
        finally:
            self.reset()

    def has_unfinished_requests(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_unfinished() or bool(self.compiling)

    def num_admittable(self) -> int:
        return self.scheduler.num_admittable()

    def num_preemptible(self, priority: int, deadline: float | None = None) -> int:
        """Running sequences strictly less urgent than a request of this priority and deadline would be (0 without
        EngineConfig.preempt_for_priority). With more than 0, such a request added now joins at the next step
        however full the batch, by preempting them, unless even all of them hold too few KV blocks for its prompt.
        One pass over the running requests."""
        return self.scheduler.num_preemptible((priority, math.inf if deadline is None else deadline))

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.compiling)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests, read without touching the scheduler's state: safe from another thread (a
        worker's heartbeat). Running may still count requests that finished in the latest step."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def num_decoding(self) -> int:
        """Running requests whose prompt is done, each step computing one token of theirs; a plain read, as
        request_counts."""
        return sum(1 for s in self.scheduler.running if s.num_computed_tokens == s.num_tokens - 1)

    def record_phase(self, phase: str) -> None:
        """Charge the host time since the latest phase of step() to `phase` (engine.stats.PHASES): a caller's own
        work per step, such as a worker's hand-off of the outputs to its publisher, counted beside the engine's."""
        self.times.lap(phase)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name!r} has no chat template: send a plain prompt instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("each message needs a 'role' and a 'content'")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    # ---- stepping -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step -> the outputs of the step that finished.

        With overlap (the default on CUDA, where a forward only launches kernels) a call schedules and launches
        the next step while the one before it is still in flight, its sampled tokens fed to the new step's inputs
        on the device; then it waits for the older step, appends its tokens, ends what it finished, and builds its
        outputs. All of that, and whatever the caller does with the outputs, runs while the device computes.
        Outputs come one call later; what they are does not change. A request that a step ends by a stop token
        or stop string was already scheduled into the next one: that row's token is dropped.
        """
        self.times.start()
        if self.compiling:
            self._admit_compiled()
        if not self.overlap:
            self._launch()
            return self._outputs(self._land())
        if self.in_flight and not self.in_flight[-1].feeds_ahead:  # its tokens are needed on the host first
            landed = self._land()
            self._launch()
            return self._outputs(landed)
        launched = self._launch()
        return self._outputs(self._land() if len(self.in_flight) > 1 or not launched else None)

    def _launch(self) -> bool:
        """Schedule a step and start its forward and sampling -> whether there was anything to run.

        Each sampling request gets a PLACEHOLDER where its token will go (none when that token is its last), so
        the scheduler, the block manager and the next step's inputs see it as one token longer; _land writes the
        token in. A request whose token is still in flight takes it, as its next input, from the device."""
        batch = self.last_batch = self.scheduler.schedule()
        if not batch.seqs:
            return False
        self.times.steps += 1
        if batch.num_tokens == len(batch.seqs):  # decode only: every sequence samples its next token
            samplers = batch.seqs
        else:
            samplers = [s for s, n in zip(batch.seqs, batch.num_new_tokens)
                        if s.num_computed_tokens + n == len(s.token_ids)]
        samplers, sample_from = self.groups.fork(samplers)
        sampling = self._sampling(samplers)
        feed = self._feed(batch) if self.in_flight else None
        self.times.lap("schedule")
        tokens, logprobs, candidates = self.runner.run(batch, sampling, feed, self.block_manager.take_copies(),
                                                       sample_from)
        bm = self.block_manager
        caching, bs = bm.prefix_caching, bm.block_size
        # Progress counts at launch: the next step's forward runs after this one on the device. A block it fills
        # is committed for sharing once none of its tokens is a placeholder.
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            done = seq.num_computed_tokens = seq.num_computed_tokens + n
            if caching and done // bs > len(seq.block_hashes):
                bm.commit(seq)
        positions = []
        add_position = positions.append
        for seq in samplers:
            ids = seq.token_ids
            add_position(len(ids))
            if len(ids) + 1 < seq.max_len and (seq.group is None or not seq.group.is_beam):
                ids.append(PLACEHOLDER)  # a beam's next token is known only once its step's search lands
        # A constrained row's next mask needs its token advanced through its matcher first.
        feeds_ahead = sampling.allowed is None and (sampling.greedy_only or not any(
            p.needs_logprobs or p.uses_history or p.use_beam_search for p in sampling.params))
        beams = [(samplers[rows[0]].group, rows, found) for (rows, _, _), found in zip(sampling.beams, candidates)]
        host, event = self.runner.to_host(tokens)
        self.in_flight.append(InFlight(samplers, positions, tokens, host, event, logprobs, feeds_ahead, beams))
        return True

    def _feed(self, batch: SchedulerOutput) -> Feed | None:
        """The rows of batch whose input is a token of the step in flight, and where it is in that step."""
        prev = self.in_flight[-1]
        if batch.seqs == prev.samplers:  # steady decoding: the same requests in the same order (an identity scan)
            return Feed(None, prev.tokens, None)  # every row
        row_of = prev.row_of()
        sources = np.fromiter((row_of.get(seq, -1) for seq in batch.seqs), np.int64, len(batch.seqs))
        rows = np.flatnonzero(sources >= 0)
        return Feed(rows, prev.tokens, sources[rows]) if len(rows) else None

    def _land(self) -> Landed | None:
        """Wait for the oldest step in flight, write its tokens in, and end the requests it finished (their blocks
        are free for the steps scheduled from now on)."""
        if not self.in_flight:
            return None
        step = self.in_flight.popleft()
        tokens = step.host_tokens()  # on an asynchronous device: the wait for the step
        self.times.lap("sample")
        reasons, texts, reported = [], {}, []
        finish, add_reason, finished = self.scheduler.finish, reasons.append, Status.FINISHED  # bound once: per row
        for i, (seq, token, pos) in enumerate(zip(step.samplers, tokens, step.positions)):
            if seq.status is finished or (seq.group is not None and seq.group.is_beam):
                # aborted while its step ran, or ended by the step before; a beam moves on with its group below
                add_reason(GONE)
                continue
            ids = seq.token_ids
            if pos < len(ids):
                ids[pos] = token
            else:
                ids.append(token)
            reason = None
            stop_token = token in seq.stop_ids and pos >= seq.min_len - 1
            if stop_token:
                reason = "stop"
            elif pos >= seq.max_len - 1:
                reason = "length"
            if seq.matcher is not None:
                reason = _advance(seq, token, reason)
            detok = seq.detok
            if not detok.lazy:  # stop strings: decoding now decides whether it ends
                text, stopped = detok.add([] if stop_token else [token], final=reason is not None)
                texts[i] = text
                if stopped:
                    reason = "stop"
            add_reason(reason)
            if seq.group is not None:
                if step.logprobs.numel():
                    seq.cumulative_logprob += float(step.logprobs[i, token])
                if reason is not None:
                    finish(seq, reason)
                    reported += self.groups.member_finished(seq)
            elif reason is not None:
                finish(seq, reason)
        for group, _, (values, indices) in step.beams:
            if group.seqs and group.seqs[0].status is Status.RUNNING:  # not aborted while its step ran
                reported += self.groups.beam_step(group, values.tolist(), indices.tolist(), self.vocab_size)
        logprobs = self._logprob_entries(step, tokens) if step.logprobs.numel() else None
        self.times.lap("update")
        return Landed(step.samplers, step.positions, tokens, reasons, texts, logprobs, reported)

    def _outputs(self, landed: Landed | None) -> list[RequestOutput]:
        if landed is None:
            return []
        outputs = []
        add = outputs.append
        logprobs = landed.logprobs
        for i, (seq, pos, token, reason) in enumerate(zip(landed.samplers, landed.positions, landed.tokens,
                                                          landed.reasons)):
            if reason is GONE or (seq.group is not None and not seq.group.streams):
                continue  # a group that reports its continuations at the end says nothing now
            detok = seq.detok
            # EOS and stop tokens are kept in token_ids but their text is not shown (a grammar's last token shows).
            hidden = reason == "stop" and token in seq.stop_ids
            if detok.lazy:  # no stop strings: the text can wait for whoever reads it
                at, text = detok.defer(NO_TOKEN if hidden else token, reason is not None), ""
            else:
                at, text = 0, landed.texts[i]
            out = RequestOutput(seq, token, reason, pos + 1, text, detok.text, detok.sent, logprobs and logprobs[i],
                                detok if detok.lazy else None, at)
            if detok.lazy and reason == "stop" and not hidden:
                # A grammar's last token, which shows: decoded now, since a reader that decodes deferred text
                # itself (the worker's publisher) hides the last token of every "stop".
                out.new_text  # noqa: B018
            out.hidden_stop = hidden
            if seq.group is not None and reason is not None:
                self._streamed_end(seq, out)
            add(out)
        outputs += landed.reported
        self.times.lap("outputs")
        return outputs

    def _streamed_end(self, seq: Sequence, out: RequestOutput) -> None:
        """A streamed continuation's last output: its request's last, with every continuation, once none runs."""
        group = seq.group
        out.cumulative_logprob = seq.cumulative_logprob if seq.params.needs_logprobs else None
        group.finals[out.index] = out
        group.unreported -= 1
        if not group.unreported:
            self.scheduler.forget(group.request_id)
            out.request_finished = True
            out.choices = [group.finals[i] for i in sorted(group.finals)]

    def _sampling(self, samplers: list[Sequence]) -> SamplingBatch:
        batch = self._sampling_settings(samplers)
        if self.constrained:
            self.times.lap("schedule")
            rows = [r for r, s in enumerate(samplers) if s.matcher is not None]
            if rows:
                bits = self.grammars.fill([samplers[r].matcher for r in rows])
                batch.allowed = (np.array(rows, dtype=np.int64), bits)
            self.times.lap("mask")
        return batch

    def _sampling_settings(self, samplers: list[Sequence]) -> SamplingBatch:
        if all(map(_PLAIN_GREEDY, samplers)):  # the common batch: one argmax, no per-row settings to gather
            return SamplingBatch.greedy()
        params = [s.params for s in samplers]
        needs_history = any(p.uses_history for p in params)
        return SamplingBatch(
            params=params,
            seeds=[s.seed for s in samplers],
            steps=[len(s.token_ids) - s.num_prompt_tokens for s in samplers],
            output_ids=[s.output_token_ids for s in samplers] if needs_history else None,
            prompt_ids=[s.token_ids[: s.num_prompt_tokens] for s in samplers] if needs_history else None,
            eos_ids=sorted(self.eos_token_ids),
            beams=self._beam_rows(samplers),
        )

    @staticmethod
    def _beam_rows(samplers: list[Sequence]) -> list[tuple[list[int], list[float], int]]:
        """Each beam group's rows (its beams, in order: the scheduler runs them together), scores, candidates."""
        rows: dict[int, tuple[Group, list[int]]] = {}
        for r, seq in enumerate(samplers):
            if seq.group is not None and seq.group.is_beam:
                rows.setdefault(id(seq.group), (seq.group, []))[1].append(r)
        return [(r, g.beams.scores, g.beams.candidates) for g, r in rows.values()]

    @staticmethod
    def _logprob_entries(step: InFlight, tokens: list[int]) -> list[list | None]:
        """Per sampled row: [(logprob of its token, {token: logprob} of its top N)], or None where not asked.
        Read before the next step launches, so reading them does not wait for that step."""
        entries = []
        for row, (seq, token) in enumerate(zip(step.samplers, tokens)):
            n = seq.params.logprobs
            if n is None:
                entries.append(None)
                continue
            lp = step.logprobs[row]
            top = {}
            if n:
                values, ids = lp.topk(min(n, lp.numel()))
                top = dict(zip(ids.tolist(), values.tolist()))
            entries.append([(float(lp[token]), top)])
        return entries

    # ---- offline convenience --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion together; final outputs in input order (each request's last:
        with several continuations, `choices` holds them all)."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self.rng.getrandbits(48):012x}-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, plist):
                if isinstance(prompt, str):
                    self.add_request(rid, prompt=prompt, params=p)
                else:
                    self.add_request(rid, prompt_token_ids=list(prompt), params=p)
        except ValueError:
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            refused = self.pop_refused()
            if refused:
                for rid in ids:
                    self.abort(rid)
                raise ValueError(refused[0][1])
            for out in self.step():
                if out.request_finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]


def _advance(seq: Sequence, token: int, reason: str | None) -> str | None:
    """Move seq's matcher past its new token -> its finish reason: "stop" once the grammar is complete."""
    matcher = seq.matcher
    if not matcher.consume_token(token):
        # The mask allowed only tokens the matcher takes, so this is the grammar engine's own failure: end here,
        # loudly, rather than go on unconstrained.
        log.error("request %s: its constraint refused token %d: %s", seq.request_id, token, matcher.get_error())
        return reason or "stop"
    return reason or ("stop" if matcher.is_stopped() else None)
