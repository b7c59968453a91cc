"""Fair-share groups: their settings (weight, cap on running jobs), kept in one Redis hash per queue that every
worker's intake reads, and what they hold now, for `pagedq groups` and the dashboard."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from producer.keys import GROUP, LANES, Keys, check_group

MAX_WEIGHT = 1000


@dataclass(frozen=True)
class GroupSettings:
    """weight: the group's share of a lane relative to the other groups with jobs there (a group of weight 2 gets
    twice the jobs of a group of weight 1). max_running: the most of its jobs running at once over all workers
    and lanes (None: no cap)."""

    weight: int = 1
    max_running: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, int) or not 1 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"weight must be an integer in [1, {MAX_WEIGHT}], got {self.weight!r}")
        if self.max_running is not None and (not isinstance(self.max_running, int) or self.max_running < 0):
            raise ValueError(f"max_running must be an integer >= 0 or none, got {self.max_running!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, text: str | None) -> GroupSettings:
        """A stored entry; one that does not parse (written by hand) counts as the defaults."""
        if not text:
            return cls()
        try:
            d = json.loads(text)
            return cls(int(d.get("weight", 1)), None if d.get("max_running") is None else int(d["max_running"]))
        except (ValueError, TypeError, AttributeError):
            return cls()


def set_group(r, keys: Keys, group: str, settings: GroupSettings) -> None:
    r.hset(keys.groups, check_group(group), settings.to_json())


def reset_group(r, keys: Keys, group: str) -> bool:
    """Back to the defaults (weight 1, no cap). True when it had settings."""
    return bool(r.hdel(keys.groups, check_group(group)))


def all_settings(r, keys: Keys) -> dict[str, GroupSettings]:
    return {g: GroupSettings.parse(v) for g, v in r.hgetall(keys.groups).items()}


def _pending(reply) -> int:
    # XPENDING's summary; a stream without the workers' group yet (no worker read it) has nothing running.
    return 0 if isinstance(reply, Exception) else int(reply["pending"])


def group_view(r, keys: Keys) -> list[dict]:
    """Per group with settings or jobs: its settings, and per lane the jobs its stream holds (queued + running)
    and those running. The jobs of no group are the lanes' own streams, named "" here."""
    settings = all_settings(r, keys)
    pipe = r.pipeline(transaction=False)
    for lane in LANES:
        pipe.smembers(keys.lane_groups(lane))
    members = dict(zip(LANES, pipe.execute(), strict=True))
    streams = [(lane, None) for lane in LANES] + [(lane, g) for lane in LANES for g in sorted(members[lane])]
    pipe = r.pipeline(transaction=False)
    for lane, g in streams:
        pipe.xlen(keys.stream(lane, g))
        pipe.xpending(keys.stream(lane, g), GROUP)
    replies = pipe.execute(raise_on_error=False)
    view: dict[str, dict] = {}
    for (lane, g), length, pending in zip(streams, replies[::2], replies[1::2], strict=True):
        held = 0 if isinstance(length, Exception) else int(length)
        running = _pending(pending)
        if held or g is not None:
            row = view.setdefault(g or "", {"group": g or "", "lanes": {}})
            row["lanes"][lane] = {"queued": max(0, held - running), "running": running}
    for g in settings:
        view.setdefault(g, {"group": g, "lanes": {}})
    for g, row in view.items():
        s = settings.get(g, GroupSettings())
        row.update(weight=s.weight, max_running=s.max_running,
                   queued=sum(x["queued"] for x in row["lanes"].values()),
                   running=sum(x["running"] for x in row["lanes"].values()))
    return sorted(view.values(), key=lambda row: row["group"])
