"""What one engine step reports per request."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence


class RequestOutput:
    """One request's news from one step, and its running totals.

    request_id, new_token_ids, new_text, finished, finish_reason ("stop" | "length" | "abort"),
    num_prompt_tokens, num_cached_tokens, logprobs (per new token, when SamplingParams.logprobs is set:
    (logprob of the token, {token_id: logprob} of the top N)); token_ids and text: all output so far.

    A request with several continuations (n > 1, best_of, beam search) reports each as its own outputs, `index`
    saying which: as they come where they stream, else all at once when the request ends (every token new then).
    `finished` ends a continuation, `request_finished` the request: its last output carries them all in `choices`
    (in index order; a plain request's is itself). `cumulative_logprob`: the continuation's summed logprob, where
    the engine tracks it (best_of, beams: there the score it was ranked by is `score`).

    The totals are read on demand from the request's own token list and text, as they stood at this step:
    copying them into every step's output would cost each request its whole output length every step. When the
    request's detokenizer defers decoding (no stop strings), new_text and text are decoded on first read.
    """

    __slots__ = ("_seq", "new_token_ids", "finish_reason", "logprobs", "_ids_end", "_new_text", "_text",
                 "_text_end", "_detok", "_pos", "index", "request_finished", "choices", "cumulative_logprob",
                 "score", "hidden_stop")

    def __init__(self, seq: Sequence, token: int, finish_reason: str | None, ids_end: int, new_text: str,
                 text: str, text_end: int, logprobs: list[tuple[float, dict[int, float]]] | None = None,
                 detok=None, pos: int = 0) -> None:
        # Positional, flat and few: one is built per running request per step, so its cost is per-token cost.
        # What never changes over a request's life (its id, prompt and cached prompt lengths) is read from it.
        self._seq = seq
        self.new_token_ids = [token]
        self.finish_reason = finish_reason
        self.logprobs = logprobs
        # The request's token_ids are written in order (a later step's placeholder past ids_end may be there
        # already) and text is an immutable str, so both slices are snapshots.
        self._ids_end = ids_end
        self._new_text = new_text
        self._text = text
        self._text_end = text_end
        self._detok = detok  # a deferring Detokenizer, and this output's position in it
        self._pos = pos
        self.index = seq.index
        self.request_finished = finish_reason is not None and seq.group is None
        self.choices: list[RequestOutput] | None = [self] if self.request_finished else None
        self.cumulative_logprob: float | None = None
        self.score: float | None = None
        # True when the last new token is a stop token (EOS included) whose text is not shown: a reader that
        # decodes new_token_ids itself (the worker's publisher) leaves that token out instead of re-deriving it.
        self.hidden_stop = False

    @classmethod
    def whole(cls, seq: Sequence, index: int, finish_reason: str, text: str) -> RequestOutput:
        """A continuation reported once, at the end: every output token of seq new."""
        out = cls(seq, 0, finish_reason, len(seq.token_ids), text, text, len(text))
        out.new_token_ids = seq.token_ids[seq.num_prompt_tokens:]
        out.index = index
        return out

    @property
    def several(self) -> bool:
        """Whether its request has several continuations (n > 1, best_of, beam search)."""
        return self._seq.group is not None

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return self._seq.num_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._seq.num_cached_tokens  # set once, at the request's first admission

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
        seq = self._seq
        return seq.token_ids[seq.num_prompt_tokens : self._ids_end]

    @property
    def text(self) -> str:
        if self._detok is not None:
            self._decode()
        return self._text[: self._text_end]

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, new={self.new_token_ids}, {self.new_text!r}, "
                f"finished={self.finished}, reason={self.finish_reason})")
