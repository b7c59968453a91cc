"""Suffix proposer (SuffixDecoding's idea, arXiv 2411.04975): prompt lookup first, then what earlier outputs of this
worker did after the same text.

A worker serves the same few task templates over and over (agents, extraction pipelines, classifiers), so its
outputs repeat one another's structure: the tail of a sequence often occurred in an earlier output, and what most
outputs did next is a good guess. Per sequence the proposer matches the sequence's tail both in its own prompt and
output (prompt lookup, engine.speculative.ngram.lookup, which also covers the running sequence's own output as it
grows) and in an index of recent finished outputs, and the longer match guesses (its own text on a tie: the nearer
guess); the other where that one has no guess. On SmolLM2, replaying its greedy outputs, this accepted a few more
drafts of fewer proposed than prompt lookup first and the index only where it has none (bench/speculative_agentic.py).

The index is the outputs' tokens themselves, in one array with a separator after each (plus a few prompt tokens
before each output, so that the start of an output can be matched from the end of its prompt template), and beside
it every pair of adjacent tokens, sorted (an int64 key of the pair, and where it ends). A match is a binary search for
the tail's last two tokens, then its occurrences narrowed one token further back at a time. Not a suffix tree, a
suffix automaton or n-gram -> next-token counts, because:
- memory is 20 bytes a token in three numpy arrays, nothing per node or per n-gram (a suffix tree or counts of 256k
  tokens are some hundreds of bytes a token as Python objects), and the bound is simply the token array's length;
- eviction drops the oldest outputs from the front, and every count is counted afresh from what is there, at each
  proposal: exact by construction, with no decrements to keep in step;
- adding an output is a few copies of the arrays (about a millisecond for 256k tokens), once per finished sequence;
  a proposal is a binary search and a few small numpy operations, a fraction of a millisecond.
What a suffix tree gives, the frequencies of each continuation of the longest match, the occurrences give as well:
the draft walks them token by token, keeping at each token the most frequent next token and the occurrences that
continue with it. Where those (the occurrences that agree with the whole draft so far, over all the tail's
occurrences: an estimate of the chance the draft is right up to there) fall below min_share of them, the draft stops:
a weak guess costs verify compute.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from engine.sequence import Sequence
from engine.speculative.ngram import lookup

# After each indexed output (and before the first): never a token (nor engine.sequence.PLACEHOLDER), so no match
# runs across two outputs.
SEP = -2


class SuffixProposer:
    def __init__(self, max_tokens: int = 256 * 1024, max_n: int = 8, min_n: int = 2, min_share: float = 0.3,
                 lookup_max_n: int = 4, lookup_min_n: int = 2, lead: int = 4) -> None:
        """max_tokens: the index's bound in tokens (separators and leads count); oldest outputs go first.
        max_n, min_n: the longest and shortest tails matched in the index (the longest that occurs wins).
        min_share: the least share of the tail's occurrences a draft must agree with to go on.
        lookup_max_n, lookup_min_n: the prompt lookup's sizes (engine.speculative.ngram).
        lead: prompt tokens indexed before each output (the end of its template, where the output starts)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"suffix sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share}")
        if max_tokens < 3:
            raise ValueError(f"max_tokens must be >= 3, got {max_tokens}")
        self.max_tokens = max_tokens
        self.max_n, self.min_n = max_n, min_n
        self.min_share = min_share
        self.lookup_n = (lookup_max_n, lookup_min_n)
        self.lead = lead
        self.lengths: deque[int] = deque()  # of the indexed outputs, oldest first, each with its SEP
        # The indexed stream from position `lo` on: a SEP (the evicted outputs' last), then each output and its SEP.
        self.tokens = np.full(1, SEP, dtype=np.int32)
        self.lo = 0
        # Every indexed pair of tokens within an output, by key (both tokens, _key), each key's in stream order:
        # the key, and the stream position of the pair's second token.
        self.keys = np.empty(0, dtype=np.int64)
        self.ends = np.empty(0, dtype=np.int64)

    @property
    def num_tokens(self) -> int:
        """Tokens in the index, separators included: at most max_tokens."""
        return len(self.tokens)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose_one(seq.token_ids, k) for seq, k in wants]

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow tokens: the guess of the longer match of tokens' tail, in tokens themselves
        (prompt lookup; on a tie, its own text is the nearer guess) or in the index; the other's where it has none."""
        found, n = self.occurrences(tokens)
        most, least = self.lookup_n
        own = lookup(tokens, k, most, max(least, n)) if n <= most else []
        if own:
            return own
        draft = self.walk(found, k) if n else []
        if draft or min(n - 1, most) < least:
            return draft
        return lookup(tokens, k, min(n - 1, most), least)  # the index's guess was too weak: a shorter own match

    def finished(self, seq: Sequence) -> None:
        """Learn seq's output (a finished or aborted one alike: what the target wrote either way)."""
        start = max(0, seq.num_prompt_tokens - self.lead)
        if len(seq.token_ids) > seq.num_prompt_tokens:
            self.add(seq.token_ids[start:])

    def add(self, tokens: list[int]) -> None:
        """Index tokens (one output, with its lead) as the newest, evicting the oldest outputs beyond max_tokens."""
        room = self.max_tokens - 2  # for the separators, where one output alone is too long
        new = np.asarray(tokens[max(0, len(tokens) - room):], dtype=np.int32)
        at = self.lo + len(self.tokens)  # new[0]'s stream position
        self.lengths.append(len(new) + 1)
        gone = 0
        while len(self.tokens) - gone + len(new) + 1 > self.max_tokens:
            gone += self.lengths.popleft()
        if gone:
            self.lo += gone
            kept = self.ends > self.lo  # pairs of the evicted outputs end at or before their last SEP, now at lo
            self.keys, self.ends = self.keys[kept], self.ends[kept]
        # Copies of at most max_tokens per finished sequence: cheap beside the steps that made its tokens.
        self.tokens = np.concatenate([self.tokens[gone:], new, np.full(1, SEP, dtype=np.int32)])
        if len(new) >= 2:
            keys = _key(new[:-1], new[1:])
            order = np.argsort(keys, kind="stable")
            keys, ends = keys[order], at + 1 + order
            # After the equal keys already there: they are all earlier in the stream.
            where = np.searchsorted(self.keys, keys, side="right")
            self.keys, self.ends = np.insert(self.keys, where, keys), np.insert(self.ends, where, ends)

    def search(self, tokens: list[int], k: int) -> list[int]:
        """The index's guess for what follows tokens: see the module's docstring."""
        found, n = self.occurrences(tokens)
        return self.walk(found, k) if n else []

    def walk(self, found: np.ndarray, k: int) -> list[int]:
        """Up to k tokens that most of the occurrences found continue with."""
        index, draft, ends = self.tokens, [], found
        for j in range(1, k + 1):
            if len(ends) == 1 and self.min_share * len(found) <= 1:
                # One occurrence left: the rest of it, to its output's end (a slice, not a count per token).
                rest = index[ends[0] + j : ends[0] + k + 1]
                stop = np.flatnonzero(rest == SEP)
                return draft + rest[: stop[0] if len(stop) else len(rest)].tolist()
            nxt = index[ends + j]
            token, top = _most_frequent(nxt)
            if top < self.min_share * len(found) or token == SEP:
                break
            draft.append(token)
            ends = ends[nxt == token]
        return draft

    def occurrences(self, tokens: list[int]) -> tuple[np.ndarray, int]:
        """Where in self.tokens the longest tail of tokens (max_n down to min_n tokens) that occurs there ends,
        ascending, and its length n; n = 0 where not even min_n of them occur. The last two tokens by binary search
        of the pairs, then narrowed one token back at a time: each longer tail's occurrences are among the shorter
        one's."""
        index, tail = self.tokens, tokens[-self.max_n:]
        found = np.empty(0, dtype=np.int64)
        if len(tokens) < self.min_n or not self.lengths:
            return found, 0
        found = self._pair(tail[-2], tail[-1]) if len(tail) >= 2 else found
        if not len(found):
            # A lone token's occurrences: a scan of the whole index, only where the pairs are not enough.
            found = np.flatnonzero(index[:-1] == tail[-1]) if self.min_n <= 1 else found
            return found, min(1, len(found))
        best, n = found, 2
        for back in range(2, len(tail)):
            # index[0] is SEP and never matches, so found - back stays >= 0 for every surviving occurrence.
            found = found[index[found - back] == tail[-1 - back]]
            if not len(found):
                break
            best, n = found, back + 1
        return (best, n) if n >= self.min_n else (found[:0], 0)

    def _pair(self, first: int, second: int) -> np.ndarray:
        """Where in self.tokens the pair (first, second) ends, ascending."""
        key = _key(np.int64(first), np.int64(second))
        lo, hi = np.searchsorted(self.keys, key, side="left"), np.searchsorted(self.keys, key, side="right")
        return self.ends[lo:hi] - self.lo


def _most_frequent(tokens: np.ndarray) -> tuple[int, int]:
    """The most frequent of tokens, the latest of equally frequent ones (the nearest in time to now), and its count."""
    if len(tokens) > 256:  # numpy's sort beats a Python count only on long arrays
        values, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
        top = int(counts.max())
        return int(tokens[np.flatnonzero(counts[inverse] == top)[-1]]), top
    seen = tokens.tolist()
    counts = Counter(seen)
    top = max(counts.values())
    return next(t for t in reversed(seen) if counts[t] == top), top


def _key(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """One int64 per pair of token ids (each below 2**31)."""
    return (first.astype(np.int64) << 32) | (second.astype(np.int64) & 0xFFFFFFFF)
