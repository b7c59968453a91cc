"""End to end: a worker subprocess on a tiny random-weight model, jobs from the sync and the async client."""

import asyncio
import time

import pytest

from producer import AsyncClient, Client, JobRequest

MAX_NUM_SEQS = 8
FLAGS = ("--max-num-seqs", str(MAX_NUM_SEQS), "--num-kv-blocks", "256", "--max-model-len", "512",
         "--served-model-name", "tiny")


def requests(n: int, tag: str) -> list[JobRequest]:
    out = []
    for i in range(n):
        common = {"id": f"{tag}-{i}", "max_tokens": 3 + i % 13, "temperature": 0, "ignore_eos": i % 3 == 0}
        if i % 2:
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}?"}]
            out.append(JobRequest(messages=msgs, model="tiny", **common))
        else:
            out.append(JobRequest(prompt=f"Once upon a time, story number {i}", **common))
    return out


def test_fifty_jobs_sync_and_async(redis_url, queue, pq_tiny_model, start_worker):
    start_worker(queue, pq_tiny_model, *FLAGS)
    sync_reqs, async_reqs = requests(25, "s"), requests(25, "a")

    with Client(redis_url, queue=queue) as c:
        jobs = c.submit_many(sync_reqs[:20]) + [c.submit(r) for r in sync_reqs[20:]]

        async def run_async():
            async with AsyncClient(redis_url, queue=queue) as ac:
                ajobs = await asyncio.gather(*(ac.submit(r) for r in async_reqs))
                results = await asyncio.gather(*(j.result(timeout=180) for j in ajobs))
                streams = []
                for j in ajobs:
                    streams.append([ev async for ev in j.stream(timeout=30)])
                return results, streams

        a_results, a_streams = asyncio.run(run_async())
        s_results = [j.result(timeout=180) for j in jobs]
        s_streams = [list(j.stream(timeout=30)) for j in jobs]

    results = s_results + a_results
    streams = s_streams + a_streams
    reqs = sync_reqs + async_reqs
    assert all(r.status == "completed" for r in results), [r.error for r in results if r.error]
    for req, res, events in zip(reqs, results, streams, strict=True):
        assert res.id == req.id
        assert events[-1].type == "done" and events[-1].result == res
        assert all(e.type == "token" for e in events[:-1])
        assert "".join(e.text for e in events[:-1]) == res.text
        assert [t for e in events[:-1] for t in e.token_ids] == res.token_ids
        assert res.usage.completion_tokens == len(res.token_ids) <= req.max_tokens
        assert res.usage.prompt_tokens > 0 and res.attempts == 1 and res.worker
        t = res.timings
        assert t.enqueued_at <= t.started_at <= t.first_token_at <= t.finished_at
        if req.ignore_eos:
            assert res.finish_reason == "length" and len(res.token_ids) == req.max_tokens

    # Greedy tokens equal the engine run directly on the same requests.
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=pq_tiny_model, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=256,
                                 max_model_len=512))
    prompts = [eng.apply_chat_template([m.model_dump() for m in r.messages]) if r.messages else r.prompt
               for r in reqs]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=r.ignore_eos) for r in reqs]
    direct = eng.generate(prompts, params)
    assert [d.token_ids for d in direct] == [r.token_ids for r in results]
    assert [d.text for d in direct] == [r.text for r in results]


def test_late_subscriber_and_cancel(redis_url, queue, rds, pq_tiny_model, start_worker):
    start_worker(queue, pq_tiny_model, *FLAGS)
    with Client(redis_url, queue=queue) as c:
        done = c.submit(prompt="Hello there", max_tokens=12, temperature=0, ignore_eos=True)
        res = done.result(timeout=120)
        time.sleep(0.2)
        # A subscriber that arrives after the job finished still gets the whole stream and the result.
        events = list(c.job(done.id).stream(timeout=5))
        assert [e.type for e in events] == ["token"] * 12 + ["done"]
        assert "".join(e.text for e in events[:-1]) == res.text and events[-1].result == res

        # Cancel a running job: it ends cancelled with what it had so far.
        long = c.submit(prompt="Count forever", max_tokens=400, temperature=0, ignore_eos=True)
        it = long.stream(timeout=120)
        first = next(it)
        assert first.type == "token"
        assert long.cancel() == "cancelling"
        rest = list(it)
        assert rest[-1].type == "cancelled"
        final = long.result(timeout=10)
        assert final.status == "cancelled" and final.finish_reason == "cancelled"
        assert 1 <= len(final.token_ids) < 400
        assert long.status() == "cancelled"

        # Idempotency against a live worker: the same id twice makes one job.
        from producer import DuplicateJobError

        c.submit(id="once", prompt="x", max_tokens=2)
        with pytest.raises(DuplicateJobError):
            c.submit(id="once", prompt="y", max_tokens=2)
        assert c.result("once", timeout=60).status == "completed"
        assert rds.xpending(c.keys.jobs, "workers")["pending"] == 0
