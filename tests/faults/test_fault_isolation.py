"""A failing engine step blames only its cause: faults injected into the step (tests/worker_hooks.py) fail the job
that causes them and no other; every co-batched job resumes from what it streamed and ends as an undisturbed run
would; the worker stays up. A step that fails whatever it runs stops the worker, loudly, its jobs handed back."""

import pytest
from faults import check_all, log_of, make_requests

from engine import EngineConfig, LLMEngine
from producer import Client, JobRequest
from worker.validate import sampling_params

FLAGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--max-model-len", "256", "--lease-ms", "3000")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_engine(pq_tiny_model):
    return LLMEngine(EngineConfig(model=pq_tiny_model, max_num_seqs=16, num_kv_blocks=512, max_model_len=256))


def choices_of(engine: LLMEngine, req: JobRequest) -> list[list[int]]:
    out = engine.generate([req.prompt], sampling_params(req))[0]
    return [c.token_ids for c in out.choices]


def test_a_fault_fails_only_its_cause(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference,
                                      pq_check_stream, reference_engine):
    c = Client(redis_url, queue=queue)
    good = make_requests(9, "iso", 24)
    several = [JobRequest(id="iso-n2", prompt="Two ways", max_tokens=12, n=2, temperature=0.8, seed=5,
                          ignore_eos=True),
               JobRequest(id="iso-beam", prompt="A beam", max_tokens=8, n=2, use_beam_search=True, beam_width=3,
                          temperature=0)]
    # Two culprits, each fine until it has streamed a few tokens: the step fails mid-way through many jobs.
    bad = [JobRequest(id=f"bad-{i}", prompt=f"Poison {i} says", max_tokens=24, ignore_eos=True, temperature=0)
           for i in range(2)]
    jobs = c.submit_many(good[:4] + bad[:1] + several + good[4:] + bad[1:])  # all in the first batch
    w = start_worker(queue, pq_tiny_model, *FLAGS, hooks={"fault-on": "bad-:5"})

    results = {j.id: j.result(timeout=240) for j in jobs}
    for b in bad:
        res = results[b.id]
        assert res.status == "failed" and res.error.type == "engine_error", res
        assert "injected fault" in res.error.message and b.id in res.error.message, res.error
        assert pq_check_stream(c, res) >= 1 and len(res.token_ids) == 5  # what it streamed stays
    check_all(c, good, [results[r.id] for r in good], pq_reference, pq_check_stream)
    for req in several:
        res = results[req.id]
        assert res.status == "completed", res
        assert [ch.token_ids for ch in res.choices] == choices_of(reference_engine, req), req.id
    log = log_of(w)
    assert "running them apart" in log and log.count("the engine step fails on it alone") == 2, log[-3000:]

    after = c.submit(prompt="After the faults", max_tokens=4, temperature=0).result(timeout=60)
    assert after.status == "completed" and len(after.token_ids) == 4
    assert w.poll() is None, "the worker died"


def test_a_fault_that_needs_company_ends_in_solo_runs(redis_url, queue, rds, pq_tiny_model, start_worker,
                                                      pq_reference, pq_check_stream):
    """Two jobs fail a step together and pass apart: no search convicts either. Each search counts against both;
    at --max-attempts they go back to the queue as failed deliveries, and their last delivery runs alone (the
    crash-loop rule): both complete, as the jobs beside them do."""
    c = Client(redis_url, queue=queue)
    reqs = make_requests(4, "pair", 16) + make_requests(4, "calm", 16)
    jobs = c.submit_many(reqs)
    w = start_worker(queue, pq_tiny_model, *FLAGS, "--max-attempts", "3", hooks={"fault-together": "pair-"})
    results = [j.result(timeout=240) for j in jobs]
    check_all(c, reqs, results, pq_reference, pq_check_stream)
    log = log_of(w)
    assert "convicted" in log and "the engine step fails on it alone" not in log, log[-3000:]
    assert max(r.attempts for r in results if r.id.startswith("pair-")) == 3
    assert all(r.attempts == 1 for r in results if r.id.startswith("calm-"))
    assert w.poll() is None


def test_a_step_that_fails_whatever_it_runs_stops_the_worker(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue)
    jobs = c.submit_many(make_requests(3, "dev", 8))
    w = start_worker(queue, pq_tiny_model, *FLAGS, hooks={"fault-every-step": 1})
    assert w.wait(120) != 0
    log = log_of(w)
    assert "no request to blame" in log and "Handing 3 jobs back" in log, log[-3000:]
    for job in jobs:  # handed back: no job failed for the device's fault, and none used up an attempt
        assert job.status() == "queued"
        state, handbacks = rds.hmget(c.keys.job(job.id), "state", "handbacks")
        assert state == "queued" and int(handbacks) >= 1
    assert rds.xpending(c.keys.jobs, "workers")["pending"] == 0
