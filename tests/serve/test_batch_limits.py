"""What one batch, and one API key's batches and files, may take in `pagedq serve`: the cap on a batch's lines
(400 at creation), a key's cap on batches that have not ended (429), a key's quota of stored file bytes (413;
deleting a file frees room). No worker: none of it needs a job to run."""

import json

import httpx
import openai
import pytest
from faults import wait_for

from producer.keys import ApiKeyKeys, BatchKeys
from serve.api_keys import key_id

LINES = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}?"}],
                              "max_tokens": 3}}) for i in range(4)]


def sdk(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def batch_of(c: openai.OpenAI, lines: list[str]):
    f = c.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def test_a_batch_past_the_line_cap_is_refused_at_creation(queue, rds, start_serve):
    c = sdk(start_serve(queue, "--max-batch-lines", "3"))
    f = c.files.create(file=("in.jsonl", "\n".join(LINES).encode()), purpose="batch")
    active = rds.smembers(BatchKeys.active)
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    err = e.value.body
    assert err["code"] == "batch_too_large" and err["param"] == "input_file_id"
    assert "holds 4 requests" in err["message"] and "3 at most" in err["message"]
    assert rds.smembers(BatchKeys.active) == active  # nothing was stored
    b = batch_of(c, LINES[:3] + ["", "  "])  # blank lines are no requests
    assert b.request_counts.total == 3 and b.status in ("in_progress", "validating")


def test_a_key_at_its_cap_of_batches_gets_429_until_one_ends(queue, rds, start_serve, tmp_path):
    ka, kb = f"sk-alpha-{queue}", f"sk-bravo-{queue}"
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ka} max_batches=2\nbravo: {kb}\n")
    base = start_serve(queue, "--api-key-file", str(keyfile), "--key-max-batches", "1")
    a, b = sdk(base, ka), sdk(base, kb)
    first, second = batch_of(a, LINES), batch_of(a, LINES)  # alpha's own cap: 2
    with pytest.raises(openai.RateLimitError) as e:
        batch_of(a, LINES)
    assert e.value.code == "key_batches_full" and "2 batches that have not ended" in e.value.message
    assert rds.zcard(ApiKeyKeys(key_id(ka)).batches) == 2
    batch_of(b, LINES)  # bravo has the server's: 1
    with pytest.raises(openai.RateLimitError):
        batch_of(b, LINES)

    a.batches.cancel(first.id)
    wait_for(lambda: a.batches.retrieve(first.id).status == "cancelled", 30, "the batch to be cancelled")
    third = batch_of(a, LINES)  # one ended: room for one more
    assert rds.zcard(ApiKeyKeys(key_id(ka)).batches) == 2 and {second.id, third.id} == {
        m.split(" ")[0] for m in rds.zrange(ApiKeyKeys(key_id(ka)).batches, 0, -1)}
    metrics = httpx.get(f"{base}/metrics").text
    assert 'pagedq_serve_key_rate_limited_total{key="alpha",limit="batches"} 1.0' in metrics


def test_a_keys_stored_file_bytes_are_capped_and_deleting_frees_them(queue, rds, start_serve, tmp_path):
    ka = f"sk-alpha-{queue}"
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"alpha: {ka}\n")
    a = sdk(start_serve(queue, "--api-key-file", str(keyfile), "--key-max-file-bytes", "3000"), ka)
    data = ("x" * 1999 + "\n").encode()
    kept = a.files.create(file=("one.jsonl", data), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        a.files.create(file=("two.jsonl", data), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "storage_limit_exceeded"
    assert "hold 2000 bytes" in e.value.message and "limit of 3000 bytes" in e.value.message
    assert [f.id for f in a.files.list()] == [kept.id]  # nothing of the refused file is stored
    assert rds.zrange(ApiKeyKeys(key_id(ka)).files, 0, -1) == [f"{kept.id} 2000"]

    assert a.files.delete(kept.id).deleted
    assert rds.zcard(ApiKeyKeys(key_id(ka)).files) == 0
    again = a.files.create(file=("two.jsonl", data), purpose="batch")
    assert a.files.content(again.id).content == data
