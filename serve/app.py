"""The ASGI app of `pagedq serve`: `uvicorn --factory serve.app:create_app` (settings from $PAGEDQ_SERVE_CONFIG,
see serve.config) or `create_app(ServeConfig(...))`.

The app holds no state of its own beyond connections and its key ring: jobs, files, batches and what each API
key owns, may still do and did live in Redis, so any number of these processes can serve one queue behind a load
balancer, and any of them may restart. SIGHUP rereads the key file (serve.api_keys) in the process that gets it;
`pagedq serve --workers N` passes it on to each of its processes (serve.run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import redis as redis_lib
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from monitor.dashboard import create_app as dashboard_app
from producer import flows
from serve import auth, cpu_process, progress, routes
from serve.batch_lease import Holder
from serve.body_limit import BodyLimit
from serve.checks import Checks
from serve.config import ServeConfig
from serve.errors import APIError, bad_request
from serve.json_response import JSON
from serve.metrics import CountRequests, ServeMetrics
from serve.queues import Queues, redis_refusal
from serve.tenants import Tenants

log = logging.getLogger("pagedq.serve")
UPKEEP_EVERY = 5  # sweeps: how often the keys' jobs that ended unseen are settled


def create_app(config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig.from_env()
    if config.log_level and not logging.getLogger().handlers:  # a worker process of uvicorn's, started afresh
        logging.basicConfig(level=config.log_level, format=config.log_format or logging.BASIC_FORMAT)
    metrics = ServeMetrics()
    tenants = Tenants(config, metrics)
    checks = Checks(config, metrics)
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        queues = state["queues"] = Queues(config, metrics)
        tenants.redis = queues.redis
        if tenants.enabled:
            log.info("API keys: %s", tenants.describe())
        reloads = _on_sighup(tenants.reload)
        sweeper = asyncio.create_task(_sweep(queues, tenants, metrics, config.sweep_interval_s))
        try:
            yield
        finally:
            if reloads:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await queues.close()
            checks.close()
            cpu_process.close()

    def queues() -> Queues:
        return state["queues"]

    async def authorized(request: Request) -> None:
        setattr(request.state, auth.KEY_STATE, auth.identify(request.headers.get("authorization"), tenants.ring))

    async def limited(request: Request) -> None:
        await tenants.admit(auth.key_of(request))

    app = FastAPI(title="pagedq", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=JSON)
    _answer_errors_as_openai(app, config, metrics)
    if not tenants.enabled:
        # The dashboard submits jobs without a bearer token (a browser form): only where the API has no keys
        # either. With keys, run `pagedq dashboard` on an operators' port instead.
        app.mount("/dashboard", dashboard_app(config.redis_url, config.queue))
    app.include_router(routes.operations(queues, metrics))
    v1 = [Depends(authorized), Depends(limited)]
    app.include_router(routes.model_routes(config, queues), dependencies=v1)
    # A completion is admitted once its body is read: its charge against the tokens per minute depends on it.
    app.include_router(routes.completion_routes(queues, tenants, checks),
                       dependencies=[Depends(authorized)])
    app.include_router(routes.file_routes(config, queues, tenants), dependencies=v1)
    app.include_router(routes.batch_routes(config, queues, metrics, tenants), dependencies=v1)
    app.add_middleware(BodyLimit, config=config)
    app.add_middleware(CountRequests, metrics=metrics)  # the outer one: it counts what BodyLimit refuses too
    return app


def _on_sighup(reload) -> bool:
    """Reload the keys on SIGHUP, in this process (the main thread's loop: uvicorn's, in each of its workers).
    Also without a key file: a SIGHUP passed on to the workers (serve.run) must not stop them."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (a test's client), no signals
        log.debug("no SIGHUP handler in this process: its keys are not reloaded")
        return False
    return True


def _answer_errors_as_openai(app: FastAPI, config: ServeConfig, metrics: ServeMetrics) -> None:
    """Every error in OpenAI's shape (serve.errors), so that the SDKs raise their usual exceptions."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSON:
        return JSON(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSON:
        return JSON(APIError(e.status_code, str(e.detail), code=str(e.status_code)).body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSON:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(x) for x in err["loc"][1:]) or None
        return JSON(bad_request(f"{param}: {err['msg']}", param).body(), 400)

    @app.exception_handler(redis_lib.RedisError)
    async def redis_down(request: Request, e: redis_lib.RedisError) -> JSON:
        err = redis_refusal(e, config, metrics)
        if err.status == 503:
            log.warning("redis error: %s", e)
        return JSON(err.body(), err.status, headers=err.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSON:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSON(APIError(500, f"internal error: {type(e).__name__}", "server_error").body(), 500)


async def _sweep(queues: Queues, tenants: Tenants, metrics: ServeMetrics, interval: float) -> None:
    """Move on the unfinished batches whose leases this process holds or can take, so that they finish (and
    their files are written) with no client polling; now and then, settle the API keys' jobs that ended with
    nobody waiting for them."""
    served = list(dict.fromkeys([queues.config.queue, *queues.config.routes.values()]))
    holder = Holder()
    rounds = 0
    while True:
        try:
            metrics.batches_held.set(await flows.adrive(queues.redis, progress.sweep(holder, tenants.tally)))
            if rounds % UPKEEP_EVERY == 0:
                await tenants.upkeep(served)
        except asyncio.CancelledError:
            raise
        except Exception:  # Redis away for a moment, say: the next round tries again
            log.warning("batch sweep failed", exc_info=True)
        rounds += 1
        await asyncio.sleep(interval)
