"""LLMEngine: add requests, step, read outputs. One continuous batch over a paged KV cache, a facade over its stages:
intake (checks, tokenization, resume, sequences), the step loop (schedule, launch, feed, land) and finishing (stop
tokens, lengths, constraints, stop strings, outputs)."""

from __future__ import annotations

import atexit
import gc
import logging
import math
import random

from engine.block_manager import BlockManager
from engine.config import DOUBLING_TOKENS, SECOND_TOKEN_COST, EngineConfig
from engine.detokenizer import Detokenizer
from engine.finishing import Finishing
from engine.group_steps import GroupSteps
from engine.intake import Intake, Limits
from engine.outputs import RequestOutput
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.self_check import self_check
from engine.sequence import PLACEHOLDER
from engine.speculative.constrained import ConstrainedProposer
from engine.speculative.draft import DraftProposer, load_draft
from engine.speculative.ngram import NgramProposer
from engine.speculative.policy import Policy
from engine.speculative.proposer import Proposer
from engine.speculative.suffix import SuffixProposer
from engine.speculative.verify import Speculator
from engine.stats import SpeculationCounts, StepTimes
from engine.step_loop import StepLoop
from engine.structured.grammars import Grammars
from engine.tokens import chat_prompt, eos_ids
from engine.weights.loader import resolve_model

log = logging.getLogger("pagedq.engine")
_heap_frozen = False


