"""The protocol models and limits: no Redis needed."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from producer import JobRequest, JobResult, Keys, Limits, StreamEvent


def test_request_defaults_and_id():
    a, b = JobRequest(prompt="hi"), JobRequest(prompt="hi")
    assert a.id != b.id and len(a.id) == 32
    assert JobRequest(id="my-key", prompt="x").id == "my-key"
    assert JobRequest(prompt="x", stop="END").stop == ["END"]
    assert len(JobRequest(id=None, prompt="x").id) == 32


@pytest.mark.parametrize("fields, needle", [
    ({}, "exactly one of prompt or messages"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ({"prompt": ""}, "prompt is empty"),
    ({"messages": []}, "messages is empty"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "max_token": 5}, "max_token"),  # a typo is an error, not silently ignored
    ({"prompt": "a", "id": "has space"}, "id must be"),
    ({"messages": [{"role": "user"}]}, "content"),
])
def test_request_rejects(fields, needle):
    with pytest.raises(ValidationError, match=needle):
        JobRequest(**fields)


def test_limits():
    lim = Limits(max_prompt_chars=10, max_tokens=100, max_metadata_bytes=20)
    lim.check(JobRequest(prompt="x" * 10, max_tokens=100))
    with pytest.raises(ValueError, match="11 characters"):
        lim.check(JobRequest(prompt="x" * 11))
    with pytest.raises(ValueError, match="max_tokens is 101"):
        lim.check(JobRequest(prompt="x", max_tokens=101))
    with pytest.raises(ValueError, match="metadata"):
        lim.check(JobRequest(prompt="x", max_tokens=1, metadata={"k": "v" * 30}))


def test_result_and_event_round_trip():
    res = JobResult(id="a", status="completed", text="hi", token_ids=[1, 2], finish_reason="length")
    ev = StreamEvent.model_validate_json(f'{{"type":"done","result":{res.model_dump_json()}}}')
    assert ev.terminal and ev.result == res
    assert not StreamEvent(type="token", text="x", token_ids=[3]).terminal


def test_keys_share_a_hash_tag():
    k = Keys("q1")
    names = [k.jobs, k.dlq, k.job("a"), k.events("a"), k.result("a")]
    assert all("{q1}" in n for n in names) and len(set(names)) == len(names)
    with pytest.raises(ValueError):
        Keys("bad{queue}")


def test_import_producer_leaves_torch_out():
    code = ("import sys, producer; bad = [m for m in ('torch', 'transformers', 'engine', 'pagedq_kernels', 'worker', "
            "'monitor', 'serve', 'bench', 'cli') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_producer_exports_everything_it_names():
    import producer

    assert sorted(producer.__all__) == sorted(producer._HOMES)
    assert all(getattr(producer, name) for name in producer.__all__)


def test_cli_and_protocol_load_without_redis():
    """The GPU check runs where no `redis` package is installed: the CLI and the protocol modules must load."""
    code = ("import sys; sys.modules['redis'] = None; import cli, producer.defaults, producer.protocol, "
            "producer.wire")
    subprocess.run([sys.executable, "-c", code], check=True)
