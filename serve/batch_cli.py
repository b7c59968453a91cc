"""`pagedq batch submit|status|wait|download`: the Batch API without the HTTP server, on the same Redis keys,
so a batch submitted here can be read through `pagedq serve` and the other way round."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from producer.connection import connect
from producer.flows import drive
from serve import batches, files
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


def status(url: str, batch_id: str) -> dict:
    return _run(url, batches.get(batch_id))


def wait(url: str, batch_id: str, on_progress: Callable[[dict], None] | None = None, interval: float = 1.0,
         timeout: float | None = None) -> dict:
    """Advance the batch until it is final (this process is enough: no server need run)."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        b = status(url, batch_id)
        if on_progress:
            on_progress(b)
        if b["status"] in FINAL:
            return b
        if end is not None and time.monotonic() > end:
            raise TimeoutError(f"batch {batch_id} is {b['status']} after {timeout} s")
        time.sleep(interval)


def download(url: str, batch_id: str, out: str | Path, errors: str | Path | None = None) -> dict:
    """Write the output file (and the error file, if asked) of a final batch; returns line counts."""
    b = status(url, batch_id)
    if b["status"] not in FINAL:
        raise BatchError(f"batch {batch_id} is {b['status']}: wait for it first (pagedq batch wait)")
    counts = {}
    for file_id, target, name in ((b["output_file_id"], out, "output"), (b["error_file_id"], errors, "errors")):
        if target is None:
            continue
        text = _run(url, files.content(file_id)) if file_id else ""
        if file_id and text is None:
            raise BatchError(f"the {name} file {file_id} expired")
        Path(target).write_text(text or "", encoding="utf-8")
        counts[name] = len((text or "").splitlines())
    return counts
