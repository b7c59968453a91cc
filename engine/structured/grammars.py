"""Constraints compiled into llguidance matchers, off the step loop, and each step's allowed-token bitmasks.

Why llguidance (not xgrammar): it builds a grammar lazily, so a JSON schema compiles in a millisecond or two
where xgrammar precomputes token masks per grammar state (tens to hundreds of ms, more for large schemas); its
per-token mask (tens of microseconds for a 49k vocabulary on one core) is computed in parallel across rows in
Rust, without the GIL; it covers the most of JSON Schema (see its docs/json_schema.md) and reads Lark and
GBNF grammars; and it has no dependencies (xgrammar pulls in triton and a TVM runtime).

A compile runs in a thread of its own; its result is cached by the constraint's text, so a thousand jobs with one
schema compile it once and each gets a copy of the compiled matcher (a copy takes microseconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine.structured.constraints import Constraint

log = logging.getLogger("pagedq.engine")
CACHE_SIZE = 512  # compiled constraints kept; a schema used again after falling out compiles again


@dataclass
class Compiled:
    """A constraint's compiled matcher, never advanced itself (requests take copies), or why it failed."""

    matcher: object | None
    error: str = ""
    seconds: float = 0.0

    def new_matcher(self):
        return self.matcher.deep_copy()


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedq-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache is read by the step loop and written from its callbacks
        self._tokenizer = None  # llguidance's view of the tokenizer: made in the compile thread, on first use
        self._executor = None
        self.compiles = 0
        self.compile_seconds = 0.0

    def compile(self, constraint: Constraint) -> Future:
        """-> a Future of the constraint's Compiled; an earlier compile of the same constraint is reused."""
        key = constraint.key
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
            future = self._cache[key] = self._pool.submit(self._compile, constraint)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: Constraint) -> Compiled:
        from llguidance import LLMatcher

        tokenizer = self.tokenizer()
        start = time.perf_counter()
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as e:
            return Compiled(None, str(e))
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        matcher = None if error else LLMatcher(tokenizer, grammar, log_level=0)
        if matcher is not None and matcher.is_error():
            error, matcher = matcher.get_error(), None
        seconds = time.perf_counter() - start
        self.compiles += 1
        self.compile_seconds += seconds
        log.debug("compiled a %s constraint in %.1f ms%s", constraint.kind, seconds * 1e3,
                  f": {error}" if error else "")
        return Compiled(matcher, _short(error), seconds)

    def tokenizer(self):
        """llguidance's tokenizer (about half a second to build, once)."""
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_ids or None)
        return self._tokenizer

    def fill(self, matchers: list) -> np.ndarray:
        """Each matcher's allowed next tokens -> a bitmask [rows, words] (int32; bit t % 32 of word t // 32 set
        where token t is allowed), computed for all rows at once in llguidance's threads."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bits = np.empty((len(matchers), self.words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.ctypes.data,
                                               self.words * 4, len(matchers))
        return bits

    def fill_verify(self, runs: list[tuple[object, list[int]]]) -> np.ndarray:
        """For a step with draft tokens: per (matcher, draft), 1 + len(draft) rows, row j the allowed tokens after
        draft[:j] -> a bitmask [rows, words] as fill's. llguidance advances each matcher through its draft and rolls
        it back: it ends where it was. Rows after a draft token the grammar refuses allow every token: the row
        before it rejects that draft, so nothing lands from them."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bits = np.full((sum(1 + len(d) for _, d in runs), self.words), -1, dtype=np.int32)
        drafted, plain, at = [], [], 0
        for matcher, draft in runs:  # llguidance takes no empty draft: those rows are plain ones
            if draft:
                drafted.append((matcher, at, draft))
            else:
                plain.append((matcher, at))
            at += 1 + len(draft)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.ctypes.data, self.words * 4,
                                                                    len(bits))
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bits.ctypes.data, self.words * 4, len(bits))
        return bits

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _short(error: str, limit: int = 1000) -> str:
    """The grammar engine's message, whole unless huge (it may quote the grammar)."""
    error = error.strip()
    return error if len(error) <= limit else error[: limit - 3] + "..."
