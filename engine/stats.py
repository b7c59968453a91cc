"""Host time per engine step, split by phase: what `pagedq bench -w overhead` reports.

A few perf_counter reads a step: cheap enough to stay on. On a GPU the forward phase is the launch time only
(the kernels run asynchronously), and its wait shows up in the phase that first needs the result (sample).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# update: a landed step's tokens written in and the requests it finished ended.
# outputs: the landed step's RequestOutputs built.
# publish: a worker's handing of the outputs to its publisher process (the engine itself never charges it).
PHASES = ("schedule", "mask", "prepare", "forward", "sample", "update", "outputs", "publish")


class StepTimes:
    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._mark = 0.0

    def start(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last start or lap to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        return {p: 1000 * s / max(1, self.steps) for p, s in self.seconds.items()}


@dataclass
class SpeculationCounts:
    """Speculative decoding since the engine started: draft tokens proposed, and those the target accepted."""

    steps: int = 0  # steps with at least one draft token
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0
