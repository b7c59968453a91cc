"""Fault test 8: hostile payloads, through the client and raw onto the stream. Each is refused at submit or
ends with a result; the worker stays up, the stream drains, and a good job afterwards completes."""

import itertools
import json
from collections import Counter

import pytest
from faults import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import Client, Limits
from producer.protocol import TERMINAL
from worker.validate import Rejected, parse

pytestmark = pytest.mark.slow

# The worker's limits, the client's too: small, so that every accepted job is cheap to run.
LIMITS = Limits(max_prompt_chars=2000, max_tokens=4, max_metadata_bytes=1024)
FLAGS = ("--max-model-len", "128", "--num-kv-blocks", "256", "--max-num-seqs", "32", "--served-model-name",
         "tiny", "--max-prompt-chars", "2000", "--max-tokens-limit", "4", "--max-metadata-bytes", "1024")
BATCH, EXAMPLES = 5, 60  # payloads per hypothesis example, examples per route: 2 * 300 payloads
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

# ---- payloads: each field is plausible or hostile -------------------------------------------------------

floats = st.floats(allow_nan=True, allow_infinity=True)
junk = st.recursive(st.none() | st.booleans() | st.integers() | floats | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                max_size=3), max_leaves=6)
huge = st.integers(min_value=2**31, max_value=2**200) | st.integers(max_value=-1)
hostile_text = st.text(max_size=40) | st.sampled_from(
    ["", " ", "{q}", "a}b{c", "x:y:z", "line\nbreak", "tab\tx", "\x00", "\ud800", "😀" * 10])
ids = st.sampled_from(["j", "a:b", "{x}", "}{", "with space", "new\nline", "é", "x" * 300, "", "\x7f"])
roles = st.sampled_from(["user", "assistant", "system"]) | hostile_text
message = st.fixed_dictionaries({}, optional={"role": roles | junk, "content": hostile_text | junk,
                                              "name": junk})
prompt = st.sampled_from(["Hi", "Tell me", "x"]) | hostile_text | st.integers(1900, 2100).map(lambda n: "é" * n) | junk
metadata = (st.dictionaries(st.text(max_size=6), junk, max_size=4)
            | st.fixed_dictionaries({"blob": st.integers(1000, 1200).map(lambda n: "b" * n)}) | junk)
FIELDS = {
    "model": st.none() | st.just("tiny") | hostile_text | junk,
    "prompt": prompt,
    "messages": st.lists(message, max_size=3) | junk,
    "max_tokens": st.integers(1, 4) | huge | floats | junk,
    "temperature": st.sampled_from([0, 0.7]) | floats | junk,
    "top_p": floats | junk,
    "top_k": st.integers(-2, 50) | huge | junk,
    "min_p": floats | junk,
    "seed": st.integers(0, 9) | huge | junk,
    "stop": st.lists(hostile_text | junk, max_size=20) | hostile_text | junk,
    "stop_token_ids": st.lists(st.integers(-5, 100) | huge, max_size=4) | junk,
    "ignore_eos": st.booleans() | junk,
    "logprobs": st.none() | st.integers(-3, 30) | junk,
    "priority": st.integers(-3, 3) | huge | junk,
    "timeout_s": st.none() | st.sampled_from([1e-9, 60.0]) | floats | junk,
    "metadata": metadata,
    "max_token": junk,  # extra fields: typos and made-up ones
    "__proto__": junk,
}
# Mostly a prompt and a few hostile fields (so that some jobs run), else anything at all.
payload = (st.fixed_dictionaries({"prompt": prompt, "max_tokens": FIELDS["max_tokens"]},
                                 optional={"id": ids | junk, **{k: v for k, v in FIELDS.items()
                                                                if k not in ("prompt", "max_tokens")}})
           | st.fixed_dictionaries({}, optional={"id": ids | junk, **FIELDS}))


def deep(n: int) -> dict:
    d: dict = {}
    for _ in range(n):
        d = {"a": d}
    return d


# Found by hand or by earlier runs; always sent, whatever hypothesis draws.
KNOWN = [
    {"prompt": "x", "max_tokens": 2, "temperature": 0.7, "top_k": 2**70},  # overflowed the sampler's tensor
    {"prompt": "x", "max_tokens": 2, "seed": -(2**80)},
    {"prompt": "x", "max_tokens": 2, "stop_token_ids": [2**70]},
    {"prompt": "x", "max_tokens": 2, "priority": 2**100},
    {"prompt": "x", "max_tokens": 2, "temperature": float("inf")},
    {"prompt": "x", "max_tokens": 2, "timeout_s": float("nan")},
    {"prompt": "x", "max_tokens": 2, "metadata": {"a": float("nan")}},
    {"prompt": "x", "max_tokens": 2, "metadata": deep(5000)},
    {"prompt": "x", "max_tokens": 2, "metadata": {"s": {1, 2}}},
    {"prompt": "x", "max_tokens": 2, "metadata": {"b": b"\xff"}},
    {"prompt": "\ud800", "max_tokens": 2},
    {"prompt": "x", "messages": [{"role": "user", "content": "y"}], "max_tokens": 2},
    {"messages": [{"role": "\x00" * 64, "content": "y"}], "max_tokens": 2},
    {"messages": [{"role": "user", "content": "y"}] * 2000, "max_tokens": 2},
    {"prompt": "x", "max_tokens": 2, "stop": ["s"] * 100},
]


