"""A time budget for checks that may be slow (a constraint's grammar, checked while a batch's lines are read): each
runs in a helper thread and is waited for `seconds` at most. A check past its budget is left to finish alone and
the next runs in a new thread, so one slow line cannot hold up the lines after it; past `max_late` late checks,
the rest are refused at once (a file of slow checks would otherwise take its lines times the budget)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")


class CheckBudget:
    def __init__(self, seconds: float, max_late: int = 3) -> None:
        self.seconds = seconds
        self.max_late = max_late
        self.late = 0
        self._pool: ThreadPoolExecutor | None = None

    def run(self, check: Callable[..., T], *args: Any) -> T:
        """check(*args), or TimeoutError when it takes longer than the budget (or too many did before)."""
        if self.late >= self.max_late:
            raise TimeoutError(f"{self.late} checks took longer than {self.seconds:g} s each: the rest are not run")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedq-check")
        future = self._pool.submit(check, *args)
        done, _ = wait([future], timeout=self.seconds)
        if not done:
            self.late += 1
            self.close()
            raise TimeoutError(f"the check took longer than {self.seconds:g} s")
        return future.result()

    def close(self) -> None:
        """Let the helper thread go (a late check still running finishes by itself)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
