"""Speculative decoding: the n-gram proposer, and greedy output with speculation equal to greedy without."""

import pytest
from preemptions import record_preemptions

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative.ngram import NgramProposer, lookup
from engine.speculative.verify import accepted


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(temperature=0))


def test_lookup_proposes_what_followed_the_latest_match():
    # "1 2" occurs twice before the tail: the later occurrence (followed by 7 8) wins.
    tokens = [1, 2, 3, 4, 9, 1, 2, 7, 8, 5, 1, 2]
    assert lookup(tokens, 2, 3, 1) == [7, 8]
    # Past the end of the tokens the copy goes on over its own proposals: the text since the match repeats.
    assert lookup(tokens, 7, 3, 1) == [7, 8, 5, 1, 2, 7, 8]


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
    # The tail matches itself a period back: the guess is more of the period.
    assert lookup([4, 4, 4, 4], 3, 2, 1) == [4, 4, 4]
    assert lookup([0, 1, 0, 1, 0, 1], 5, 3, 1) == [0, 1, 0, 1, 0]
    assert lookup([3, 0, 1, 2, 0, 1], 4, 2, 1) == [2, 0, 1, 2]


def test_ngram_proposer_reads_prompt_and_output():
    seq = _seq([10, 11, 12, 13, 14, 10, 11])
    proposer = NgramProposer(max_n=3, min_n=2)
    assert proposer.propose([(seq, 2)]) == [[12, 13]]
    seq.token_ids += [12, 99]  # output tokens count as well
    assert proposer.propose([(seq, 3)]) == [[]]
    seq.token_ids += [10, 11, 12]
    assert proposer.propose([(seq, 4)]) == [[99, 10, 11, 12]]


@pytest.mark.parametrize("sizes", [(0, 1), (2, 1), (4, 3)])
def test_ngram_proposer_rejects_bad_sizes(sizes):
    min_n, max_n = sizes
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=max_n, min_n=min_n)


# ---- the verify step: greedy with speculation equals greedy without, token for token ----

HITS = [  # repetitive text: lookup finds the tail in the prompt
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
    " ".join(str(i % 7) for i in range(60)),
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n    return",
]
MISSES = ["Hello there, how are you?", "a", "Write a poem about the sea, the sky and the birds between them."]
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def test_accepted_keeps_the_agreeing_prefix_and_the_next_target_token():
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, plus the bonus token
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # stops at the first disagreement
    assert accepted([5, 6, 7], [1, 6, 7, 8]) == [1]  # none accepted: the target's own token
    assert accepted([], [4]) == [4]


def check_blocks(engine) -> None:
    """Block accounting: every running sequence holds exactly the blocks its computed tokens fill, reference counts
    are the holders, and the free list is every block nobody holds."""
    bm = engine.block_manager
    held = [0] * bm.num_blocks
    for seq in engine.scheduler.running:
        if seq.status.name != "RUNNING":
            continue
        assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), seq
        for block in seq.block_table:
            held[block] += 1
    assert held == bm.ref_counts
    assert set(bm.free) == {b for b in range(bm.num_blocks) if held[b] == 0}


def run(engine, prompts, params, late: int = 0) -> list:
    """engine.generate, with the block accounting checked after every step, and each output's logprobs kept in
    `streamed` (request id -> entries). late: the last `late` requests join after three steps, into a running batch."""
    ids = [f"r{i}" for i in range(len(prompts))]
    plist = params if isinstance(params, list) else [params] * len(prompts)
    todo = list(zip(ids, prompts, plist))
    now, todo = todo[: len(todo) - late], todo[len(todo) - late:]
    for rid, prompt, p in now:
        engine.add_request(rid, prompt, params=p)
    final, steps = {}, 0
    engine.streamed = {rid: [] for rid in ids}
    while engine.has_unfinished_requests() or todo:
        steps += 1
        if steps == 4:
            for rid, prompt, p in todo:
                engine.add_request(rid, prompt, params=p)
            todo = []
        for out in engine.step():
            engine.streamed[out.request_id] += out.logprobs or []
            if out.request_finished:
                final[out.request_id] = out
        check_blocks(engine)
    assert engine.num_free_blocks == engine.num_total_blocks
    return [final[r] for r in ids]


def same_logprobs(got: dict, want: dict) -> None:
    """Each request's streamed logprobs agree within float tolerance: a verify step computes a row among more rows,
    so its sums run in another order."""
    assert got.keys() == want.keys()
    for rid in want:
        assert len(got[rid]) == len(want[rid]), rid
        for (lp, top), (want_lp, want_top) in zip(got[rid], want[rid]):
            assert lp == pytest.approx(want_lp, abs=1e-4), rid
            assert top.keys() == want_top.keys(), rid
            assert [top[t] for t in want_top] == pytest.approx(list(want_top.values()), abs=1e-4), rid


def pair(make_engine, arch="llama", **config):
    # A KV pool the size of these prompts: sized from memory, two engines a test would take up to 4 GiB.
    config.setdefault("num_kv_blocks", 256)
    return make_engine(arch, **config), make_engine(arch, speculative="ngram", **config)


