"""Bad input raises ValueError that says what to change, and leaves the other requests running."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model("llama"), max_model_len=64))


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
