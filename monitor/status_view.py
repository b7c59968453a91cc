"""The text of `pagedq status` and `pagedq workers`: plain aligned tables, wide enough for a terminal."""

from __future__ import annotations


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = [header, *rows]
    return "\n".join(indent + "  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in lines)


def worker_row(w: dict, now: float | None = None, with_queue: bool = False) -> list[str]:
    total = w.get("kv_blocks_total") or 0
    used = w.get("kv_blocks_used") or 0
    kv = f"{used}/{total} ({100 * used / total:.0f}%)" if total else "-"
    batch = f"{w.get('running', 0)}/{w.get('max_num_seqs') or '?'}"
    up = (w.get("updated_at") or 0) - (w.get("started_at") or 0)
    row = [w["id"], str(w.get("model", "?")), f"{w.get('device', '?')}/{w.get('dtype', '?')}", batch,
           str(w.get("waiting", 0)), kv, f"{w.get('tokens_per_s', 0):.1f}", f"{1000 * (w.get('last_step_s') or 0):.1f}",
           _age(up), "draining" if w.get("draining") else "up"]
    return [w.get("queue", "?"), *row] if with_queue else row


WORKER_HEADER = ["WORKER", "MODEL", "DEVICE", "BATCH", "WAITING", "KV BLOCKS", "TOK/S", "STEP MS", "UPTIME",
                 "STATE"]


def workers_table(workers: list[dict], with_queue: bool = False) -> str:
    header = (["QUEUE"] if with_queue else []) + WORKER_HEADER
    return _table(header, [worker_row(w, with_queue=with_queue) for w in workers], indent="")


def queue_table(info: dict) -> str:
    """One queue: a summary line, its live workers, and consumers that have no heartbeat."""
    workers = info.get("workers", [])
    lines = [f"queue {info['queue']}: {info['waiting']} waiting, {info['pending']} running (pending), "
             f"{len(info['consumers'])} consumers, {len(workers)} live workers",
             f"  depth {info['length']}, oldest job {_age(info.get('oldest_age_s'))}, oldest waiting "
             f"{_age(info.get('oldest_waiting_age_s'))}, oldest running {_age(info.get('oldest_pending_age_s'))}, "
             f"{info.get('dead_letters', 0)} dead letters"]
    lanes = info.get("lanes") or {}
    if any(x["length"] for x in lanes.values()):
        lines.append("  lanes: " + "; ".join(
            f"{lane} {x['waiting']} waiting, {x['pending']} running, oldest waiting {_age(x.get('oldest_waiting_age_s'))}"
            + (f", {x['groups']} groups" if x.get("groups") else "") for lane, x in lanes.items()))
    if workers:
        lines.append(_table(WORKER_HEADER, [worker_row(w) for w in workers]))
    stale = [c for c in info["consumers"] if not c.get("alive")]
    for c in stale:
        lines.append(f"  consumer {c['name']} (no heartbeat): {c['pending']} pending, idle {c['idle_ms'] / 1000:.1f} s")
    return "\n".join(lines)
