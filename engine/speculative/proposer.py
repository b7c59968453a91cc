"""The interface every proposer of draft tokens implements."""

from __future__ import annotations

from typing import Protocol

from engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens that may follow seq's tokens (prompt and output so far); [] when it has no guess. The
        target model verifies them, so a wrong guess costs compute, never correctness."""
        ...
