"""Prometheus metrics. Without prometheus-client (or without --metrics-port) every call is a no-op."""

from __future__ import annotations


class _Nop:
    def labels(self, *a, **k) -> _Nop:
        return self

    def inc(self, *a) -> None:
        pass

    def set(self, *a) -> None:
        pass

    def observe(self, *a) -> None:
        pass


class Metrics:
    def __init__(self, queue: str, port: int | None = None) -> None:
        self.registry = None
        nop = _Nop()
        self.jobs = self.tokens = self.steps = self.step_seconds = self.publish_seconds = nop
        self.running = self.pending_acks = self.lease_lost = self.kv_free = self.kv_total = nop
        if port is None:
            return
        try:
            import prometheus_client as pc
        except ImportError:
            raise RuntimeError("--metrics-port needs prometheus-client: pip install 'pagedq[worker]'") from None
        self.registry = reg = pc.CollectorRegistry()
        q = {"queue": queue}
        self.jobs = pc.Counter("pagedq_jobs", "Jobs finished, by final status", ["queue", "status"], registry=reg)
        self.tokens = pc.Counter("pagedq_generated_tokens", "Tokens generated", ["queue"], registry=reg).labels(**q)
        self.steps = pc.Counter("pagedq_engine_steps", "Engine steps", ["queue"], registry=reg).labels(**q)
        self.step_seconds = pc.Histogram("pagedq_step_seconds", "Engine step time", ["queue"], registry=reg,
                                         buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)).labels(**q)
        self.publish_seconds = pc.Histogram("pagedq_publish_seconds", "One publisher round trip", ["queue"],
                                            registry=reg, buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1,
                                                                   .25)).labels(**q)
        self.running = pc.Gauge("pagedq_running_jobs", "Jobs in the engine", ["queue"], registry=reg).labels(**q)
        self.pending_acks = pc.Gauge("pagedq_pending_acks", "Finished jobs not yet acked", ["queue"],
                                     registry=reg).labels(**q)
        self.lease_lost = pc.Counter("pagedq_lease_lost", "Writes refused: lease lost", ["queue"],
                                     registry=reg).labels(**q)
        # Free equals total whenever the engine is idle; less means blocks leaked (the soak test reads these).
        self.kv_free = pc.Gauge("pagedq_kv_blocks_free", "Free KV cache blocks", ["queue"], registry=reg).labels(**q)
        self.kv_total = pc.Gauge("pagedq_kv_blocks_total", "KV cache blocks", ["queue"], registry=reg).labels(**q)
        pc.start_http_server(port, registry=reg)
        self.queue = queue

    def job_done(self, status: str) -> None:
        if self.registry is not None:
            self.jobs.labels(queue=self.queue, status=status).inc()
