"""A job as the publisher process follows it: per continuation, the decoder that turns its tokens to text as the
engine's deferred decoding would and its output so far; and the JobResult it ends with."""

from __future__ import annotations

import logging

from engine.detokenizer import Detokenizer
from producer.protocol import Choice, ErrorInfo, JobResult, Timings, TokenLogprob, Usage
from worker.job import RunningJob
from worker.publisher.messages import StepOutput

log = logging.getLogger("pagedq.worker")

# The engine's finish reasons, as a JobResult names them.
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
_ENGINE = {v: k for k, v in FINISH.items()}


class ChoiceView:
    """One continuation's output so far (a job with one has one, index 0)."""

    def __init__(self, index: int, detok: Detokenizer | None, ids: list[int], text: str,
                 finish_reason: str | None = None) -> None:
        self.index = index
        self.ids = list(ids)
        # Joined only when a result needs it: a running text per step would copy the whole output every step.
        self.pieces = [text]
        self.logprobs: list[TokenLogprob] | None = None  # the writer's, in step order
        self.finish_reason = finish_reason  # the engine's, once it ended
        self.cumulative_logprob: float | None = None
        self.detok = detok

    def decode(self, tokens: list[int], reason: str | None) -> str:
        # As the engine's deferred decoding: a stop token (EOS included) ends the text without showing.
        if reason is None:
            return "".join(map(self.detok.add_one, tokens))
        return self.detok.add([] if reason == "stop" else tokens, final=True)[0]

    def text(self) -> str:
        return "".join(self.pieces)


class JobView:
    def __init__(self, job: RunningJob, tokenizer=None, context: list[int] | None = None) -> None:
        """tokenizer None: a job that never began in this process (ended before its first step); it has only the
        output of earlier deliveries. context: the tail of its prompt, for the decoders."""
        self.job = job
        self.tokenizer, self.context = tokenizer, context
        self.choices: dict[int, ChoiceView] = {}
        for index, ids, text, reason in job.resumed:  # a reason as the stream names it, back to the engine's
            self.choices[index] = ChoiceView(index, self._decoder(ids, text), ids, text, _ENGINE.get(reason, reason))
        self.emitted = sum(len(c.ids) for c in self.choices.values())  # output tokens its event stream holds
        self.cached = 0  # prompt tokens served from the prefix cache, as of its latest step
        # The token chunks the writer sent, in order: what it sends again to a stream that lost its last writes
        # (a failover promoted a replica that lacked them). The last chunk rides with the result and is not here.
        self.sent: list = []

    @classmethod
    def begin(cls, job: RunningJob, tokenizer, context: list[int]) -> JobView:
        """A job that entered the engine."""
        return cls(job, tokenizer, context)

    @property
    def several(self) -> bool:
        return self.job.request is not None and self.job.request.several

    def _decoder(self, ids: list[int], text: str) -> Detokenizer | None:
        if self.tokenizer is None:
            return None
        detok = Detokenizer(self.tokenizer, self.context, [])
        if ids:
            detok.resume(ids, text)
        return detok

    def choice(self, index: int) -> ChoiceView:
        if index not in self.choices:
            self.choices[index] = ChoiceView(index, self._decoder([], ""), [], "")
        return self.choices[index]

    def take(self, tokens: list[int], text: str | None, reason: str | None, cached: int, logprobs, now: float,
             index: int = 0, ends_job: bool | None = None, cumulative_logprob: float | None = None) -> StepOutput:
        """One step's news of one of the job's continuations. text None: decode the tokens here; logprobs as they
        crossed the pipe. ends_job None: the job ends with its continuation (a job with one)."""
        if logprobs:  # JSON keeps no int keys: (logprob, [[token, logprob], ...]) per token
            logprobs = [(lp, dict(top)) for lp, top in logprobs]
        choice = self.choice(index)
        if text is None:
            try:
                text = choice.decode(tokens, reason)
            except Exception:  # the tokens still count, and the job still ends: its text misses a piece
                log.exception("job %s: could not decode tokens %s", self.job.id, tokens)
                text = ""
        offset = self.emitted  # the worker's count too: the tokens its stream holds before these
        self.emitted += len(tokens)
        choice.ids.extend(tokens)
        choice.pieces.append(text)
        choice.finish_reason = reason or choice.finish_reason
        choice.cumulative_logprob = cumulative_logprob
        self.cached = cached
        if self.job.first_token_at is None and tokens:
            self.job.first_token_at = now
        ends_job = reason is not None if ends_job is None else ends_job
        return StepOutput(self, choice, offset, tokens, text, reason, ends_job, cached, logprobs)

    def result(self, status: str, worker: str, model: str | None, finished_at: float, finish_reason: str | None,
               error: ErrorInfo | None = None) -> JobResult:
        """The job's result with its output so far (once it ended, no step adds to it): choice 0's in the single
        fields, and with several continuations, each in `choices` (finish_reason: the job's, for one that had not
        ended)."""
        job = self.job
        first = self.choices.get(0) or ChoiceView(0, None, [], "")
        choices = None
        if self.several:
            choices = [Choice(index=c.index, text=c.text(), token_ids=list(c.ids),
                              finish_reason=FINISH.get(c.finish_reason, finish_reason), logprobs=c.logprobs,
                              cumulative_logprob=c.cumulative_logprob)
                       for c in sorted(self.choices.values(), key=lambda c: c.index)]
        return JobResult(
            id=job.id,
            status=status,
            text=first.text(),
            token_ids=list(first.ids),
            finish_reason=finish_reason if choices is None else FINISH.get(first.finish_reason, finish_reason),
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=self.emitted, cached_tokens=self.cached),
            timings=Timings(enqueued_at=job.enqueued_at, started_at=job.started_at,
                            first_token_at=job.first_token_at, finished_at=finished_at),
            worker=worker,
            attempts=job.attempts,
            error=error,
            model=model,
            logprobs=first.logprobs,
            metadata=job.request.metadata if job.request is not None else {},
            choices=choices,
        )
