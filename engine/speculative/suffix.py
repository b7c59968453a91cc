"""Suffix proposer (SuffixDecoding's idea, arXiv 2411.04975): prompt lookup first, then what earlier outputs of this
worker did after the same text.

A worker serves the same few task templates over and over (agents, extraction pipelines, classifiers), so its
outputs repeat one another's structure: the tail of a sequence often occurred in an earlier output, and what most
outputs did next is a good guess. Per sequence the proposer first tries prompt lookup over the sequence's own prompt
and output (engine.speculative.ngram.lookup; this also covers the running sequence's own output as it grows); where
that has no guess, it matches the sequence's tail against an index of recent finished outputs.

The index is the outputs' tokens themselves, in one array with a separator after each (plus a few prompt tokens
before each output, so that the start of an output can be matched from the end of its prompt template), and a match
is one vectorized scan of it, as in lookup. Not a suffix tree, a suffix automaton or hashed
n-gram counts, because:
- memory is exactly the tokens kept (4 bytes each, nothing per n-gram or per node: a suffix tree or n-gram counts of
  256k tokens are some hundreds of bytes per token in Python objects), so the bound is simply the array's length;
- eviction is dropping the oldest outputs from the front, and every count is counted afresh from what is there:
  exact by construction, with no decrements to keep in step;
- a scan of 256k tokens is some tens of microseconds of numpy, small beside a decode step of the target model.
What a suffix tree gives, the frequencies of each continuation of the longest match, the scan gives as well: the
matches' end positions are the occurrences of the tail, and the draft walks them token by token, keeping at each
token the most frequent next token and the occurrences that continue with it. Where that share of the occurrences
(those that continue with the whole draft so far, over all the tail's occurrences: an estimate of the chance the
draft is right up to there) falls below min_share, the draft stops: a weak guess costs verify compute.
"""

from __future__ import annotations

from collections import deque

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
        self.tokens = np.full(1, SEP, dtype=np.int32)  # SEP, then each output and its SEP, oldest first

    @property
    def num_tokens(self) -> int:
        """Tokens in the index, separators included: at most max_tokens."""
        return len(self.tokens)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose_one(seq.token_ids, k) for seq, k in wants]

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that may follow tokens: prompt lookup's guess, else the index's, else []."""
        draft = lookup(tokens, k, *self.lookup_n)
        return draft or self.search(tokens, k)

    def finished(self, seq: Sequence) -> None:
        """Learn seq's output (a finished or aborted one alike: what the target wrote either way)."""
        start = max(0, seq.num_prompt_tokens - self.lead)
        if len(seq.token_ids) > seq.num_prompt_tokens:
            self.add(seq.token_ids[start:])

    def add(self, tokens: list[int]) -> None:
        """Index tokens (one output, with its lead) as the newest, evicting the oldest outputs beyond max_tokens."""
        room = self.max_tokens - 2  # for the separators, where one output alone is too long
        tokens = tokens[max(0, len(tokens) - room):]
        self.lengths.append(len(tokens) + 1)
        drop, size = 0, len(self.tokens) + len(tokens) + 1
        while size > self.max_tokens:
            gone = self.lengths.popleft()
            drop, size = drop + gone, size - gone
        # One copy of at most max_tokens per finished sequence: cheap beside the steps that made its tokens.
        self.tokens = np.concatenate([self.tokens[:1], self.tokens[1 + drop:], np.asarray(tokens, dtype=np.int32),
                                      np.full(1, SEP, dtype=np.int32)])

    def search(self, tokens: list[int], k: int) -> list[int]:
        """The index's guess for what follows tokens: see the module's docstring."""
        if k < 1 or len(tokens) < self.min_n or not self.lengths:
            return []
        found = self.occurrences(tokens)
        if found is None:
            return []
        index, draft, ends = self.tokens, [], found
        for j in range(1, k + 1):
            nxt = index[ends + j]
            values, inverse, counts = np.unique(nxt, return_inverse=True, return_counts=True)
            top = counts.max()
            if top < self.min_share * len(found):
                break
            # Among equally frequent tokens the latest occurrence's: the nearest in time to now.
            token = int(nxt[np.flatnonzero(counts[inverse] == top)[-1]])
            if token == SEP:
                break
            draft.append(token)
            ends = ends[nxt == token]
        return draft

    def occurrences(self, tokens: list[int]) -> np.ndarray | None:
        """Where in the index the longest tail of tokens (max_n down to min_n tokens) ends, ascending; None where
        not even min_n of them occur. Narrowed one token back at a time: each longer tail's occurrences are among
        the shorter one's."""
        index = self.tokens
        tail = tokens[-self.max_n:]
        # The last position is always SEP: no occurrence ends there with a continuation after it.
        found = np.flatnonzero(index[:-1] == tail[-1])
        best = found if self.min_n <= 1 else None
        for back in range(1, len(tail)):
            if not len(found):
                break
            # index[0] is SEP and never matches, so found - back stays >= 0 for every surviving occurrence.
            found = found[index[found - back] == tail[-1 - back]]
            if len(found) and back + 1 >= self.min_n:
                best = found
        return best if best is not None and len(best) else None
