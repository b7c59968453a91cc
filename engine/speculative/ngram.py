"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the sequence's tail.

Grounded jobs (summaries, extraction, rewriting, code edits) copy runs of their prompt into their output, so the
tail of the output so far often occurs in the prompt, and what followed it there is a good guess for what comes
next. No model: one vectorized scan of the tokens per proposal.
"""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence


class NgramProposer:
    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        """max_n, min_n: the longest and shortest tails matched; a longer match is tried first (a better guess)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [lookup(seq.token_ids, k, self.max_n, self.min_n) for seq, k in wants]

    def finished(self, seq: Sequence) -> None:
        pass  # nothing kept per sequence


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """k tokens that followed the most recent earlier occurrence of tokens' last n (n from max_n down to min_n), or
    [] where none occurs. Where fewer than k follow it before the end, the copy goes on over the tokens it proposed
    (as LZ77 copies an overlapping match): a tail that matched p tokens back repeats with period p."""
    if k < 1 or len(tokens) <= min_n:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    size = len(ids)
    # Where an earlier occurrence could end: before the last token, on a token equal to it.
    ends = np.flatnonzero(ids[:-1] == ids[-1])
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):  # the rest of the n-gram, one position back at a time
            if not len(found):
                break
            found = found[ids[found - back] == ids[size - 1 - back]]
        if len(found):
            start = int(found[-1]) + 1  # the latest match: the text nearest to where generation is now
            out = ids[start : start + k].tolist()
            period = size - start
            while len(out) < k:
                out.append(out[len(out) - period])
            return out
    return []
