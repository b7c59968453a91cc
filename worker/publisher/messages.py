"""What crosses the pipe between the worker and its publisher process: one record per message, and the one
encoder (encode) and decoder (decode) of them.

Worker -> process, in order: Setup, first; Begin when a job enters the engine; Step per engine step; End, Fail
or Release as Publisher's calls of the same names; Forget for a job dropped without a result; Flush asks for
word once everything before it is written; Stop, the last.
Process -> worker: Settled (finished jobs written), Notice (a cancel or a lost lease learned from Redis), Metric
(a call of writer.WriterMetrics to make on the worker's Metrics), Flushed (everything before a Flush written).

Every message is JSON, [its tag, its fields...]: nothing but JSON is ever decoded by the worker's processes.
A job travels as job_to_wire's dict: the fields of RunningJob that the publisher writes, none of the worker's own.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

from producer import calls
from producer.durability import ASYNC_DURABILITY, Durability
from producer.protocol import JobRequest
from worker.job import RunningJob

# ---- worker -> process ----------------------------------------------------------------------------------------


class Setup(NamedTuple):
    redis_url: str
    redis_options: dict
    cluster: bool  # as the worker found it: the process need not ask the server again
    queue: str
    settings: calls.WorkerSettings
    model: str
    tokenizer: tuple[str, str]  # ("rust", its JSON) or ("folder", where transformers loads it from)
    log_level: int
    durability: Durability = ASYNC_DURABILITY

    @classmethod
    def from_wire(cls, fields: list) -> Setup:
        setup = cls._make(fields)
        return setup._replace(settings=calls.WorkerSettings(**setup.settings), tokenizer=tuple(setup.tokenizer),
                              durability=Durability(**setup.durability))


class Begin(NamedTuple):
    """A job entered the engine: its outputs follow."""

    job: RunningJob
    context: list[int]  # the tail of its prompt, for the decoders

    @classmethod
    def from_wire(cls, fields: list) -> Begin:
        return cls(job_from_wire(fields[0]), fields[1])


class Extra(NamedTuple):
    """What one job of a step has to say beyond its tokens: sent only for the few that do (a last step, logprobs,
    text the engine decoded, a job with several continuations)."""

    at: int  # the job's place in the step's columns
    text: str | None  # the text the step decoded (for stop strings); None: the process decodes the tokens
    finish_reason: str | None  # the engine's: stop, length or abort
    logprobs: list | None  # per token: [its logprob, [[token id, logprob], ...] of the top N] (JSON has no int keys)
    hidden_stop: bool = False  # the last token is a stop token whose text is not shown (RequestOutput.hidden_stop)
    index: int = 0  # which continuation
    ends_job: bool = False  # the job's last step (with one continuation: when it has a finish reason)
    cumulative_logprob: float | None = None


class Step(NamedTuple):
    """One engine step's outputs of the jobs the worker holds. By column, which encodes several times faster than
    a record per job (a step's cost is per-token cost): the job ids, the new tokens (an int where there is one),
    the prompt tokens served from the prefix cache; an Extra for the jobs with more to say. Offsets are not here:
    the process counts the tokens of each job it has seen."""

    now: float
    ids: list[str]
    tokens: list[int | list[int]]
    cached: list[int]
    extras: list[Extra]

    @classmethod
    def from_wire(cls, fields: list) -> Step:
        now, ids, tokens, cached, extras = fields
        return cls(now, ids, tokens, cached, [Extra._make(e) for e in extras])


class End(NamedTuple):
    """A job the engine no longer runs ends (cancelled, expired, shut down) with its output so far."""

    job: RunningJob
    status: str
    finish_reason: str
    why: str = ""  # the result's error message, if any (an expired job's: which deadline passed, where)

    @classmethod
    def from_wire(cls, fields: list) -> End:
        return cls(job_from_wire(fields[0]), *fields[1:])


class Fail(NamedTuple):
    job: RunningJob
    type: str
    message: str

    @classmethod
    def from_wire(cls, fields: list) -> Fail:
        return cls(job_from_wire(fields[0]), *fields[1:])


class Release(NamedTuple):
    """A job goes back to the queue: "handback" (draining) or "retry" (it failed)."""

    job: RunningJob
    mode: str
    type: str = ""
    message: str = ""

    @classmethod
    def from_wire(cls, fields: list) -> Release:
        return cls(job_from_wire(fields[0]), *fields[1:])


class Forget(NamedTuple):
    """A job left the engine without a result from this worker (its lease was lost)."""

    job_id: str
    lease: str


class Flush(NamedTuple):
    n: int  # the worker's count of flushes: Flushed(n) answers it


class Stop(NamedTuple):
    timeout: float  # how long Redis errors are retried before what is left is given up


# ---- process -> worker ----------------------------------------------------------------------------------------


class Settled(NamedTuple):
    n: int  # finished jobs written (or given up on): they no longer hold the worker's intake room


class Notice(NamedTuple):
    kind: str  # "cancel" | "lost"
    job_id: str
    lease: str


class Metric(NamedTuple):
    name: str  # a method of writer.WriterMetrics
    args: list


class Flushed(NamedTuple):
    n: int


Message = (Setup | Begin | Step | End | Fail | Release | Forget | Flush | Stop
           | Settled | Notice | Metric | Flushed)

TAGS: dict[type, str] = {Setup: "setup", Begin: "begin", Step: "step", End: "end", Fail: "fail",
                         Release: "release", Forget: "forget", Flush: "flush", Stop: "stop", Settled: "settled",
                         Notice: "notice", Metric: "metric", Flushed: "flushed"}
_READ = {tag: getattr(cls, "from_wire", cls._make) for cls, tag in TAGS.items()}


def encode(msg: Message) -> str:
    """msg as JSON, [its tag, its fields...]; a job as job_to_wire's dict, other records as their fields."""
    return json.dumps([TAGS[type(msg)], *msg], separators=(",", ":"), default=_plain)


def decode(value: list) -> Message:
    """A message from its JSON value (json.loads of what encode wrote)."""
    return _READ[value[0]](value[1:])


def encode_batch(encoded: list[str]) -> bytes:
    """Messages encode()d, in one write: one wake-up of the other side per batch."""
    return f"[{','.join(encoded)}]".encode()


def decode_batch(raw: bytes) -> list[Message]:
    return [decode(value) for value in json.loads(raw)]


def _plain(value: Any) -> Any:
    # Called by json only for what it cannot hold as is: the step's columns never get here.
    if isinstance(value, RunningJob):
        return job_to_wire(value)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} does not cross the publisher's pipe")


def job_to_wire(job: RunningJob) -> dict:
    """The job's fields the publisher writes, in values JSON holds (the request as its JSON)."""
    d = {name: getattr(job, name) for name in RunningJob.SENT if name != "request"}
    d["request"] = job.request.model_dump(mode="json") if job.request is not None else None
    return d


def job_from_wire(d: dict) -> RunningJob:
    request = d.pop("request")
    return RunningJob(**d, request=JobRequest.model_validate(request) if request is not None else None)


def tokenizer_spec(tokenizer) -> tuple[str, str]:
    """What the publisher process needs to decode like the engine: a fast tokenizer's Rust core as JSON (no
    transformers import on the other side), else the folder the tokenizer was loaded from."""
    rust = getattr(tokenizer, "_tokenizer", None)
    return ("rust", rust.to_str()) if rust is not None else ("folder", str(tokenizer.name_or_path))