def add_unique_id(p: dict, n: int) -> dict:
    # Hostile ids keep their hostility but get a suffix, so that no two payloads (or hypothesis replays) share
    # an id and hit the duplicate check instead of the one under test.
    if isinstance(p.get("id"), str):
        p["id"] += f"-{n}"
    return p


# ---- raw stream entries -----------------------------------------------------------------------------------

def raw_entry(p: dict, n: int, kind: str, blob: bytes) -> dict:
    """A stream entry as a producer that skips the client might write it."""
    jid = f"raw{n}" + (p["id"] if isinstance(p.get("id"), str) else "")
    body = {**p, "id": jid}
    if kind == "json":
        return {"id": jid, "job": json.dumps(body)}  # NaN / Infinity included: Python's json allows them
    if kind == "other-id":
        return {"id": jid, "job": json.dumps({**body, "id": f"not-{jid}"})}
    if kind == "no-id":
        return {"job": json.dumps(body)}
    if kind == "no-job":
        return {"id": jid, "payload": json.dumps(body)}
    if kind == "bytes":
        return {"id": jid, "job": blob}
    if kind == "bytes-id":
        return {"id": jid.encode() + b"\xff\xfe", "job": json.dumps(body)}
    if kind == "not-object":
        return {"id": jid, "job": json.dumps([body])}
    if kind == "pickle-like":
        return {"id": jid, "job": b"\x80\x04\x95" + blob}  # a pickle header: never unpickled
    return {"id": jid, "job": json.dumps(body), "extra": blob, "more": "x" * 100}


KINDS = ("json", "json", "json", "other-id", "no-id", "no-job", "bytes", "bytes-id", "not-object",
         "pickle-like", "extra-fields")
raw = st.tuples(payload, st.sampled_from(KINDS), st.binary(min_size=1, max_size=64))


def job_id_of(fields: dict, entry: str) -> str:
    """The id the worker files the entry's result under (see Worker._admit); it decodes bytes leniently."""
    jid = fields.get("id")
    if isinstance(jid, bytes):
        jid = jid.decode("utf-8", "replace")
    return jid or entry


def would_run(fields: dict, job_id: str) -> bool:
    """The worker's own checks, run here: False means the job must fail."""
    job = fields.get("job")
    if isinstance(job, bytes):
        job = job.decode("utf-8", "replace")
    try:
        req = parse({"job": job} if job is not None else {}, job_id, LIMITS, {"tiny"})
        req.model_dump_json()
        return True
    except Rejected:
        return False


def test_hostile_payloads(redis_url, queue, rds, pq_tiny_model, start_worker):
    c = Client(redis_url, queue=queue, limits=LIMITS)
    proc = start_worker(queue, pq_tiny_model, *FLAGS)
    counter = itertools.count()
    refused, accepted = [], []  # client route
    entries = []  # raw route: (entry id, fields)

    @FUZZ
    @given(st.lists(payload, min_size=BATCH, max_size=BATCH))
    def through_client(batch: list[dict]) -> None:
        for p in batch:
            p = add_unique_id(p, next(counter))
            try:
                accepted.append(c.submit(p).id)
            except ValueError as e:  # ValidationError, a limit, or JSON that cannot be encoded: a clear refusal
                assert str(e), p
                refused.append(type(e).__name__)

    @FUZZ
    @given(st.lists(raw, min_size=BATCH, max_size=BATCH))
    def raw_onto_stream(batch: list) -> None:
        for p, kind, blob in batch:
            fields = raw_entry(p, next(counter), kind, blob)
            entries.append((rds.xadd(c.keys.jobs, fields), fields))

    through_client.hypothesis.inner_test(KNOWN)
    raw_onto_stream.hypothesis.inner_test([(p, "json", b"") for p in KNOWN if "metadata" not in p])
    through_client()
    raw_onto_stream()
    total = len(refused) + len(accepted) + len(entries)
    print(f"fuzz: {total} payloads; client: {len(refused)} refused ({Counter(refused)}), {len(accepted)} "
          f"accepted; raw: {len(entries)}")
    assert total >= 500 and len(refused) >= 50 and len(accepted) >= 20

    # Every entry, from either route, is acked and deleted once its job ends.
    def drained() -> bool:
        assert proc.poll() is None, "the worker died"
        return rds.xlen(c.keys.jobs) == 0 and rds.xpending(c.keys.jobs, "workers")["pending"] == 0

    wait_for(drained, 120, "the stream to drain")
    for job_id in accepted:
        res = c.result(job_id, timeout=5)
        assert res.status in TERMINAL and res.status != "cancelled", res
        if res.status == "failed":
            assert res.error and res.error.type and res.error.message, res
        else:
            assert len(res.token_ids) <= LIMITS.max_tokens
    failed = 0
    outcomes = Counter()
    for entry, fields in entries:
        job_id = job_id_of(fields, entry)
        res = c.result(job_id, timeout=5)
        outcomes[res.error.type if res.error else res.status] += 1
        if not would_run(fields, job_id):
            assert res.status == "failed" and res.error.type and res.error.message, (fields, res)
            failed += 1
        else:
            assert res.status in ("completed", "failed", "expired"), (fields, res)
    print(f"fuzz: raw outcomes {dict(outcomes)}")
    assert failed >= len(entries) // 3
    assert proc.poll() is None, "the worker died"

    good = c.submit(prompt="Hello", max_tokens=2, temperature=0, model="tiny").result(timeout=60)
    assert good.status == "completed" and len(good.token_ids) == 2
    assert proc.poll() is None
