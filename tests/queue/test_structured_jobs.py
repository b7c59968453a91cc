"""Constraints end to end (issue 25): jobs through Redis and a worker, and `pagedq serve` driven by the official
`openai` SDK: parse() with a pydantic model, forced tool calls (named and required, whole and streamed), and
400s that name what is wrong with a schema."""

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, ValidationError

from producer import Client, JobRequest

WORKER_FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "512",
                "--served-model-name", "tiny")
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "book_trip", "description": "Book a trip.", "parameters": CITY}},
         {"type": "function", "function": {"name": "cancel", "parameters": {
             "type": "object", "properties": {"ref": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
             "required": ["ref"], "additionalProperties": False}}}]


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


def test_constrained_jobs_through_redis(redis_url, queue, pq_tiny_model, start_worker):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    with Client(redis_url, queue=queue) as c:
        jobs = {
            "schema": c.submit(prompt="Trip:", max_tokens=64, temperature=1.0, seed=3,
                               response_format={"type": "json_schema",
                                                "json_schema": {"name": "trip", "schema": CITY, "strict": True}}),
            "choice": c.submit(prompt="Yes or no?", max_tokens=8, guided_choice=["yes", "no"]),
            "regex": c.submit(prompt="Code:", max_tokens=16, temperature=0, guided_regex="[a-f]{4}-[0-9]{2}"),
            "bad": c.submit(prompt="Code:", max_tokens=16, guided_regex="(unclosed"),
            "plain": c.submit(prompt="Hello", max_tokens=5, temperature=0),
        }
        res = {k: j.result(timeout=60) for k, j in jobs.items()}
        jsonschema.validate(json.loads(res["schema"].text), CITY)
        assert res["schema"].finish_reason == "stop"
        assert res["choice"].text in ("yes", "no")
        assert re.fullmatch("[a-f]{4}-[0-9]{2}", res["regex"].text)
        assert res["bad"].status == "failed" and res["bad"].error.type == "invalid_request"
        assert "unclosed group" in res["bad"].error.message
        assert res["plain"].status == "completed" and len(res["plain"].token_ids) == 5
        # Streamed: the token events add up to text that parses.
        job = c.submit(prompt="Trip:", max_tokens=64, guided_json=CITY, seed=4)
        text = "".join(e.text for e in job.stream() if e.type == "token")
        jsonschema.validate(json.loads(text), CITY)
    # Refused at submit when the client can tell.
    for bad in ({"guided_choice": []}, {"guided_regex": "a", "guided_choice": ["a"]},
                {"response_format": {"type": "xml"}}, {"guided_json": "{not json"},
                {"guided_choice": ["a"], "use_beam_search": True, "temperature": 0}):
        with pytest.raises(ValidationError):
            JobRequest(prompt="x", **bad)


def test_a_grammars_last_token_shows_and_a_stop_token_does_not(redis_url, queue, pq_tiny_model, start_worker):
    """Both end with "stop": a grammar's last token is part of the text, in the result and in the event stream; a
    stop token (as EOS) is kept in token_ids but its text is not shown. The engine says which (hidden_stop)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pq_tiny_model)
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    with Client(redis_url, queue=queue) as c:
        free = c.submit(prompt="Code:", max_tokens=8, temperature=0).result(timeout=60)
        stop = free.token_ids[3]
        jobs = {"grammar": c.submit(prompt="Code:", max_tokens=16, temperature=0, guided_regex="[a-f]{4}-[0-9]{2}"),
                "stop token": c.submit(prompt="Code:", max_tokens=16, temperature=0, stop_token_ids=[stop])}
        for name, job in jobs.items():
            events = list(job.stream())
            res = events[-1].result
            assert res.status == "completed" and res.finish_reason == "stop", name
            assert "".join(e.text for e in events if e.type == "token") == res.text, name
            assert [t for e in events if e.type == "token" for t in e.token_ids] == res.token_ids, name
            shown = res.token_ids if name == "grammar" else res.token_ids[:-1]
            assert res.text == tok.decode(shown, skip_special_tokens=True), name
    assert re.fullmatch("[a-f]{4}-[0-9]{2}", jobs["grammar"].result(timeout=5).text)
    assert jobs["stop token"].result(timeout=5).token_ids[-1] == stop


def test_openai_sdk_parse_tools_and_errors(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    base = start_serve(queue, "--model", "tiny")
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Tell me about a pet."}]

    parsed = oa.chat.completions.parse(model="tiny", messages=msgs, response_format=Pet, max_tokens=64, seed=1)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and parsed.choices[0].finish_reason == "stop"

    chat = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=64, seed=2,
                                      response_format={"type": "json_object"}, extra_body={"guided_json": None})
    assert chat.choices[0].finish_reason in ("stop", "length")

    # A named function: the output is its arguments.
    named = oa.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=64, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "book_trip"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "book_trip" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)

    # "required": one or more calls, each to a given function with arguments valid for it.
    required = oa.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                          max_tokens=96, seed=4, parallel_tool_calls=False)
    (call,) = required.choices[0].message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    # Streamed, through the SDK's own accumulation of tool-call deltas.
    with oa.chat.completions.stream(model="tiny", messages=msgs, tools=[openai.pydantic_function_tool(Pet)],
                                    tool_choice={"type": "function", "function": {"name": "Pet"}},
                                    max_tokens=64, seed=5) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Pet)
    chunks = list(oa.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                             max_tokens=96, seed=4, parallel_tool_calls=False, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].function.arguments == required.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # Completions take vLLM's guided_* too.
    comp = oa.completions.create(model="tiny", prompt="Answer:", max_tokens=8,
                                 extra_body={"guided_choice": ["alpha", "beta"]})
    assert comp.choices[0].text in ("alpha", "beta")

    # What is wrong is a 400 that names it, before any job is queued.
    for kwargs, says in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "objekt"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "unclosed group"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "auto"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ]:
        with pytest.raises(openai.BadRequestError, match=says):
            oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, **kwargs)
