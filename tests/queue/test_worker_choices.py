"""Jobs with several continuations through Redis and a real worker (issue 24): n, best_of and beam search in the
job's JSON, token events that say which continuation, results with every choice, per-choice streams, limits, and a
SIGKILL of the worker that every continuation resumes from."""

import json
import os
import signal

import pytest
from faults import started, wait_for

from engine import EngineConfig, LLMEngine
from producer import Client, JobRequest
from producer.flows import parse_event
from worker.validate import sampling_params

FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256")


@pytest.fixture(scope="module")
def reference(pq_tiny_model):
    """reference(JobRequest) -> the engine's choices for it, run directly with the worker's settings."""
    eng = LLMEngine(EngineConfig(model=pq_tiny_model, max_num_seqs=16, num_kv_blocks=512, max_model_len=256))

    def run(req: JobRequest) -> list[tuple[list[int], str]]:
        [out] = eng.generate([req.prompt], sampling_params(req))
        return [(c.token_ids, c.text) for c in out.choices]

    return run


def events_of(c: Client, job_id: str) -> list:
    return [parse_event(eid, f) for eid, f in c.redis.xrange(c.keys.events(job_id))]


def assert_stream_holds_every_choice(c: Client, res) -> None:
    """Each continuation's token events, in order, are exactly its tokens and text; one terminal event, last."""
    events = events_of(c, res.id)
    assert events[-1].terminal and sum(e.terminal for e in events) == 1
    for choice in res.choices:
        mine = [e for e in events[:-1] if e.index == choice.index]
        assert [t for e in mine for t in e.token_ids] == choice.token_ids, choice.index
        assert "".join(e.text for e in mine) == choice.text, choice.index


def test_n_choices_stream_by_index_and_end_together(redis_url, queue, pq_tiny_model, start_worker, reference):
    c = Client(redis_url, queue=queue)
    start_worker(queue, pq_tiny_model, *FLAGS)
    req = JobRequest(prompt="Three ways to say hello:", n=3, temperature=0.9, seed=5, max_tokens=12,
                     ignore_eos=True)
    job = c.submit(req)
    res = job.result(timeout=120)
    assert res.status == "completed" and [ch.index for ch in res.choices] == [0, 1, 2]
    assert [(ch.token_ids, ch.text) for ch in res.choices] == reference(req)
    assert (res.text, res.token_ids) == (res.choices[0].text, res.choices[0].token_ids)  # the single fields: choice 0
    assert res.usage.completion_tokens == 36
    assert_stream_holds_every_choice(c, res)
    # A per-choice stream: that continuation's chunks, then the end.
    one = list(job.stream(timeout=10, choice=1))
    assert "".join(e.text for e in one[:-1]) == res.choices[1].text and one[-1].type == "done"


def test_best_of_and_beams_stream_nothing_before_the_end(redis_url, queue, pq_tiny_model, start_worker, reference):
    c = Client(redis_url, queue=queue)
    start_worker(queue, pq_tiny_model, *FLAGS)
    reqs = [JobRequest(prompt="Pick the best:", n=2, best_of=4, temperature=0.9, seed=3, max_tokens=10,
                       ignore_eos=True),
            JobRequest(prompt="Search the beams:", n=2, use_beam_search=True, beam_width=3, temperature=0,
                       max_tokens=10)]
    for req, job in zip(reqs, c.submit_many(reqs)):
        res = job.result(timeout=120)
        assert res.status == "completed", res.error
        assert [(ch.token_ids, ch.text) for ch in res.choices] == reference(req)
        assert all(ch.cumulative_logprob is not None for ch in res.choices)
        events = events_of(c, res.id)
        # Everything arrives with the end: the chunks ride in the same write as the result.
        assert_stream_holds_every_choice(c, res)
        assert {e.index for e in events[:-1]} == {0, 1}


