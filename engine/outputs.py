"""What one engine step reports per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # Running totals, so that a caller needs no state of its own.
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Per new token, when SamplingParams.logprobs is set: (logprob of the token, {token_id: logprob} of the top N).
    logprobs: list[tuple[float, dict[int, float]]] | None = None
