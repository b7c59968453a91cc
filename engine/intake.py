"""Request intake: checks a request, tokenizes it, resumes what a crashed worker streamed, builds its sequences
(a group where it has several continuations) and hands them to the scheduler once its constraint is compiled.
Bad input raises ValueError before anything changes."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from engine.beam_search import BeamSearch
from engine.detokenizer import Detokenizer
from engine.group import Group, child_seed
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.structured.grammars import Compiled, Grammars

log = logging.getLogger("pagedq.engine")

Resumed = dict[int, tuple[list[int], str, str | None]]  # continuation -> (token ids, text, finish reason or None)


@dataclass
class Compiling:
    """A request whose constraint is still compiling: it joins the scheduler (admit) once its matcher exists."""

    seq: Sequence
    future: Future
    admit: Callable[[], None]


@dataclass
class Limits:
    """What an engine can run: checked at intake."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    num_blocks: int


class Intake:
    def __init__(self, tokenizer, grammars: Grammars, scheduler: Scheduler, limits: Limits, eos_ids: set[int],
                 rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.scheduler = scheduler
        self.limits = limits
        self.eos_ids = frozenset(eos_ids)
        self.rng = rng
        self.compiling: dict[str, Compiling] = {}
        self.refused: list[tuple[str, str]] = []  # (request id, why): constraints that failed to compile

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
            priority: int, deadline: float | None, resume: Resumed) -> None:
        """Queue a request (LLMEngine.add_request says what each argument means)."""
        params.validate()
        ids = self.prompt_ids(prompt, prompt_token_ids)
        if request_id in self.scheduler.by_id or request_id in self.compiling:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._check_fits(params, len(ids))
        choices = resume if params.streams else {}
        for index, (tokens, _, reason) in choices.items():
            self._check_resumed(index, tokens, len(ids), params, done=reason is not None)
        seq = Sequence(request_id, ids, params, priority, seed=self.rng.getrandbits(63), eos_ids=self.eos_ids,
                       max_model_len=self.limits.max_model_len, deadline=deadline)
        seq.detok = Detokenizer(self.tokenizer, ids, params.stop)
        if params.width == 1:
            _resume(seq, *choices.get(0, ([], "", None))[:2])
            self._admit(seq, lambda: self.scheduler.add(seq))
            return
        group = seq.group = Group(request_id, params, [seq])
        if params.use_beam_search:
            group.beams = BeamSearch(params.width, len(ids), seq.max_len, seq.stop_ids, params.length_penalty,
                                     params.early_stopping)
            seq.gang = group
        if not choices:
            self._admit(seq, lambda: self.scheduler.add(seq))
            return
        self._resume_group(seq, group, choices)
        self._admit(seq, lambda: self.scheduler.add_group(group.seqs))

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids, checked: exactly one of text or ids, not empty, tokens of this model, room for
        at least one more token."""
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt is empty: give at least one character")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids or [])
        if not ids:
            raise ValueError("prompt is empty: it encodes to no tokens")
        vocab, longest = self.limits.vocab_size, self.limits.max_model_len
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(ids) >= longest:
            raise ValueError(f"prompt is {len(ids)} tokens, but this model runs at most {longest} tokens in all "
                             f"(prompt + output): shorten the prompt")
        return ids

    def _resume_group(self, seq: Sequence, group: Group, choices: Resumed) -> None:
        """Continuations streamed before (a crashed worker's): each goes on from its own tokens, none shared."""
        params, ids = seq.params, seq.token_ids
        members = [seq] + [seq.fork(i, child_seed(seq.seed, i)) for i in range(1, params.width)]
        for member in members:
            member.detok = Detokenizer(self.tokenizer, ids, params.stop)
            tokens, text, reason = choices.get(member.index, ([], "", None))
            _resume(member, tokens, text)
            if reason is not None:
                member.finish_reason, member.status = reason, Status.FINISHED
        group.seqs = [m for m in members if m.finish_reason is None]
        group.done = [m for m in members if m.finish_reason is not None]
        if not group.seqs:
            raise ValueError("resume: every continuation had ended: the request is already complete")
        group.unreported = len(group.seqs)
        group.forked = True

    def _check_fits(self, params: SamplingParams, prompt_len: int) -> None:
        """ValueError, naming the field, for a request this engine could never run: a stop token past the
        vocabulary, or more sequences than a batch holds, or more KV blocks than the cache has (it would wait, or be
        preempted by itself, for ever)."""
        limits = self.limits
        vocab = limits.vocab_size
        bad = next((t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad!r} is not a token of this model: give ids in [0, {vocab})")
        width, field = params.width, params.width_field
        if width > limits.max_num_seqs:
            raise ValueError(f"{field} is {width}: this engine runs at most {limits.max_num_seqs} sequences at "
                             f"once (max_num_seqs), so the request could never start")
        need = self._blocks_at_most(width, prompt_len, params.max_tokens)
        if need > limits.num_blocks:
            raise ValueError(f"{field} is {width} with max_tokens {params.max_tokens}: its continuations may need "
                             f"{need} KV blocks, and this engine's cache holds {limits.num_blocks}: lower "
                             f"{field} or max_tokens")

    def _blocks_at_most(self, width: int, prompt_len: int, max_tokens: int) -> int:
        """KV blocks a request of `width` sequences holds at its longest: the prompt's full blocks, shared, and each
        sequence's own from there."""
        bs = self.limits.block_size
        longest = min(prompt_len + max_tokens, self.limits.max_model_len)
        shared = prompt_len // bs
        return shared + width * (-(-longest // bs) - shared)

    def _check_resumed(self, index: int, tokens: list[int], prompt_len: int, params: SamplingParams, done: bool
                       ) -> None:
        if not 0 <= index < params.n:
            raise ValueError(f"resume: continuation {index} does not exist (n={params.n})")
        vocab = self.limits.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"resume_token_ids must be integers in [0, {vocab})")
        full = len(tokens) >= params.max_tokens or prompt_len + len(tokens) >= self.limits.max_model_len
        if full and not done:
            raise ValueError("resume_token_ids leave no room for another token: the request is already complete")

    # ---- constraints ----------------------------------------------------------------------------------------

    def _admit(self, seq: Sequence, admit: Callable[[], None]) -> None:
        """Hand a new request to the scheduler (admit), once its constraint, if any, is compiled. A compile already
        done (the constraint seen before) is taken now, and its error raised; a new one is waited for by step()."""
        constraint = seq.params.constraint
        if constraint is None:
            admit()
            return
        future = self.grammars.compile(constraint)
        if not future.done():
            self.compiling[seq.request_id] = Compiling(seq, future, admit)
            return
        _attach(seq, future.result())
        admit()

    def admit_compiled(self, idle: bool) -> None:
        """Requests whose constraint finished compiling join the scheduler, or are refused (self.refused). When
        nothing else runs (idle), wait a little for a compile rather than spin."""
        if idle:
            wait([c.future for c in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        for request_id, pending in list(self.compiling.items()):
            if not pending.future.done():
                continue
            del self.compiling[request_id]
            try:
                _attach(pending.seq, pending.future.result())
            except ValueError as e:
                log.info("request %s refused: %s", request_id, e)
                self.refused.append((request_id, str(e)))
                continue
            pending.admit()

    def pop_refused(self) -> list[tuple[str, str]]:
        refused, self.refused = self.refused, []
        return refused


def _attach(seq: Sequence, compiled: Compiled) -> None:
    """Give the request's sequences their matchers, advanced past any output they resume with. ValueError (the
    grammar engine's message) where the constraint did not compile."""
    if compiled.error:
        raise ValueError(f"invalid {seq.params.constraint.kind} constraint: {compiled.error}")
    members = seq.group.seqs if seq.group is not None and seq.group.forked else [seq]
    for member in members:
        member.matcher = compiled.new_matcher()
        output = member.output_token_ids
        if output and not member.matcher.consume_tokens(output):
            raise ValueError(f"the output to resume from does not fit the constraint: {member.matcher.get_error()}")


def _resume(seq: Sequence, tokens: list[int], text: str) -> None:
    if tokens:
        seq.token_ids.extend(tokens)
        seq.detok.resume(tokens, text)
