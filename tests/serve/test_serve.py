"""`pagedq serve` end to end: real processes (redis-server, a worker on a tiny model, the server on a free
port), driven by the official `openai` client and, for the wire details, by httpx."""

import json

import httpx
import openai
import pytest
from faults import wait_for

from producer import Client
from worker.redis_server import free_port

WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "512",
                "--served-model-name", "tiny")


def job_id(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def sse_events(lines) -> list[str]:
    """The `data:` payloads of an SSE body, checking its framing: `data: ...` lines, each event ended by a
    blank line."""
    out, pending = [], None
    for line in lines:
        if line == "":
            assert pending is not None, "an empty event"
            out.append(pending)
            pending = None
        else:
            assert line.startswith("data: ") and pending is None, line
            pending = line[len("data: "):]
    assert pending is None, "the last event is not closed by a blank line"
    return out


def test_openai_client(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    base = start_serve(queue, "--model", "tiny")
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    with Client(redis_url, queue=queue) as c:
        chat = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, seed=1,
                                          presence_penalty=0.5, frequency_penalty=0.1, user="u-1")
        res = c.result(job_id(chat.id), timeout=10)
        assert chat.object == "chat.completion" and chat.model == "tiny"
        assert chat.choices[0].message.content == res.text and chat.choices[0].message.role == "assistant"
        assert chat.choices[0].finish_reason == res.finish_reason
        assert chat.usage.completion_tokens == len(res.token_ids) and chat.usage.prompt_tokens > 0
        assert res.metadata == {"user": "u-1"}

        # Streamed: the deltas add up to the job's text; the finish reason, then the usage, come last.
        chunks = list(oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
        res = c.result(job_id(chunks[0].id), timeout=10)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == res.text
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == 7 == len(res.token_ids)
        assert all(ch.usage is None for ch in chunks[:-1])

        comp = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                     logprobs=2, stop=["\n\n"])
        res = c.result(job_id(comp.id), timeout=10)
        assert comp.object == "text_completion" and comp.choices[0].text == res.text
        assert comp.choices[0].logprobs.tokens == [f"token_id:{t}" for t in res.token_ids]
        assert all(len(top) >= 1 for top in comp.choices[0].logprobs.top_logprobs)

        stream = oa.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                       stream=True)
        parts = list(stream)
        assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text  # greedy: the same text

        assert [m.id for m in oa.models.list()] == ["tiny"]
        # A server told no model lists what the queue's live workers serve (their heartbeats), and mounts the
        # dashboard (it has no API keys).
        bare = start_serve(queue)
        assert [m["id"] for m in httpx.get(f"{bare}/v1/models").json()["data"]] == ["tiny"]
        assert "pagedq" in httpx.get(f"{bare}/dashboard/", follow_redirects=True).text
        with pytest.raises(openai.NotFoundError):
            oa.chat.completions.create(model="gpt-9", messages=msgs)

        # A job the worker fails answers in OpenAI's shape, with the worker's reason.
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 600}])
        assert e.value.code == "prompt_too_long" and "512" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:  # refused before it is queued: the client's limits
            oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=100_000)
        assert e.value.code == "limit_exceeded" and "max_tokens" in e.value.message

        # Idempotency-Key: a retried POST attaches to the first one's job.
        h = {"Idempotency-Key": f"idem-{queue}"}
        a = oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, extra_headers=h)
        b = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "other"}],
                                       max_tokens=9, extra_headers=h)
        assert a.id == b.id == f"chatcmpl-idem-{queue}" and a.choices[0].message.content == b.choices[0].message.content
        assert b.usage.completion_tokens == 5

    metrics = httpx.get(f"{base}/metrics").text
    assert 'pagedq_serve_requests_total{route="/v1/chat/completions",status="200"}' in metrics


