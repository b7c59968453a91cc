"""How many draft tokens each sequence gets in a step: by what its drafts are worth, against what they cost.

A draft token's worth is the tokens it is expected to add: the j-th draft of a sequence lands only if the j - 1
before it were accepted too, so with a per-token acceptance rate a it adds a ** j. Its cost is a bigger step: a
forward of T tokens costs about 1 + T / doubling_tokens one-token steps (below doubling_tokens tokens, reading the
weights dominates and more tokens come almost free; past it, compute does), plus a one-token step's second token
where the kernels change path there (second_token_cost), plus what the proposer spends (a draft model's forward
per draft depth). Drafts are taken best first while each raises the step's expected tokens per unit of cost, so a
small batch speculates, a sequence whose drafts keep failing gets fewer, and a batch large enough to be
compute-bound gets none: speculation turns itself off.

Each sequence's acceptance rate is counted over its recent verify steps (older ones fade), starting from the rate of
all sequences so far, so a new sequence is not judged on nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence

FADE = 0.95  # per verify step: what a sequence's older counts still weigh
# Per step without drafts: a sequence judged not worth drafting for drifts back toward the all-sequences rate, and
# gets another try where its text turns to something its proposer knows.
IDLE_FADE = 0.97
PRIOR_WEIGHT = 1.0  # the all-sequences rate counts as this many verified tokens of a new sequence
# The all-sequences rate before anything was verified: optimistic, so that a step's fixed extra cost (a quantized
# CPU step's second token, a draft model's forward) does not keep speculation from ever being tried.
START_RATE = 0.7
# Per step, the all-sequences counts drift back toward START_RATE: where speculation stopped for a low rate, new
# sequences try drafts again now and then (a workload changes), rather than never again.
DRIFT = 0.99


@dataclass
class Rate:
    """Faded counts of a sequence's verified draft tokens: accepted, and rejections (at most one a step)."""

    accepted: float = 0.0
    rejected: float = 0.0


class Policy:
    def __init__(self, max_k: int, doubling_tokens: int, draft_cost: float = 0.0, second_token_cost: float = 0.0
                 ) -> None:
        """draft_cost: what the proposer spends per draft token, in one-token target steps (a draft model's
        forward; 0 for a lookup). second_token_cost: what a step of one token costs more once it has two (kernels
        that change path there)."""
        self.max_k = max_k
        self.doubling = doubling_tokens
        self.draft_cost = draft_cost
        self.second_token_cost = second_token_cost
        self.rates: dict[Sequence, Rate] = {}
        self.total = Rate(START_RATE * PRIOR_WEIGHT, (1 - START_RATE) * PRIOR_WEIGHT)

    def rate(self, seq: Sequence) -> float:
        """seq's estimated chance that a draft token is accepted, given the ones before it were."""
        total = self.total
        prior = total.accepted / (total.accepted + total.rejected)
        own = self.rates.get(seq) or Rate()
        return (own.accepted + PRIOR_WEIGHT * prior) / (own.accepted + own.rejected + PRIOR_WEIGHT)

    def plan(self, seqs: list[Sequence], limits: list[int], num_tokens: int, num_samplers: int) -> list[int]:
        """Draft tokens for each of seqs (at most limits[i]) in a step of num_tokens tokens where num_samplers rows
        sample a token: drafts while each adds more expected tokens than it costs."""
        total = self.total
        total.accepted = total.accepted * DRIFT + START_RATE * PRIOR_WEIGHT * (1 - DRIFT)
        total.rejected = total.rejected * DRIFT + (1 - START_RATE) * PRIOR_WEIGHT * (1 - DRIFT)
        rates = [self.rate(seq) for seq in seqs]
        # In one-token steps: the step's cost, and what one more draft token adds to it: its share of the forward,
        # and a proposer's forward where it drafts one deeper than any sequence so far (one for the whole batch).
        gain, cost, tokens = float(num_samplers), 1 + num_tokens / self.doubling, num_tokens
        ks = [0] * len(seqs)
        depth = 0
        # Worth of the next draft per sequence; the best is taken while it beats the step's tokens per cost.
        worth = list(rates)
        while True:
            best = max(range(len(seqs)), key=worth.__getitem__, default=None)
            extra = 1 / self.doubling + (self.draft_cost if best is not None and ks[best] == depth else 0.0)
            if tokens == 1:
                extra += self.second_token_cost
            if best is None or worth[best] * cost <= gain * extra:
                self._idle(seqs, ks)
                return ks
            gain, cost, tokens = gain + worth[best], cost + extra, tokens + 1
            depth = max(depth, ks[best] + 1)
            ks[best] += 1
            worth[best] = worth[best] * rates[best] if ks[best] < min(self.max_k, limits[best]) else 0.0

    def _idle(self, seqs: list[Sequence], ks: list[int]) -> None:
        for seq, k in zip(seqs, ks):
            own = self.rates.get(seq)
            if k == 0 and own is not None:
                own.accepted *= IDLE_FADE
                own.rejected *= IDLE_FADE

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verify step of seq landed: accepted of its proposed draft tokens."""
        own = self.rates.setdefault(seq, Rate())
        rejected = 1.0 if accepted < proposed else 0.0
        own.accepted = own.accepted * FADE + accepted
        own.rejected = own.rejected * FADE + rejected
        self.total.accepted += accepted
        self.total.rejected += rejected

    def forget(self, seq: Sequence) -> None:
        self.rates.pop(seq, None)
