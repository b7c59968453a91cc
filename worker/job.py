"""A job the worker holds."""

from __future__ import annotations

from dataclasses import dataclass

from producer.calls import Delivery
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
    resume_ids: list[int] | None = None  # output an earlier delivery streamed, that this one continues
    resume_text: str = ""

    @property
    def delivery(self) -> Delivery:
        return Delivery(self.id, self.entry, self.lease)