def same(off, on, prompts, params, late: int = 0) -> list:
    want, got = run(off, prompts, params, late), run(on, prompts, params, late)
    same_logprobs(on.streamed, off.streamed)
    for prompt, w, g in zip(prompts, want, got):
        assert [c.token_ids for c in g.choices] == [c.token_ids for c in w.choices], f"prompt {prompt!r}"
        assert [c.finish_reason for c in g.choices] == [c.finish_reason for c in w.choices]
        assert g.text == w.text
    return got


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_speculation_equals_greedy_without(make_engine, arch, backend):
    off, on = pair(make_engine, arch, attention_backend=backend, block_size=8)
    same(off, on, HITS + MISSES, GREEDY)
    counts = on.speculation
    assert counts.steps > 0 and 0 < counts.accepted <= counts.proposed
    assert off.speculation.proposed == 0


def test_one_sequence_at_a_time(make_engine):
    off, on = pair(make_engine, block_size=4)
    for prompt in HITS[:2] + MISSES[:1]:
        same(off, on, [prompt], GREEDY)
    assert on.speculation.accepted > 0


@pytest.mark.slow
def test_lengths_and_stop_tokens_inside_a_verified_run(make_engine):
    off, on = pair(make_engine, block_size=4)
    for n in range(1, 8):
        same(off, on, HITS[:1], SamplingParams(max_tokens=n, temperature=0))
    # Stop on tokens greedy gives a few tokens in: a step may land tokens past it, which must not show.
    plain = run(off, HITS[:1], GREEDY)[0].token_ids
    for at in (2, 5, 9):
        same(off, on, HITS[:1], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[plain[at]]))
    same(off, on, HITS[:1], SamplingParams(max_tokens=40, temperature=0, stop=[off.tokenizer.decode(plain[6:8])]))


@pytest.mark.slow
def test_mixed_batch_only_greedy_rows_speculate(make_engine):
    off, on = pair(make_engine, block_size=8)
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=30, temperature=0, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.8, seed=7),
              SamplingParams(max_tokens=20, temperature=0.9, seed=3, n=2), GREEDY]
    prompts = [HITS[0], HITS[1], HITS[2], HITS[1], HITS[0], MISSES[0]]
    same(off, on, prompts, params)
    assert on.streamed["r2"] and on.speculation.accepted > 0
    # The same requests joining a running batch: a group's prompt that forks in a step with drafts (they are
    # dropped for that step), sampled rows beside verified ones.
    steps = on.speculation.steps
    same(off, on, prompts, params, late=3)
    assert on.speculation.steps > steps


@pytest.mark.slow
def test_preemption_changes_nothing(make_engine):
    # 20 blocks of 8 tokens hold the longest request, not all six at once: preemption must happen, and change nothing.
    off, on = pair(make_engine, num_kv_blocks=20, block_size=8, max_num_batched_tokens=64)
    preempted = record_preemptions(on)
    same(off, on, HITS + MISSES, GREEDY)
    assert preempted and on.speculation.accepted > 0


@pytest.mark.slow
def test_prefix_cache_hits_change_nothing(make_engine):
    off, on = pair(make_engine, block_size=4)
    system = "You are a helpful assistant who answers in one sentence. " * 3
    prompts = [system + q for q in ("the cat sat on the mat, the cat sat on the", "What is red?", "Count to three.")]
    same(off, on, prompts[:1], GREEDY)
    got = same(off, on, prompts, GREEDY)
    assert all(o.num_cached_tokens > 0 for o in got)
    # What the drafts wrote and the target rejected never became a cached prefix: a third pass still agrees.
    same(off, on, prompts, GREEDY)
    assert on.speculation.accepted > 0


def test_config_checks():
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="overlap_steps"):
        EngineConfig(speculative="ngram", overlap_steps=True)
    assert EngineConfig(speculative="ngram").overlap_steps is False


@pytest.mark.slow
def test_smollm2_summary_is_the_same(smollm2, make_engine):
    """The real model on a grounded job (it copies from its prompt): lookup hits, and nothing changes."""
    on = make_engine("smollm2-135m-instruct", max_num_seqs=16, num_kv_blocks=512, quantization="none",
                     speculative="ngram")
    doc = ("The Harbor Bridge opened in 1932 and carries 48,000 vehicles a day. Its renovation costs 62 million "
           "euros: the national fund pays 40 million, the region 12 million and the city 10 million. Nordbau "
           "Infrastructure is the contractor. Two lanes of four are open until May; the ferry runs until midnight.")
    prompts = [smollm2.apply_chat_template([{"role": "user", "content": doc + "\n\nSummarize the text above, "
                                             "keeping every number."}]),
               smollm2.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])]
    params = SamplingParams(max_tokens=64, temperature=0)
    want = smollm2.generate(prompts, params)
    got = on.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert on.speculation.accepted > 0


def test_a_request_may_refuse_to_speculate(make_engine):
    off, on = pair(make_engine, block_size=8)
    plain = SamplingParams(max_tokens=30, temperature=0, speculative=False)
    same(off, on, HITS[:2], plain)
    assert on.speculation.proposed == 0
    same(off, on, HITS[:1], GREEDY)
    assert on.speculation.proposed > 0
