"""A job the worker holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from producer.calls import Delivery
from producer.keys import DEFAULT_LANE
from producer.protocol import JobRequest


@dataclass
class RunningJob:
    """The worker's record of one delivery of a job. Its fields in SENT cross to the publisher (messages.Begin),
    which writes them in the job's result; the others are the worker's own and stay in it. What the result says
    of the output (its tokens, text, first token time, usage) is the publisher's own (job_view.JobView): the
    worker only sends it each step's events."""

    id: str
    entry: str  # its stream entry id, to XACK
    lease: str  # the token every write presents
    attempts: int
    enqueued_at: float | None
    started_at: float
    request: JobRequest | None = None
    prompt_tokens: int = 0
    # What earlier deliveries streamed, that this one continues, per continuation (a job with one: index 0):
    # [index, token ids, text, finish reason if it had ended]. Lists: the job crosses a pipe as JSON.
    resumed: list[list] = field(default_factory=list)
    lane: str = DEFAULT_LANE  # the lane and group whose stream it was read from
    group: str | None = None

    # ---- the worker's own ----
    deadline: float | None = None  # unix time past which it expires
    # When this delivery's first token came, as the step loop saw it: for its metrics and its preemption
    # (the result's first_token_at is the publisher's, from the same step's event).
    first_token_at: float | None = None
    # Searches for the cause of a failed engine step that this job was in and that found none (worker.quarantine):
    # at max_attempts the job goes back to the queue as a failed delivery (the crash-loop rule).
    unexplained_faults: int = 0

    SENT: ClassVar[tuple[str, ...]] = ("id", "entry", "lease", "attempts", "enqueued_at", "started_at", "request",
                                       "prompt_tokens", "resumed", "lane", "group")

    def resumed_choice(self, index: int) -> tuple[list[int], str, str | None]:
        for i, ids, text, reason in self.resumed:
            if i == index:
                return ids, text, reason
        return [], "", None

    @property
    def resumed_tokens(self) -> int:
        return sum(len(ids) for _, ids, _, _ in self.resumed)

    @property
    def delivery(self) -> Delivery:
        return Delivery(self.id, self.entry, self.lease, self.lane, self.group)
