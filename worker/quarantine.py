"""Finding the job that made an engine step fail, by running the suspects apart.

When a step raises, every job that was in the engine is a suspect: the engine is reset, and the suspects run again
in groups, one group alone at a time, the others parked (out of the engine, still leased, their tokens so far in
their event streams). A group passes once each of its jobs has landed a token past where it stood when the step
failed (or ended): the fault did not come back, so none of them caused it. A group whose step fails again is split
in two halves that run in turn (bisection); a job whose step fails while it runs alone is the cause.

Only this bookkeeping lives here, with no engine and no Redis: the worker (worker.worker) moves the jobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable


def halves(jobs: list[str]) -> list[list[str]]:
    """jobs split in two groups to run apart (one group if there is a single job)."""
    mid = (len(jobs) + 1) // 2
    return [group for group in (jobs[:mid], jobs[mid:]) if group]


class Quarantine:
    def __init__(self, landed: dict[str, int]) -> None:
        """landed: each suspect's landed output tokens when the step failed; it is cleared once past them."""
        self.marks = dict(landed)
        suspects = list(landed)
        self.todo: deque[list[str]] = deque(halves(suspects) if len(suspects) > 1 else [suspects])
        self.running: list[str] = []  # the group in the engine now, alone
        self.cleared: list[str] = []  # passed: parked until the search ends, then they run together again
        self.convicted: list[str] = []
        self.failed_groups: list[list[str]] = []  # the groups whose steps failed again, in the search

    @property
    def suspects(self) -> list[str]:
        """Jobs not cleared yet (parked or running), in no particular order."""
        return [*self.running, *(job for group in self.todo for job in group)]

    def next_group(self) -> list[str] | None:
        """The group to run now, alone; None once every group was run (the search is over)."""
        self.running = self.todo.popleft() if self.todo else []
        return self.running or None

    def failed(self, landed: dict[str, int]) -> str | None:
        """The running group's step failed -> its job if it ran alone (the cause: convicted here), else None and the
        group is split to run in halves next. landed: where its jobs stood at this failure (a later mark)."""
        group, self.running = self.running, []
        self.failed_groups.append(group)
        self.marks.update((job, max(self.marks.get(job, 0), n)) for job, n in landed.items() if job in group)
        if len(group) == 1:
            self.convicted.append(group[0])
            return group[0]
        self.todo.extendleft(reversed(halves(group)))
        return None

    def passed(self, landed: Callable[[str], int | None]) -> bool:
        """Whether every job of the running group got past its mark; landed(job) is where it stands now, None for
        a job no longer in the engine (it ended). True moves the group to the cleared ones."""
        if not self.running:
            return False
        for job in self.running:
            now = landed(job)
            if now is not None and now <= self.marks.get(job, 0):
                return False
        self.cleared += self.running
        self.running = []
        return True

    def unexplained(self) -> set[str]:
        """Jobs of the groups that failed again with none of the jobs convicted in them: a fault that needs
        company (or comes and goes) was among them. The worker counts these against them."""
        convicted = set(self.convicted)
        return {job for group in self.failed_groups if not convicted & set(group) for job in group}

    def drop(self, jobs: Iterable[str]) -> None:
        """Jobs that left the worker meanwhile (ended, cancelled, expired, lease lost): no longer suspects."""
        gone = set(jobs)
        self.running = [j for j in self.running if j not in gone]
        self.cleared = [j for j in self.cleared if j not in gone]
        self.todo = deque(kept for kept in ([j for j in group if j not in gone] for group in self.todo) if kept)
