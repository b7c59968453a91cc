"""The hidden-stop rule, decided once (engine.finishing): a stop token that ends a continuation keeps its id in
token_ids, shows no text, and says so in RequestOutput.hidden_stop, whether the text is deferred, decoded for stop
strings, or reported whole at the end (best_of); a token that ends by the length limit shows."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams

PROMPT = [5, 17, 250, 31, 8, 90] * 2


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=64, attention_backend="torch"))


def run(engine: LLMEngine, params: SamplingParams) -> list:
    engine.add_request("r", prompt_token_ids=PROMPT, params=params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("stop", [[], ["never said"]], ids=["deferred", "stop strings"])
def test_a_stop_token_ends_with_no_text(engine, stop):
    free = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=stop))[0]
    ids = free.token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token greedy decoding first samples there
    token = ids[k]
    cut = engine.generate([PROMPT], SamplingParams(max_tokens=k, temperature=0, ignore_eos=True, stop=stop))[0]
    outs = run(engine, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop=stop,
                                      stop_token_ids=[token]))
    last = outs[-1]
    assert last.finish_reason == "stop" and last.hidden_stop and last.request_finished
    assert last.token_ids == free.token_ids[: k + 1] and last.new_token_ids == [token]
    assert last.text == cut.text and "".join(o.new_text for o in outs) == cut.text  # held-back text may end it
    assert not any(o.hidden_stop for o in outs[:-1])
    assert not free.hidden_stop and free.finish_reason == "length"


def test_continuations_reported_whole_leave_their_stop_token_out(engine):
    every = list(range(engine.vocab_size))  # whatever is sampled first ends the continuation
    outs = run(engine, SamplingParams(n=1, best_of=2, temperature=1.0, seed=3, max_tokens=4, stop_token_ids=every))
    [last] = outs
    assert last.finish_reason == "stop" and last.hidden_stop and len(last.token_ids) == 1 and last.text == ""
    streamed = run(engine, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, stop_token_ids=every))
    assert [o.hidden_stop for o in streamed] == [True, True] and all(o.text == "" for o in streamed)
