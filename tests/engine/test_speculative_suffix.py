"""The suffix proposer: prompt lookup, else the index of recent outputs; and greedy output with it equal to greedy
without on a tiny model."""

import random

import pytest
from test_speculative import GREEDY, HITS, MISSES, check_blocks, run, same

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative.suffix import SuffixProposer


def _done(prompt: list[int], output: list[int]) -> Sequence:
    """A sequence that leaves the engine with this output."""
    seq = Sequence("r", prompt, SamplingParams(temperature=0))
    seq.token_ids += output
    return seq


def _learned(*outputs: list[int], **kwargs) -> SuffixProposer:
    proposer = SuffixProposer(lead=0, **kwargs)
    for out in outputs:
        proposer.finished(_done([1000], out))
    return proposer


def test_longest_match_wins():
    # "2 3" alone was followed by 9 twice (more often), but "1 2 3" once, by 7 8: the longer match is the guess.
    proposer = _learned([1, 2, 3, 7, 8], [5, 2, 3, 9, 9], [6, 2, 3, 9, 9], max_n=4, min_share=0.0)
    assert proposer.search([40, 1, 2, 3], 2) == [7, 8]
    assert proposer.search([40, 4, 2, 3], 2) == [9, 9]  # "4 2 3" never occurred: the 2-token tail decides
    assert proposer.search([40, 4, 4, 3], 2) == []  # "4 3" never occurred, and 1-token tails are not tried


def test_frequency_decides_between_continuations():
    proposer = _learned([1, 2, 5, 6], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 7], [1, 2, 5, 6], [1, 2, 5, 6],
                        min_share=0.0)
    # After "1 2": 5 four times, 3 twice; after "1 2 5": 6 three times, 7 once.
    assert proposer.search([1, 2], 3) == [5, 6]
    # A tie goes to the latest output.
    tie = _learned([1, 2, 3], [1, 2, 4], min_share=0.0)
    assert tie.search([9, 1, 2], 1) == [4]


def test_threshold_cuts_a_weak_guess():
    outputs = [[1, 2, 5, 6, 7], [1, 2, 5, 6, 8], [1, 2, 5, 9, 9], [1, 2, 3, 3, 3]]
    # Shares of the 4 occurrences of "1 2": 5 (3/4), 5 6 (2/4), 5 6 7 (1/4; the latest of the tie 7 / 8 is 8).
    assert _learned(*outputs, min_share=0.0).search([1, 2], 4) == [5, 6, 8]
    assert _learned(*outputs, min_share=0.5).search([1, 2], 4) == [5, 6]
    assert _learned(*outputs, min_share=0.6).search([1, 2], 4) == [5]
    assert _learned(*outputs, min_share=0.8).search([1, 2], 4) == []


def test_draft_stops_at_the_end_of_an_output():
    proposer = _learned([1, 2, 3], [4, 5, 6])
    assert proposer.search([1, 2], 5) == [3]  # never runs on into the next output
    assert proposer.search([2, 3], 5) == []


def _propose(proposer: SuffixProposer, tokens: list[int], k: int) -> list[int]:
    return proposer.propose([(Sequence("r", tokens, SamplingParams(temperature=0)), k)])[0]


def test_the_longer_match_of_prompt_and_index_wins():
    proposer = _learned([1, 2, 3, 4], [5, 1, 2, 3, 4])
    assert _propose(proposer, [1, 2, 8, 8, 1, 2], 2) == [8, 8]  # "1 2" in both: its own text is the nearer guess
    assert _propose(proposer, [7, 7, 1, 2], 2) == [3, 4]  # not in its own text: the index's
    assert _propose(proposer, [9, 1, 2, 6, 6, 5, 1, 2], 2) == [3, 4]  # "5 1 2" in the index beats its own "1 2"
    assert _propose(proposer, [5, 1, 2, 6, 6, 5, 1, 2], 2) == [6, 6]  # ... but not its own "5 1 2"
    # Where the index's longer match gives too weak a guess, the shorter own match still does.
    weak = _learned([5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 2, 6], min_share=0.5)
    assert weak.search([9, 5, 1, 2], 2) == []
    assert _propose(weak, [1, 2, 8, 9, 5, 1, 2], 2) == [8, 9]
    assert _propose(weak, [7, 5, 1, 2], 2) == []


def test_lead_matches_the_start_of_an_output():
    # The end of a prompt template, then the output: a new request of the template gets the output's start.
    proposer = SuffixProposer(lead=3)
    proposer.finished(_done([50, 51, 90, 91, 92], [10, 11, 12, 13]))
    assert proposer.search([60, 61, 90, 91, 92], 3) == [10, 11, 12]
    proposer.finished(_done([1, 2], []))  # no output: nothing learned
    assert len(proposer.lengths) == 1


