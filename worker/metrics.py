"""Prometheus metrics of one worker, and the per-interval latency counts its heartbeat carries.

Names follow Prometheus conventions: base units (`_seconds`), `_total` on counters (prometheus-client adds it),
a `queue` label everywhere and `model` on what a job or a step produced, since workers of one queue may serve
different models. Without prometheus-client (or without --metrics-port) the Prometheus side is a no-op, but the
interval window still fills: heartbeats, `pagedq status` and the dashboard use it with or without Prometheus.

The queue gauges (depth, pending, oldest ages, dead letters) describe Redis, not this worker: every worker of a
queue exports the same values, so aggregate them with `max by (queue)`, never `sum`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from worker.latency_window import TPOT_BUCKETS, TTFT_BUCKETS, LatencyWindow

QUEUE_WAIT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
E2E_BUCKETS = (.1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5)
PUBLISH_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25)
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Writes unconfirmed this close together are one spell without a replica: a writer without one writes again every
# CONFIRM_RETRY_S plus a WAIT's timeout (worker.publisher.healing), well within this.
ALONE_GAP_S = 10.0


class _Nop:
    def labels(self, *a: Any, **k: Any) -> _Nop:
        return self

    def inc(self, *a: Any) -> None:
        pass

    def set(self, *a: Any) -> None:
        pass

    def remove(self, *a: Any) -> None:
        pass

    def observe(self, *a: Any) -> None:
        pass


class Metrics:
    """What the worker, its publisher and its heartbeat observe. Its publisher's writer reports through
    publish_round_trip, lease_lost, job_done, dead_letter, not_replicated and resent (worker.publisher.writer.
    WriterMetrics), from another process."""

    def __init__(self, queue: str, port: int | None = None, model: str = "") -> None:
        self.queue, self.model = queue, model
        self.registry = None
        self.window = LatencyWindow()
        self._lock = threading.Lock()  # the step loop and the publisher-reply thread both count jobs
        self.jobs_finished = 0
        self.unreplicated_at: float | None = None  # the last write no replica confirmed (wall time)
        self.alone_since: float | None = None  # when this spell of them began
        nop = _Nop()
        for name in ("jobs", "tokens", "prompt_tokens", "cached_tokens", "preemptions", "retries", "dead_letters",
                     "lease_losses", "unreplicated", "unreplicated_now", "resent_tokens", "steps", "failed_steps", "convicted", "spec_proposed", "spec_accepted", "step_seconds", "publish_seconds", "batch_seqs", "batch_tokens",
                     "queue_wait", "ttft", "tpot", "e2e", "running", "running_seqs", "waiting_seqs",
                     "pending_acks", "kv_free", "kv_used", "kv_total", "depth", "pending", "oldest_pending_age",
                     "oldest_waiting_age", "dlq_length", "live_workers", "lane_started", "lane_wait", "lane_ttft",
                     "lane_tokens", "lane_depth", "lane_waiting_age", "group_started", "group_wait", "group_tokens",
                     "group_depth"):
            setattr(self, name, nop)
        self.group_labels: set[tuple[str, str]] = set()  # (lane, group) of the group_depth gauges set now
        if port is None:
            return
        try:
            import prometheus_client as pc
        except ImportError:
            raise RuntimeError("--metrics-port needs prometheus-client: pip install 'pagedq[worker]'") from None
        self.registry = reg = pc.CollectorRegistry()
        q, qm = {"queue": queue}, {"queue": queue, "model": model}
        QM = ["queue", "model"]

        def counter(name: str, doc: str, labels: list[str] = QM) -> Any:
            return pc.Counter(name, doc, labels, registry=reg).labels(**(qm if "model" in labels else q))

        def gauge(name: str, doc: str) -> Any:
            return pc.Gauge(name, doc, ["queue"], registry=reg).labels(**q)

        def histogram(name: str, doc: str, buckets: tuple, labels: list[str] = QM) -> Any:
            return pc.Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(
                **(qm if "model" in labels else q))

        # ---- counters ----
        self.jobs = pc.Counter("pagedq_jobs", "Jobs finished by this worker, by final status",
                               ["queue", "model", "status"], registry=reg)
        for status in ("completed", "failed", "cancelled", "expired"):  # at 0 from the start: rate() sees the first
            self.jobs.labels(queue=queue, model=model, status=status)
        self.tokens = counter("pagedq_generated_tokens", "Output tokens generated")
        self.prompt_tokens = counter("pagedq_prompt_tokens", "Prompt tokens of the jobs started")
        self.cached_tokens = counter("pagedq_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self.preemptions = counter("pagedq_preemptions", "Sequences preempted (their KV blocks freed, recomputed later)")
        self.retries = counter("pagedq_job_retries", "Deliveries of a job after its first (reclaimed or retried)")
        self.dead_letters = counter("pagedq_dead_letters", "Jobs this worker sent to the dead-letter stream")
        self.lease_losses = counter("pagedq_lease_losses", "Writes refused because the job's lease was lost")
        self.unreplicated = counter("pagedq_unreplicated_writes", "Round trips of writes fewer replicas than "
                                    "asked confirmed in time (durability replicated)", ["queue"])
        self.resent_tokens = counter("pagedq_resent_tokens", "Tokens written again to a stream that had lost them "
                                     "(a failover promoted a replica without the last writes)", ["queue"])
        self.steps = counter("pagedq_engine_steps", "Engine steps")
        self.failed_steps = counter("pagedq_engine_failed_steps", "Engine steps that raised (the jobs in them "
                                    "resumed; the cause searched for by running them apart)")
        self.convicted = counter("pagedq_engine_fault_jobs", "Jobs failed as the cause of an engine step that raised "
                                 "(each reproduced it running alone)")
        self.spec_proposed = counter("pagedq_speculative_proposed_tokens", "Draft tokens proposed (speculative "
                                     "decoding, --speculative)")
        self.spec_accepted = counter("pagedq_speculative_accepted_tokens", "Draft tokens the model accepted: output "
                                     "tokens beyond one per sequence per step")
        # ---- histograms ----
        self.queue_wait = histogram("pagedq_queue_wait_seconds", "Enqueue to start on a worker", QUEUE_WAIT_BUCKETS)
        self.ttft = histogram("pagedq_time_to_first_token_seconds", "Enqueue to the first output token", TTFT_BUCKETS)
        self.tpot = histogram("pagedq_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per job", TPOT_BUCKETS)
        self.e2e = histogram("pagedq_e2e_seconds", "Enqueue to the last token of a job the engine finished",
                             E2E_BUCKETS)
        self.batch_seqs = histogram("pagedq_batch_size_sequences", "Sequences in one engine step",
                                    BATCH_SEQ_BUCKETS)
        self.batch_tokens = histogram("pagedq_batch_size_tokens", "Tokens (prefill and decode) in one engine step",
                                      BATCH_TOKEN_BUCKETS)
        self.step_seconds = histogram("pagedq_step_seconds", "Engine step time", STEP_BUCKETS)
        self.publish_seconds = histogram("pagedq_publish_seconds", "One publisher round trip", PUBLISH_BUCKETS,
                                         ["queue"])
        # ---- gauges: this worker ----
        self.running = gauge("pagedq_running_jobs", "Jobs this worker holds in its engine")
        self.running_seqs = gauge("pagedq_running_sequences", "Sequences in the engine's running batch")
        self.waiting_seqs = gauge("pagedq_waiting_sequences", "Sequences admitted to the engine, waiting for room")
        self.pending_acks = gauge("pagedq_pending_acks", "Finished jobs not yet acked")
        self.unreplicated_now = gauge("pagedq_unreplicated", "1 while this worker's writes go unconfirmed by "
                                      "replicas (durability replicated): job ends are published on the primary alone")
        # Free equals total whenever the engine is idle; less means blocks leaked (the soak test reads these).
        self.kv_free = gauge("pagedq_kv_blocks_free", "Free KV cache blocks")
        self.kv_used = gauge("pagedq_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = gauge("pagedq_kv_blocks_total", "KV cache blocks")
        # ---- gauges: the queue in Redis, refreshed with each heartbeat ----
        self.depth = gauge("pagedq_queue_depth", "Jobs in the queue's stream: waiting and running")
        self.pending = gauge("pagedq_queue_pending_entries", "Jobs delivered to a worker and not yet acked")
        self.oldest_pending_age = gauge("pagedq_queue_oldest_pending_age_seconds",
                                        "Age of the oldest delivered, unacked job")
        self.oldest_waiting_age = gauge("pagedq_queue_oldest_waiting_age_seconds",
                                        "Age of the oldest job no worker has taken yet")
        self.dlq_length = gauge("pagedq_queue_dead_letters", "Entries in the queue's dead-letter stream")
        self.live_workers = gauge("pagedq_queue_live_workers", "Workers of the queue with a live heartbeat")
        self._lanes_and_groups(pc, reg)
        pc.start_http_server(port, registry=reg)

    def _lanes_and_groups(self, pc: Any, reg: Any) -> None:
        """Per lane and per fair-share group. A group label takes one series per group that ran a job (API keys,
        customers): the per-group ones are counters of sums, no histograms, to keep that cheap."""
        lane, group = ["queue", "lane"], ["queue", "lane", "group"]
        self.lane_started = pc.Counter("pagedq_lane_jobs_started", "Jobs started, by lane", lane, registry=reg)
        self.lane_wait = pc.Histogram("pagedq_lane_queue_wait_seconds", "Enqueue to start on a worker, by lane",
                                      lane, registry=reg, buckets=QUEUE_WAIT_BUCKETS)
        self.lane_ttft = pc.Histogram("pagedq_lane_time_to_first_token_seconds", "Enqueue to the first output "
                                      "token, by lane", lane, registry=reg, buckets=TTFT_BUCKETS)
        self.lane_tokens = pc.Counter("pagedq_lane_generated_tokens", "Output tokens of the jobs finished, by lane",
                                      lane, registry=reg)
        self.lane_depth = pc.Gauge("pagedq_lane_depth", "Jobs in the lane's streams: waiting and running", lane,
                                   registry=reg)
        self.lane_waiting_age = pc.Gauge("pagedq_lane_oldest_waiting_age_seconds", "Age of the lane's oldest job "
                                         "no worker has taken yet", lane, registry=reg)
        self.group_started = pc.Counter("pagedq_group_jobs_started", "Jobs started, by lane and group", group,
                                        registry=reg)
        self.group_wait = pc.Counter("pagedq_group_queue_wait_seconds", "Sum of enqueue-to-start times of the "
                                     "jobs started (divide by pagedq_group_jobs_started for the mean)", group,
                                     registry=reg)
        self.group_tokens = pc.Counter("pagedq_group_generated_tokens", "Output tokens of the jobs finished, by "
                                       "lane and group", group, registry=reg)
        self.group_depth = pc.Gauge("pagedq_group_depth", "Jobs in a group's stream of a lane: waiting and "
                                    "running", group, registry=reg)

    # ---- job life ------------------------------------------------------------------------------------------

    def job_done(self, status: str) -> None:
        with self._lock:
            self.jobs_finished += 1
        self.jobs.labels(queue=self.queue, model=self.model, status=status).inc()

    def job_started(self, enqueued_at: float | None, started_at: float, prompt_tokens: int, attempts: int,
                    lane: str, group: str | None) -> None:
        self.lane_started.labels(self.queue, lane).inc()
        if group is not None:
            self.group_started.labels(self.queue, lane, group).inc()
        if enqueued_at is not None:
            wait = max(0.0, started_at - enqueued_at)
            self.queue_wait.observe(wait)
            self.lane_wait.labels(self.queue, lane).observe(wait)
            if group is not None:
                self.group_wait.labels(self.queue, lane, group).inc(wait)
        self.prompt_tokens.inc(prompt_tokens)
        if attempts > 1:
            self.retries.inc()

    def first_token(self, enqueued_at: float | None, started_at: float, now: float, cached_tokens: int,
                    lane: str) -> None:
        ttft = max(0.0, now - (enqueued_at if enqueued_at is not None else started_at))
        self.ttft.observe(ttft)
        self.lane_ttft.labels(self.queue, lane).observe(ttft)
        self.window.ttft(ttft)
        self.cached_tokens.inc(cached_tokens)

    def finished(self, enqueued_at: float | None, started_at: float, first_token_at: float | None, now: float,
                 output_tokens: int, lane: str, group: str | None) -> None:
        """A job the engine finished (stop or length), with the output tokens of this delivery."""
        self.lane_tokens.labels(self.queue, lane).inc(output_tokens)
        if group is not None:
            self.group_tokens.labels(self.queue, lane, group).inc(output_tokens)
        self.e2e.observe(max(0.0, now - (enqueued_at if enqueued_at is not None else started_at)))
        if first_token_at is not None and output_tokens > 1:
            tpot = max(0.0, now - first_token_at) / (output_tokens - 1)
            self.tpot.observe(tpot)
            self.window.tpot(tpot)

    def dead_letter(self) -> None:
        self.dead_letters.inc()
        self.job_done("failed")

    def lease_lost(self) -> None:
        """A write refused: another worker holds the job now."""
        self.lease_losses.inc()

    def publish_round_trip(self, seconds: float) -> None:
        self.publish_seconds.observe(seconds)

    def not_replicated(self) -> None:
        """A round trip of writes whose WAIT counted fewer replicas than durability asks."""
        now = time.time()
        last = self.unreplicated_at
        if last is None or now - last > ALONE_GAP_S:
            self.alone_since = now
        self.unreplicated_at = now
        self.unreplicated.inc()
        self.unreplicated_now.set(1)

    def unreplicated_since(self) -> float | None:
        """When this worker's writes began to go unconfirmed by replicas (wall time), or None while replicas
        confirm them (no unconfirmed write within ALONE_GAP_S)."""
        last = self.unreplicated_at
        if last is None or time.time() - last > ALONE_GAP_S:
            self.unreplicated_now.set(0)
            return None
        return self.alone_since

    def resent(self, tokens: int) -> None:
        """Tokens sent again to a job's stream after a failover lost them there."""
        self.resent_tokens.inc(tokens)

    # ---- steps and state -----------------------------------------------------------------------------------

    def step(self, seqs: int, tokens: int, preempted: int, generated: int) -> None:
        self.batch_seqs.observe(seqs)
        self.batch_tokens.observe(tokens)
        if preempted:
            self.preemptions.inc(preempted)
        self.window.generated(generated)

    def engine_state(self, running: int, waiting: int, kv_free: int, kv_total: int) -> None:
        self.running_seqs.set(running)
        self.waiting_seqs.set(waiting)
        self.kv_free.set(kv_free)
        self.kv_used.set(kv_total - kv_free)
        self.kv_total.set(kv_total)

    def queue_state(self, info: dict) -> None:
        """`info`: producer.queue_info.queue_info's answer."""
        self.depth.set(info["length"])
        self.pending.set(info["pending"])
        self.oldest_pending_age.set(info.get("oldest_pending_age_s") or 0)
        self.oldest_waiting_age.set(info.get("oldest_waiting_age_s") or 0)
        self.dlq_length.set(info.get("dead_letters", 0))
        for lane, x in info.get("lanes", {}).items():
            self.lane_depth.labels(self.queue, lane).set(x["length"])
            self.lane_waiting_age.labels(self.queue, lane).set(x.get("oldest_waiting_age_s") or 0)
        groups = {(x["lane"], x["group"]): x["length"] for x in info.get("groups", [])}
        for lane, group in self.group_labels - groups.keys():  # its stream is gone: so is its series
            self.group_depth.remove(self.queue, lane, group)
        for (lane, group), length in groups.items():
            self.group_depth.labels(self.queue, lane, group).set(length)
        self.group_labels = set(groups)
