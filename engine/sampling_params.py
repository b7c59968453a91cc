"""Per-request generation settings.

A job's sampling fields are producer/sampling_fields.py's table, which the engine cannot import (the layers):
these fields restate it, and tests/queue/test_sampling_fields.py holds their names, defaults and bounds to it. min_tokens
and constraint are the engine's own (a job's constraint comes from response_format or guided_*)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured.constraints import Constraint


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; N >= 0: the sampled token's logprob and the top N
    # Several continuations of one prompt, prefilled once and sharing its KV blocks (engine.group):
    n: int = 1  # continuations returned
    best_of: int | None = None  # continuations run (sampling), the n of highest cumulative logprob returned; None: n
    use_beam_search: bool = False  # beam search (greedy: temperature 0) instead of sampling
    beam_width: int | None = None  # beams; None: best_of, else n
    length_penalty: float = 1.0  # beam search: a finished beam's score is its logprob / length ** length_penalty
    early_stopping: bool | str = False  # beam search: True, False or "never", as in transformers' generate
    speculative: bool = True  # False: never draft tokens for it (engine.speculative), where the engine speculates
    # What the output must parse as (engine.structured.constraints): every token is picked from those the grammar allows,
    # and the request ends ("stop") where the grammar does.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "length_penalty")
        for name in floats:  # NaN passes every comparison below, and infinity turns the sampler's math to NaN
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0 or -1 turns it off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            bad("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be between 0 and 20, got {self.logprobs}")
        self._validate_continuations(bad)

    def _validate_continuations(self, bad) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            bad(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.beam_width is not None and (not isinstance(self.beam_width, int) or self.beam_width < self.n):
            bad(f"beam_width must be an integer >= n ({self.n}), got {self.beam_width!r}")
        if self.early_stopping not in (True, False, "never"):
            bad(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if self.constraint is not None and self.use_beam_search:
            bad("beam search does not take a constraint (json_schema, regex, choice, grammar): sample instead")
        if not self.use_beam_search:
            if self.beam_width is not None:
                bad("beam_width is for beam search: set use_beam_search")
            return
        # Beam search ranks every beam's continuations by their logprob: nothing is drawn, nothing is reshaped.
        sampled = self.temperature != 0 or self.top_p != 1 or self.top_k or self.min_p
        if sampled or self.uses_history:
            bad("beam search is greedy: give temperature 0 and no top_p, top_k, min_p or penalties")
        if self.stop:
            bad("beam search does not take stop strings (stop_token_ids and EOS do end a beam)")

    @property
    def uses_history(self) -> bool:
        """Whether sampling needs the request's earlier tokens (a penalty)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_logprobs(self) -> bool:
        """Whether sampling must compute its rows' logprobs: asked for, or best_of's ranking of continuations."""
        return self.logprobs is not None or (not self.use_beam_search and self.width > self.n)

    @property
    def width(self) -> int:
        """Sequences run at once: the beams, or best_of (n) continuations sampled."""
        if self.use_beam_search:
            return self.beam_width or self.best_of or self.n
        return self.best_of or self.n

    @property
    def width_field(self) -> str:
        """The field that sets width, for a message that names it."""
        if self.use_beam_search and self.beam_width is not None:
            return "beam_width"
        return "best_of" if self.best_of is not None else "n"

    @property
    def streams(self) -> bool:
        """Whether each continuation's tokens can be reported as they come: not when the ones returned are picked
        at the end (beam search, best_of > n)."""
        return not self.use_beam_search and self.width == self.n
