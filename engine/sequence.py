"""One request as the engine tracks it: tokens, progress through the KV cache, and when it is done."""

from __future__ import annotations

import copy
import itertools
import math
from enum import Enum, auto

from engine.sampling_params import SamplingParams

_arrivals = itertools.count()
# In token_ids, where a sampled token still on the device will go (overlapped steps): never a token id, never hashed.
PLACEHOLDER = -1


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        seed: int = 0,
        eos_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.deadline = deadline  # unix seconds, or None: only an order among equal priorities, never enforced here
        self.arrival = next(_arrivals)
        # Fixed for the request's life and read per sequence per step by the scheduler: computed once.
        # priority_key: which of two requests is more urgent (the lower), for admission and preemption alike;
        # sort_key adds arrival, so a preempted request goes back ahead of later arrivals of the same urgency.
        self.priority_key: tuple[int, float] = (priority, math.inf if deadline is None else deadline)
        self.sort_key: tuple[int, float, int] = (*self.priority_key, self.arrival)
        # Sampling draws depend on (seed, output position) only, so the batch around a request never matters.
        self.seed = params.seed if params.seed is not None else seed
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.table_row = -1  # its row in BlockManager.tables while it holds blocks
        self.block_hashes: list[int] = []  # prefix-cache hashes of the full blocks computed so far
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Fixed for the request's life, so the step's per-token checks are a set lookup and two compares.
        self.plain_greedy = params.temperature == 0 and not (
            params.min_tokens or params.uses_history or params.needs_logprobs or params.use_beam_search)
        self.min_len = self.num_prompt_tokens + params.min_tokens  # a stop token ends it from this length on
        self.max_len = self.num_prompt_tokens + params.max_tokens
        if max_model_len is not None:
            self.max_len = min(self.max_len, max_model_len)
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.detok = None  # the engine's Detokenizer for it
        self.group = None  # the engine.group.Group it is a continuation or beam of, if any
        self.gang = None  # its group again where that is a beam search: the beams step together, as one unit
        self.index = 0  # its continuation's index in the group
        self.cumulative_logprob = 0.0  # of its output tokens, where the group needs it (best_of, beams)
        self.matcher = None  # its constraint's llguidance matcher, advanced by each token that lands
        self.hidden_stop = False  # it ended on a stop token whose text is not shown (engine.finishing)

    def fork(self, index: int, seed: int) -> Sequence:
        """Another continuation from where this one is: the same tokens and progress, no blocks yet (the block
        manager shares this one's), its own seed and index."""
        child = copy.copy(self)
        child.token_ids = list(self.token_ids)
        child.block_table, child.table_row, child.block_hashes = [], -1, list(self.block_hashes)
        child.index, child.seed = index, seed
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()
        return child

    # A unit is what the scheduler admits, steps and preempts together: a beam gang's live beams, else the sequence
    # alone (a sampling continuation too: it shares its prompt's blocks by reference counts, and runs on its own).
    # These two say, once, what a group means to the scheduler.

    @property
    def unit(self) -> list[Sequence]:
        """The sequences admitted and preempted with this one, itself included."""
        return [self] if self.gang is None else list(self.gang.seqs)

    @property
    def slots(self) -> int:
        """Batch slots it holds: one, but a group's prompt holds one per continuation until it forks into them."""
        group = self.group
        return group.width if group is not None and not group.forked and self.index == 0 else 1

    def request_members(self) -> list[Sequence]:
        """Every sequence of the request this one is the first of: itself, and its group's others."""
        if self.group is None:
            return [self]
        return [self, *self.group.seqs, *self.group.done]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
