"""The worker's publisher process: it decodes text as the engine would, it dies with its worker, and a worker
whose publisher died stops with a clear error instead of computing results nobody writes."""

import os
import re
import signal
from pathlib import Path

import pytest
from faults import log_of, started, wait_for

from engine import Constraint, SamplingParams
from producer import Client
from worker.job import RunningJob
from worker.publisher.handle import extra
from worker.publisher.job_view import JobView
from worker.publisher.messages import Extra, tokenizer_spec
from worker.publisher.process import RustTokenizer

FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "256", "--lease-ms", "1500")


# the `engine` fixture (conftest.py)
pytestmark = pytest.mark.engine(max_num_seqs=8, num_kv_blocks=256, max_model_len=256)


def _follow(engine, tokenizer, prompt: list[int], params: SamplingParams, resume: tuple[list[int], str] = ([], "")
            ) -> tuple[str, str]:
    """(the engine's own text, the text a JobView decodes from the same step records)."""
    from engine.detokenizer import CONTEXT_TOKENS

    engine.add_request("r", prompt_token_ids=prompt, params=params, resume_token_ids=resume[0],
                       resume_text=resume[1])
    job = RunningJob(id="r", entry="0-1", lease="l", attempts=1, enqueued_at=None, started_at=0.0,
                     resumed=[[0, resume[0], resume[1], None]] if resume[0] else [])
    view = JobView.begin(job, tokenizer, prompt[-CONTEXT_TOKENS:])
    while True:
        for out in engine.step():
            assert out.text_deferred  # nothing in the step needs the text without stop strings
            view.take(out.new_token_ids, extra(0, out) if out.finished else None, 0, 0.0)
            if out.finished:
                return out.text, view.choice(0).text()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_the_publisher_decodes_as_the_engine(engine, seed):
    tokenizer = RustTokenizer(tokenizer_spec(engine.tokenizer)[1])  # as the process gets it: JSON, no transformers
    prompt = engine.tokenizer.encode(f"Café ☕ naïve 你好 {seed}")
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed)
    ref, got = _follow(engine, tokenizer, prompt, params)
    assert got == ref
    first = engine.generate([prompt], SamplingParams(max_tokens=7, temperature=1.0, seed=seed))[0]
    # Ended by a stop token (one this run samples), whose text is never shown.
    stop = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, stop_token_ids=[first.token_ids[4]])
    ref, got = _follow(engine, tokenizer, prompt, stop)
    assert got == ref
    # Resumed after tokens another delivery streamed.
    ref, got = _follow(engine, tokenizer, prompt, params, (list(first.token_ids), first.text))
    assert got == ref


def test_the_publisher_shows_a_grammars_last_token_and_hides_a_stop_token(engine):
    """The publisher leaves out a last token only where the engine says it is a hidden stop token: a grammar's
    last token ends its job with "stop" too, and shows. (Every output decoded by the publisher here, as it is
    once the engine defers a grammar's last token like any other.)"""
    from engine.detokenizer import CONTEXT_TOKENS

    tokenizer = RustTokenizer(tokenizer_spec(engine.tokenizer)[1])
    prompt = engine.tokenizer.encode("Code:")
    free = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    cases = {"grammar": SamplingParams(max_tokens=16, temperature=0,
                                       constraint=Constraint("regex", "[a-f]{4}-[0-9]{2}")),
             "stop token": SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[free.token_ids[3]])}
    texts = {}
    for name, params in cases.items():
        engine.add_request(name, prompt_token_ids=prompt, params=params)
        view = JobView.begin(RunningJob(id=name, entry="0-1", lease="l", attempts=1, enqueued_at=None,
                                        started_at=0.0), tokenizer, prompt[-CONTEXT_TOKENS:])
        last = None
        while last is None:
            for out in engine.step():
                extra = Extra(0, None, out.finish_reason, None, out.hidden_stop) if out.finished else None
                view.take(out.new_token_ids, extra, 0, 0.0)
                last = out if out.finished else None
        assert last.finish_reason == "stop" and last.hidden_stop == (name == "stop token"), name
        texts[name] = view.choice(0).text()
        assert texts[name] == last.text, name
    assert re.fullmatch("[a-f]{4}-[0-9]{2}", texts["grammar"])  # its last digit shown
    assert texts["stop token"] == engine.tokenizer.decode(free.token_ids[:3], skip_special_tokens=True)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_the_publisher_process_ends_with_its_worker(redis_url, queue, pq_tiny_model, start_worker):
    w = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_for(lambda: started(w), 120, "the worker")
    with Client(redis_url, queue=queue) as c:
        res = c.submit(prompt="hello", max_tokens=8, temperature=0, logprobs=2).result(timeout=60)
    assert res.status == "completed" and len(res.token_ids) == 8
    # Logprobs cross the pipe too: each token's own, and its top 2 keyed by token id.
    assert [lp.token_id for lp in res.logprobs] == res.token_ids
    assert all(len(lp.top) == 2 and lp.token_id in lp.top for lp in res.logprobs)
    [child] = _children(w.pid)
    os.kill(w.pid, signal.SIGKILL)
    w.wait()
    wait_for(lambda: not _alive(child), 30, "the publisher process to exit after its worker")


def test_a_worker_stops_when_its_publisher_dies(redis_url, queue, pq_tiny_model, start_worker):
    w = start_worker(queue, pq_tiny_model, *FLAGS)
    wait_for(lambda: started(w), 120, "the worker")
    [child] = _children(w.pid)
    with Client(redis_url, queue=queue) as c:
        job = c.submit(prompt="hello", max_tokens=200, temperature=0, ignore_eos=True)
        wait_for(lambda: c.redis.xlen(c.keys.events(job.id)) >= 1, 60, "tokens")
        os.kill(child, signal.SIGKILL)
        assert w.wait(60) != 0
        assert "publisher process exited" in log_of(w)
        # Its job is not lost: a worker started after it resumes it once the lease runs out.
        w2 = start_worker(queue, pq_tiny_model, *FLAGS)
        wait_for(lambda: started(w2), 120, "the second worker")
        res = job.result(timeout=120)
    assert res.status == "completed" and len(res.token_ids) == 200
