"""The size of the engine's last scheduled batch, for the batch-size histograms and the preemption counter.

The engine reports per-request outputs only (a prefill chunk that samples nothing is absent from them), so the
probe wraps this one engine instance's `scheduler.schedule` and remembers the size of each batch it returns.
Nothing else changes: the wrapper returns the same object.
"""

from __future__ import annotations

from typing import Any


class BatchProbe:
    def __init__(self, engine: Any) -> None:
        self.seqs = self.tokens = self.preempted = 0
        scheduler = getattr(engine, "scheduler", None)
        if scheduler is None:  # not our engine: the histograms stay empty
            return
        inner = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.seqs = len(out.seqs)
            self.tokens = sum(out.num_new_tokens)
            self.preempted = len(out.preempted)
            return out

        scheduler.schedule = schedule
