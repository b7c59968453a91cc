"""The settings of one `pagedq serve`, passed to the ASGI factory as JSON in an environment variable (so that
uvicorn's own worker processes, which import the factory afresh, get them too)."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from producer import defaults

ENV = "PAGEDQ_SERVE_CONFIG"
STORE_TTL_S = 7 * 24 * 3600  # files and batches live this long


class ServeConfig(BaseModel):
    redis_url: str = defaults.REDIS_URL
    queue: str = defaults.QUEUE
    models: list[str] = Field(default_factory=list)  # served names, routed to `queue`
    routes: dict[str, str] = Field(default_factory=dict)  # model -> queue
    api_keys: list[str] = Field(default_factory=list)  # bearer tokens; none here nor in api_key_file: no auth
    api_key_file: str | None = None  # a key file (serve.api_keys): named, hashed keys with limits; SIGHUP rereads it
    key_rpm: int | None = None  # requests per minute per key (None or 0: no limit); a key file may set its own
    key_tpm: int | None = None  # tokens per minute per key, charged at admission and settled when the job ends
    key_max_jobs: int | None = None  # interactive jobs a key may have queued or running on each queue
    settle_after_s: float = 10.0  # a key's job older than this that ended unseen is settled by the sweeper
    # How the server's processes log: uvicorn starts its --workers afresh, and each sets its logging up from these.
    log_level: str | None = None
    log_format: str | None = None
    max_queue_depth: int | None = None  # queued + running jobs of a lane at which new requests for it get 429
    retry_after_s: int = 1
    # Load: completion requests one process answers at once (past it: 429 with Retry-After). Waiting costs no
    # connection (serve.events), so this bounds memory and the CPU of streaming, not Redis.
    max_open_requests: int = 4096
    redis_connections: int = 16  # the process's pool for short commands (submits, reads); requests share it
    redis_wait_s: float = 10.0  # how long a command waits for a free pooled connection (past it: 429, busy)
    redis_grace_s: float = 5.0  # how long waiting requests wait for Redis to come back before their 503
    default_max_tokens: int | None = None  # None: JobRequest's default
    # A request's body, counted as it streams in (413 past it): /v1/files takes max_file_bytes instead.
    max_body_bytes: int = 16 * 2**20
    max_file_bytes: int = 100 * 2**20
    # A request's constraint is compiled off the event loop (serve.checks), this many at once, each within
    # constraint_check_s (a 400 past it). The grammar engine releases the GIL: each thread may take a core from the
    # process's streams and the workers beside it.
    constraint_check_s: float = 5.0
    constraint_threads: int = 1
    # A stream whose client does not read is dropped once this many of its job's events (or bytes) wait for it.
    stream_buffer_events: int = 4096
    stream_buffer_bytes: int = 2**20
    store_ttl_s: int = STORE_TTL_S
    batch_priority: int = 10  # of batch lines that send none (they run in the batch lane; lower runs first)
    sweep_interval_s: float = 1.0  # how often each process advances unfinished batches
    # What one batch, and one key's batches and files, may take (a key file may set a key's own; 0 lifts one).
    max_batch_lines: int = 50_000  # requests in one batch (OpenAI's limit): a longer file is refused, 400
    key_max_batches: int | None = None  # batches a key may have that have not ended (429 past it); None: no limit
    key_max_file_bytes: int | None = None  # bytes of files a key may store, its batches' outputs too (413 past it)

    def queue_of(self, model: str | None) -> str:
        """The queue a request for `model` goes to: its route, else the default queue."""
        return self.routes.get(model or "", self.queue)

    def known(self, model: str) -> bool:
        """With no model configured every name goes through (the workers judge); otherwise only listed ones."""
        return not (self.models or self.routes) or model in self.models or model in self.routes

    def to_env(self) -> dict[str, str]:
        return {ENV: self.model_dump_json()}

    @classmethod
    def from_env(cls) -> ServeConfig:
        raw = os.environ.get(ENV)
        if raw:
            return cls.model_validate_json(raw)
        return cls(redis_url=os.environ.get("PAGEDQ_REDIS_URL") or os.environ.get("REDIS_URL") or defaults.REDIS_URL,
                   queue=os.environ.get("PAGEDQ_QUEUE") or defaults.QUEUE)


def parse_routes(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`MODEL=QUEUE` items -> {model: queue}."""
    out: dict[str, str] = {}
    for item in items:
        model, sep, queue = item.partition("=")
        if not sep or not model or not queue:
            raise ValueError(f"route {item!r}: give MODEL=QUEUE")
        out[model] = queue
    return out
