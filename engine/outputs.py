"""What one engine step reports per request."""

from __future__ import annotations


class RequestOutput:
    """One request's news from one step, and its running totals.

    request_id, new_token_ids, new_text, finished, finish_reason ("stop" | "length" | "abort"),
    num_prompt_tokens, num_cached_tokens, logprobs (per new token, when SamplingParams.logprobs is set:
    (logprob of the token, {token_id: logprob} of the top N)); token_ids and text: all output so far.

    The totals are read on demand from the request's own token list and text, as they stood at this step:
    copying them into every step's output would cost each request its whole output length every step. When the
    request's detokenizer defers decoding (no stop strings), new_text and text are decoded on first read.
    """

    __slots__ = ("request_id", "new_token_ids", "finished", "finish_reason", "num_prompt_tokens",
                 "num_cached_tokens", "logprobs", "_ids", "_ids_start", "_ids_end", "_new_text", "_text",
                 "_text_end", "_detok", "_pos")

    def __init__(self, request_id: str, token: int, finish_reason: str | None, all_ids: list[int], ids_end: int,
                 num_prompt_tokens: int, num_cached_tokens: int, new_text: str, text: str, text_end: int,
                 logprobs: list[tuple[float, dict[int, float]]] | None = None, detok=None, pos: int = 0) -> None:
        # Positional and flat: one is built per running request per step, so its cost is per-token cost.
        self.request_id = request_id
        self.new_token_ids = [token]
        self.finished = finish_reason is not None
        self.finish_reason = finish_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.logprobs = logprobs
        # all_ids: prompt + output, written in order (a later step's placeholder past ids_end may be there
        # already); text: an immutable str. So both slices are snapshots.
        self._ids = all_ids
        self._ids_start = num_prompt_tokens
        self._ids_end = ids_end
        self._new_text = new_text
        self._text = text
        self._text_end = text_end
        self._detok = detok  # a deferring Detokenizer, and this output's position in it
        self._pos = pos

    def _decode(self) -> None:
        detok = self._detok
        if detok is None:  # another thread decoded it meanwhile
            return
        start, end = detok.text_range(self._pos)
        text = detok.text  # only ever grows while deferring (no stop strings to cut)
        self._new_text, self._text, self._text_end = text[start:end], text, end
        self._detok = None

    @property
    def text_deferred(self) -> bool:
        """True while this output's text is still to be decoded (its request has no stop strings): a reader in
        another process can decode new_token_ids itself instead."""
        return self._detok is not None

    @property
    def new_text(self) -> str:
        if self._detok is not None:
            self._decode()
        return self._new_text

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._ids_start : self._ids_end]

    @property
    def text(self) -> str:
        if self._detok is not None:
            self._decode()
        return self._text[: self._text_end]

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, new={self.new_token_ids}, {self.new_text!r}, "
                f"finished={self.finished}, reason={self.finish_reason})")
