"""Incremental text: deltas add up to the final text and never carry half a character."""

import pytest

from engine import SamplingParams
from engine.detokenizer import Detokenizer


@pytest.mark.parametrize("text", ["你好，世界！今天天气很好。我们去公园散步吧。", "Café ☕ naïve — 🙂 emoji 👍🏽 ok", "plain ascii text."])
def test_detokenizer_deltas_are_whole_characters(engine, text):
    ids = engine.tokenizer.encode(text)
    d = Detokenizer(engine.tokenizer, engine.tokenizer.encode("Say:"), [])
    deltas = [d.add([t], final=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)


def test_detokenizer_holds_back_a_stop_string_prefix(engine):
    tok = engine.tokenizer
    ids = tok.encode("one two three STOP four")
    d = Detokenizer(tok, [], ["STOP"])
    deltas = []
    for t in ids:
        delta, stopped = d.add([t], final=False)
        deltas.append(delta)
        if stopped:
            break
    assert stopped and "".join(deltas) == "one two three "
    assert not any("S" in x for x in deltas)


def stream(engine, prompt, params):
    engine.add_request("s", prompt=prompt, params=params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.new_text)
            final = o
    return deltas, final


@pytest.mark.parametrize("prompt", ["请用中文写一首关于大海的诗。", "Tell me a story about a dragon."])
def test_engine_stream_adds_up_to_the_final_text(engine, prompt):
    deltas, final = stream(engine, prompt, SamplingParams(max_tokens=48, temperature=0.8, seed=7))
    assert "".join(deltas) == final.text
    assert final.text == engine.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_engine_stream_with_stop_string(engine):
    free = engine.generate(["Tell me a story about a dragon."], SamplingParams(max_tokens=40, temperature=0))[0]
    stop = free.text[8:14]
    deltas, final = stream(engine, "Tell me a story about a dragon.",
                           SamplingParams(max_tokens=40, temperature=0, stop=[stop]))
    assert "".join(deltas) == final.text == free.text[: free.text.index(stop)]


@pytest.mark.slow
def test_smollm2_chinese_stream(smollm2):
    ids = smollm2.apply_chat_template([{"role": "user", "content": "用中文介绍一下北京。"}])
    smollm2.add_request("zh", prompt_token_ids=ids, params=SamplingParams(max_tokens=40, temperature=0))
    deltas, final = [], None
    while smollm2.has_unfinished_requests():
        for o in smollm2.step():
            deltas.append(o.new_text)
            final = o
    assert "".join(deltas) == final.text
    assert not any("\ufffd" in x for x in deltas)


@pytest.mark.parametrize("cut", [1, 5, 17])
@pytest.mark.parametrize("seed", [None, 11])
def test_resumed_request_continues_the_stream(engine, cut, seed):
    prompt = "请讲一个关于龙的故事。"
    params = SamplingParams(max_tokens=30, temperature=0 if seed is None else 0.9, seed=seed)
    deltas, whole = stream(engine, prompt, params)
    sent = "".join(deltas[:cut])
    engine.add_request("r", prompt=prompt, params=params, resume_token_ids=whole.token_ids[:cut], resume_text=sent)
    rest, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            rest.append(o.new_text)
            final = o
    assert final.token_ids == whole.token_ids
    assert sent + "".join(rest) == whole.text


def _collect(engine, prompt, params):
    engine.add_request("lazy", prompt=prompt, params=params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["请用中文写一首关于大海的诗。", "Tell me a story about a dragon."])
def test_deferred_text_is_the_same_whoever_reads_it_and_in_what_order(engine, prompt):
    """Without stop strings the step only records tokens; the text of each step must not depend on when, in
    which order or from which thread it is read."""
    import threading

    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3)
    in_order = [o.new_text for o in _collect(engine, prompt, params)]
    outs = _collect(engine, prompt, params)
    final_text = outs[-1].text  # the last one first: decodes every step before it
    backwards = [o.new_text for o in reversed(outs)][::-1]
    assert backwards == in_order and "".join(in_order) == final_text

    outs = _collect(engine, prompt, params)
    seen: dict[int, str] = {}

    def read(rows):
        for i in rows:
            seen[i] = outs[i].new_text

    threads = [threading.Thread(target=read, args=(range(k, len(outs), 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [seen[i] for i in range(len(outs))] == in_order
    assert [o.text for o in outs][-1] == final_text


def test_deferred_text_stops_at_a_stop_token_without_showing_it(engine):
    prompt = "Tell me a story about a dragon."
    free = _collect(engine, prompt, SamplingParams(max_tokens=30, temperature=0))
    stop_token = free[3].new_token_ids[0]
    outs = _collect(engine, prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token]))
    last = outs[-1]
    assert last.finish_reason == "stop" and last.token_ids[-1] == stop_token
    assert last.text == engine.tokenizer.decode(last.token_ids[:-1], skip_special_tokens=True)
    assert "".join(o.new_text for o in outs) == last.text