def _freeze_first_engine() -> None:
    """The first engine of a process (a worker's only one) lives as long as the process: its model, tokenizer and
    cache bookkeeping go out of the collector's sight, so full collections no longer walk them every time requests
    come and go. Only the first: a frozen object is never freed, and a process that makes engine after engine
    (the test suite, a benchmark comparing settings) must get their memory back."""
    global _heap_frozen
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # at exit everything must be collectable again (native bindings check)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config = config or EngineConfig(**kwargs)
        self.model_name = config.model
        folder = resolve_model(config.model, config.cache_dir)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.runner = ModelRunner(config, folder)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.hf_config.vocab_size
        self._eos_token_ids = eos_ids(folder, self.runner.hf_config, self.tokenizer)
        self.rng = random.Random(config.seed)
        self.times = StepTimes()
        self.runner.times = self.times
        self.speculation = SpeculationCounts()  # draft tokens proposed and accepted, whether speculation is on or not
        self.draft = load_draft(config, self.runner, self.tokenizer) if config.speculative == "draft" else None
        if self.draft is not None:
            self.draft.times = self.times  # its forwards count in the step's phases
        if config.speculative != "off":
            log.info("speculative decoding: %s, up to %d draft tokens per sequence a step", config.speculative,
                     config.num_speculative_tokens)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._build(overlap=config.overlap_steps if config.overlap_steps is not None
                    else self.runner.device.type == "cuda", constrained=False)
        _freeze_first_engine()

    def _build(self, overlap: bool, constrained: bool) -> None:
        """Fresh bookkeeping and stages over the same model: at start, and after reset()."""
        config = self.config
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner.forget_steps(self.block_manager.tables)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.preempt_for_priority)
        self.groups = GroupSteps(self.scheduler, self.block_manager,
                                 lambda prompt, stop: Detokenizer(self.tokenizer, prompt, stop))
        limits = Limits(self.vocab_size, self.max_model_len, config.max_num_seqs, config.block_size,
                        self.num_total_blocks)
        self.intake = Intake(self.tokenizer, self.grammars, self.scheduler, limits, self.eos_token_ids, self.rng)
        self.finishing = Finishing(self.scheduler, self.groups)
        speculator = None
        if config.speculative != "off":
            inner = self._proposer()
            # Constrained sequences draft their grammar's forced tokens first; the others, the inner proposer's guess.
            proposer = ConstrainedProposer(inner)
            policy = self._policy(getattr(inner, "step_cost", 0.0))
            speculator = Speculator(proposer, policy, self.block_manager, config.max_num_batched_tokens,
                                    self.scheduler.watermark, self.speculation)
            self.scheduler.on_finish = speculator.finished
        self.loop = StepLoop(self.runner, self.scheduler, self.groups, self.finishing, self.grammars, self.times,
                             self.eos_token_ids, overlap, constrained, speculator)

    def _policy(self, draft_cost: float) -> Policy:
        """The speculation policy, with what a step costs on this device and these weights (config.DOUBLING_TOKENS)."""
        config = self.config
        kind = self.runner.device.type + ("-quantized" if self.runner.quantized else "")
        doubling = config.speculative_doubling_tokens or DOUBLING_TOKENS.get(kind, DOUBLING_TOKENS["cpu"])
        return Policy(config.num_speculative_tokens, doubling, draft_cost, SECOND_TOKEN_COST.get(kind, 0.0))

    def _proposer(self) -> Proposer:
        """A fresh proposer of the configured kind (a draft model's runner is the engine's, loaded once)."""
        config = self.config
        if config.speculative == "draft":
            return DraftProposer(self.draft, config.block_size, config.max_num_batched_tokens)
        return SuffixProposer() if config.speculative == "suffix" else NgramProposer()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel replica (nothing to do on one device)."""
        self.runner.close()

    @property
    def last_batch(self) -> SchedulerOutput:
        """What the latest step ran: for a worker's batch-size metrics."""
        return self.loop.last_batch

    @property
    def eos_token_ids(self) -> set[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        """New end-of-sequence ids (a test's "every token ends"): for the requests added from now on."""
        self._eos_token_ids = ids
        self.intake.eos_ids, self.loop.eos_ids = frozenset(ids), sorted(ids)

    @property
    def overlap(self) -> bool:
        """Whether a step launches before the one in flight lands (engine.step_loop)."""
        return self.loop.overlap

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
        choices = dict(resume or {})
        if resume_token_ids:
            choices[0] = (list(resume_token_ids), resume_text, None)
        self.intake.add(request_id, prompt, prompt_token_ids, params, priority, deadline, choices)
        if params.constraint is not None:
            self.loop.constrained = True  # from now on each step looks for matchers

    def pop_refused(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests refused since the last call: their constraint did not compile. They
        are no longer in the engine and make no outputs."""
        return self.intake.pop_refused()

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its KV blocks are free when this returns. False if it was not in the engine."""
        if self.intake.compiling.pop(request_id, None) is not None:
            return True
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return False
        self.finishing.abort(seq)
        return True

    def reset(self) -> list[str]:
        """Drop every request and every step in flight, after a step raised: whatever that step left half done (a
        table, a placeholder token, a group's beams) goes with fresh bookkeeping, and the KV cache is all free.
        Returns the ids of the requests dropped; they make no more outputs, and may be added again."""
        dropped = list(dict.fromkeys([*self.scheduler.by_id, *self.intake.compiling]))
        self._build(self.loop.overlap, self.loop.constrained)
        return dropped

    def landed(self, request_id: str) -> int | None:
        """Output tokens the request's furthest sequence has landed (resumed ones included), or None if it is not in
        the engine. A step that raised may have landed some of its tokens: they count."""
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return 0 if request_id in self.intake.compiling else None
        return max(m.num_output_tokens - (m.token_ids[-1] == PLACEHOLDER) for m in seq.request_members())

    def self_check(self) -> str | None:
        """Run one tiny greedy request alone (engine.self_check) -> None if it passed, else its error."""
        return self_check(self)

    def has_unfinished_requests(self) -> bool:
        return bool(self.loop.in_flight) or self.scheduler.has_unfinished() or bool(self.intake.compiling)

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
        return len(self.scheduler.waiting) + len(self.intake.compiling)

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
        return chat_prompt(self.tokenizer, self.model_name, messages, add_generation_prompt)

    def step(self) -> list[RequestOutput]:
        """Run one step -> the outputs of the step that landed. With overlap (engine.step_loop) they are those of
        the step launched by the call before: outputs come one call later, and are the same."""
        self.times.start()
        if self.intake.compiling:
            self.intake.admit_compiled(idle=not self.scheduler.has_unfinished() and not self.loop.in_flight)
        outputs = self.finishing.outputs(self.loop.step())
        self.times.lap("outputs")
        return outputs

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
                text = isinstance(prompt, str)
                self.add_request(rid, prompt if text else None, None if text else list(prompt), p)
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
