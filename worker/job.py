"""A job the worker holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.calls import Delivery
from producer.keys import DEFAULT_LANE
from producer.protocol import JobRequest


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
    emitted: int = 0  # output tokens in its event stream (those of earlier deliveries included)
    # What earlier deliveries streamed, that this one continues, per continuation (a job with one: index 0):
    # [index, token ids, text, finish reason if it had ended]. Lists: the job crosses a pipe as JSON.
    resumed: list[list] = field(default_factory=list)
    # Searches for the cause of a failed engine step that this job was in and that found none (worker.quarantine):
    # at max_attempts the job goes back to the queue as a failed delivery (the crash-loop rule).
    unexplained_faults: int = 0
    lane: str = DEFAULT_LANE  # the lane and group whose stream it was read from
    group: str | None = None

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
