"""Fault test 8: hostile requests, thousands, over every JobRequest field, through the client and raw onto the
stream, beside well-formed jobs on one worker. Each hostile one is refused at submit or ends with a result (a
failure says why); no engine step fails (every bad value is stopped where it enters); the well-formed jobs equal
an undisturbed run token for token; the worker stays up, the stream drains, and a job afterwards completes."""

import itertools
import json
from collections import Counter

import pytest
from faults import check_all, log_of, make_requests, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer import Client, JobRequest, Limits
from producer import protocol as P
from producer.protocol import TERMINAL
from worker.validate import Rejected, parse

pytestmark = pytest.mark.slow

# The worker's limits, the client's too: small, so that every accepted job is cheap to run.
LIMITS = Limits(max_prompt_chars=2000, max_tokens=16, max_metadata_bytes=1024)
FLAGS = ("--max-model-len", "128", "--num-kv-blocks", "256", "--max-num-seqs", "32", "--served-model-name",
         "tiny", "--max-prompt-chars", "2000", "--max-tokens-limit", "16", "--max-metadata-bytes", "1024")
BATCH, EXAMPLES = 10, 110  # payloads per hypothesis example, examples per route: 2 * 1,100 payloads
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

# ---- payloads: each field is plausible, at or past its bounds, of the wrong type, or not valid Unicode -------

floats = st.floats(allow_nan=True, allow_infinity=True)
junk = st.recursive(st.none() | st.booleans() | st.integers() | floats | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                max_size=3), max_leaves=6)
huge = st.integers(min_value=2**31, max_value=2**200) | st.integers(max_value=-1)
lone = st.sampled_from(["\ud800", "a\udfffb", "😀\ud83d", "\udc00" * 3])  # lone surrogates: not valid Unicode
hostile_text = st.text(max_size=40) | lone | st.sampled_from(
    ["", " ", "{q}", "a}b{c", "x:y:z", "line\nbreak", "tab\tx", "\x00", "😀" * 10, "x" * 1001])


def ints(lo: int, hi: int, plausible: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """Integers in range, at its ends, just past them, far past them, and not integers at all."""
    edges = st.sampled_from([lo, hi, lo - 1, hi + 1, 2**63, -(2**63) - 1, 2**64, 2**200])
    return (st.integers(lo, min(hi, lo + 50)) if plausible is None else plausible) | edges | huge | floats | junk


def reals(lo: float, hi: float, plausible: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """Floats in range, at its ends, just past them, the extremes of a float, NaN and infinities, wrong types."""
    edges = st.sampled_from([lo, hi, lo - 1e-9, hi * (1 + 1e-9) + 1e-9, 5e-324, -5e-324, 1e-45, 1e38, 3.5e38, 1e308,
                             -1e308])
    return (st.floats(lo, hi) if plausible is None else plausible) | edges | floats | junk


schema = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]}, True,
                          {"type": "nope"}, {"$ref": "#/nowhere"}, {"pattern": "("}, {"type": "object", "k": "\ud800"}])
roles = st.sampled_from(["user", "assistant", "system"]) | hostile_text
message = st.fixed_dictionaries({}, optional={"role": roles | junk, "content": hostile_text | junk, "name": junk})
prompt = st.sampled_from(["Hi", "Tell me", "x"]) | hostile_text | st.integers(1900, 2100).map(lambda n: "é" * n) | junk
metadata = (st.dictionaries(st.text(max_size=6) | lone, junk | lone, max_size=4)
            | st.fixed_dictionaries({"blob": st.integers(1000, 1200).map(lambda n: "b" * n)}) | junk)
