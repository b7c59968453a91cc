"""The Lua scripts, one per state change (see the header of each file in scripts/; producer.calls builds
their calls)."""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources

# A job's life (the JavaScript client runs the same files), then the group's upkeep, the Batch API's store and the
# API keys of `pagedq serve`.
NAMES = ("submit", "start", "publish", "complete", "fail", "cancel", "renew", "release", "retry", "take", "prune",
         "remove_consumer", "set_if", "lease", "limit", "reserve")


@cache
def source(name: str) -> str:
    # lib.lua holds local helpers; Redis has no includes, so every script carries a copy.
    if name not in NAMES:
        raise ValueError(f"no script {name!r}")
    files = resources.files("producer").joinpath("scripts")
    return files.joinpath("lib.lua").read_text() + files.joinpath(f"{name}.lua").read_text()


@cache
def sha(name: str) -> str:
    """The digest EVALSHA takes: computed here, so that no round trip is needed to learn it."""
    return hashlib.sha1(source(name).encode()).hexdigest()


def load_all(r) -> None:
    """Load every script on a sync client (at worker start; after a Redis restart the flows reload them)."""
    for name in NAMES:
        r.script_load(source(name))
