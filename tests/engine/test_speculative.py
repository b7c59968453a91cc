"""Speculative decoding: the n-gram proposer, and greedy output with speculation equal to greedy without."""

import pytest

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative.ngram import NgramProposer, lookup


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(temperature=0))


def test_lookup_proposes_what_followed_the_latest_match():
    # "1 2" occurs twice before the tail: the later occurrence (followed by 7 8) wins.
    tokens = [1, 2, 3, 4, 9, 1, 2, 7, 8, 5, 1, 2]
    assert lookup(tokens, 2, 3, 1) == [7, 8]
    assert lookup(tokens, 10, 3, 1) == [7, 8, 5, 1, 2]  # runs up to the end of the tokens


def test_lookup_prefers_the_longer_match():
    # The tail "5 1 2" occurs once, early; "1 2" alone occurs later. The longer match is the better guess.
    tokens = [5, 1, 2, 30, 31, 1, 2, 40, 41, 5, 1, 2]
    assert lookup(tokens, 2, 3, 1) == [30, 31]
    assert lookup(tokens, 2, 2, 1) == [40, 41]


def test_lookup_misses():
    assert lookup([1, 2, 3, 4, 5], 3, 3, 1) == []
    assert lookup([1, 2, 3, 1, 9, 2], 3, 3, 2) == []  # "9 2" never occurred before; 1-grams are not tried
    assert lookup([1, 2, 3, 1, 9, 2], 3, 3, 1) == [3, 1, 9]
    assert lookup([7], 3, 3, 1) == []
    assert lookup([1, 2, 1, 2], 0, 3, 1) == []


def test_lookup_overlapping_repeats():
    # The tail matches itself a period back: the guess is what follows there, up to the end of the tokens.
    assert lookup([4, 4, 4, 4], 3, 2, 1) == [4]
    assert lookup([0, 1, 0, 1, 0, 1], 4, 3, 1) == [0, 1]


def test_ngram_proposer_reads_prompt_and_output():
    seq = _seq([10, 11, 12, 13, 14, 10, 11])
    proposer = NgramProposer(max_n=3, min_n=2)
    assert proposer.propose(seq, 2) == [12, 13]
    seq.token_ids += [12, 99]  # output tokens count as well
    assert proposer.propose(seq, 3) == []
    seq.token_ids += [10, 11, 12]
    assert proposer.propose(seq, 2) == [99, 10]


@pytest.mark.parametrize("sizes", [(0, 1), (2, 1), (4, 3)])
def test_ngram_proposer_rejects_bad_sizes(sizes):
    min_n, max_n = sizes
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=max_n, min_n=min_n)
