"""Tiny random-weight models with SmolLM2's tokenizer, for fast tests (and the JavaScript client's tests).

`python3 tests/tiny_model.py [DIR] [--arch llama]` builds one and prints its path.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_model import TINY_ARCHS, make_tiny_model  # noqa: E402
from engine.weights.loader import cache_root  # noqa: E402


def cached_tiny_model(arch: str = "llama", seed: int = 0, kv_heads: int = 2) -> str:
    """A tiny model of `arch` (4 attention heads, `kv_heads` KV heads), built once into the model cache and reused
    by every later test run."""
    kv = "" if kv_heads == 2 else f"-kv{kv_heads}"
    return make_tiny_model(str(cache_root() / f"tiny-{arch}{kv}-{seed}-v1"), arch, seed, kv_heads=kv_heads)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("path", nargs="?", help="where to write it; default: the model cache")
    ap.add_argument("--arch", default="llama", choices=TINY_ARCHS)
    a = ap.parse_args()
    print(make_tiny_model(a.path, a.arch) if a.path else cached_tiny_model(a.arch))
