"""Percentiles of latency bucket counts merged over workers: each worker's heartbeat appends its interval's
counts per bucket (worker.latency_window), keyed by the bucket's upper bound; summed over workers and read here,
as Prometheus' histogram_quantile reads a histogram, they give the fleet's percentiles, not an average of each
worker's."""

from __future__ import annotations


def quantile(counts: dict[str, int], q: float) -> float | None:
    """The q-quantile (0..1) of merged bucket counts {upper bound: count}, interpolated linearly inside its
    bucket; None without observations. A value in the +Inf bucket reads as the last finite bound."""
    items = sorted(((float(k), n) for k, n in counts.items() if n), key=lambda kv: kv[0])
    total = sum(n for _, n in items)
    if not total:
        return None
    rank = q * total
    seen, lower = 0, 0.0
    for upper, n in items:
        if seen + n >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - seen) / n
        seen += n
        lower = upper if upper != float("inf") else lower
    return lower
