"""Incremental detokenization with stop strings.

Text is decoded over a short window of tokens and a delta is emitted only when the window does not end inside a
multi-byte character (the decoder shows that as U+FFFD), so a stream never carries half a character. While stop
strings are set, the last len(longest stop) - 1 characters are held back, so a stop string never leaks into a
stream before it is recognized and cut.
"""

from __future__ import annotations

CONTEXT_TOKENS = 6  # prompt tokens decoded with the output, so the first output token gets its leading space right


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # all decoded output text, before any stop cut
        self.sent = 0  # characters of text already handed out
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Feed new tokens -> (new text to emit, whether a stop string ended the output)."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
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
