"""What one engine step reports per request."""

from __future__ import annotations


class RequestOutput:
    """One request's news from one step, and its running totals.

    request_id, new_token_ids, new_text, finished, finish_reason ("stop" | "length" | "abort"),
    num_prompt_tokens, num_cached_tokens, logprobs (per new token, when SamplingParams.logprobs is set:
    (logprob of the token, {token_id: logprob} of the top N)); token_ids and text: all output so far.

    The totals are read on demand from the request's own token list and text, as they stood at this step:
    copying them into every step's output would cost each request its whole output length every step.
    """

    __slots__ = ("request_id", "new_token_ids", "new_text", "finished", "finish_reason", "num_prompt_tokens",
                 "num_cached_tokens", "logprobs", "_ids", "_ids_start", "_ids_end", "_text", "_text_end")

    def __init__(self, request_id: str, new_token_ids: list[int], new_text: str, finished: bool,
                 finish_reason: str | None = None, *, all_ids: list[int] | None = None, num_prompt_tokens: int = 0,
                 text: str = "", text_end: int | None = None, num_cached_tokens: int = 0,
                 logprobs: list[tuple[float, dict[int, float]]] | None = None) -> None:
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.new_text = new_text
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.logprobs = logprobs
        # all_ids: prompt + output, only ever appended to; text: an immutable str, so both slices are snapshots.
        self._ids = all_ids if all_ids is not None else list(new_token_ids)
        self._ids_start = num_prompt_tokens if all_ids is not None else 0
        self._ids_end = len(self._ids)
        self._text = text
        self._text_end = len(text) if text_end is None else text_end

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._ids_start : self._ids_end]

    @property
    def text(self) -> str:
        return self._text[: self._text_end]

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, new={self.new_token_ids}, {self.new_text!r}, "
                f"finished={self.finished}, reason={self.finish_reason})")
