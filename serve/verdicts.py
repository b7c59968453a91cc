"""What the grammar engine said of the constraints serve checked lately: an LRU keyed by a hash of (kind, the spec's
canonical JSON), bounded in entries and in bytes. The many requests that share a schema compile it once, and a
flood of distinct specs cannot grow it past its bound: a key is 32 bytes whatever the spec's size, and a verdict's
text is counted."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

CACHE_ENTRIES = 4096
CACHE_BYTES = 16 * 2**20
ENTRY_BYTES = 256  # what an entry costs beside its problem's text: the key, the tuple, the dict's slot


class Verdict(NamedTuple):
    """A constraint's check: code "" when it is fine; else why not (invalid_constraint, constraint_timeout)."""

    code: str = ""
    problem: str = ""


FINE = Verdict()


def spec_key(kind: str, spec: Any) -> bytes:
    """The cache key of a constraint: the same for the same spec however its JSON was spelled."""
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).digest()


def cost(key: bytes, verdict: Verdict) -> int:
    return ENTRY_BYTES + len(key) + len(verdict.problem.encode("utf-8", "surrogatepass"))


class Verdicts:
    """The LRU; thread-safe, as a batch may be read off the event loop while requests are checked on it."""

    def __init__(self, max_entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, Verdict] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> Verdict | None:
        with self._lock:
            verdict = self._items.get(key)
            if verdict is not None:
                self._items.move_to_end(key)
            return verdict

    def put(self, key: bytes, verdict: Verdict) -> None:
        size = cost(key, verdict)
        if size > self.max_bytes:  # would evict everything else and still not fit
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= cost(key, old)
            self._items[key] = verdict
            self.bytes += size
            while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
                k, v = self._items.popitem(last=False)
                self.bytes -= cost(k, v)


VERDICTS = Verdicts()  # the process's: its requests and its batches' lines share what was compiled
