"""The Files API's store in Redis: a file is a metadata hash and its content, both with a TTL. Sans-IO flows
(see producer.flows): the asyncio server and the sync CLI run the same code."""

from __future__ import annotations

import time
import uuid

from producer.flows import Cmd, Flow, Pipe
from producer.keys import BatchKeys

PURPOSES = ("batch", "batch_output")
OWNER = "owner"  # the field of a file's (and a batch's) hash that names the key that made it


def new_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def visible(stored_owner: str | None, owner: str | None) -> bool:
    """Whether a file or batch whose hash names `stored_owner` is there for a request of key id `owner`. A server
    without keys asks as None and sees everything; a key sees only what it made."""
    return owner is None or stored_owner == owner


def put(content: str, filename: str, purpose: str, ttl: int, file_id: str | None = None,
        owner: str | None = None) -> Flow:
    """Store a file (of key id `owner`, if any); returns its file object. A given `file_id` is overwritten (the
    batch's output files are written under fixed ids, so that two processes that finalize one batch write the
    same file)."""
    file_id = file_id or new_id()
    now = int(time.time())
    meta = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": len(content.encode()),
            "created_at": now, "expires_at": now + ttl}
    ops = [
        # Content first: a file whose metadata exists has its content.
        Cmd("set", (BatchKeys.file_content(file_id), content), {"ex": ttl}),
        # Its owner in the same HSET as the rest: no moment shows the file without it.
        Cmd("hset", (BatchKeys.file(file_id),), {"mapping": meta | ({OWNER: owner} if owner else {})}),
        Cmd("expire", (BatchKeys.file(file_id), ttl)),
    ]
    for index in (BatchKeys.files, *([BatchKeys.files_of(owner)] if owner else [])):
        ops += [Cmd("zadd", (index, {file_id: now})), Cmd("zremrangebyscore", (index, 0, now - ttl))]
    yield Pipe(ops)
    return render(meta)


def get(file_id: str, owner: str | None = None) -> Flow:
    """The file object, or None (also for another key's file)."""
    meta = yield Cmd("hgetall", (BatchKeys.file(file_id),))
    return render(meta) if meta and visible(meta.get(OWNER), owner) else None


def content(file_id: str, owner: str | None = None) -> Flow:
    """The file's text, or None (also for another key's file)."""
    stored, text = yield Pipe([Cmd("hget", (BatchKeys.file(file_id), OWNER)),
                               Cmd("get", (BatchKeys.file_content(file_id),))])
    return text if visible(stored, owner) else None


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
    """True when the file existed (and was the key's)."""
    stored = yield Cmd("hget", (BatchKeys.file(file_id), OWNER))
    if not visible(stored, owner):
        return False
    ops = [Cmd("delete", (BatchKeys.file(file_id), BatchKeys.file_content(file_id))),
           Cmd("zrem", (BatchKeys.files, file_id))]
    if stored:
        ops.append(Cmd("zrem", (BatchKeys.files_of(stored), file_id)))
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
