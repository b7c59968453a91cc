"""A job the worker holds, and the JobResult it ends with."""

from __future__ import annotations

from dataclasses import dataclass

from producer.calls import Delivery
from producer.protocol import ErrorInfo, JobRequest, JobResult, Timings, TokenLogprob, Usage

FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


@dataclass
class RunningJob:
    id: str
    entry: str  # its stream entry id, to XACK
    lease: str  # the token every write presents
    attempts: int
    enqueued_at: float | None
    started_at: float
    request: JobRequest | None = None
    prompt_tokens: int = 0
    deadline: float | None = None  # unix time past which it expires
    first_token_at: float | None = None
    last: object | None = None  # the latest RequestOutput: running totals for a cancelled job's partial result
    logprobs: list[TokenLogprob] | None = None  # filled by the publisher, in step order
    emitted: int = 0  # output tokens in its event stream (those of earlier deliveries included)
    resume_ids: list[int] | None = None  # output an earlier delivery streamed, that this one continues
    resume_text: str = ""

    @property
    def delivery(self) -> Delivery:
        return Delivery(self.id, self.entry, self.lease)

    def result(self, status: str, worker: str, model: str | None, finished_at: float, out=None,
               finish_reason: str | None = None, error: ErrorInfo | None = None) -> JobResult:
        out = out if out is not None else self.last
        if finish_reason is None and out is not None:
            finish_reason = FINISH.get(out.finish_reason or "")
        ids = list(out.token_ids) if out is not None else list(self.resume_ids or [])
        return JobResult(
            id=self.id,
            status=status,
            text=out.text if out is not None else self.resume_text,
            token_ids=ids,
            finish_reason=finish_reason,
            usage=Usage(prompt_tokens=self.prompt_tokens,
                        completion_tokens=len(ids),
                        cached_tokens=out.num_cached_tokens if out is not None else 0),
            timings=Timings(enqueued_at=self.enqueued_at, started_at=self.started_at,
                            first_token_at=self.first_token_at, finished_at=finished_at),
            worker=worker,
            attempts=self.attempts,
            error=error,
            model=model,
            logprobs=self.logprobs,
            metadata=self.request.metadata if self.request is not None else {},
        )
