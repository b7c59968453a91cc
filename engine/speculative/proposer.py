"""The interface every proposer of draft tokens implements."""

from __future__ import annotations

from typing import Protocol

from engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Per (sequence, k) of a step: up to k tokens that may follow the sequence's tokens (prompt and output so
        far); [] where it has no guess. One call per step, so a proposer that runs a model drafts for the whole
        batch at once. The target model verifies them: a wrong guess costs compute, never correctness."""
        ...

    def finished(self, seq: Sequence) -> None:
        """seq left the engine (finished, aborted): drop what is kept for it, learn from its output."""
        ...
