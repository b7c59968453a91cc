"""Finishing: what a landed token ends, whether its text shows, and the outputs a step reports.

One rule decides "this token's text is not shown": a stop token (EOS included) that ends its sequence, i.e. one
in its stop ids at or past min_tokens. Stop strings decode without it, deferred text skips it, a continuation
reported whole leaves it out (Sequence.hidden_stop) and RequestOutput.hidden_stop carries it to readers that decode
token ids themselves (the worker's publisher).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.detokenizer import NO_TOKEN
from engine.group_steps import GroupSteps
from engine.outputs import RequestOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

log = logging.getLogger("pagedq.engine")
GONE = "gone"  # a landed row that makes no output: its request ended while the step ran


@dataclass
class Landed:
    """A step whose tokens are written in: what its outputs are built from."""

    samplers: list[Sequence]
    positions: list[int]
    tokens: list[int]
    reasons: list[str | None]  # finish reason per row, or GONE
    hidden: list[bool]  # per row: its token is a stop token whose text is not shown
    texts: dict[int, str]  # new text by row, for requests with stop strings (decoded when the token landed)
    logprobs: list[list | None] | None
    reported: list[RequestOutput]  # groups that ended and report their continuations whole


def is_hidden_stop(seq: Sequence, token: int, pos: int) -> bool:
    """Whether the token landing at pos ends seq as a stop token, its text not shown (the one place this is
    decided)."""
    return token in seq.stop_ids and pos >= seq.min_len - 1


class Finishing:
    def __init__(self, scheduler: Scheduler, groups: GroupSteps) -> None:
        self.scheduler = scheduler
        self.groups = groups

    def check(self, seq: Sequence, token: int, pos: int) -> tuple[str | None, bool, str | None]:
        """The token just written at pos -> (seq's finish reason or None, whether the token's text is hidden, its
        new text where seq has stop strings: decoding now decides whether it ends)."""
        hidden = is_hidden_stop(seq, token, pos)
        reason = "stop" if hidden else ("length" if pos >= seq.max_len - 1 else None)
        if seq.matcher is not None:
            reason = advance(seq, token, reason)
        detok = seq.detok
        if detok.lazy:
            return reason, hidden, None
        text, stopped = detok.add([] if hidden else [token], final=reason is not None)
        return ("stop" if stopped else reason), hidden, text

    def end(self, seq: Sequence, reason: str, hidden: bool) -> list[RequestOutput]:
        """seq ended (its blocks are free now) -> outputs of a group that this ended and reports whole."""
        seq.hidden_stop = hidden
        self.scheduler.finish(seq, reason)
        return self.groups.member_finished(seq) if seq.group is not None else []

    def abort(self, seq: Sequence) -> None:
        """Drop the request seq is the first sequence of, every continuation with it."""
        if seq.group is None:
            self.scheduler.finish(seq, "abort")
            return
        for member in {id(m): m for m in [seq, *seq.group.seqs]}.values():
            if member.status is not Status.FINISHED:
                self.scheduler.finish(member, "abort")
        seq.group.seqs = []
        self.scheduler.forget(seq.request_id)

    def outputs(self, landed: Landed | None) -> list[RequestOutput]:
        if landed is None:
            return []
        outputs = []
        add = outputs.append
        logprobs = landed.logprobs
        rows = zip(landed.samplers, landed.positions, landed.tokens, landed.reasons, landed.hidden)
        for i, (seq, pos, token, reason, hidden) in enumerate(rows):
            if reason is GONE or (seq.group is not None and not seq.group.streams):
                continue  # a group that reports its continuations at the end says nothing now
            detok = seq.detok
            if detok.lazy:  # no stop strings: the text can wait for whoever reads it
                at, text = detok.defer(NO_TOKEN if hidden else token, reason is not None), ""
            else:
                at, text = 0, landed.texts[i]
            out = RequestOutput(seq, token, reason, pos + 1, text, detok.text, detok.sent, logprobs and logprobs[i],
                                detok if detok.lazy else None, at)
            out.hidden_stop = hidden
            if seq.group is not None and reason is not None:
                self._streamed_end(seq, out)
            add(out)
        outputs += landed.reported
        return outputs

    def _streamed_end(self, seq: Sequence, out: RequestOutput) -> None:
        """A streamed continuation's last output: its request's last, with every continuation, once none runs."""
        out.cumulative_logprob = seq.cumulative_logprob if seq.params.needs_logprobs else None
        if seq.group.streamed_end(out):
            self.scheduler.forget(seq.request_id)


def advance(seq: Sequence, token: int, reason: str | None) -> str | None:
    """Move seq's matcher past its new token -> its finish reason: "stop" once the grammar is complete."""
    matcher = seq.matcher
    if not matcher.consume_token(token):
        # The mask allowed only tokens the matcher takes, so this is the grammar engine's own failure: end here,
        # loudly, rather than go on unconstrained.
        log.error("request %s: its constraint refused token %d: %s", seq.request_id, token, matcher.get_error())
        return reason or "stop"
    return reason or ("stop" if matcher.is_stopped() else None)
