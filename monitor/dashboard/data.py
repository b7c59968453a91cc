"""What the dashboard shows, read from Redis alone (heartbeats, streams, stats), so one page serves any number
of workers on any number of hosts. Plain sync functions: the web app runs them in a thread."""

from __future__ import annotations

import json

import redis as redis_lib

from monitor import fleet
from monitor.percentiles import quantile
from producer.dlq import list_dead
from producer.keys import Keys

DEAD_LETTERS_SHOWN = 20


def state(r: redis_lib.Redis, queues: list[str]) -> dict:
    """Every queue's status (depth, pending, ages, consumers, live workers) and its newest dead letters."""
    out = []
    for info in fleet.status_of(r, queues):
        dead = list_dead(r, Keys(info["queue"]), DEAD_LETTERS_SHOWN)
        info["dead"] = [{k: d.get(k) for k in ("entry", "id", "error", "reason", "attempts", "worker", "at")}
                        for d in dead]
        out.append(info)
    now_s, now_us = r.time()
    return {"now": int(now_s) + int(now_us) / 1e6, "queues": out}


def _merge(into: dict[str, int], raw: str | None) -> None:
    for bound, n in json.loads(raw or "{}").items():
        into[bound] = into.get(bound, 0) + int(n)


def history(r: redis_lib.Redis, queues: list[str], minutes: float = 15, step_s: float = 10) -> dict:
    """Throughput and TTFT/TPOT percentiles per `step_s` slot over the last `minutes`, summed over the queues'
    workers from their heartbeat intervals. A slot's percentiles come from the merged bucket counts of every
    interval that ended in it, so they are the fleet's, not an average of the workers'."""
    now_s, now_us = r.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    n = max(1, int(minutes * 60 / step_s))
    start_ms = now_ms - int(n * step_s * 1000)
    tokens = [0] * n
    ttft: list[dict[str, int]] = [{} for _ in range(n)]
    tpot: list[dict[str, int]] = [{} for _ in range(n)]
    for q in queues:
        for entry_id, f in r.xrange(Keys(q).stats, min=start_ms):
            i = min(n - 1, int((int(entry_id.split("-")[0]) - start_ms) / (step_s * 1000)))
            if i < 0:
                continue
            tokens[i] += int(f.get("tokens", 0))
            _merge(ttft[i], f.get("ttft"))
            _merge(tpot[i], f.get("tpot"))
    slots = []
    for i in range(n):
        slots.append({
            "t": (start_ms + (i + 1) * step_s * 1000) / 1000,  # the slot's end
            "tokens_per_s": round(tokens[i] / step_s, 2),
            "ttft_p50": quantile(ttft[i], 0.5), "ttft_p95": quantile(ttft[i], 0.95),
            "tpot_p50": quantile(tpot[i], 0.5), "tpot_p95": quantile(tpot[i], 0.95),
            "jobs": sum(ttft[i].values()),
        })
    return {"step_s": step_s, "minutes": minutes, "slots": slots}
