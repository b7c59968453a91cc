"""A job as the publisher process follows it: the decoder that turns its tokens to text as the engine's deferred
decoding would, its output so far, and the JobResult it ends with."""

from __future__ import annotations

import logging

from engine.detokenizer import Detokenizer
from producer.protocol import ErrorInfo, JobResult, Timings, TokenLogprob, Usage
from worker.job import RunningJob
from worker.publisher.messages import StepOutput

log = logging.getLogger("pagedq.worker")

# The engine's finish reasons, as a JobResult names them.
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


class JobView:
    def __init__(self, job: RunningJob, detok: Detokenizer | None = None) -> None:
        """detok None: a job that never began in this process (ended before its first step); it has only the
        output of earlier deliveries."""
        self.job = job
        self.ids = list(job.resume_ids or [])
        # Joined only when a result needs it: a running text per step would copy the whole output every step.
        self.pieces = [job.resume_text]
        self.cached = 0  # prompt tokens served from the prefix cache, as of its latest step
        self.logprobs: list[TokenLogprob] | None = None  # the writer's, in step order
        # The token chunks the writer sent, in order: what it sends again to a stream that lost its last writes
        # (a failover promoted a replica that lacked them). The last chunk rides with the result and is not here.
        self.sent: list = []
        self.detok = detok

    @classmethod
    def begin(cls, job: RunningJob, tokenizer, context: list[int]) -> JobView:
        """A job that entered the engine; `context`: the tail of its prompt, for the decoder."""
        detok = Detokenizer(tokenizer, context, [])
        if job.resume_ids:
            detok.resume(job.resume_ids, job.resume_text)
        return cls(job, detok)

    def decode(self, tokens: list[int], reason: str | None) -> str:
        # As the engine's deferred decoding: a stop token (EOS included) ends the text without showing.
        if reason is None:
            return "".join(map(self.detok.add_one, tokens))
        return self.detok.add([] if reason == "stop" else tokens, final=True)[0]

    def take(self, tokens: list[int], text: str | None, reason: str | None, cached: int, logprobs,
             now: float) -> StepOutput:
        """One step's news of the job. text None: decode the tokens here; logprobs as they crossed the pipe."""
        if logprobs:  # JSON keeps no int keys: (logprob, [[token, logprob], ...]) per token
            logprobs = [(lp, dict(top)) for lp, top in logprobs]
        if text is None:
            try:
                text = self.decode(tokens, reason)
            except Exception:  # the tokens still count, and the job still ends: its text misses a piece
                log.exception("job %s: could not decode tokens %s", self.job.id, tokens)
                text = ""
        offset = len(self.ids)  # the worker's count too: the tokens its stream holds before these
        self.ids.extend(tokens)
        self.pieces.append(text)
        self.cached = cached
        if self.job.first_token_at is None and tokens:
            self.job.first_token_at = now
        return StepOutput(self, offset, tokens, text, reason, cached, logprobs)

    def text(self) -> str:
        return "".join(self.pieces)

    def result(self, status: str, worker: str, model: str | None, finished_at: float, finish_reason: str | None,
               error: ErrorInfo | None = None) -> JobResult:
        """The job's result with its output so far (once it ended, no step adds to it)."""
        job = self.job
        return JobResult(
            id=job.id,
            status=status,
            text=self.text(),
            token_ids=list(self.ids),
            finish_reason=finish_reason,
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=len(self.ids),
                        cached_tokens=self.cached),
            timings=Timings(enqueued_at=job.enqueued_at, started_at=job.started_at,
                            first_token_at=job.first_token_at, finished_at=finished_at),
            worker=worker,
            attempts=job.attempts,
            error=error,
            model=model,
            logprobs=self.logprobs,
            metadata=job.request.metadata if job.request is not None else {},
        )
