"""`pagedq batch submit|status|wait|download`: the Batch API without the HTTP server, on the same Redis keys,
so a batch submitted here can be read through `pagedq serve` and the other way round."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from producer.connection import connect
from producer.flows import Flow, Offload, drive
from producer.keys import BatchKeys
from serve import batches, files
from serve.batch_lease import Holder
from serve.batch_store import FINAL
from serve.config import ServeConfig
from serve.errors import APIError
from serve.translate import CHAT, ENDPOINTS


class BatchError(Exception):
    pass


def _run(url: str, flow):
    r = connect(url, decode_responses=True)
    try:
        return drive(r, flow)
    except APIError as e:
        raise BatchError(e.message) from None
    finally:
        r.close()


def guess_endpoint(text: str) -> str:
    """The `url` of the file's first request line that names a served endpoint; else chat completions."""
    for line in text.splitlines():
        try:
            url = json.loads(line).get("url")
        except (ValueError, AttributeError):
            continue
        if url in ENDPOINTS:
            return url
    return CHAT


def submit(config: ServeConfig, path: str | Path, endpoint: str | None = None, window: str = "24h",
           metadata: dict | None = None) -> dict:
    """Upload the JSONL file and create a batch of it; returns the batch object."""
    text = Path(path).read_text(encoding="utf-8")
    size = len(text.encode())
    if size > config.max_file_bytes:
        raise BatchError(f"{path} is {size} bytes; the limit is {config.max_file_bytes}")

    def flow():
        meta = yield from files.put(text, Path(path).name, "batch", config.store_ttl_s)
        return (yield from batches.create(config, meta["id"], endpoint or guess_endpoint(text), window, metadata))

    return _run(config.redis_url, flow())


def status(url: str, batch_id: str, holder: Holder | None = None) -> dict:
    """The batch object, moved on first unless a server (or another `wait`) holds it."""
    return _run(url, batches.get(batch_id, holder=holder))


def wait(url: str, batch_id: str, on_progress: Callable[[dict], None] | None = None, interval: float = 1.0,
         timeout: float | None = None) -> dict:
    """Move the batch on until it is final (this process is enough: no server need run), holding its lease for
    the while when no server holds it."""
    end = None if timeout is None else time.monotonic() + timeout
    holder = Holder()
    try:
        while True:
            b = status(url, batch_id, holder)
            if on_progress:
                on_progress(b)
            if b["status"] in FINAL:
                return b
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"batch {batch_id} is {b['status']} after {timeout} s")
            time.sleep(interval)
    finally:
        _run(url, holder.give_up(BatchKeys.sweeper(batch_id)))


def download(url: str, batch_id: str, out: str | Path, errors: str | Path | None = None) -> dict:
    """Write the output file (and the error file, if asked) of a final batch; returns line counts."""
    b = status(url, batch_id)
    if b["status"] not in FINAL:
        raise BatchError(f"batch {batch_id} is {b['status']}: wait for it first (pagedq batch wait)")
    counts = {}
    for file_id, target, name in ((b["output_file_id"], out, "output"), (b["error_file_id"], errors, "errors")):
        if target is None:
            continue
        with open(target, "w", encoding="utf-8") as f:
            counts[name] = _run(url, _save(file_id, f)) if file_id else 0
        if counts[name] is None:
            raise BatchError(f"the {name} file {file_id} expired")
    return counts


def _save(file_id: str, f) -> Flow:
    """Write the file to `f` a part at a time; returns its lines (None: it expired, before or meanwhile)."""
    found = yield from files.parts(file_id)
    if found is None:
        return None
    lines = 0
    for n in range(found[0]):
        text = yield from files.part(file_id, n)
        if text is None:
            return None
        yield Offload(f.write, (text,))
        lines += text.count("\n")
    return lines
