"""A batch's output file is written in parts of at most PART_BYTES (no Redis value grows with a batch), each cut
between characters, and comes back whole: streamed by GET /v1/files/{id}/content, and by `pagedq batch
download`. The jobs' results are written here as a worker writes them (a state and a result), large enough that
a few dozen lines fill several parts."""

import json

import httpx
import openai
import redis
from click.testing import CliRunner

from cli import main
from producer import flows, wire
from producer.keys import BatchKeys, Keys
from producer.protocol import JobResult, Usage
from serve import batches, files
from serve.config import ServeConfig

TEXT = "Élan vital, naïve café: 東京 🚀 " * 3000  # ~105 KB of 1- to 4-byte characters


def test_a_large_output_is_stored_in_parts_and_read_back_whole(redis_url, queue, start_serve, tmp_path):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    cfg = ServeConfig(redis_url=redis_url, queue=queue)
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "tiny", "messages": [{"role": "user", "content": "Go"}]}})
             for i in range(30)]
    f = flows.drive(r, files.put("\n".join(lines), "in.jsonl", "batch", 600))
    batch_id = flows.drive(r, batches.create(cfg, f["id"], "/v1/chat/completions"))["id"]
    keys = Keys(queue)
    for i in range(30):
        job = f"{batch_id}-{i}"
        res = JobResult(id=job, status="completed", text=f"{i}: {TEXT}", finish_reason="length",
                        usage=Usage(prompt_tokens=3, completion_tokens=9))
        r.set(keys.result(job), res.model_dump_json())
        r.hset(keys.job(job), wire.F_STATE, wire.COMPLETED)
    b = flows.drive(r, batches.get(batch_id))
    assert b["status"] == "completed" and b["request_counts"]["completed"] == 30

    out = b["output_file_id"]
    count = int(r.hget(BatchKeys.file(out), files.PARTS))
    sizes = [r.strlen(BatchKeys.file_content(out, n)) for n in range(count)]
    assert count > 3 and max(sizes) <= files.PART_BYTES and sum(sizes) == int(r.hget(BatchKeys.file(out), "bytes"))
    assert not r.exists(BatchKeys.file_content(out, count))

    c = openai.OpenAI(base_url=f"{start_serve(queue)}/v1", api_key="x", max_retries=0)
    text = c.files.content(out).text
    assert len(text.encode()) == sum(sizes)
    got = [json.loads(x) for x in text.splitlines()]
    assert [x["custom_id"] for x in got] == [f"r{i}" for i in range(30)]
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] == f"{i}: {TEXT}"
               for i, x in enumerate(got))
    with httpx.stream("GET", f"{c.base_url}files/{out}/content") as resp:
        assert resp.headers["content-length"] == str(sum(sizes)) and resp.read().decode() == text

    saved = tmp_path / "out.jsonl"
    res = CliRunner().invoke(main, ["batch", "download", batch_id, "-o", str(saved)], env={"REDIS_URL": redis_url})
    assert res.exit_code == 0 and "30 lines of output" in res.output, res.output
    assert saved.read_text(encoding="utf-8") == text
    r.close()


def test_parts_are_cut_between_characters():
    parts = files.Parts(limit=5)
    text = "aé東🚀" * 7 + "z"
    out = parts.feed(text[:9].encode()) + parts.feed(text[9:].encode()) + parts.end()
    assert b"".join(out).decode() == text and all(len(p) <= 5 for p in out)
    assert [p.decode() for p in out]  # each part is text on its own
    assert files.split("") == []
