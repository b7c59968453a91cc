"""What the peers measured beside pagedq (vLLM, llama.cpp) have in common: an install of their own, outside
pagedq's dependencies, found through a flag or an environment variable."""

from __future__ import annotations

import os
from pathlib import Path


class Unavailable(Exception):
    """The peer cannot run here; the message says what to install or pass."""


def locate(given: str | None, env: str, flag: str, missing: str) -> str:
    """The peer's executable: `given` (the flag's value), else $env -> its path. Unavailable (missing: what to do)
    when neither names one, or the named file is not there."""
    path = given or os.environ.get(env)
    if not path:
        raise Unavailable(missing)
    if not Path(path).expanduser().exists():
        raise Unavailable(f"{flag} {path}: no such file")
    return str(Path(path).expanduser())
