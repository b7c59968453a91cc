"""The Lua scripts, one per state change (see the header of each file in scripts/)."""

from __future__ import annotations

from functools import cache
from importlib import resources

NAMES = ("submit", "start", "publish", "complete", "fail", "cancel", "renew", "release", "retry")


@cache
def source(name: str) -> str:
    # lib.lua holds local helpers; Redis has no includes, so every script carries a copy.
    files = resources.files("producer").joinpath("scripts")
    return files.joinpath("lib.lua").read_text() + files.joinpath(f"{name}.lua").read_text()


class Scripts:
    """The scripts registered on one client (sync or asyncio: register_script picks the right kind).

    `sha` gives the digests for callers that pipeline EVALSHA directly: redis-py's pipelined Script
    objects cost an extra SCRIPT EXISTS round trip per pipeline, which a worker step cannot afford.
    """

    def __init__(self, redis) -> None:
        for name in NAMES:
            setattr(self, name, redis.register_script(source(name)))

    def sha(self, name: str) -> str:
        return getattr(self, name).sha

    def load_all(self, redis) -> None:
        """Load every script on a sync client (after a Redis restart, say)."""
        for name in NAMES:
            redis.script_load(source(name))
