"""Prometheus metrics of one serve process (GET /metrics); a pure ASGI middleware counts every request. With API
keys, the per-key series carry the key's name (label `key`), never the key: requests by status, the requests its
limits refused, and the jobs and tokens of the key's jobs this process settled (serve.tenancy: each job is
settled by one process, so the sum over processes is the key's total)."""

from __future__ import annotations

import time

import prometheus_client as pc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.auth import KEY_STATE


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = reg = pc.CollectorRegistry()
        self.requests = pc.Counter("pagedq_serve_requests", "HTTP requests, by route and status",
                                   ["route", "status"], registry=reg)
        self.seconds = pc.Histogram("pagedq_serve_request_seconds", "Time to the end of the response, by route",
                                    ["route"], registry=reg,
                                    buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
        self.in_flight = pc.Gauge("pagedq_serve_in_flight", "Requests being answered", registry=reg)
        self.open_requests = pc.Gauge("pagedq_serve_open_requests",
                                      "Completion requests admitted and not yet answered (whole or streamed)",
                                      registry=reg)
        self.refused = pc.Counter("pagedq_serve_refused",
                                  "Completion requests refused before their job was queued, by reason: "
                                  "open_requests, queue_full, redis_busy, constraint_busy (429), "
                                  "redis_unavailable (503)",
                                  ["reason"], registry=reg)
        self.queue_full = pc.Counter("pagedq_serve_queue_full",
                                     "Completion requests refused because the lane of the queue their job would "
                                     "join held --max-queue-depth jobs (also in pagedq_serve_refused, "
                                     "reason queue_full), by queue and lane", ["queue", "lane"], registry=reg)
        self.jobs_submitted = pc.Counter("pagedq_serve_jobs_submitted",
                                         "Jobs this process queued, by lane: completion requests, and the lines of "
                                         "the batches it created (each batch's, once its lines were read)",
                                         ["lane"], registry=reg)
        self.reader_waiters = pc.Gauge("pagedq_serve_reader_waiters",
                                       "Requests waiting on each event reader (serve.events)", ["reader"],
                                       registry=reg)
        self.reader_round = pc.Histogram("pagedq_serve_reader_round_seconds",
                                         "One XREAD round of each event reader: until an event comes, a new "
                                         "request wakes it, or its block ends", ["reader"], registry=reg,
                                         buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.constraint_checks = pc.Counter("pagedq_serve_constraint_checks",
                                            "Constraints compiled to check them (a verdict remembered from an "
                                            "earlier request compiles nothing)", registry=reg)
        self.constraint_timeouts = pc.Counter("pagedq_serve_constraint_check_timeouts",
                                              "Constraint checks that ran past --constraint-check (refused, 400)",
                                              registry=reg)
        self.stream_drops = pc.Counter("pagedq_serve_stream_drops",
                                       "Streams dropped because their client did not read: more of the job's "
                                       "events waited than --stream-buffer-events or --stream-buffer-bytes",
                                       registry=reg)
        self.batches = pc.Counter("pagedq_serve_batches_created", "Batches created", registry=reg)
        self.batches_held = pc.Gauge("pagedq_serve_batches_held",
                                     "Unfinished batches this process moves on (holds the sweeper lease of)",
                                     registry=reg)
        self.key_requests = pc.Counter("pagedq_serve_key_requests", "HTTP requests of each API key, by status",
                                       ["key", "status"], registry=reg)
        self.key_rate_limited = pc.Counter("pagedq_serve_key_rate_limited",
                                           "Requests of each API key refused by its limits (requests, tokens, jobs, batches, "
                                           "file_bytes)",
                                           ["key", "limit"], registry=reg)
        self.key_jobs = pc.Counter("pagedq_serve_key_jobs", "Jobs of each API key that ended (settled here)",
                                   ["key"], registry=reg)
        self.key_prompt_tokens = pc.Counter("pagedq_serve_key_prompt_tokens",
                                            "Prompt tokens of each API key's jobs (settled here)", ["key"],
                                            registry=reg)
        self.key_completion_tokens = pc.Counter("pagedq_serve_key_completion_tokens",
                                                "Completion tokens of each API key's jobs (settled here)", ["key"],
                                                registry=reg)

    def count_usage(self, key: str, jobs: int, prompt_tokens: int, completion_tokens: int) -> None:
        self.key_jobs.labels(key).inc(jobs)
        self.key_prompt_tokens.labels(key).inc(prompt_tokens)
        self.key_completion_tokens.labels(key).inc(completion_tokens)

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
            key = scope.get("state", {}).get(KEY_STATE)  # set by the auth dependency (serve.app)
            if key is not None:
                self.metrics.key_requests.labels(key.name, str(status["code"])).inc()
            self.metrics.seconds.labels(route).observe(time.perf_counter() - start)
