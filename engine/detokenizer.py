"""Incremental detokenization with stop strings.

Text is emitted only once it does not end inside a multi-byte character, so a stream never carries half a
character. A fast tokenizer decodes through its Rust `DecodeStream`, one call per token; any other through a
short window of tokens decoded twice (the text it shows is the new part, held while it ends in U+FFFD). While stop
strings are set, the last len(longest stop) - 1 characters are held back, so a stop string never leaks into a
stream before it is recognized and cut.

Without stop strings nothing in the step loop needs the text, so decoding is deferred: the step only records the
token (`defer`), and whoever reads an output's text first (the worker's publisher thread, or a caller of
`generate`) decodes up to it (`text_range`). Decoding stays in token order whoever asks, under a lock.
"""

from __future__ import annotations

import threading

NO_TOKEN = -1  # a deferred position whose token is not shown (EOS, a stop token)
CONTEXT_TOKENS = 6  # prompt tokens decoded with the output, so the first output token gets its leading space right

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an old tokenizers release
    DecodeStream = None


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class _Stream:
    """Rust-side incremental decoding; `pending` keeps the ids it holds back, to flush them at the end."""

    def __init__(self, tokenizer, context: list[int]) -> None:
        self.tokenizer = tokenizer
        self.rust = tokenizer._tokenizer
        self.stream = DecodeStream(ids=context, skip_special_tokens=True)
        self.step = self.stream.step
        self.pending: list[int] = []

    def add_one(self, token_id: int) -> str:
        chunk = self.step(self.rust, token_id)
        if chunk is None:
            self.pending.append(token_id)
            return ""
        if self.pending:
            self.pending.clear()
        return chunk

    def add(self, ids: list[int], final: bool) -> str:
        out = ""
        for t in ids:
            chunk = self.step(self.rust, t)
            if chunk is None:
                self.pending.append(t)
            else:
                out += chunk
                self.pending.clear()
        if final and self.pending:  # the output ends inside a character: show what a full decode shows
            out += _decode(self.tokenizer, self.pending)
            self.pending = []
        return out


class _Window:
    def __init__(self, tokenizer, context: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context)
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, ids: list[int], final: bool) -> str:
        self.ids.extend(ids)
        before = _decode(self.tokenizer, self.ids[self.prefix : self.read])
        after = _decode(self.tokenizer, self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def add_one(self, token_id: int) -> str:
        return self.add([token_id], final=False)


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        fast = DecodeStream is not None and getattr(tokenizer, "_tokenizer", None) is not None
        self.decoder = _Stream(tokenizer, context) if fast else _Window(tokenizer, context)
        self.text = ""  # all decoded output text, before any stop cut
        self.sent = 0  # characters of text already handed out
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.lazy = not stop
        self._queued: list[int] = []  # deferred tokens by position; NO_TOKEN: a position that shows no token
        self._ends = [0]  # text length before position 0, then after each decoded position
        self._final_at = -1  # the position that ends the output (flushes held-back bytes)
        self._lock = threading.Lock()

    def defer(self, token_id: int, final: bool) -> int:
        """Record the next token for later decoding -> its position (for text_range). Lazy detokenizers only."""
        pos = len(self._queued)
        if final:
            self._final_at = pos
        self._queued.append(token_id)
        return pos

    def text_range(self, pos: int) -> tuple[int, int]:
        """Decode up to position pos if not yet done -> the slice of `text` that position added."""
        ends = self._ends
        if len(ends) <= pos + 1:
            with self._lock:
                while len(ends) <= pos + 1:
                    i = len(ends) - 1
                    token = self._queued[i]
                    if i == self._final_at:
                        self.add([] if token == NO_TOKEN else [token], final=True)
                    elif token != NO_TOKEN:
                        self.add_one(token)
                    ends.append(len(self.text))
        return ends[pos], ends[pos + 1]

    def add_one(self, token_id: int) -> str:
        """add([token_id], final=False) without stop strings -> the new text: what most steps of most requests do."""
        new = self.decoder.add_one(token_id)
        if new:
            self.text += new
            self.sent = len(self.text)
        return new

    def add(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Feed new tokens -> (new text to emit, whether a stop string ended the output)."""
        new = self.decoder.add(token_ids, final)
        if not (final or self.stop):  # the hot case: nothing to hold back or cut
            if new:
                self.text += new
                self.sent = len(self.text)
            return new, False
        self.text += new
        stopped = False
        if self.stop:
            # Only the tail that the new text could complete needs scanning.
            start = max(0, self.sent - self.hold)
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                stopped = True
        end = len(self.text) if (final or stopped) else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta, stopped

    def resume(self, token_ids: list[int], sent_text: str) -> None:
        """Take up output that was decoded and partly streamed elsewhere: sent_text is what readers already have."""
        self.add(token_ids, final=False)
        if not self.text.startswith(sent_text):
            # The other side decoded differently (another tokenizer version, say): trust what was streamed.
            self.text = sent_text
        self.sent = len(sent_text)
        self._ends = [self.sent]