FIELDS = {
    "model": st.none() | st.just("tiny") | hostile_text | st.just("m" * 300) | junk,
    "prompt": prompt,
    "messages": st.lists(message, max_size=3) | junk,
    "max_tokens": ints(1, P.INT32_MAX, st.integers(1, 4)) | st.sampled_from([16, 17]),
    "temperature": reals(0, P.MAX_TEMPERATURE, st.sampled_from([0, 0.7, 1e-40])),
    "top_p": reals(0, 1, st.sampled_from([1, 0.5, 1e-300])),
    "top_k": ints(-1, P.INT32_MAX, st.integers(-2, 50)),
    "min_p": reals(0, 1),
    "seed": st.none() | ints(P.INT64_MIN, P.INT64_MAX, st.integers(0, 9)),
    "stop": st.lists(hostile_text | junk, max_size=20) | hostile_text | junk,
    "stop_token_ids": st.lists(ints(0, P.INT32_MAX, st.sampled_from([0, 2, 49151, 49152, 10**6])), max_size=4)
    | st.integers(250, 260).map(lambda n: list(range(n))) | junk,
    "ignore_eos": st.booleans() | junk,
    "logprobs": st.none() | ints(0, 20),
    "presence_penalty": reals(-2, 2),
    "frequency_penalty": reals(-2, 2),
    "repetition_penalty": reals(P.MIN_REPETITION_PENALTY, P.MAX_REPETITION_PENALTY, st.sampled_from([1.0, 1.3])),
    "n": ints(1, P.INT32_MAX, st.integers(1, 3)) | st.sampled_from([16, 17, 33]),
    "best_of": st.none() | ints(1, P.INT32_MAX, st.integers(1, 4)) | st.sampled_from([32, 33]),
    "use_beam_search": st.booleans() | junk,
    "beam_width": st.none() | ints(1, P.INT32_MAX, st.integers(1, 4)) | st.sampled_from([32, 33]),
    "length_penalty": reals(-P.MAX_LENGTH_PENALTY, P.MAX_LENGTH_PENALTY, st.sampled_from([1.0, 2000.0, -2000.0])),
    "early_stopping": st.sampled_from([True, False, "never", "sometimes"]) | junk,
    "speculative": st.booleans() | st.sampled_from([0, 1, "false", "no"]) | junk,
    "response_format": st.none() | st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}])
    | schema.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}) | junk,
    "guided_json": st.none() | schema | st.just("{not json") | junk,
    "guided_regex": st.none() | st.sampled_from(["[ab]{2}", "(", "a*", "\\d+\ud800"]) | hostile_text | junk,
    "guided_choice": st.none() | st.lists(hostile_text, max_size=3) | junk,
    "guided_grammar": st.none() | st.sampled_from(['start: "a" | "b"', "start: (", 'root ::= "x"']) | junk,
    "lane": st.sampled_from(["interactive", "default", "batch", "urgent", "", "Batch"]) | hostile_text | junk,
    "priority": ints(-P.INT32_MAX, P.INT32_MAX, st.integers(-3, 3)),
    "group": st.none() | st.sampled_from(["acme", "a@b.c", "{x}", "with space", "g" * 129, "new\n", "ok\n"])
    | hostile_text | junk,
    "timeout_s": st.none() | reals(1e-9, P.MAX_TIMEOUT_S, st.sampled_from([1e-9, 60.0])),
    "metadata": metadata,
    "max_token": junk,  # extra fields: typos and made-up ones
    "__proto__": junk,
}
# Mostly a prompt and a few hostile fields (so that some jobs run), else anything at all.
payload = (st.fixed_dictionaries({"prompt": prompt, "max_tokens": FIELDS["max_tokens"]},
                                 optional={"id": st.sampled_from(["j", "a:b", "{x}", "}{", "with space", "new\nline",
                                                                  "é", "x" * 300, "", "\x7f", "\ud800"]) | junk,
                                           **{k: v for k, v in FIELDS.items() if k not in ("prompt", "max_tokens")}})
           | st.fixed_dictionaries({}, optional={"id": junk, **FIELDS}))


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
    {"prompt": "x", "max_tokens": 2, "stop_token_ids": [49152]},  # past the vocabulary: beam candidates, bans
    {"prompt": "x", "max_tokens": 2, "priority": 2**100},
    {"prompt": "x", "max_tokens": 2, "temperature": float("inf")},
    {"prompt": "x", "max_tokens": 2, "timeout_s": float("nan")},
    {"prompt": "x", "max_tokens": 2, "metadata": {"a": float("nan")}},
    {"prompt": "x", "max_tokens": 2, "metadata": deep(5000)},
    {"prompt": "x", "max_tokens": 2, "metadata": {"s": {1, 2}}},
    {"prompt": "x", "max_tokens": 2, "metadata": {"b": b"\xff"}},
    {"prompt": "\ud800", "max_tokens": 2},
    {"prompt": "x", "max_tokens": 2, "metadata": {"k\ud800": 1}},
    {"prompt": "x", "messages": [{"role": "user", "content": "y"}], "max_tokens": 2},
    {"messages": [{"role": "\x00" * 64, "content": "y"}], "max_tokens": 2},
    {"messages": [{"role": "user", "content": "y"}] * 2000, "max_tokens": 2},
    {"prompt": "x", "max_tokens": 2, "stop": ["s"] * 100},
    # Issue 38's: an OverflowError in the beam step failed every job of the batch and stopped the worker.
    {"prompt": "x", "max_tokens": 4, "use_beam_search": True, "n": 2, "temperature": 0, "length_penalty": 2000},
    {"prompt": "x", "max_tokens": 4, "use_beam_search": True, "n": 2, "temperature": 0, "length_penalty": 10,
     "stop_token_ids": list(range(256))},
    {"prompt": "x", "max_tokens": 4, "n": 2, "best_of": 33},  # wider than any batch of this worker
    {"prompt": "x", "max_tokens": 16, "n": 16, "best_of": 32},  # as wide as it takes: runs
    {"prompt": "x", "max_tokens": 4, "temperature": 1e-45, "top_p": 1e-300},
    {"prompt": "x", "max_tokens": 4, "logprobs": 20, "temperature": 0.5, "repetition_penalty": 0.01},
]


