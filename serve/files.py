"""The Files API's store in Redis: a file is a metadata hash and its content in parts of at most PART_BYTES, so
that no Redis value grows with a file (a batch's output has no bound of its own); all with a TTL. A file's hash
is written last: a file that can be read is whole.

With API keys, the bytes of the files a key stores count against its budget (ApiKeyKeys.files, scored by each
file's expiry, producer/scripts/reserve.lua): an upload that would take the key past its cap is refused, and a
file leaves the budget when it is deleted or expires. A batch's output files count there too, never refused (a
batch's results are not dropped for a quota). Sans-IO flows (see producer.flows): the asyncio server and the
sync CLI run the same code.
"""

from __future__ import annotations

import time
import uuid

from producer import calls, flows
from producer.flows import Cmd, Flow, Offload, Pipe
from producer.keys import ApiKeyKeys, BatchKeys
from serve.errors import APIError

PURPOSES = ("batch", "batch_output")
OWNER = "owner"  # the field of a file's (and a batch's) hash that names the key that made it
PARTS = "parts"  # the field of a file's hash that counts its parts (absent: one, a file written whole)
PART_BYTES = 2**20
PARTS_PER_TRIP = 8  # parts written or read per round trip


def new_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def visible(stored_owner: str | None, owner: str | None) -> bool:
    """Whether a file or batch whose hash names `stored_owner` is there for a request of key id `owner`. A server
    without keys asks as None and sees everything; a key sees only what it made."""
    return owner is None or stored_owner == owner


class Parts:
    """UTF-8 bytes fed in pieces, handed back in parts of at most PART_BYTES, each cut between two characters
    (the server's connection decodes every value it reads)."""

    def __init__(self, limit: int = PART_BYTES) -> None:
        self.limit = limit
        self.size = 0
        self._held = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The parts `data` filled."""
        self._held += data
        self.size += len(data)
        out, start = [], 0
        while len(self._held) - start > self.limit:
            cut = start + self.limit
            while self._held[cut] & 0xC0 == 0x80:  # a continuation byte: the character began before
                cut -= 1
            out.append(bytes(self._held[start:cut]))
            start = cut
        del self._held[:start]
        return out

    def end(self) -> list[bytes]:
        """The last part, if anything is left."""
        rest, self._held = bytes(self._held), bytearray()
        return [rest] if rest else []


def split(content: str | bytes) -> list[bytes]:
    """A whole file's parts."""
    parts = Parts()
    return parts.feed(content.encode() if isinstance(content, str) else content) + parts.end()


def _meta(file_id: str, filename: str, purpose: str, ttl: int, size: int) -> dict:
    now = int(time.time())
    return {"id": file_id, "filename": filename, "purpose": purpose, "bytes": size, "created_at": now,
            "expires_at": now + ttl}


def _write(file_id: str, first: int, parts: list[bytes], ttl: int) -> Flow:
    for s in range(0, len(parts), PARTS_PER_TRIP):
        yield Pipe([Cmd("set", (BatchKeys.file_content(file_id, n), p), {"ex": ttl})
                    for n, p in enumerate(parts[s:s + PARTS_PER_TRIP], first + s)])


def _reserve(meta: dict, owner: str, quota: int) -> Flow:
    """Count the file's bytes in its key's budget, or 413 when they would take the key past `quota` (0: none).
    413, not 429: waiting does not help (deleting files does), and the SDKs retry a 429 by themselves."""
    size = int(meta["bytes"])
    r = yield from flows.run_call(calls.reserve(ApiKeyKeys(owner).files, meta["id"], size, quota,
                                                meta["expires_at"], time.time()))
    if not r.ok:
        raise APIError(413, f"this key's files hold {r.total} bytes, and this file's {size} would take them past "
                       f"its limit of {quota} bytes: delete files (DELETE /v1/files/{{file_id}}) or wait for "
                       "them to expire", param="file", code="storage_limit_exceeded")


def _commit(meta: dict, parts: int, owner: str | None, ttl: int) -> Flow:
    """The file's hash (its owner in the same HSET: no moment shows the file without it) and its listings."""
    file_id, now = meta["id"], meta["created_at"]
    ops = [Cmd("hset", (BatchKeys.file(file_id),), {"mapping": meta | {PARTS: parts} | ({OWNER: owner} if owner
                                                                                         else {})}),
           Cmd("expire", (BatchKeys.file(file_id), ttl))]
    for index in (BatchKeys.files, *([BatchKeys.files_of(owner)] if owner else [])):
        ops += [Cmd("zadd", (index, {file_id: now})), Cmd("zremrangebyscore", (index, 0, now - ttl))]
    yield Pipe(ops)
    return render(meta)


