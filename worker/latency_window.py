"""What one worker saw since its last heartbeat: tokens generated and TTFT/TPOT counts per latency bucket.

Each heartbeat appends one such interval to the queue's stats stream. Bucket counts (not samples, not
percentiles) are what make the picture exact across workers: the dashboard sums the counts of every worker's
intervals in a time slot and reads the percentiles off the sum (monitor.percentiles), where percentiles computed
per worker could not be combined at all. A bucket's key is its upper bound as text, so a reader needs no copy of
the bounds.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (.01, .025, .05, .1, .25, .5, .75, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5)


def bucket_of(bounds: tuple[float, ...], value: float) -> str:
    """The upper bound (as the key a stats entry uses) of the bucket `value` falls in; "+Inf" past the last."""
    i = bisect.bisect_left(bounds, value)
    return repr(float(bounds[i])) if i < len(bounds) else "+Inf"


class LatencyWindow:
    """Filled by the step loop, emptied by the heartbeat thread: hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._tokens = 0
        self._ttft: dict[str, int] = {}
        self._tpot: dict[str, int] = {}

    def generated(self, n: int) -> None:
        if n:
            with self._lock:
                self._tokens += n

    def ttft(self, seconds: float) -> None:
        key = bucket_of(TTFT_BUCKETS, seconds)
        with self._lock:
            self._ttft[key] = self._ttft.get(key, 0) + 1

    def tpot(self, seconds: float) -> None:
        key = bucket_of(TPOT_BUCKETS, seconds)
        with self._lock:
            self._tpot[key] = self._tpot.get(key, 0) + 1

    def take(self) -> tuple[int, dict[str, int], dict[str, int]]:
        """(tokens, ttft counts, tpot counts) since the last take; starts a new interval."""
        with self._lock:
            out = (self._tokens, self._ttft, self._tpot)
            self._reset()
        return out