def test_every_field_is_fuzzed():
    assert set(JobRequest.model_fields) <= set(FIELDS) | {"id"}, set(JobRequest.model_fields) - set(FIELDS)


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
    jid = jid.encode("utf-8", "backslashreplace").decode()  # Redis takes bytes: a surrogate cannot be sent
    body = {**p, "id": jid}
    # NaN / Infinity included: Python's json allows them; a lone surrogate goes as its escape, as JSON spells it.
    text = json.dumps(body, default=repr)
    if kind == "json":
        return {"id": jid, "job": text}
    if kind == "other-id":
        return {"id": jid, "job": json.dumps({**body, "id": f"not-{jid}"}, default=repr)}
    if kind == "no-id":
        return {"job": text}
    if kind == "no-job":
        return {"id": jid, "payload": text}
    if kind == "bytes":
        return {"id": jid, "job": blob}
    if kind == "bytes-id":
        return {"id": jid.encode() + b"\xff\xfe", "job": text}
    if kind == "not-object":
        return {"id": jid, "job": json.dumps([body], default=repr)}
    if kind == "pickle-like":
        return {"id": jid, "job": b"\x80\x04\x95" + blob}  # a pickle header: never unpickled
    return {"id": jid, "job": text, "extra": blob, "more": "x" * 100}


KINDS = ("json", "json", "json", "json", "other-id", "no-id", "no-job", "bytes", "bytes-id", "not-object",
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


def test_hostile_payloads(redis_url, queue, rds, pq_tiny_model, start_worker, pq_reference, pq_check_stream):
    c = Client(redis_url, queue=queue, limits=LIMITS)
    proc = start_worker(queue, pq_tiny_model, *FLAGS)
    counter = itertools.count()
    refused, accepted = [], []  # client route
    entries = []  # raw route: (entry id, fields)
    good = [r.model_copy(update={"model": "tiny"}) for r in make_requests(12, "good", 12)]

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

    jobs = c.submit_many(good[:6])  # the well-formed ones run among the hostile ones
    through_client.hypothesis.inner_test(KNOWN)
    raw_onto_stream.hypothesis.inner_test([(p, "json", b"") for p in KNOWN if "metadata" not in p])
    through_client()
    jobs += c.submit_many(good[6:])
    raw_onto_stream()
    total = len(refused) + len(accepted) + len(entries) + len(good)
    print(f"fuzz: {total} requests; client: {len(refused)} refused at submit ({Counter(refused)}), {len(accepted)} "
          f"accepted; raw: {len(entries)}; well-formed: {len(good)}")
    assert total >= 2000 and len(refused) >= 300 and len(accepted) >= 100

    # Every entry, from either route, is acked and deleted once its job ends.
    def drained() -> bool:
        assert proc.poll() is None, "the worker died"
        return rds.xlen(c.keys.jobs) == 0 and rds.xpending(c.keys.jobs, "workers")["pending"] == 0

    wait_for(drained, 300, "the stream to drain")
    check_all(c, good, [j.result(timeout=5) for j in jobs], pq_reference, pq_check_stream)
    outcomes = Counter()
    for job_id in accepted:
        res = c.result(job_id, timeout=5)
        outcomes[res.error.type if res.error else res.status] += 1
        assert res.status in TERMINAL and res.status != "cancelled", res
        if res.status == "failed":
            assert res.error and res.error.type and res.error.message, res
        else:
            assert len(res.token_ids) <= LIMITS.max_tokens
    print(f"fuzz: accepted at submit, then {dict(outcomes)}")
    failed, outcomes = 0, Counter()
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
    log = log_of(proc)
    assert "engine step failed" not in log, log[log.index("engine step failed") - 2000:][:6000]

    after = c.submit(prompt="Hello", max_tokens=2, temperature=0, model="tiny").result(timeout=60)
    assert after.status == "completed" and len(after.token_ids) == 2
    assert proc.poll() is None