def test_sse_framing(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    base = start_serve(queue)  # no --model: any name goes to the queue, the worker judges
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    with Client(redis_url, queue=queue) as c:
        res = c.result(job_id(chunks[0]["id"]), timeout=10)
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks[:-1]) == res.text

    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and "usage" not in json.loads(events[0])
    assert [json.loads(e)["object"] for e in events[:-1]] == ["text_completion"] * (len(events) - 1)

    # A model the workers do not serve: the job fails before any token, so the stream is never opened.
    r = httpx.post(f"{base}/v1/chat/completions", json={**body, "model": "gpt-9", "prompt": None,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model" and "gpt-9" in r.text


def _kv(metrics_url: str) -> tuple[float, float]:
    text = httpx.get(metrics_url).text
    vals = {}
    for line in text.splitlines():
        if line.startswith(("pagedq_kv_blocks_free", "pagedq_kv_blocks_total")):
            vals[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return vals.get("pagedq_kv_blocks_free", -1), vals.get("pagedq_kv_blocks_total", -2)


def test_disconnect_cancels_the_job(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    port = free_port()
    # The model's whole context: the job must outlast the disconnect's way to the worker on a loaded machine.
    start_worker(queue, pq_tiny_model, "--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "2048",
                 "--served-model-name", "tiny", "--metrics-port", str(port))
    base = start_serve(queue, "--model", "tiny")
    # One job first: the worker is up and past its first steps, so the disconnect below meets a running stream.
    httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
               timeout=120).raise_for_status()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines)[len("data: "):])
        wait_for(lambda: next(lines).startswith("data: {"), 120, "a token chunk")
    # The connection is closed: the server cancels the job, the worker stops it and frees its blocks.
    with Client(redis_url, queue=queue) as c:
        res = c.result(job_id(first["id"]), timeout=120)
        assert (res.status, res.finish_reason) == ("cancelled", "cancelled"), (res.status, len(res.token_ids))
        assert 1 <= len(res.token_ids) < 2000
    free_total = wait_for(lambda: (lambda f, t: t > 0 and f == t and (f, t))(*_kv(f"http://127.0.0.1:{port}")),
                          120, "the KV blocks to come back")
    assert free_total[0] == free_total[1]


def test_queue_full_auth_and_unsupported_fields(redis_url, queue, start_serve, tmp_path):
    """No worker: the queue only fills."""
    keyfile = tmp_path / "keys"
    keyfile.write_text("# keys\nkey-two\n")
    base = start_serve(queue, "--model", "tiny", "--max-queue-depth", "2", "--retry-after", "3",
                       "--api-key", "key-one", "--api-key-file", str(keyfile))
    ok = {"Authorization": "Bearer key-one"}
    msgs = [{"role": "user", "content": "Hi"}]

    assert httpx.get(f"{base}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}):
        r = httpx.get(f"{base}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer key-two"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()

    # tools without tool_choice means "auto", which needs a model's tool-call parser (serve.tools)
    for extra, param in [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
                         ({"n": 0}, "n"), ({"logit_bias": {"1": 5}}, "logit_bias"),
                         ({"response_format": {"type": "xml"}}, "response_format"),
                         ({"frobnicate": 1}, "frobnicate"), ({"temperature": -1}, "temperature"),
                         ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role"),
                         ({"max_completion_tokens": 0}, "max_completion_tokens")]:
        r = httpx.post(f"{base}/v1/chat/completions", headers=ok, json={"model": "tiny", "messages": msgs, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param.split("[")[0] in err["message"], (extra, err)
    r = httpx.post(f"{base}/v1/completions", headers=ok, json={"model": "tiny", "prompt": [1, 2, 3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="key-one", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oa.completions.create(model="tiny", prompt="x", best_of=0)

    # The interactive lane holds two jobs (nobody runs them): the third request is turned away with Retry-After.
    with Client(redis_url, queue=queue) as c:
        c.submit(prompt="one", lane="interactive")
        c.submit(prompt="two", lane="interactive", group="someone")
    r = httpx.post(f"{base}/v1/chat/completions", headers=ok, json={"model": "tiny", "messages": msgs})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "queue_full"
