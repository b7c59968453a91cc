"""Text that is not valid Unicode (a lone surrogate: JSON can spell "\\ud800", UTF-8 cannot hold it) is a 400
that names where it is, on every route that makes jobs, never a 500; and no answer fails to encode one.
A real serve process (no worker: every request here is refused before a job would run)."""

import json

import httpx
import pytest
from faults import wait_for

from serve.errors import APIError
from serve.json_response import JSON
from serve.responses import dumps, sse
from serve.translate import parse

LONE = "\ud800"


def post(base: str, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes the surrogate ("\ud800"): the body is valid UTF-8, its JSON string is not valid Unicode.
    return httpx.post(f"{base}{path}", content=json.dumps(body), headers={"Content-Type": "application/json"})


CASES = [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": f"hi {LONE}"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": LONE}]}]},
     "messages[1].content[1].text"),
    ("/v1/completions", {"model": "tiny", "prompt": f"Once {LONE} upon"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [LONE]}, "prompt[0]"),
    ("/v1/completions", {"model": f"tiny{LONE}", "prompt": "x"}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["a", LONE]}, "stop[1]"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", f"bogus{LONE}": 1}, "bogus\\ud800"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "metadata": {LONE: "v"}}, "metadata.\\ud800"),
]


def test_a_lone_surrogate_is_a_400_naming_the_field(queue, start_serve):
    base = start_serve(queue, "--model", "tiny")
    for path, body, param in CASES:
        r = post(base, path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "invalid_unicode", (body, err)
        assert "lone surrogate" in err["message"] and err["message"].startswith(param)


def test_a_batch_line_with_a_lone_surrogate_is_that_line_s_error(queue, start_serve):
    base = start_serve(queue, "--model", "tiny")
    lines = [{"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": LONE}]}},
             {"custom_id": f"bad-id-{LONE}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}}]
    text = "\n".join(json.dumps(line) for line in lines).encode()
    f = httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", text)}, data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    b = httpx.post(f"{base}/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions",
                                                "completion_window": "24h"})
    assert b.status_code == 200, b.text
    done = wait_for(lambda: (lambda x: x["status"] in ("completed", "failed") and x)(
        httpx.get(f"{base}/v1/batches/{b.json()['id']}").json()), 60, "the batch to end")
    assert done["request_counts"]["failed"] == 2, done
    errors = [json.loads(e) for e in httpx.get(f"{base}/v1/files/{done['error_file_id']}/content").text.splitlines()]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("bad", "invalid_unicode"),
                                                                       ("bad-id-\\ud800", "invalid_unicode")]
    assert errors[0]["error"]["message"].startswith("body.messages[0].content")


def test_parse_names_the_field():
    with pytest.raises(APIError) as e:
        parse("chat", {"model": "m", "messages": [{"role": "user", "content": LONE}]})
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages[0].content", "invalid_unicode")


def test_answers_never_fail_to_encode_one():
    body = {"error": {"message": f"quoting {LONE}", "param": LONE}}
    for raw in (dumps(body), sse(body)[len(b"data: "):-2], JSON(body).body):
        assert json.loads(raw) == body  # escaped, so the client reads back what was sent
    assert dumps({"text": "é"}) == '{"text":"é"}'.encode()  # valid text stays as it is, in UTF-8


def test_lone_surrogate_finds_where_it_is():
    from producer.protocol import lone_surrogate

    assert lone_surrogate({"a": ["ok", {"b": f"x{LONE}"}]}) == ("a[1].b", LONE)
    assert lone_surrogate({"k": {f"key{LONE}": 1}}) == ("k.key\\ud800", LONE)  # keys too, spelled as JSON does
    assert lone_surrogate({"fine": ["é", "\U0001f600", 1.5, None]}) is None
    deep: list = [LONE]
    for _ in range(5000):  # past what JSON encoding recurses into: walked instead
        deep = [deep]
    assert lone_surrogate(deep) == ("[0]" * 5000 + "[0]", LONE)
    assert lone_surrogate({"s": {1, 2}, "t": (LONE,)}) == ("t[0]", LONE)  # not plain JSON: walked
