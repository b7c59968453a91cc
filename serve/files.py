"""The Files API's store in Redis: a file is a metadata hash and its content, both with a TTL. Sans-IO flows
(see producer.flows): the asyncio server and the sync CLI run the same code."""

from __future__ import annotations

import time
import uuid

from producer.flows import Cmd, Flow, Pipe
from producer.keys import BatchKeys

PURPOSES = ("batch", "batch_output")


def new_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def put(content: str, filename: str, purpose: str, ttl: int, file_id: str | None = None) -> Flow:
    """Store a file; returns its file object. A given `file_id` is overwritten (the batch's output files are
    written under fixed ids, so that two processes that finalize one batch write the same file)."""
    file_id = file_id or new_id()
    now = int(time.time())
    meta = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": len(content.encode()),
            "created_at": now, "expires_at": now + ttl}
    yield Pipe([
        # Content first: a file whose metadata exists has its content.
        Cmd("set", (BatchKeys.file_content(file_id), content), {"ex": ttl}),
        Cmd("hset", (BatchKeys.file(file_id),), {"mapping": meta}),
        Cmd("expire", (BatchKeys.file(file_id), ttl)),
        Cmd("zadd", (BatchKeys.files, {file_id: now})),
        Cmd("zremrangebyscore", (BatchKeys.files, 0, now - ttl)),
    ])
    return render(meta)


def get(file_id: str) -> Flow:
    """The file object, or None."""
    meta = yield Cmd("hgetall", (BatchKeys.file(file_id),))
    return render(meta) if meta else None


def content(file_id: str) -> Flow:
    """The file's text, or None."""
    return (yield Cmd("get", (BatchKeys.file_content(file_id),)))


def listing(limit: int, purpose: str | None = None) -> Flow:
    """The newest files first."""
    ids = yield Cmd("zrevrange", (BatchKeys.files, 0, max(0, limit * 4) - 1))
    metas = (yield Pipe([Cmd("hgetall", (BatchKeys.file(i),)) for i in ids])) if ids else []
    gone = [i for i, m in zip(ids, metas) if not m]
    if gone:
        yield Cmd("zrem", (BatchKeys.files, *gone))
    out = [render(m) for m in metas if m and (purpose is None or m.get("purpose") == purpose)]
    return out[:limit]


def delete(file_id: str) -> Flow:
    """True when the file existed."""
    n = yield Pipe([Cmd("delete", (BatchKeys.file(file_id), BatchKeys.file_content(file_id))),
                    Cmd("zrem", (BatchKeys.files, file_id))])
    return bool(n[0])


def render(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": int(meta["bytes"]), "created_at": int(meta["created_at"]),
            "expires_at": int(meta["expires_at"]), "filename": meta["filename"], "purpose": meta["purpose"],
            "status": "processed", "status_details": None}


def check_id(file_id: str) -> str:
    """ValueError for an id that cannot name a file's keys."""
    BatchKeys.file(file_id)
    return file_id
