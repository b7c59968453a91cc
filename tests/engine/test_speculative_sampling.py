"""Speculative decoding for sampled requests: each row of a verify step draws the token that (seed, output position)
fixes, so a seeded request gives the same tokens with speculation as without, and the output's distribution is the
target's (a chi-square test over many seeds, with drafts forced on)."""

import math
from collections import Counter

import pytest
from test_speculative import HITS, MISSES, pair, run, same

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

SAMPLED = [
    SamplingParams(max_tokens=30, temperature=0.02, seed=1),
    SamplingParams(max_tokens=30, temperature=0.05, top_p=0.9, top_k=20, seed=2),
    SamplingParams(max_tokens=30, temperature=0.02, min_p=0.2, seed=3, logprobs=3),
    SamplingParams(max_tokens=30, temperature=0.03, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2, seed=4),
    SamplingParams(max_tokens=30, temperature=0.02, min_tokens=12, seed=5),
    SamplingParams(max_tokens=30, temperature=0, logprobs=0),
]


class Fixed:
    """A proposer that always drafts the same tokens: drafts on every step, whatever the text."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.tokens[:k] for _, k in wants]

    def finished(self, seq: Sequence) -> None:
        pass


@pytest.mark.slow
def test_seeded_sampling_with_speculation_equals_without(make_engine):
    off, on = pair(make_engine, block_size=8)
    prompts = [HITS[0], HITS[1], HITS[2], HITS[0], HITS[1], MISSES[2]]
    same(off, on, prompts, SAMPLED)
    assert on.speculation.accepted > 0
    assert on.streamed["r2"] and on.streamed["r5"]  # logprobs came, per landed token, equal to off's


def test_drafts_on_every_step_change_no_seeded_token(make_engine):
    """Drafts the target mostly rejects: every step verifies some, and the draws stay the undisturbed ones."""
    off, on = pair(make_engine, block_size=4)
    greedy = run(off, [MISSES[0]], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    _force(on, Fixed(greedy[1:5]))
    params = [SamplingParams(max_tokens=12, temperature=0.02, seed=s) for s in range(6)]
    same(off, on, [MISSES[0]] * len(params), params)
    assert on.speculation.proposed > 0


def _tokens_by_position(engine, prompt: str, seeds: range, max_tokens: int) -> list[Counter]:
    """The tokens at each output position over one request per seed."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.12, seed=s, ignore_eos=True) for s in seeds]
    outs = run(engine, [prompt] * len(params), params)
    return [Counter(o.token_ids[p] for o in outs) for p in range(max_tokens)]


def _chi_square_same(a: Counter, b: Counter) -> tuple[float, float]:
    """Two samples of equal size from one distribution? -> (the chi-square statistic, its 0.999 quantile). Tokens
    seen fewer than 10 times in both together are pooled into one category."""
    pooled_a = pooled_b = 0
    stat, cats = 0.0, 0
    for t in set(a) | set(b):
        x, y = a[t], b[t]
        if x + y < 10:
            pooled_a, pooled_b = pooled_a + x, pooled_b + y
            continue
        stat, cats = stat + (x - y) ** 2 / (x + y), cats + 1
    if pooled_a + pooled_b:
        stat, cats = stat + (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b), cats + 1
    df = max(1, cats - 1)
    z = 3.09  # the standard normal's 0.999 quantile; Wilson-Hilferty turns it into the chi-square's
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class Always:
    """A policy that takes every draft offered (up to 4): the verify path on every step, whatever the batch."""

    def plan(self, seqs: list[Sequence], limits: list[int], num_tokens: int, num_samplers: int) -> list[int]:
        return [min(4, limit) for limit in limits]

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass


def _force(engine, proposer) -> None:
    engine.loop.speculator.proposer = proposer
    engine.loop.speculator.policy = Always()


class Likely:
    """A proposer that drafts, after each token, the token that most often followed it at that output position in
    another sample of the target: drafts the target often accepts, and often rejects."""

    def __init__(self, outputs: list[list[int]]) -> None:
        seen: dict[tuple[int, int], Counter] = {}
        for ids in outputs:
            for pos in range(1, len(ids)):
                seen.setdefault((pos, ids[pos - 1]), Counter())[ids[pos]] += 1
        self.next = {key: counts.most_common(1)[0][0] for key, counts in seen.items()}

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        drafts = []
        for seq, k in wants:
            pos, draft = seq.num_output_tokens, []
            token = seq.token_ids[-1]
            while len(draft) < k and (pos, token) in self.next:
                token = self.next[pos, token]
                draft.append(token)
                pos += 1
            drafts.append(draft)
        return drafts

    def finished(self, seq: Sequence) -> None:
        pass


@pytest.mark.slow
def test_output_distribution_is_the_targets(make_engine):
    """Disjoint seeds with and without speculation, drafts on most steps: the tokens at every position, drafted
    ones included, follow one distribution (chi-square, 0.1% level)."""
    off, on = pair(make_engine, block_size=8, max_num_seqs=256)
    prompt = MISSES[0]  # on the tiny random model: a few likely tokens at each position at this temperature
    n, size = 600, 5
    params = [SamplingParams(max_tokens=size, temperature=0.12, seed=s, ignore_eos=True) for s in range(2 * n, 3 * n)]
    _force(on, Likely([o.token_ids for o in run(off, [prompt] * n, params)]))
    with_drafts = _tokens_by_position(on, prompt, range(n), size)
    without = _tokens_by_position(off, prompt, range(n, 2 * n), size)
    assert on.speculation.accepted > n // 2  # the drafts were verified, and many were kept
    for pos, (a, b) in enumerate(zip(with_drafts, without)):
        assert len(a) > 3, "the test needs a spread distribution"
        stat, limit = _chi_square_same(a, b)
        assert stat < limit, f"position {pos}: chi-square {stat:.1f} >= {limit:.1f}; {a.most_common(5)} vs " \
                             f"{b.most_common(5)}"
