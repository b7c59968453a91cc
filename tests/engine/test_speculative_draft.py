"""Speculative decoding with a draft model: greedy output with it equals greedy without, token for token, whatever
the draft proposes; its shadows' blocks all come back; a draft with another vocabulary is refused."""

import pytest
from test_speculative import GREEDY, HITS, MISSES, check_blocks
from test_speculative_sampling import Always
from tiny_model import cached_tiny_model

from bench.random_model import make_tiny_model
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.speculative.draft import DraftProposer
from engine.weights.loader import cache_root

PROMPTS = HITS + MISSES


def _draft_pair(make_engine, draft: str, **config):
    config.setdefault("num_kv_blocks", 256)
    return make_engine(**config), make_engine(speculative="draft", draft_model=draft, **config)


def _run(engine, prompts, params) -> list:
    """Every request at once (each its own max_tokens: they finish at different steps), block accounting checked
    after every step -> the final outputs in order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, plist):
        engine.add_request(rid, prompt, params=p)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_finished:
                final[out.request_id] = out
        check_blocks(engine)
    assert engine.num_free_blocks == engine.num_total_blocks
    return [final[r] for r in ids]


def _same(off, on, prompts, params) -> None:
    want, got = _run(off, prompts, params), _run(on, prompts, params)
    for prompt, w, g in zip(prompts, want, got):
        assert g.token_ids == w.token_ids, f"prompt {prompt!r}"
        assert g.text == w.text and g.finish_reason == w.finish_reason
    proposer = on.loop.speculator.proposer
    draft = getattr(proposer, "inner", proposer)
    assert not draft.shadows and draft.bm.num_free_blocks == draft.bm.num_blocks  # every shadow's blocks are back


def _lengths(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12 + 7 * i, temperature=0) for i in range(n)]


def test_target_drafting_for_itself_accepts_nearly_all(make_engine, tiny_model):
    off, on = _draft_pair(make_engine, tiny_model("llama"), block_size=8)
    _same(off, on, PROMPTS, _lengths(len(PROMPTS)))
    counts = on.speculation
    assert counts.proposed > 0 and counts.accepted / counts.proposed >= 0.9, counts


@pytest.mark.slow
def test_another_draft_changes_nothing(make_engine):
    other = cached_tiny_model("llama", seed=1)  # the same vocabulary, other weights: drafts mostly rejected
    off, on = _draft_pair(make_engine, other, block_size=4)
    _same(off, on, PROMPTS, _lengths(len(PROMPTS)))
    _same(off, on, PROMPTS[:2], GREEDY)  # again, on the same engines: nothing of the first run is left over
    counts = on.speculation
    assert counts.proposed > 0 and counts.accepted < counts.proposed


@pytest.mark.slow
def test_mixed_batch_and_small_budget(make_engine):
    # Sampled rows beside drafted ones, and prompts longer than a step's tokens: the catch-up goes in chunks.
    other = cached_tiny_model("llama", seed=1)
    off, on = _draft_pair(make_engine, other, block_size=4, max_num_batched_tokens=24)
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=0.8, seed=5), *_lengths(4)]
    on.loop.speculator.policy = Always()  # drafts this poor are not worth a step: verify them anyway
    _same(off, on, PROMPTS[:6], params)
    assert on.speculation.proposed > 0


def test_draft_kv_pool_too_small_drafts_less(make_engine, tiny_model):
    # A few draft blocks: shadows of other sequences are evicted, or a sequence goes undrafted; the output stays.
    off, on = _draft_pair(make_engine, tiny_model("llama"), block_size=4)
    on.loop.speculator.proposer = DraftProposer(on.draft, 4, on.config.max_num_batched_tokens, num_blocks=12)
    _same(off, on, PROMPTS, _lengths(len(PROMPTS)))
    assert on.speculation.accepted > 0


@pytest.mark.slow
def test_reset_builds_a_fresh_draft(make_engine, tiny_model):
    off, on = _draft_pair(make_engine, tiny_model("llama"), block_size=8)
    on.add_request("x", HITS[0], params=GREEDY)
    for _ in range(3):
        on.step()
    old = on.loop.speculator.proposer.inner
    assert old.shadows
    on.reset()
    new = on.loop.speculator.proposer.inner
    assert new is not old and new.runner is old.runner and not new.shadows
    _same(off, on, PROMPTS[:3], GREEDY)


def test_vocabulary_mismatch_is_refused(make_engine, tiny_model):
    other = make_tiny_model(str(cache_root() / "tiny-llama-vocab1000-v1"), shape={"vocab_size": 1000})
    with pytest.raises(ValueError, match="does not share the tokenizer .*vocab_size"):
        make_engine(num_kv_blocks=64, speculative="draft", draft_model=other)


def test_config_checks():
    with pytest.raises(ValueError, match="needs draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="draft_quantization"):
        EngineConfig(speculative="draft", draft_model="x", draft_quantization="int3")
    assert EngineConfig(speculative="draft", draft_model="x").overlap_steps is False


def test_worker_options():
    from cli.worker import engine_config, worker

    ctx = worker.make_context("worker", ["--speculative", "draft", "--draft-model", "tiny-draft",
                                         "--draft-quantization", "int4", "--num-kv-blocks", "64"])
    config = engine_config(dict(ctx.params))
    assert (config.speculative, config.draft_model, config.draft_quantization) == ("draft", "tiny-draft", "int4")
    with pytest.raises(ValueError, match="needs draft_model"):
        engine_config(dict(worker.make_context("worker", ["--speculative", "draft"]).params))


def test_smollm2_drafted_by_its_quantized_self(smollm2, make_engine):
    """The real pair: SmolLM2 in float32 verifies what its own Q4_1 GGUF blocks draft. The output is the float
    model's, token for token; most drafts are accepted."""
    on = make_engine("smollm2-135m-instruct", max_num_seqs=16, num_kv_blocks=512, quantization="none",
                     speculative="draft", draft_model="smollm2-135m-instruct", draft_quantization="auto")
    assert on.draft.quantized  # the draft kept the GGUF's blocks
    prompts = [smollm2.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("Name three colors of the rainbow.", "What is the capital of France? Answer in one sentence.")]
    params = SamplingParams(max_tokens=48, temperature=0)
    want = smollm2.generate(prompts, params)
    got = on.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert on.speculation.acceptance_rate > 0.5, on.speculation