def put(content: str | bytes, filename: str, purpose: str, ttl: int, file_id: str | None = None,
        owner: str | None = None, quota: int = 0) -> Flow:
    """Store a file (UTF-8 text, or its bytes) of key id `owner`, if any, within `quota` bytes of files for that
    key (0: no limit; 413 past it); returns its file object."""
    parts = yield Offload(split, (content,))
    meta = _meta(file_id or new_id(), filename, purpose, ttl, sum(map(len, parts)))
    if owner:
        yield from _reserve(meta, owner, quota)
    yield from _write(meta["id"], 0, parts, ttl)
    return (yield from _commit(meta, len(parts), owner, ttl))


class Writer:
    """A file written while it is made (a batch's output): its parts go to Redis as they fill, so this process
    holds one at most; `close` writes the last one and the file's hash. Written under a fixed id, the same lines
    make the same parts: two processes that write one file write the same keys."""

    def __init__(self, file_id: str, filename: str, purpose: str, ttl: int, owner: str | None = None) -> None:
        self.file_id, self.filename, self.purpose, self.ttl, self.owner = file_id, filename, purpose, ttl, owner
        self.parts = Parts()
        self.written = 0

    def write(self, data: bytes) -> Flow:
        full = self.parts.feed(data)
        yield from _write(self.file_id, self.written, full, self.ttl)
        self.written += len(full)

    def close(self) -> Flow:
        """The file object; None (no file) when nothing was written."""
        rest = self.parts.end()
        yield from _write(self.file_id, self.written, rest, self.ttl)
        self.written += len(rest)
        if not self.parts.size:
            return None
        meta = _meta(self.file_id, self.filename, self.purpose, self.ttl, self.parts.size)
        if self.owner:
            yield from _reserve(meta, self.owner, 0)
        return (yield from _commit(meta, self.written, self.owner, self.ttl))


def get(file_id: str, owner: str | None = None) -> Flow:
    """The file object, or None (also for another key's file)."""
    meta = yield Cmd("hgetall", (BatchKeys.file(file_id),))
    return render(meta) if meta and visible(meta.get(OWNER), owner) else None


def parts(file_id: str, owner: str | None = None) -> Flow:
    """(how many parts the file has, its bytes), or None when there is no such file (or it is another key's)."""
    meta = yield Cmd("hmget", (BatchKeys.file(file_id), [OWNER, PARTS, "bytes"]))
    stored, count, size = meta
    if size is None or not visible(stored, owner):
        return None
    return (1 if count is None else int(count)), int(size)


def part(file_id: str, n: int) -> Flow:
    """Part n of the file's text; None once the file expired or was deleted."""
    return (yield Cmd("get", (BatchKeys.file_content(file_id, n),)))


def content(file_id: str, owner: str | None = None) -> Flow:
    """The file's whole text, or None (also for another key's file)."""
    found = yield from parts(file_id, owner)
    if found is None:
        return None
    texts = []
    for s in range(0, found[0], PARTS_PER_TRIP):
        texts += yield Pipe([Cmd("get", (BatchKeys.file_content(file_id, n),))
                             for n in range(s, min(found[0], s + PARTS_PER_TRIP))])
    return None if None in texts else "".join(texts)


def listing(limit: int, purpose: str | None = None, owner: str | None = None) -> Flow:
    """The newest files first (of key id `owner`, if given)."""
    index = BatchKeys.files if owner is None else BatchKeys.files_of(owner)
    ids = yield Cmd("zrevrange", (index, 0, max(0, limit * 4) - 1))
    metas = (yield Pipe([Cmd("hgetall", (BatchKeys.file(i),)) for i in ids])) if ids else []
    gone = [i for i, m in zip(ids, metas) if not m]
    if gone:
        yield Cmd("zrem", (index, *gone))
    out = [render(m) for m in metas if m and visible(m.get(OWNER), owner)
           and (purpose is None or m.get("purpose") == purpose)]
    return out[:limit]


def delete(file_id: str, owner: str | None = None) -> Flow:
    """True when the file existed (and was the key's); its bytes leave its key's budget."""
    stored, count, size = yield Cmd("hmget", (BatchKeys.file(file_id), [OWNER, PARTS, "bytes"]))
    if size is None or not visible(stored, owner):
        return False
    keys = [BatchKeys.file(file_id), *(BatchKeys.file_content(file_id, n) for n in range(int(count or 1)))]
    ops = [Cmd("delete", tuple(keys)), Cmd("zrem", (BatchKeys.files, file_id))]
    if stored:
        ops += [Cmd("zrem", (BatchKeys.files_of(stored), file_id)),
                Cmd("zrem", (ApiKeyKeys(stored).files, calls.budget_member(file_id, int(size))))]
    n = yield Pipe(ops)
    return bool(n[0])


def render(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "expires_at": int(meta["expires_at"]), "filename": meta["filename"], "purpose": meta["purpose"],
            "status": "processed", "status_details": None}


def check_id(file_id: str) -> str:
    """ValueError for an id that cannot name a file's keys."""
    BatchKeys.file(file_id)
    return file_id
