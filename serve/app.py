"""The ASGI app of `pagedq serve`: `uvicorn --factory serve.app:create_app` (settings from $PAGEDQ_SERVE_CONFIG,
see serve.config) or `create_app(ServeConfig(...))`.

The app holds no state of its own beyond connections: jobs, files and batches live in Redis, so any number of
these processes can serve one queue behind a load balancer, and any of them may restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis as redis_lib
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from producer import flows
from serve import auth, batches, completions, files, progress
from serve.config import ServeConfig
from serve.errors import APIError, bad_request, not_found
from serve.metrics import CountRequests, ServeMetrics
from serve.models import list_models
from serve.queues import Queues

log = logging.getLogger("pagedq.serve")


def create_app(config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig.from_env()
    metrics = ServeMetrics()
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        queues = state["queues"] = Queues(config)
        sweeper = asyncio.create_task(_sweep(queues, config.sweep_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await queues.close()

    def queues() -> Queues:
        return state["queues"]

    async def run(flow: flows.Flow):
        return await flows.adrive(queues().redis, flow)

    async def authorized(request: Request) -> None:
        auth.check(request.headers.get("authorization"), config.api_keys)

    app = FastAPI(title="pagedq", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    v1 = Depends(authorized)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail), code=str(e.status_code)).body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(x) for x in err["loc"][1:]) or None
        return JSONResponse(bad_request(f"{param}: {err['msg']}", param).body(), 400)

    @app.exception_handler(redis_lib.RedisError)
    async def redis_down(request: Request, e: redis_lib.RedisError) -> JSONResponse:
        log.warning("redis error: %s", e)
        return JSONResponse(APIError(503, f"the queue's Redis is unavailable: {type(e).__name__}", "server_error",
                                     code="redis_unavailable").body(), 503)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", "server_error").body(), 500)

    if not config.api_keys:
        # The dashboard submits jobs without a bearer token (a browser form): only where the API has no keys
        # either. With keys, run `pagedq dashboard` on an operators' port instead.
        from monitor.dashboard import create_app as dashboard_app

        app.mount("/dashboard", dashboard_app(config.redis_url, config.queue))

    @app.get("/health")
    async def health() -> Response:
        try:
            await queues().redis.ping()
        except redis_lib.RedisError as e:
            return JSONResponse({"status": "error", "redis": str(e)}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[v1])
    async def models() -> dict:
        return {"object": "list", "data": await list_models(config, queues().redis)}

    @app.get("/v1/models/{model:path}", dependencies=[v1])
    async def model(model: str) -> dict:
        for m in await list_models(config, queues().redis):
            if m["id"] == model:
                return m
        raise not_found(f"The model `{model}` does not exist", "model")

    @app.post("/v1/chat/completions", dependencies=[v1])
    async def chat(request: Request) -> Response:
        return await completions.handle("chat", request, queues())

    @app.post("/v1/completions", dependencies=[v1])
    async def completion(request: Request) -> Response:
        return await completions.handle("completion", request, queues())

    @app.post("/v1/files", dependencies=[v1])
    async def upload(request: Request) -> dict:
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > config.max_file_bytes + 64 * 1024:
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
            text = data.decode()
        except UnicodeDecodeError:
            raise bad_request("the file must be UTF-8 JSONL", "file") from None
        return await run(files.put(text, upload.filename or "upload.jsonl", purpose, config.store_ttl_s))

    @app.get("/v1/files", dependencies=[v1])
    async def list_files(limit: int = 100, purpose: str | None = None) -> dict:
        data = await run(files.listing(max(1, min(limit, 10_000)), purpose))
        return {"object": "list", "data": data, "has_more": False}

    @app.get("/v1/files/{file_id}", dependencies=[v1])
    async def get_file(file_id: str) -> dict:
        meta = await run(files.get(_file_id(file_id)))
        if meta is None:
            raise not_found(f"No such File object: {file_id}", "file_id")
        return meta

    @app.get("/v1/files/{file_id}/content", dependencies=[v1])
    async def file_content(file_id: str) -> Response:
        text = await run(files.content(_file_id(file_id)))
        if text is None:
            raise not_found(f"No such File object: {file_id}", "file_id")
        return Response(text, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}", dependencies=[v1])
    async def delete_file(file_id: str) -> dict:
        if not await run(files.delete(_file_id(file_id))):
            raise not_found(f"No such File object: {file_id}", "file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches", dependencies=[v1])
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
        out = await run(batches.create(config, body["input_file_id"], body["endpoint"],
                                       body.get("completion_window") or "24h", body.get("metadata")))
        metrics.batches.inc()
        return out

    @app.get("/v1/batches", dependencies=[v1])
    async def list_batches(limit: int = 20, after: str | None = None) -> dict:
        return await run(batches.listing(max(1, min(limit, 100)), after))

    @app.get("/v1/batches/{batch_id}", dependencies=[v1])
    async def get_batch(batch_id: str) -> dict:
        return await run(batches.get(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=[v1])
    async def cancel_batch(batch_id: str) -> dict:
        return await run(batches.cancel(batch_id))

    app.add_middleware(CountRequests, metrics=metrics)
    return app


def _file_id(file_id: str) -> str:
    try:
        files.check_id(file_id)
    except ValueError as e:
        raise not_found(str(e), "file_id") from None
    return file_id


async def _sweep(queues: Queues, interval: float) -> None:
    """Advance unfinished batches, so that they finish (and their files are written) with no client polling."""
    while True:
        try:
            await flows.adrive(queues.redis, progress.sweep())
        except asyncio.CancelledError:
            raise
        except Exception:  # Redis away for a moment, say: the next round tries again
            log.warning("batch sweep failed", exc_info=True)
        await asyncio.sleep(interval)