def test_eviction_keeps_the_bound_and_forgets_evicted_outputs():
    proposer = SuffixProposer(max_tokens=64, lead=0)
    for i in range(40):
        proposer.finished(_done([1000], [100 + i, 200 + i, 300 + i, 400 + i, 500 + i]))
        assert proposer.num_tokens <= 64
        assert proposer.num_tokens == 1 + sum(proposer.lengths)
        assert len(proposer.keys) == len(proposer.ends) < proposer.num_tokens  # the pairs: fewer than the tokens
    # 10 outputs of 5 tokens and a separator fit in 64: the latest ten are known, the earlier ones forgotten.
    assert len(proposer.lengths) == 10
    assert proposer.search([139, 239], 3) == [339, 439, 539]
    assert proposer.search([130, 230], 3) == [330, 430, 530]
    assert proposer.search([129, 229], 3) == []
    assert proposer.search([100, 200], 3) == []
    # Counts are exact after eviction: a continuation seen in evicted outputs only no longer weighs.
    proposer = SuffixProposer(max_tokens=25, lead=0, min_share=0.0)
    for out in ([1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 4], [8, 8, 8], [9, 9, 9]):
        proposer.finished(_done([1000], out))
    assert proposer.search([1, 2], 1) == [3]
    for out in ([7, 7, 7], [6, 6, 6]):  # evicts two of the three "1 2 3"
        proposer.finished(_done([1000], out))
    assert proposer.search([1, 2], 1) == [4]  # 3 once and 4 once: the latest wins the tie


def test_an_output_longer_than_the_bound_keeps_its_tail():
    proposer = SuffixProposer(max_tokens=10, lead=0)
    proposer.finished(_done([1000], list(range(1, 30))))
    assert proposer.num_tokens == 10 and proposer.search([23, 24], 2) == [25, 26]
    assert proposer.search([3, 4], 2) == []


def _reference(outputs: list[list[int]], tokens: list[int], k: int, max_n: int, min_n: int, share: float) -> list[int]:
    """search() spelled out over the outputs themselves: the longest tail that occurs, then token by token the most
    frequent next token (the latest of a tie) while the occurrences agreeing with the draft keep their share."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        tail = tokens[-n:]
        found = [(out, i + n) for out in outputs for i in range(len(out) - n + 1) if out[i : i + n] == tail]
        if found:
            break
    else:
        return []
    draft, left = [], found
    for j in range(k):
        nexts = [out[at + j] if at + j < len(out) else None for out, at in left]
        top = max(nexts.count(t) for t in nexts)
        token = [t for t in nexts if nexts.count(t) == top][-1]
        if top < share * len(found) or token is None:
            break
        draft.append(token)
        left = [o for o, t in zip(left, nexts) if t == token]
    return draft


@pytest.mark.parametrize("seed", range(6))
def test_search_agrees_with_a_plain_reference(seed):
    rng = random.Random(seed)
    max_n, min_n = rng.randint(2, 6), rng.randint(1, 2)
    share, cap = rng.choice([0.0, 0.3, 0.6]), rng.randint(20, 200)
    proposer = SuffixProposer(max_tokens=cap, max_n=max_n, min_n=min_n, min_share=share, lead=0)
    kept: list[list[int]] = []
    for _ in range(60):
        out = [rng.randrange(5) for _ in range(rng.randint(0, 30))]
        proposer.add(out)
        kept.append(out[max(0, len(out) - (cap - 2)):])
        while 1 + sum(len(o) + 1 for o in kept) > cap:  # the bound, oldest outputs first
            kept.pop(0)
        assert proposer.num_tokens == 1 + sum(len(o) + 1 for o in kept) <= cap
        for _ in range(5):
            tokens = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
            k = rng.randint(1, 6)
            assert proposer.search(tokens, k) == _reference(kept, tokens, k, max_n, min_n, share), (tokens, k)


@pytest.mark.parametrize("kwargs", [{"min_n": 0}, {"min_n": 3, "max_n": 2}, {"min_share": 1.5}, {"max_tokens": 2}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        SuffixProposer(**kwargs)


# ---- on a tiny model: greedy with "suffix" equals greedy without ----

def _pair(make_engine, **config):
    config.setdefault("num_kv_blocks", 256)
    return make_engine("llama", **config), make_engine("llama", speculative="suffix", **config)


@pytest.mark.slow
def test_greedy_with_suffix_equals_greedy_without(make_engine):
    off, on = _pair(make_engine, block_size=8)
    same(off, on, HITS + MISSES, GREEDY)
    same(off, on, HITS + MISSES, GREEDY, late=3)  # again: now the index knows the first pass's outputs
    assert 0 < on.speculation.accepted <= on.speculation.proposed


def test_a_repeated_task_is_mostly_accepted(make_engine):
    off, on = _pair(make_engine, block_size=4)
    prompts = MISSES[2:]  # no repeats inside: prompt lookup alone guesses little
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = same(off, on, prompts, params)[0]
    before = on.speculation.accepted
    again = same(off, on, prompts, params)[0]  # the same task again: its earlier output is in the index
    assert again.token_ids == first.token_ids
    accepted = on.speculation.accepted - before
    # The first token comes from the prefill, the rest are decode steps: most of them land as accepted drafts.
    assert accepted >= 0.6 * (len(again.token_ids) - 1), (accepted, on.speculation)
    check_blocks(on)
    assert on.num_free_blocks == off.num_free_blocks == on.num_total_blocks


def test_block_accounting_equals_a_run_without(make_engine):
    off, on = _pair(make_engine, block_size=4, max_num_batched_tokens=64)
    prompts = [HITS[1], MISSES[0], HITS[1], MISSES[0]]
    for _ in range(2):
        run(off, prompts, GREEDY)
        run(on, prompts, GREEDY)  # checks every step: held blocks are what computed tokens fill
        assert sorted(on.block_manager.free) == sorted(off.block_manager.free)
        assert on.block_manager.ref_counts == off.block_manager.ref_counts
        # The same prefixes cached: nothing a rejected draft wrote is offered as one.
        assert set(on.block_manager.cached) == set(off.block_manager.cached)
    assert on.speculation.accepted > 0
