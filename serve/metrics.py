"""Prometheus metrics of one serve process (GET /metrics); a pure ASGI middleware counts every request."""

from __future__ import annotations

import time

import prometheus_client as pc
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = reg = pc.CollectorRegistry()
        self.requests = pc.Counter("pagedq_serve_requests", "HTTP requests, by route and status",
                                   ["route", "status"], registry=reg)
        self.seconds = pc.Histogram("pagedq_serve_request_seconds", "Time to the end of the response, by route",
                                    ["route"], registry=reg,
                                    buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
        self.in_flight = pc.Gauge("pagedq_serve_in_flight", "Requests being answered", registry=reg)
        self.batches = pc.Counter("pagedq_serve_batches_created", "Batches created", registry=reg)

    def render(self) -> bytes:
        return pc.generate_latest(self.registry)


class CountRequests:
    """Counts by route template (/v1/batches/{batch_id}), not by path: ids would make a series each."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        start = time.perf_counter()

        async def send_(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_)
        finally:
            self.metrics.in_flight.dec()
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.requests.labels(route, str(status["code"])).inc()
            self.metrics.seconds.labels(route).observe(time.perf_counter() - start)
