"""Sampling: seeds, filters, stops, lengths, penalties, logprobs."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.engine(max_num_batched_tokens=128)  # the `engine` fixture (conftest.py)


PROMPTS = ["The sea is", "Tell me about cats", "1, 2, 3,", "Hello", "Why is the sky blue?", "Paris"]


@pytest.mark.slow
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine):
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    alone = engine.generate(["The sea is"], p)[0].token_ids
    others = [SamplingParams(max_tokens=5 + i, temperature=0.8, seed=i) for i in range(len(PROMPTS))]
    batch = engine.generate(PROMPTS + ["The sea is"], others + [p])[-1].token_ids
    assert alone == batch
    assert engine.generate(["The sea is"], p)[0].token_ids == alone


@pytest.mark.slow
def test_different_seeds_differ_and_unseeded_runs_vary(engine):
    a = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=1.0, seed=1))[0].token_ids
    b = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=1.0, seed=2))[0].token_ids
    assert a != b
    runs = {tuple(o.token_ids) for o in engine.generate(["Hello"] * 4, SamplingParams(max_tokens=16, temperature=1.0))}
    assert len(runs) > 1


@pytest.mark.slow
def test_seeded_sampling_survives_preemption(tiny_model):
    small = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=8, block_size=8))
    big = LLMEngine(EngineConfig(model=tiny_model("llama")))
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=s) for s in range(len(PROMPTS))]
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == [
        o.token_ids for o in big.generate(PROMPTS, params)
    ]


@pytest.mark.slow
def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    topk = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk]


def test_tiny_top_p_and_high_min_p_are_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    top_p = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=5))
    min_p = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, seed=5))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top_p] == [o.token_ids for o in min_p]


def test_max_tokens_and_length_reason(engine):
    o = engine.generate(["Hello"], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(o.token_ids) == 7 and o.finish_reason == "length"


def test_stop_token_ids_end_the_output(engine):
    free = engine.generate(["The sea is"], SamplingParams(max_tokens=20, temperature=0))[0].token_ids
    stop_at = free[5]
    o = engine.generate(["The sea is"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_at]))[0]
    assert o.finish_reason == "stop"
    assert o.token_ids == free[: free.index(stop_at) + 1]


def test_min_tokens_holds_back_eos_and_stop_tokens(engine):
    free = engine.generate(["The sea is"], SamplingParams(max_tokens=20, temperature=0))[0].token_ids
    first = free[0]
    o = engine.generate(
        ["The sea is"], SamplingParams(max_tokens=10, min_tokens=4, temperature=0, stop_token_ids=[first])
    )[0]
    assert first not in o.token_ids[:4] and len(o.token_ids) >= 4


def test_stop_string_across_tokens_is_cut_from_the_text(engine):
    free = engine.generate(["Tell me about cats"], SamplingParams(max_tokens=24, temperature=0))[0]
    text = free.text
    assert len(text) > 12
    stop = text[5:11]  # six characters that very likely span a token boundary
    o = engine.generate(["Tell me about cats"], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert o.finish_reason == "stop"
    assert o.text == text[: text.index(stop)]
    assert stop not in o.text


@pytest.mark.slow
def test_ignore_eos(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model("llama")))
    engine.eos_token_ids = set(range(engine.vocab_size))  # every token is "EOS"
    assert len(engine.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0))[0].token_ids) == 1
    o = engine.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(o.token_ids) == 5


@pytest.mark.slow
def test_penalties_change_the_output(engine):
    base = engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
    rep = engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=24, temperature=0, repetition_penalty=2.0))[0]
    freq = engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0))[0]
    assert rep.token_ids != base or freq.token_ids != base
    # A strong presence penalty forbids repeats of generated tokens in a random model's 49k vocabulary.
    pres = engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=24, temperature=0, presence_penalty=2.0))[0]
    assert len(set(pres.token_ids)) >= len(set(base))


def test_logprobs(engine):
    outs = []
    engine.add_request("lp", prompt="Hello", params=SamplingParams(max_tokens=3, temperature=0, logprobs=3))
    while engine.has_unfinished_requests():
        outs += engine.step()
    for o in outs:
        (lp, top), = o.logprobs
        assert len(top) == 3 and lp <= 0
        assert o.new_token_ids[0] in top and top[o.new_token_ids[0]] == pytest.approx(lp)
        assert lp == pytest.approx(max(top.values()))  # greedy took the most likely token
