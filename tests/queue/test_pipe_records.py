"""The worker <-> publisher pipe's records: each message crosses as JSON and comes back as the same record; a job
crosses without the worker's own fields; the token event's encoder and decoder agree."""

import json

from producer import calls, wire
from producer.protocol import JobRequest
from worker.job import RunningJob
from worker.publisher import messages as m


def _job() -> RunningJob:
    return RunningJob(id="a", entry="1-0", lease="l", attempts=2, enqueued_at=1.0, started_at=2.0,
                      request=JobRequest(id="a", prompt="hi", max_tokens=3, metadata={"k": "v"}), prompt_tokens=4,
                      resumed=[[0, [5, 6], "xy", None]], lane="high", group="g",
                      deadline=9.0, first_token_at=3.0, unexplained_faults=1)


def _every_message() -> list:
    job = _job()
    setup = m.Setup("redis://h:1", {"socket_timeout": 5}, False, "q", calls.WorkerSettings("w", 1000, 3, 60, 100),
                    "tiny", ("rust", "{}"), 20)
    extra = m.Extra(1, None, "stop", [[-0.5, [[7, -0.5]]]], True, 2, True, -1.5)
    return [setup, m.Begin(job, [1, 2]), m.Step(1.5, ["a", "b"], [5, [6, 7]], [0, 3], [extra]),
            m.End(job, "expired", "expired", "late"), m.Fail(job, "bad", "why"), m.Release(job, "retry"),
            m.Forget("a", "l"), m.Flush(3), m.Stop(2.0), m.Settled(2), m.Notice("cancel", "a", "l"),
            m.Metric("resent", [3]), m.Flushed(3)]


def test_every_message_crosses_as_itself():
    msgs = _every_message()
    assert {type(msg) for msg in msgs} == set(m.TAGS)  # one of each kind
    for msg in msgs:
        back = m.decode(json.loads(m.encode(msg)))
        if hasattr(msg, "job"):
            back = back._replace(job=_job())  # the job: below
        assert back == msg
    batch = m.decode_batch(m.encode_batch([m.encode(msg) for msg in msgs]))
    assert [type(msg) for msg in batch] == [type(msg) for msg in msgs]


def test_every_record_of_the_pipe_has_a_tag():
    records = {v for v in vars(m).values()
               if isinstance(v, type) and issubclass(v, tuple) and hasattr(v, "_fields") and v.__module__ == m.__name__}
    assert records - {m.Extra} == set(m.TAGS)
    assert all(cls.__bases__ == (tuple,) for cls in m.TAGS)  # NamedTuples: JSON writes them as arrays


def test_a_job_crosses_without_the_workers_own_fields():
    job = _job()
    back = m.decode(json.loads(m.encode(m.Begin(job, [])))).job
    for name in RunningJob.SENT:
        assert getattr(back, name) == getattr(job, name), name
    assert (back.deadline, back.first_token_at, back.unexplained_faults) == (None, None, 0)


def test_the_token_event_decodes_as_encoded():
    fast = wire.token_event('a "quoted" ☕\n', [1, 2])
    assert fast == '{"type":"token","text":"a \\"quoted\\" ☕\\n","token_ids":[1,2]}'  # PROTOCOL.md's shape
    assert wire.read_token_event(fast) == (0, [1, 2], 'a "quoted" ☕\n', None)
    lps = [{"token_id": 3, "logprob": -0.1, "top": {3: -0.1}}]
    several = wire.token_event("b", [3], lps, index=2, finish_reason="length")
    assert json.loads(several)["logprobs"] == [{"token_id": 3, "logprob": -0.1, "top": {"3": -0.1}}]
    assert wire.read_token_event(several) == (2, [3], "b", "length")
    assert wire.read_token_event(json.dumps({"type": "done", "result": {}})) is None
