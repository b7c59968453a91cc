"""A job as the publisher process follows it: per continuation, the decoder that turns its tokens to text as the
engine's deferred decoding would and its output so far; each step's news of it (StepOutput); and the JobResult it
ends with. What the result says of the output is kept here only: the worker sends events (messages.Step)."""

from __future__ import annotations

import logging
from typing import NamedTuple

from engine.detokenizer import Detokenizer
from producer.protocol import Choice, ErrorInfo, JobResult, Timings, TokenLogprob, Usage
from worker.job import RunningJob
from worker.publisher.messages import Extra

log = logging.getLogger("pagedq.worker")

# The engine's finish reasons, as a JobResult names them.
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
_ENGINE = {v: k for k, v in FINISH.items()}
_NO_EXTRA = Extra(0, None, None, None)


class StepOutput(NamedTuple):
    """One job's news from one engine step, as the publisher process writes it (one per job per step): rebuilt
    from the step's message, with the text the step left to the process decoded and where the tokens start in
    the job's stream counted."""

    view: JobView  # the job as the process follows it
    choice: ChoiceView  # the continuation these are of (a job with one: its only one)
    offset: int  # output tokens the job's event stream holds before these (every continuation's)
    token_ids: list[int]  # the new ones
    text: str  # theirs
    finish_reason: str | None  # set on the continuation's last step: stop, length or abort
    ends_job: bool  # the job's last step (with one continuation: the same as a finish reason)
    cached_tokens: int
    logprobs: list | None  # per token: (its logprob, {token id: logprob} of the top N)


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

    def decode(self, tokens: list[int], reason: str | None, hidden_stop: bool = False) -> str:
        """As the engine's deferred decoding. hidden_stop: the last token is a stop token (EOS included) whose
        text is not shown, as the engine said (a grammar's last token ends with "stop" too, and shows)."""
        if reason is None:
            return "".join(map(self.detok.add_one, tokens))
        return self.detok.add(tokens[:-1] if hidden_stop else tokens, final=True)[0]

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
        # What the result says of the output, kept here only (the worker sends events):
        self.emitted = sum(len(c.ids) for c in self.choices.values())  # output tokens its event stream holds
        self.cached = 0  # prompt tokens served from the prefix cache, as of its latest step
        self.first_token_at: float | None = None  # the time of the first step that brought this delivery tokens
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

    def take(self, tokens: list[int], extra: Extra | None, cached: int, now: float) -> StepOutput:
        """One step's news of one of the job's continuations: its new tokens and, for a job with more to say,
        the step's Extra (None: tokens and nothing else, of continuation 0, not its last)."""
        extra = extra or _NO_EXTRA
        logprobs = extra.logprobs
        if logprobs:  # JSON keeps no int keys: (logprob, [[token, logprob], ...]) per token
            logprobs = [(lp, dict(top)) for lp, top in logprobs]
        reason = extra.finish_reason
        choice = self.choice(extra.index)
        text = extra.text
        if text is None:
            try:
                text = choice.decode(tokens, reason, extra.hidden_stop)
            except Exception:  # the tokens still count, and the job still ends: its text misses a piece
                log.exception("job %s: could not decode tokens %s", self.job.id, tokens)
                text = ""
        offset = self.emitted  # the tokens its stream holds before these
        self.emitted += len(tokens)
        choice.ids.extend(tokens)
        choice.pieces.append(text)
        choice.finish_reason = reason or choice.finish_reason
        choice.cumulative_logprob = extra.cumulative_logprob
        self.cached = cached
        if self.first_token_at is None and tokens:
            self.first_token_at = now
        return StepOutput(self, choice, offset, tokens, text, reason, extra.ends_job, cached, logprobs)

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
                            first_token_at=self.first_token_at, finished_at=finished_at),
            worker=worker,
            attempts=job.attempts,
            error=error,
            model=model,
            logprobs=first.logprobs,
            metadata=job.request.metadata if job.request is not None else {},
            choices=choices,
        )
