"""The speculation policy, without a model: drafts where they add more tokens than they cost, none where the
batch is compute-bound, fewer for a sequence whose drafts keep failing."""

import pytest
from test_speculative import HITS, pair, run

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative.policy import START_RATE, Policy


def _seqs(n: int) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=0)) for i in range(n)]


def _learn(policy: Policy, seq: Sequence, accepted: int, proposed: int = 4, steps: int = 10) -> None:
    for _ in range(steps):
        policy.record(seq, proposed, accepted)


def test_one_sequence_drafts_more_the_better_its_drafts_do():
    policy = Policy(max_k=8, doubling_tokens=16)
    good, bad, new = _seqs(3)
    _learn(policy, good, accepted=4)
    _learn(policy, bad, accepted=0, steps=40)
    ks = [policy.plan([seq], [100], num_tokens=1, num_samplers=1)[0] for seq in (good, new, bad)]
    assert ks[0] == 8  # every draft accepted lately: as many as allowed
    assert ks[0] > ks[1] > ks[2]
    assert ks[2] == 0  # a sequence none of whose drafts lands is not worth a token of compute


def test_limits_cap_the_drafts():
    policy = Policy(max_k=8, doubling_tokens=16)
    (seq,) = _seqs(1)
    _learn(policy, seq, accepted=4)
    assert policy.plan([seq], [3], num_tokens=1, num_samplers=1) == [3]
    assert Policy(max_k=2, doubling_tokens=16).plan([seq], [100], 1, 1) == [2]


def test_a_compute_bound_batch_gets_no_drafts():
    policy = Policy(max_k=8, doubling_tokens=16)
    seqs = _seqs(64)
    assert sum(policy.plan(seqs[:1], [100], num_tokens=1, num_samplers=1)) > 0
    assert policy.plan(seqs, [100] * 64, num_tokens=64, num_samplers=64) == [0] * 64
    # A step made long by a prefill chunk is no reason to stop: a draft costs it as little as any other step.
    assert policy.plan(seqs[:1], [100], num_tokens=512, num_samplers=1)[0] > 0


@pytest.mark.parametrize("rate", [0.3, 0.5, 0.7])
def test_drafts_stop_where_the_batch_crosses_over(rate):
    """The batch size past which no draft is taken: rate * (doubling + batch) <= batch, i.e. batch >=
    rate * doubling / (1 - rate)."""
    policy = Policy(max_k=8, doubling_tokens=16)
    seqs = _seqs(64)
    for seq in seqs:
        policy.rates[seq] = type(policy.total)(accepted=rate * 1000, rejected=(1 - rate) * 1000)
    rate = policy.rate(seqs[0])  # its own count, and a little of the shared one
    crossover = rate * 16 / (1 - rate)
    for size in (1, 2, 4, 8, 16, 32, 64):
        drafts = sum(policy.plan(seqs[:size], [100] * size, size, size))
        assert (drafts == 0) == (size >= crossover), size


def test_the_shared_rate_drifts_back_so_speculation_is_tried_again():
    policy = Policy(max_k=8, doubling_tokens=16)
    seqs = _seqs(200)
    for seq in seqs[:100]:
        _learn(policy, seq, accepted=0, steps=3)
        policy.forget(seq)
    fresh = seqs[100]
    assert policy.plan([fresh], [100], 1, 1) == [0]  # everyone's drafts failed: a new sequence gets none
    for _ in range(2000):
        policy.plan([], [], 1, 1)
    assert policy.rate(fresh) == pytest.approx(START_RATE, abs=0.05)
    assert policy.plan([fresh], [100], 1, 1)[0] > 0


def test_a_sequence_left_without_drafts_gets_another_try():
    policy = Policy(max_k=8, doubling_tokens=16)
    bad, good = _seqs(2)
    _learn(policy, good, accepted=4, steps=20)
    _learn(policy, bad, accepted=0, steps=40)
    assert policy.plan([bad], [100], 1, 1) == [0]
    tries = 1
    while policy.plan([bad], [100], 1, 1) == [0]:
        tries += 1
    assert 5 < tries < 100


def test_forget_drops_a_sequence():
    policy = Policy(max_k=8, doubling_tokens=16)
    (seq,) = _seqs(1)
    _learn(policy, seq, accepted=4)
    policy.forget(seq)
    assert seq not in policy.rates


def test_a_full_batch_does_not_speculate_and_a_lone_request_does(make_engine):
    off, on = pair(make_engine, block_size=8, max_num_seqs=64, num_kv_blocks=1024)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # 48 requests decoding together: past the crossover; they all end in the same step.
    prompts = [HITS[1]] * 48
    assert [o.token_ids for o in run(on, prompts, params)] == [o.token_ids for o in run(off, prompts, params)]
    assert on.speculation.proposed == 0
    run(on, prompts[:1], params)
    assert on.speculation.proposed > 0


def test_a_costly_second_token_asks_more_of_a_lone_sequences_drafts():
    """Where a step's second token costs half a step (quantized CPU kernels), a lone sequence drafts only when its
    drafts land often enough to pay for it; in a batch the cost is paid already."""
    policy = Policy(max_k=8, doubling_tokens=10, second_token_cost=0.5)
    seqs = _seqs(2)
    for seq, rate in zip(seqs, (0.25, 0.7)):
        policy.rates[seq] = type(policy.total)(accepted=rate * 1000, rejected=(1 - rate) * 1000)
    assert policy.plan(seqs[:1], [100], 1, 1) == [0]
    assert policy.plan(seqs[1:], [100], 1, 1)[0] >= 2
    assert Policy(max_k=8, doubling_tokens=10).plan(seqs[:1], [100], 1, 1)[0] > 0
