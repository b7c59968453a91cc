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
from starlette.responses import JSONResponse

from monitor.dashboard import create_app as dashboard_app
from producer import flows
from serve import auth, progress, routes
from serve.config import ServeConfig
from serve.errors import APIError, bad_request
from serve.metrics import CountRequests, ServeMetrics
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

    async def authorized(request: Request) -> None:
        auth.check(request.headers.get("authorization"), config.api_keys)

    app = FastAPI(title="pagedq", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _answer_errors_as_openai(app)
    if not config.api_keys:
        # The dashboard submits jobs without a bearer token (a browser form): only where the API has no keys
        # either. With keys, run `pagedq dashboard` on an operators' port instead.
        app.mount("/dashboard", dashboard_app(config.redis_url, config.queue))
    app.include_router(routes.operations(queues, metrics))
    v1 = [Depends(authorized)]
    app.include_router(routes.model_routes(config, queues), dependencies=v1)
    app.include_router(routes.completion_routes(queues), dependencies=v1)
    app.include_router(routes.file_routes(config, queues), dependencies=v1)
    app.include_router(routes.batch_routes(config, queues, metrics), dependencies=v1)
    app.add_middleware(CountRequests, metrics=metrics)
    return app


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error in OpenAI's shape (serve.errors), so that the SDKs raise their usual exceptions."""

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
