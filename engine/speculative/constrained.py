"""Drafts for sequences under a constraint: the tokens the grammar forces first (jump-forward), then the wrapped
proposer's guess, cut where the grammar refuses it.

Structured output spends many of its tokens on text the grammar already fixes: a schema's keys, quotes and
separators, the rest of a choice once its first token is out. llguidance computes those tokens (the matcher's
fast-forward tokens); proposed as drafts, the verify step lands them in one forward, and since the constrained mask
at such a row allows that token alone, the target can only agree. A draft token the grammar would refuse could never
be accepted (its row's mask excludes it), so the draft ends before it and the step computes no row in vain.
"""

from __future__ import annotations

from engine.sequence import Sequence
from engine.speculative.proposer import Proposer


class ConstrainedProposer:
    def __init__(self, inner: Proposer) -> None:
        """inner: the configured proposer; it drafts for sequences without a matcher as if unwrapped, and
        continues a constrained sequence's forced tokens."""
        self.inner = inner

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        forced = [seq.matcher.compute_ff_tokens()[:k] if seq.matcher is not None else [] for seq, k in wants]
        asks = [(i, k - len(ff)) for i, ((seq, k), ff) in enumerate(zip(wants, forced)) if len(ff) < k]
        guesses = self._ask([(wants[i][0], k) for i, k in asks], [forced[i] for i, _ in asks])
        drafts = forced
        for (i, _), guess in zip(asks, guesses):
            drafts[i] = forced[i] + guess
        for i, (seq, _) in enumerate(wants):
            if seq.matcher is not None and drafts[i]:
                drafts[i] = drafts[i][: seq.matcher.validate_tokens(drafts[i])]  # checks, never moves the matcher
        return drafts

    def _ask(self, wants: list[tuple[Sequence, int]], forced: list[list[int]]) -> list[list[int]]:
        """The inner proposer's drafts, each guessed after the sequence's forced tokens: they are in its tokens for
        the call (as the verify step's drafts are during its forward), out again after."""
        if not wants:
            return []
        for (seq, _), ff in zip(wants, forced):
            seq.token_ids.extend(ff)
        try:
            return self.inner.propose(wants)
        finally:
            for (seq, _), ff in zip(wants, forced):
                if ff:
                    del seq.token_ids[-len(ff):]

    def finished(self, seq: Sequence) -> None:
        self.inner.finished(seq)