def test_bad_continuation_settings_fail_with_a_reason(redis_url, queue, rds, pq_tiny_model, start_worker):
    """Limits are refused at submit by the client; a producer that skips the client (a bare XADD) gets a failed
    result saying why, and the worker serves the next job."""
    c = Client(redis_url, queue=queue)
    with pytest.raises(ValueError, match="n is 17, the limit is 16"):
        c.submit(prompt="hi", n=17)
    with pytest.raises(ValueError, match="best_of is 40, the limit is 32"):
        c.submit(prompt="hi", n=2, best_of=40)
    bad = {"a": (dict(n=17), "n is 17, the limit is 16"),
           "b": (dict(n=2, use_beam_search=True), "beam search is greedy"),
           "c": (dict(n=3, best_of=2), "best_of must be"),
           "d": (dict(n=2, early_stopping="sometimes"), "early_stopping")}
    for tag, (fields, _) in bad.items():
        rds.xadd(c.keys.jobs, {"id": f"bad-{tag}", "job": json.dumps({"prompt": "hi", "max_tokens": 4, **fields})})
    start_worker(queue, pq_tiny_model, *FLAGS)
    for tag, (_, says) in bad.items():
        wait_for(lambda tag=tag: rds.exists(c.keys.job(f"bad-{tag}")), 120, f"a worker to take bad-{tag}")
        res = c.result(f"bad-{tag}", timeout=120)
        assert res.status == "failed" and says in res.error.message, (tag, res.error)
    assert c.submit(prompt="still here", max_tokens=3).result(timeout=120).status == "completed"


@pytest.mark.slow
def test_sigkill_mid_generation_resumes_every_continuation(redis_url, queue, rds, pq_tiny_model, start_worker,
                                                          reference):
    c = Client(redis_url, queue=queue)
    a = start_worker(queue, pq_tiny_model, *FLAGS, "--lease-ms", "1500")  # its jobs move on soon after a kill
    wait_for(lambda: started(a), 120, "worker A")
    req = JobRequest(prompt="Four stories at once:", n=4, temperature=0.8, seed=11, max_tokens=120,
                     ignore_eos=True)
    job = c.submit(req)
    # Killed once every continuation has streamed something, and none has ended.
    wait_for(lambda: {e.index for e in events_of(c, req.id)} == {0, 1, 2, 3}, 120, "all four streaming")
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    streamed = len(events_of(c, req.id))
    start_worker(queue, pq_tiny_model, *FLAGS, "--lease-ms", "1500")
    res = job.result(timeout=180)
    assert res.status == "completed" and res.attempts > 1, res
    assert [(ch.token_ids, ch.text) for ch in res.choices] == reference(req)
    assert len(events_of(c, req.id)) > streamed
    assert_stream_holds_every_choice(c, res)  # nothing repeated, nothing missing, per continuation


def test_openai_sdk_n_best_of_and_beams_through_serve(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    """The official openai client: n=3 chat, streamed and not; best_of on completions; beam search as vLLM's
    extra parameters. Usage counts every choice's tokens."""
    import openai

    start_worker(queue, pq_tiny_model, *FLAGS, "--served-model-name", "tiny")
    base = start_serve(queue, "--model", "tiny")
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Name three colours."}]
    c = Client(redis_url, queue=queue)
    chat = oa.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=8, temperature=0.9, seed=4)
    res = c.result(chat.id.split("-", 1)[1], timeout=10)
    assert [ch.index for ch in chat.choices] == [0, 1, 2]
    assert [ch.message.content for ch in chat.choices] == [ch.text for ch in res.choices]
    assert chat.usage.completion_tokens == sum(len(ch.token_ids) for ch in res.choices) == 24

    chunks = list(oa.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=8, temperature=0.9,
                                             seed=4, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert [texts[i] for i in range(3)] == [ch.message.content for ch in chat.choices]  # the same seed
    assert finishes == {0: "length", 1: "length", 2: "length"} and chunks[-1].usage.completion_tokens == 24

    best = oa.completions.create(model="tiny", prompt="The best line:", n=2, best_of=4, max_tokens=6,
                                 temperature=0.9, seed=2)
    assert len(best.choices) == 2 and best.usage.completion_tokens == 12
    beams = oa.completions.create(model="tiny", prompt="The best line:", n=2, max_tokens=6, temperature=0,
                                  extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.8})
    res = c.result(beams.id.split("-", 1)[1], timeout=10)
    assert [ch.text for ch in beams.choices] == [ch.text for ch in res.choices] and len(res.choices) == 2
    with pytest.raises(openai.BadRequestError, match="limit is 16"):
        oa.chat.completions.create(model="tiny", messages=msgs, n=17)
