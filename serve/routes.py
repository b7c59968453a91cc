"""The routes of `pagedq serve`, one APIRouter per group: OpenAI's models, completions, files and batches under
/v1, and the operator's /health and /metrics. Each is made for one app from what its handlers need: the
settings, the app's queues (opened when it starts, hence a getter), its API keys and its metrics.

With API keys, a request acts for its key (`key_of`): files and batches are made as that key's, and another
key's are not found (404: their existence is not revealed either)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis as redis_lib
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from producer import flows
from serve import batches, completions, files, lanes
from serve.auth import key_of
from serve.body_limit import FORM_SLACK
from serve.checks import Checks
from serve.config import ServeConfig
from serve.errors import APIError, bad_request, not_found
from serve.metrics import ServeMetrics
from serve.queues import Queues
from serve.served_models import list_models
from serve.tenants import Tenants

QueuesOf = Callable[[], Queues]


async def _run(queues: Queues, flow: flows.Flow) -> Any:
    return await flows.adrive(queues.redis, flow)


def owner_of(request: Request) -> str | None:
    """The key id that the request's files and batches belong to; None (everything) without keys."""
    key = key_of(request)
    return key.id if key else None


def operations(queues: QueuesOf, metrics: ServeMetrics) -> APIRouter:
    """GET /health (Redis answers) and GET /metrics (Prometheus); no API key, as a probe or a scraper has none."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        try:
            await queues().redis.ping()
        except redis_lib.RedisError as e:
            return JSONResponse({"status": "error", "redis": str(e)}, 503)
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics_() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return router


def model_routes(config: ServeConfig, queues: QueuesOf) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": await list_models(config, queues().redis)}

    @router.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        for m in await list_models(config, queues().redis):
            if m["id"] == model:
                return m
        raise not_found(f"The model `{model}` does not exist", "model")

    return router


def completion_routes(queues: QueuesOf, tenants: Tenants, checks: Checks) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await completions.handle("chat", request, queues(), tenants, checks)

    @router.post("/v1/completions")
    async def completion(request: Request) -> Response:
        return await completions.handle("completion", request, queues(), tenants, checks)

    return router


def file_routes(config: ServeConfig, queues: QueuesOf, tenants: Tenants) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    async def upload(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > config.max_file_bytes + FORM_SLACK:
            raise APIError(413, f"the file is larger than {config.max_file_bytes} bytes", param="file")
        form = await request.form(max_files=1, max_fields=8)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise bad_request("purpose must be 'batch' (pagedq stores batch input files only)", "purpose")
        if upload is None or isinstance(upload, str):
            raise bad_request("send the file as multipart form field 'file'", "file")
        data = await upload.read(config.max_file_bytes + 1)
        if len(data) > config.max_file_bytes:
            raise APIError(413, f"the file is larger than {config.max_file_bytes} bytes", param="file")
        try:
            await asyncio.to_thread(data.decode)  # stored as sent, once known to be UTF-8
        except UnicodeDecodeError:
            raise bad_request("the file must be UTF-8 JSONL", "file") from None
        key = key_of(request)
        flow = files.put(data, upload.filename or "upload.jsonl", purpose, config.store_ttl_s, owner=owner_of(request),
                         quota=tenants.limits(key).max_file_bytes)
        return await tenants.limited(key, _run(queues(), flow))

    @router.get("/v1/files")
    async def list_files(request: Request, limit: int = 100, purpose: str | None = None) -> dict:
        data = await _run(queues(), files.listing(max(1, min(limit, 10_000)), purpose, owner_of(request)))
        return {"object": "list", "data": data, "has_more": False}

    @router.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> dict:
        meta = await _run(queues(), files.get(_file_id(file_id), owner_of(request)))
        if meta is None:
            raise not_found(f"No such File object: {file_id}", "file_id")
        return meta

    @router.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        found = await _run(queues(), files.parts(_file_id(file_id), owner_of(request)))
        if found is None:
            raise not_found(f"No such File object: {file_id}", "file_id")
        count, size = found

        async def body() -> AsyncIterator[bytes]:
            for n in range(count):
                text = await _run(queues(), files.part(file_id, n))
                if text is None:  # deleted or expired meanwhile: the body ends short of its Content-Length
                    return
                yield text.encode()

        # A part at a time: a file of any size passes through a part's worth of this process's memory.
        return StreamingResponse(body(), media_type="application/jsonl", headers={"Content-Length": str(size)})

    @router.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> dict:
        if not await _run(queues(), files.delete(_file_id(file_id), owner_of(request))):
            raise not_found(f"No such File object: {file_id}", "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    return router


def _file_id(file_id: str) -> str:
    try:
        files.check_id(file_id)
    except ValueError as e:
        raise not_found(str(e), "file_id") from None
    return file_id


def batch_routes(config: ServeConfig, queues: QueuesOf, metrics: ServeMetrics, tenants: Tenants) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches")
    async def create_batch(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        for field in ("input_file_id", "endpoint"):
            if not isinstance(body.get(field), str):
                raise bad_request(f"{field} is required", field)
        unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {sorted(unknown)[0]}", sorted(unknown)[0])
        key = key_of(request)
        flow = batches.create(config, body["input_file_id"], body["endpoint"], body.get("completion_window") or "24h",
                              body.get("metadata"), owner_of(request), tenants.limits(key).max_batches,
                              key.top_priority if key else None)
        out = await tenants.limited(key, _run(queues(), flow))
        metrics.batches.inc()
        if out.get("status") not in ("validating", "failed"):  # its lines' jobs were queued (batch lane)
            counts = out.get("request_counts") or {}
            metrics.jobs_submitted.labels(lanes.BATCH).inc(max(0, counts.get("total", 0) - counts.get("failed", 0)))
        return out

    @router.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None) -> dict:
        return await _run(queues(), batches.listing(max(1, min(limit, 100)), after, owner_of(request)))

    # Reads: the process that holds a batch's lease moves it on (serve.progress), whichever process is asked.
    @router.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> dict:
        return await _run(queues(), batches.show(batch_id, owner_of(request)))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> dict:
        return await _run(queues(), batches.cancel(batch_id, owner_of(request)))

    return router
