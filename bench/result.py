"""What one system produced on one workload, counted the same way for every system."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    """One request: what it asked for, what it got, and when (seconds; None where a system cannot say)."""

    id: str
    prompt_tokens: int
    asked: int
    produced: int  # output token ids actually generated for it (prompt and padding stripped)
    ttft: float | None = None  # arrival (or submission) to first token
    tpot: float | None = None  # mean time between its later tokens
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from a prefix cache: no model work


@dataclass
class Run:
    system: str
    workload: str
    outcomes: list[Outcome] = field(default_factory=list)
    elapsed: float = 0.0  # wall seconds from the first request in to the last result out
    status: str = "ok"  # ok | unavailable | error | skipped
    note: str = ""
    subset: bool = False  # ran on the first few requests of the workload only
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        # Only what was asked counts: a static batch that runs past a request's length earns nothing for it.
        return sum(min(o.produced, o.asked) for o in self.outcomes)

    @property
    def prompt_tokens(self) -> int:
        return sum(o.prompt_tokens for o in self.outcomes)

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens the model actually ran: a prefix-cache hit costs no FLOPs and earns no MFU."""
        return sum(o.prompt_tokens - o.cached_tokens for o in self.outcomes)

    @property
    def mismatches(self) -> list[str]:
        return [o.id for o in self.outcomes if o.error or o.produced != o.asked]

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.elapsed > 0 and bool(self.outcomes)

    def throughput(self) -> float:
        return self.output_tokens / self.elapsed if self.ok else 0.0

    def summary(self) -> dict:
        d = {"system": self.system, "workload": self.workload, "status": self.status, "note": self.note,
             "requests": len(self.outcomes), "subset": self.subset}
        if not self.ok:
            return d
        ttft = [o.ttft for o in self.outcomes if o.ttft is not None]
        tpot = [o.tpot for o in self.outcomes if o.tpot is not None]
        d.update(
            elapsed_s=self.elapsed,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.prompt_tokens - self.computed_prompt_tokens,
            output_tokens=self.output_tokens,
            output_tokens_per_s=self.throughput(),
            total_tokens_per_s=(self.prompt_tokens + self.output_tokens) / self.elapsed,
            requests_per_s=len(self.outcomes) / self.elapsed,
            checked=not self.mismatches,
            mismatched_requests=self.mismatches[:20],
            num_mismatched=len(self.mismatches),
            ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
            tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
            **self.extra,
        )
        return d


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tpot(first: float | None, last: float | None, n: int) -> float | None:
    if first is None or last is None or n < 2:
        return None
    return (last - first) / (n - 1)
