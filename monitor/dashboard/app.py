"""The dashboard as an ASGI app (Starlette): one HTML page and a small JSON + server-sent-events API under it.

Standalone: `pagedq dashboard`. Inside another ASGI app (`pagedq serve`): `app.mount("/dashboard",
create_app(redis_url, queue))`. Every URL the page uses is relative to where it is served, so any mount path
works.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from monitor import fleet
from monitor.dashboard import data
from producer import defaults
from producer.keys import check_queue

PAGE = Path(__file__).with_name("page.html")
MAX_TOKENS_LIMIT = 4096  # the form's jobs: a dashboard is not the place for long generations
STREAM_TIMEOUT_S = 600.0  # an SSE stream gives up on a job that has not ended after this long
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream


class _Redis:
    """Clients made on first use, inside the server's event loop (an asyncio client belongs to one loop)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self._sync = None
        self._async: dict[str, Any] = {}
        self._aredis = None

    def sync(self):
        if self._sync is None:
            from producer.connection import connect

            self._sync = connect(self.url, decode_responses=True)
        return self._sync

    def client(self, queue: str):
        from producer import AsyncClient
        from producer.connection import connect_async

        if self._aredis is None:
            self._aredis = connect_async(self.url, decode_responses=True)
        if queue not in self._async:
            self._async[queue] = AsyncClient(queue=queue, redis=self._aredis)
        return self._async[queue]


def create_app(redis_url: str | None = None, queue: str = defaults.QUEUE) -> Starlette:
    """The dashboard for every queue a worker has served, plus `queue` (shown first, the form's default)."""
    conn = _Redis(redis_url)
    page = PAGE.read_text()

    def queues() -> list[str]:
        return [queue] + [q for q in fleet.known_queues(conn.sync()) if q != queue]

    async def index(request: Request) -> Response:
        if not request.url.path.endswith("/"):  # relative API URLs need the trailing slash
            return RedirectResponse(request.url.path + "/")
        return HTMLResponse(page.replace("{{QUEUE}}", json.dumps(queue)))

    async def api_state(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(lambda: data.state(conn.sync(), queues())))

    async def api_history(request: Request) -> Response:
        minutes = min(60.0, float(request.query_params.get("minutes", 15)))
        step = max(1.0, float(request.query_params.get("step", 10)))
        only = request.query_params.get("queue")
        return JSONResponse(await run_in_threadpool(
            lambda: data.history(conn.sync(), [check_queue(only)] if only else queues(), minutes, step)))

    async def api_submit(request: Request) -> Response:
        try:
            body = await request.json()
            q = check_queue(body.get("queue") or queue)
            max_tokens = int(body.get("max_tokens", 64))
            if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
                raise ValueError(f"max_tokens must be 1-{MAX_TOKENS_LIMIT}")
            fields: dict[str, Any] = {"max_tokens": max_tokens, "temperature": float(body.get("temperature", 0))}
            prompt = str(body.get("prompt", ""))
            if body.get("chat"):
                fields["messages"] = [{"role": "user", "content": prompt}]
            else:
                fields["prompt"] = prompt
            job = await conn.client(q).submit(**fields)
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            return JSONResponse({"error": str(e)}, status_code=400)
        return JSONResponse({"id": job.id, "queue": q})

    async def api_events(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        try:
            client = conn.client(check_queue(request.query_params.get("queue") or queue))
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return StreamingResponse(_sse(client, job_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return Starlette(routes=[
        Route("/", index),
        Route("/api/state", api_state),
        Route("/api/history", api_history),
        Route("/api/submit", api_submit, methods=["POST"]),
        Route("/api/jobs/{job_id}/events", api_events),
    ])


async def _sse(client, job_id: str):
    """The job's events as SSE: `token` events with the new text, then one `done`, `error` or `cancelled`."""
    events = client.stream(job_id, timeout=STREAM_TIMEOUT_S).__aiter__()
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield ": keepalive\n\n"
                continue
            try:
                ev = pending.result()
            except StopAsyncIteration:
                return
            except Exception as e:  # not found, timed out, Redis gone: the page shows why
                yield f"event: error\ndata: {json.dumps({'error': f'{type(e).__name__}: {e}'})}\n\n"
                return
            yield f"id: {ev.event_id}\nevent: {ev.type}\ndata: {ev.model_dump_json()}\n\n"
            if ev.type != "token":
                return
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        pending.cancel()
