"""Several continuations of one prompt (n, best_of) on shared KV blocks with copy-on-write (issue 24).

The rule under test: continuation i of a request with seed s gives the tokens of a single request with seed
child_seed(s, i), whatever shares the batch; blocks are shared until written, and the pool is whole at the end.
"""

import pytest
from shared_blocks import OTHER, PROMPT, run_checking_blocks

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.group import child_seed


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.9, "top_p": 0.95, "seed": seed, "max_tokens": 12, "ignore_eos": True,
                             **kw})


def singles(engine: LLMEngine, prompt: list[int], seed: int, count: int) -> list[list[int]]:
    """The documented equivalents: continuation i as a request of its own with seed child_seed(seed, i)."""
    outs = engine.generate([prompt] * count, [sampled(child_seed(seed, i)) for i in range(count)])
    return [o.token_ids for o in outs]


def continuations(engine: LLMEngine, seed: int, n: int) -> list[list[int]]:
    """An n-continuation request beside a plain one, as one batch -> its choices' tokens in index order."""
    group, plain = engine.generate([PROMPT, OTHER], [sampled(seed, n=n), sampled(3)])
    assert [c.index for c in group.choices] == list(range(n)) and plain.choices == [plain]
    return [c.token_ids for c in group.choices]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_seeded_continuations_equal_single_requests(llama, backend):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend=backend))
    want = singles(engine, PROMPT, 7, 4)
    assert len({tuple(w) for w in want}) == 4, "the derived seeds should give four different continuations"
    assert continuations(engine, 7, 4) == want
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.slow
def test_broken_copy_on_write_is_caught(llama):
    """With the copy before a write into a shared block skipped, the continuations overwrite each other's KV in
    the prompt's last block: the equivalence above must fail, or it proves nothing."""
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch",
                                    enable_prefix_caching=False))
    want = singles(engine, PROMPT, 7, 4)
    engine.block_manager.shared_write = lambda seq: False
    assert continuations(engine, 7, 4) != want


def test_the_prompt_is_prefilled_once_and_its_blocks_shared(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch",
                                    enable_prefix_caching=False))
    prefilled = []
    run = engine.runner.run

    def spy(batch, *rest):
        prefilled.append(sum(n for n in batch.num_new_tokens if n > 1))
        return run(batch, *rest)

    engine.runner.run = spy
    engine.add_request("g", prompt_token_ids=PROMPT, params=sampled(1, n=4))
    engine.step()
    engine.step()
    tables = [s.block_table for s in engine.scheduler.running]
    assert len(tables) == 4 and prefilled[0] == len(PROMPT)
    # The full prompt blocks are one set of blocks; each continuation has its own copy of the partly filled one.
    assert len({tuple(t[:2]) for t in tables}) == 1 and len({t[2] for t in tables}) == 4
    assert [engine.block_manager.ref_counts[b] for b in tables[0][:2]] == [4, 4]
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(prefilled) == len(PROMPT)


@pytest.mark.slow
def test_best_of_returns_the_n_most_likely(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch"))
    for i in range(5):
        engine.add_request(f"single{i}", prompt_token_ids=PROMPT, params=sampled(child_seed(11, i), logprobs=0))
    tokens: dict[str, list[int]] = {}
    summed: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
            summed[out.request_id] = summed.get(out.request_id, 0.0) + sum(e[0] for e in out.logprobs)
    scores = {tuple(tokens[r]): summed[r] for r in tokens}
    [out] = engine.generate([PROMPT], sampled(11, n=2, best_of=5))
    got = [(tuple(c.token_ids), c.cumulative_logprob) for c in out.choices]
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])[:2]
    assert [t for t, _ in got] == [t for t, _ in ranked]
    for (_, cum), (_, score) in zip(got, ranked):
        assert cum == pytest.approx(score, abs=1e-4)
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.slow
def test_streamed_continuations_report_as_they_come(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch"))
    engine.add_request("g", prompt_token_ids=PROMPT, params=sampled(2, n=3))
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.index] += out.new_token_ids
            if out.request_finished:
                last = out
    assert last is not None and [c.index for c in last.choices] == [0, 1, 2]
    assert [seen[c.index] for c in last.choices] == [c.token_ids for c in last.choices]
    assert "g" not in engine.scheduler.by_id


@pytest.mark.slow
def test_best_of_and_beams_say_nothing_until_the_end(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch"))
    engine.add_request("b", prompt_token_ids=PROMPT, params=sampled(2, n=1, best_of=3))
    engine.add_request("s", prompt_token_ids=OTHER,
                       params=SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=8))
    outs = []
    while engine.has_unfinished_requests():
        outs.append(engine.step())
    said = [o for step in outs for o in step]
    assert {o.request_id for o in said} == {"b", "s"}
    for rid in ("b", "s"):
        mine = [o for o in said if o.request_id == rid]
        assert mine[-1].request_finished and all(o.new_token_ids == o.token_ids for o in mine)


@pytest.mark.slow
def test_a_group_under_preemption_gives_the_same_continuations(llama):
    """A pool too small for everything at once: continuations are preempted (each on its own) and recomputed, and
    every continuation still equals its single-request equivalent; the block accounting holds after every step."""
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=14, block_size=8, attention_backend="torch",
                                    max_num_batched_tokens=64))
    preempted = []
    orig = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), orig(seq))
    for i, p in enumerate([PROMPT, OTHER, PROMPT[:20]]):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=sampled(20 + i, n=3))
    final = run_checking_blocks(engine)
    roomy = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch"))
    want = {i: singles(roomy, p, 20 + i, 3) for i, p in enumerate([PROMPT, OTHER, PROMPT[:20]])}
    assert preempted, "the pool should have been too small to run every group at once"
    for i in range(3):
        assert [c.token_ids for c in final[f"r{i}"].choices] == [w for w in want[i]]


@pytest.mark.slow
def test_resume_goes_on_from_every_continuation(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch"))
    [whole] = engine.generate([PROMPT], sampled(4, n=3, max_tokens=10))
    choices = whole.choices
    cut = {c.index: (c.token_ids[:k], engine.tokenizer.decode(c.token_ids[:k]), None)
           for c, k in zip(choices, (3, 0, 6))}
    engine.add_request("again", prompt_token_ids=PROMPT, params=sampled(4, n=3, max_tokens=10), resume=cut)
    new: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            new[out.index] += out.new_token_ids
    for c in choices:
        assert cut[c.index][0] + new[c.index] == c.token_ids


def test_abort_frees_every_continuation(llama):
    engine = LLMEngine(EngineConfig(model=llama, num_kv_blocks=64, attention_backend="torch"))
    engine.add_request("g", prompt_token_ids=PROMPT, params=sampled(1, n=4, max_tokens=50))
    engine.add_request("b", prompt_token_ids=OTHER,
                       params=SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.abort("g") and engine.abort("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.add_request("g", prompt_token_ids=PROMPT, params=sampled(1, n=2, max_tokens=2))  # the id is free again


@pytest.mark.parametrize("params, says", [
    (dict(n=0), "n must be"),
    (dict(n=3, best_of=2), "best_of must be"),
    (dict(n=2, use_beam_search=True, temperature=0.7), "beam search is greedy"),
    (dict(n=2, use_beam_search=True, temperature=0, stop=["x"]), "stop strings"),
    (dict(n=2, beam_width=4), "use_beam_search"),
    (dict(n=2, use_beam_search=True, temperature=0, early_stopping="sometimes"), "early_stopping"),
])
def test_bad_settings_say_why(params, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**params).validate()
