"""Bad input raises ValueError that says what to change, and leaves the other requests running."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.engine(max_model_len=64)  # the `engine` fixture (conftest.py)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ({"prompt": "word " * 100}, "shorten the prompt"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids must be integers"),
        ({}, "exactly one of prompt or prompt_token_ids"),
    ],
)
def test_bad_requests_are_refused_and_the_others_keep_running(engine, kwargs, message):
    engine.add_request("good", prompt="Hello", params=SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", **kwargs)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "good" and outs[-1].finished
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens must be between"),
        ({"logprobs": 50}, "logprobs must be between"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id(engine):
    engine.add_request("dup", prompt="Hi", params=SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("dup", prompt="Hi")
    engine.abort("dup")
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks_and_unknown_abort_is_false(engine):
    engine.add_request("x", prompt="Hello there", params=SamplingParams(max_tokens=50))
    engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    assert engine.abort("x") is True
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.abort("x") is False


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        LLMEngine(EngineConfig(model="no-such-model"))
    with pytest.raises(ValueError, match="does not exist"):
        LLMEngine(EngineConfig(model="/nope/model.gguf"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="not supported"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_bad_config():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model="smollm2-135m-instruct", max_model_len=10**6))


def test_chat_template_errors(engine):
    with pytest.raises(ValueError, match="messages is empty"):
        engine.apply_chat_template([])
    with pytest.raises(ValueError, match="role"):
        engine.apply_chat_template([{"content": "hi"}])


# ---- requests the engine could never run, and arithmetic that must not fail (issue 38) ----

@pytest.fixture(scope="module")
def small(tiny_model):
    """A small engine: 8 sequences, 24 KV blocks of 16 tokens (6 sequences of the longest, 64 tokens)."""
    return LLMEngine(EngineConfig(model=tiny_model("llama"), max_model_len=64, max_num_seqs=8, num_kv_blocks=24))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stop_token_ids": [49152]}, r"stop_token_ids: 49152 is not a token of this model: give ids in \[0, 49152\)"),
        ({"n": 9}, "n is 9: this engine runs at most 8 sequences"),
        ({"n": 2, "best_of": 12}, "best_of is 12: this engine runs at most 8"),
        ({"n": 7, "max_tokens": 62}, "n is 7 with max_tokens 62: its continuations may need 28 KV blocks, and this "
                                     "engine's cache holds 24"),
        ({"use_beam_search": True, "beam_width": 8, "temperature": 0, "max_tokens": 60}, "beam_width is 8"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"length_penalty": float("inf"), "use_beam_search": True, "temperature": 0}, "length_penalty must be a finite number"),
    ],
)
def test_requests_that_could_never_run_are_refused(small, kwargs, message):
    with pytest.raises(ValueError, match=message):
        small.add_request("never", prompt_token_ids=[1, 2], params=SamplingParams(**kwargs))
    assert not small.has_unfinished_requests()


def test_what_fits_exactly_is_taken(small):
    # 6 continuations of a 2-token prompt, 62 tokens each: 4 blocks apiece = the 24 the cache has.
    out = small.generate([[1, 2]], SamplingParams(n=6, max_tokens=62, temperature=0.9, seed=3, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.choices] == [62] * 6
    assert small.num_free_blocks == small.num_total_blocks


@pytest.mark.parametrize("penalty", [2000.0, -2000.0, 1e300])
def test_beam_search_with_any_length_penalty_runs(small, penalty):
    params = SamplingParams(n=2, use_beam_search=True, beam_width=3, temperature=0, max_tokens=12,
                            length_penalty=penalty, stop_token_ids=list(range(200)))
    out = small.generate([[5, 6, 7]], params)[0]
    assert len(out.choices) == 2 and all(c.token_ids for c in out.choices)


def test_extreme_sampling_values_draw_real_tokens(small):
    tiny = small.generate([[1, 2]], SamplingParams(temperature=1e-40, max_tokens=4, seed=7, ignore_eos=True))[0]
    floor = small.generate([[1, 2]], SamplingParams(temperature=1e-2, max_tokens=4, seed=7, ignore_eos=True))[0]
    assert tiny.token_ids == floor.token_ids  # sampled at the floor, not through inf and NaN
    greedy = small.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    nucleus = small.generate([[1, 2]], SamplingParams(temperature=1.0, top_p=1e-300, max_tokens=4, seed=7,
                                                      ignore_eos=True))[0]
    assert nucleus.token_ids == greedy.token_ids  # top_p rounds to 0 in float32: the top token is still kept
    many = small.generate([[1, 2]], SamplingParams(temperature=0, logprobs=20, max_tokens=2, ignore_eos=True))[0]
    assert all(len(top) == 20 for _, top in many.logprobs)


def test_reset_after_a_failed_step_and_resume(small, monkeypatch):
    """What the worker does when a step raises: reset, then add each request again from what it had output."""
    params = [SamplingParams(max_tokens=12, temperature=t, seed=s, ignore_eos=True) for t, s in
              ((0, None), (0.8, 11), (0.8, 12))]
    prompts = [[1, 2, 3], [4, 5], [6]]
    undisturbed = [o.token_ids for o in small.generate(prompts, params)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        small.add_request(f"r{i}", prompt_token_ids=p, params=sp)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    for _ in range(5):
        for o in small.step():
            out[o.request_id] += o.new_token_ids
    run = small.runner.run
    monkeypatch.setattr(small.runner, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        small.step()
    assert [small.landed(f"r{i}") for i in range(3)] == [len(out[f"r{i}"]) for i in range(3)]
    assert sorted(small.reset()) == ["r0", "r1", "r2"]
    assert not small.has_unfinished_requests() and small.num_free_blocks == small.num_total_blocks
    assert small.self_check() is not None  # the step still fails: nothing but the engine to blame
    monkeypatch.setattr(small.runner, "run", run)
    assert small.self_check() is None and not small.has_unfinished_requests()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        small.add_request(f"r{i}", prompt_token_ids=p, params=sp, resume_token_ids=out[f"r{i}"])
    while small.has_unfinished_requests():
        for o in small.step():
            out[o.request_id] += o.new_token_ids
    assert [out[f"r{i}"] for i in range(3)] == undisturbed
