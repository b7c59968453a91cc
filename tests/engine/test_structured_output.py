"""Constraints in the engine (issue 25): a random-weight tiny model, which never writes JSON by itself, writes
output that parses and fits whenever a constraint says so; unconstrained rows beside it are untouched."""

import json
import re

import jsonschema
import pytest

from engine import Constraint, EngineConfig, SamplingParams

# Nested objects, arrays, enums, bounded numbers, required fields. Strings and decimals are bounded: a random
# model inside a free string rarely picks the closing quote, and greedy after "1." may add zeros forever; the
# test is about validity, not about patience.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "owner"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[A-Z]{2}-[0-9]{3}"


pytestmark = pytest.mark.engine(max_num_seqs=64, num_kv_blocks=768)  # the `engine` fixture (conftest.py)


def constrained(kind, spec, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 160)
    return SamplingParams(constraint=Constraint(kind, spec), **kw)


@pytest.mark.slow
def test_a_hundred_outputs_of_a_nested_schema_validate(engine):
    params = [constrained("json_schema", SCHEMA, temperature=0 if i % 4 == 0 else 1.0, seed=i) for i in range(100)]
    prompts = [f"Describe pet number {i}." for i in range(100)]
    outs = engine.generate(prompts, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 10  # sampled rows differ: the mask steers, it does not decide
    # A schema seen before is not compiled again.
    assert engine.grammars.compiles <= 2


def test_regex_choice_and_grammar_outputs_match(engine):
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x"'
    params = [constrained("regex", REGEX, temperature=0), constrained("choice", CHOICES, temperature=0),
              constrained("grammar", grammar, temperature=0.8, seed=3), constrained("json_object", None, seed=2,
                                                                                    max_tokens=400)]
    outs = engine.generate(["Code:", "Sentiment:", "List:", "Object:"], params)
    assert re.fullmatch(REGEX, outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in CHOICES and outs[1].finish_reason == "stop"
    assert re.fullmatch(r"\((?:[a-c]|x)(?:,(?:[a-c]|x))*\)", outs[2].text), outs[2].text
    if outs[3].finish_reason == "stop":  # free keys and strings: a random model may run out of tokens inside one
        assert isinstance(json.loads(outs[3].text), dict)
    again = engine.generate(["Code:", "Sentiment:"], params[:2])
    assert [o.text for o in again] == [o.text for o in outs[:2]]  # greedy is deterministic
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]


def test_sampled_rows_never_leave_a_choice(engine):
    params = [constrained("choice", CHOICES, temperature=1.5, top_k=0, seed=s) for s in range(24)]
    outs = engine.generate(["Pick one."] * 24, params)
    assert all(o.text in CHOICES for o in outs), [o.text for o in outs]
    # Seeded draws are exact: the same seeds, the same picks.
    assert [o.text for o in engine.generate(["Pick one."] * 24, params)] == [o.text for o in outs]


def test_logprobs_see_the_masked_distribution(engine):
    out = engine.generate(["Sentiment:"], constrained("choice", CHOICES, temperature=0, logprobs=5))[0]
    allowed_first = {engine.tokenizer.encode(c)[0] for c in CHOICES} | {
        t for c in CHOICES for t in engine.tokenizer.encode(c)[:1]}
    token_lp, top = out.logprobs[0]
    assert token_lp > float("-inf")
    finite = {t for t, lp in top.items() if lp > float("-inf")}
    assert finite and finite <= set(range(engine.vocab_size))
    # Every token the first step ranks with a finite logprob starts one of the choices.
    texts = {engine.tokenizer.decode([t]) for t in finite}
    assert all(any(c.startswith(t) for c in CHOICES) for t in texts), (texts, allowed_first)


def test_unconstrained_rows_are_untouched(engine):
    plain = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)]
    prompts = ["The weather today", "Once upon a time"]
    alone = engine.generate(prompts, plain)
    mixed = engine.generate(prompts + ["Code:", "Pet:"],
                            plain + [constrained("regex", REGEX, temperature=0),
                                     constrained("json_schema", SCHEMA, temperature=1.0, seed=1)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert re.fullmatch(REGEX, mixed[2].text)
    jsonschema.validate(json.loads(mixed[3].text), SCHEMA)


def test_several_continuations_each_fit(engine):
    out = engine.generate(["Pet:"], constrained("json_schema", SCHEMA, n=4, temperature=1.0, seed=5))[0]
    assert len(out.choices) == 4
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    best = engine.generate(["Pick:"], constrained("choice", CHOICES, n=2, best_of=4, temperature=1.0, seed=1))[0]
    assert all(c.text in CHOICES for c in best.choices)


@pytest.mark.slow
def test_preempted_and_resumed_requests_keep_their_constraint(tiny_model):
    from engine import LLMEngine

    # Few blocks: a batch of long outputs preempts and recomputes; the matchers keep their place.
    small = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_seqs=6, num_kv_blocks=20, block_size=8))
    params = [constrained("json_schema", SCHEMA, temperature=1.0, seed=i) for i in range(6)]
    outs = small.generate([f"Pet {i}, described at some length:" for i in range(6)], params)
    assert any(o._seq.num_preemptions for o in outs)
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # Resumed after a crash: the matcher is rebuilt from the tokens already emitted and goes on from there.
    whole = small.generate(["Pet 0:"], params[0])[0]
    cut = len(whole.token_ids) // 2
    small.add_request("resumed", prompt="Pet 0:", params=params[0], resume_token_ids=whole.token_ids[:cut],
                      resume_text=small.tokenizer.decode(whole.token_ids[:cut]))
    tokens = list(whole.token_ids[:cut])
    while small.has_unfinished_requests():
        for out in small.step():
            tokens += out.new_token_ids
    assert tokens == whole.token_ids


@pytest.mark.parametrize("kind, spec, message", [
    ("json_schema", {"type": "objekt"}, "objekt"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", "root ::= (", "grammar"),
])
def test_a_bad_constraint_is_refused_and_the_rest_run(engine, kind, spec, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(["Hi."], constrained(kind, spec))
    # Through step(): the request leaves the engine with the reason; the others finish.
    engine.add_request("ok", prompt="Hi.", params=SamplingParams(max_tokens=4, temperature=0))
    try:
        engine.add_request("bad", prompt="Hi.", params=constrained(kind, spec))
        refused = []  # compiling: refused by a later step
    except ValueError as e:  # compiled before (the generate above): refused at once
        refused = [("bad", str(e))]
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.request_finished}
        refused += engine.pop_refused()
    assert done == {"ok"} and [r for r, _ in refused] == ["bad"] and message in refused[0][1]


def test_constraints_that_are_wrong_on_their_face():
    for kind, spec in [("choice", []), ("choice", ["a", ""]), ("regex", ""), ("json_schema", "{}"), ("xml", "")]:
        with pytest.raises(ValueError):
            Constraint(kind, spec)
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, temperature=0, n=2, constraint=Constraint("choice", ["a"]))
