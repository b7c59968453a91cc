"""What crosses the pipe between the worker and its publisher process, and the record of one job's step.

Worker -> process, in order: (SETUP, Setup); (BEGIN, job, prompt tail) when a job enters the engine;
(STEP, now, job ids, tokens, cached, extras) per engine step (see StepOutput); (END | FAIL | RELEASE, job, ...)
as Publisher's calls of the same names; (FORGET, job id, lease) for a job dropped without a result; (FLUSH, n)
asks for word once everything before it is written; (STOP, timeout), the last.
Process -> worker: (SETTLED, n) finished jobs written; (NOTICE, kind, job id, lease) a cancel or a lost lease
learned from Redis; (METRIC, name, *args) a call of writer.WriterMetrics to make on the worker's Metrics;
(FLUSHED, n) everything handed over before (FLUSH, n) is written (or given up on).
Every message is JSON: nothing but JSON is ever decoded by the worker's processes. Jobs travel as job_to_wire's
dict.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

from producer import calls
from producer.durability import ASYNC_DURABILITY, Durability
from producer.protocol import JobRequest
from worker.job import RunningJob

if TYPE_CHECKING:
    from worker.publisher.job_view import ChoiceView, JobView

SETUP, BEGIN, STEP, END, FAIL, RELEASE, FORGET, FLUSH, STOP = (
    "setup", "begin", "step", "end", "fail", "release", "forget", "flush", "stop")
SETTLED, NOTICE, METRIC, FLUSHED = "settled", "notice", "metric", "flushed"


class StepOutput(NamedTuple):
    """One job's news from one engine step, as the publisher process writes it. (A tuple: one per job per step.)

    A step crosses the pipe by column, which encodes several times faster than a record per job: the job ids, the
    new tokens (an int where there is one), the prompt tokens served from the prefix cache, and, for the few jobs
    with more to say, an extra (index, the text the step decoded for stop strings or null, the finish reason,
    the logprobs, and for a job with several continuations: which one, whether the job ends, its cumulative
    logprob). The process rebuilds one StepOutput per job: it decodes the text the step left to it, and
    counts where the tokens start in the job's stream."""

    view: JobView  # the job as the process follows it
    choice: ChoiceView  # the continuation these are of (a job with one: its only one)
    offset: int  # output tokens the job's event stream holds before these (every continuation's)
    token_ids: list[int]  # the new ones
    text: str  # theirs
    finish_reason: str | None  # set on the continuation's last step: stop, length or abort
    ends_job: bool  # the job's last step (with one continuation: the same as a finish reason)
    cached_tokens: int
    logprobs: list | None  # per token: (its logprob, {token id: logprob} of the top N)


@dataclasses.dataclass
class Setup:
    redis_url: str
    redis_options: dict
    cluster: bool  # as the worker found it: the process need not ask the server again
    queue: str
    settings: calls.WorkerSettings
    model: str
    tokenizer: tuple[str, str]  # ("rust", its JSON) or ("folder", where transformers loads it from)
    log_level: int
    durability: Durability = ASYNC_DURABILITY

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> Setup:
        return cls(**{**d, "settings": calls.WorkerSettings(**d["settings"]), "tokenizer": tuple(d["tokenizer"]),
                      "durability": Durability(**d["durability"])})


def tokenizer_spec(tokenizer) -> tuple[str, str]:
    """What the publisher process needs to decode like the engine: a fast tokenizer's Rust core as JSON (no
    transformers import on the other side), else the folder the tokenizer was loaded from."""
    rust = getattr(tokenizer, "_tokenizer", None)
    return ("rust", rust.to_str()) if rust is not None else ("folder", str(tokenizer.name_or_path))


def job_to_wire(job: RunningJob) -> dict:
    """The job as it is now, in values JSON holds (the request as its JSON)."""
    d = {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name != "request"}
    d["request"] = job.request.model_dump(mode="json") if job.request is not None else None
    return d


def job_from_wire(d: dict) -> RunningJob:
    request = d.pop("request")
    return RunningJob(**d, request=JobRequest.model_validate(request) if request is not None else None)
