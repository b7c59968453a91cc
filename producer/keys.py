"""Every Redis key name of a queue, defined here and nowhere else.

All keys of one queue carry the hash tag `{<queue>}`, so a script that touches several of them stays on one
Redis Cluster slot: a cluster scales by queue.
"""

from __future__ import annotations

import re

PREFIX = "pq"
# The one consumer group of every queue's job stream: workers of a queue share its entries.
GROUP = "workers"

_QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")

# A queue's priority lanes, most urgent first: each is a stream of its own, and every worker's intake reads them
# in this order (with a floor share for the lower ones: worker/intake.py). "default" is the stream `pq:{q}:jobs`
# that queues had before lanes, so a bare XADD to it keeps working.
LANES = ("interactive", "default", "batch")
DEFAULT_LANE = "default"
# A job's fair-share group (a tenant, a customer) becomes part of a key name: no braces (the hash tag), no spaces.
GROUP_NAME_PATTERN = r"^[A-Za-z0-9_.:@\-]{1,128}$"
_GROUP_NAME_RE = re.compile(GROUP_NAME_PATTERN)


def check_queue(queue: str) -> str:
    # Braces would break the hash tag; whitespace and odd characters only make keys hard to type.
    if not isinstance(queue, str) or not _QUEUE_RE.fullmatch(queue):
        raise ValueError(f"queue name must be 1-128 characters of [A-Za-z0-9_.:-], got {queue!r}")
    return queue


def check_lane(lane: str) -> str:
    if lane not in LANES:
        raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
    return lane


def check_group(group: str) -> str:
    if not isinstance(group, str) or not _GROUP_NAME_RE.fullmatch(group):
        raise ValueError(f"group must be 1-128 characters of [A-Za-z0-9_.:@-], got {group!r}")
    return group


# Every queue some worker has served: queue -> its last heartbeat (unix ms). `pagedq workers`, `status --all`
# and the dashboard start here to find the queues, and from each queue its workers. It cannot share a queue's
# slot (it spans queues), so it is written by a plain ZADD apart from the queue's own keys; `pq:queues` cannot
# meet a queue's keys, which always open with `pq:{`.
QUEUES = f"{PREFIX}:queues"


class Keys:
    """The key names of one queue."""

    def __init__(self, queue: str) -> None:
        self.queue = check_queue(queue)
        self.base = f"{PREFIX}:{{{queue}}}"
        # Stream: one entry per queued job of the default lane without a group, read by the worker group. Every
        # lane and group has a stream of its own (stream()); this one is also where bare XADDs of old producers go.
        self.jobs = f"{self.base}:jobs"
        self.dlq = f"{self.base}:dlq"  # stream: jobs given up on (dead letters)
        self.group = GROUP
        # Heartbeats. Each live worker refreshes its own record key (with a TTL, so a dead worker vanishes
        # without anyone cleaning up) and its score in `workers` (its record's expiry, ms): readers list live
        # workers with one ZRANGEBYSCORE and read their records with one MGET instead of a SCAN, which on a
        # cluster would have to visit every node. Both sit under the queue's hash tag, so one pipeline (and the
        # consumer-pruning script, which checks a record) stays on the queue's slot.
        self.workers = f"{self.base}:workers"  # sorted set: worker id -> its record's expiry (unix ms)
        self.stats = f"{self.base}:stats"  # stream: one entry per heartbeat: tokens, TTFT/TPOT bucket counts
        # Hash: fair-share group -> its settings as JSON ({"weight": w, "max_running": n}), set by `pagedq groups`
        # and read by every worker's intake; a group without an entry has weight 1 and no cap.
        self.groups = f"{self.base}:groups"
        # Stream, capped: one entry per job queued to a group's stream, so that an idle worker blocked on it wakes
        # (group streams come and go; the lanes' own streams wake it themselves).
        self.bell = f"{self.base}:bell"

    def stream(self, lane: str = DEFAULT_LANE, group: str | None = None) -> str:
        """Stream: the queued jobs of one lane and fair-share group. The default lane without a group is `jobs`."""
        if group is not None:
            return f"{self.jobs}:{check_lane(lane)}:{check_group(group)}"
        return self.jobs if check_lane(lane) == DEFAULT_LANE else f"{self.jobs}:{lane}"

    def lane_streams(self) -> list[str]:
        """The lanes' own streams (jobs without a group), most urgent first: they always exist once a worker ran."""
        return [self.stream(lane) for lane in LANES]

    def lane_groups(self, lane: str) -> str:
        """Set: the groups that have a stream in the lane (it holds jobs queued or running); a worker drops a group
        once its stream is empty (producer/scripts/prune.lua)."""
        return f"{self.base}:lane:{check_lane(lane)}:groups"

    def ready(self, lane: str) -> str:
        """Set: the groups of the lane whose streams may hold jobs no worker has read yet. submit.lua adds a group;
        take.lua removes it when a read finds its stream drained."""
        return f"{self.base}:lane:{check_lane(lane)}:ready"

    def worker(self, worker_id: str) -> str:
        """String with a TTL: the worker's heartbeat record as JSON."""
        return f"{self.base}:worker:{worker_id}"

    def job(self, job_id: str) -> str:
        """Hash: the job's state, lease token, attempts, timestamps."""
        return f"{self.base}:job:{job_id}"

    def events(self, job_id: str) -> str:
        """Stream: the job's token chunks, then one terminal event."""
        return f"{self.base}:events:{job_id}"

    def result(self, job_id: str) -> str:
        """String: the job's final JobResult as JSON, with a TTL."""
        return f"{self.base}:result:{job_id}"

    def owner_jobs(self, key_id: str) -> str:
        """Sorted set: the jobs an API key of `pagedq serve` has queued or running on this queue, each as
        "<job id> <tokens charged>" scored by its enqueue time. In the queue's slot, so that submit.lua checks
        the key's cap and adds the job in one step."""
        return f"{self.base}:owner:{check_key_id(key_id)}:jobs"


# ---- the Batch API (`pagedq serve`, `pagedq batch`): files and batches, not tied to one queue ----------------
# A batch's jobs may go to several queues (its lines name models, models route to queues), so its own keys
# cannot share a queue's slot. Each file and each batch gets a hash tag of its own id instead: all keys of one
# batch sit on one Redis Cluster slot (a script over them is legal and one batch's reads go to one node),
# while different batches spread over the cluster. The prefixes `pq:file:` and `pq:batch:` cannot meet a
# queue's keys, which always open with `pq:{`.

_STORE_ID_RE = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def check_store_id(kind: str, value: str) -> str:
    # An id from a URL becomes part of key names: braces would move it to another slot, colons fake a suffix.
    if not isinstance(value, str) or not _STORE_ID_RE.match(value):
        raise ValueError(f"{kind} id must be 1-128 characters of [A-Za-z0-9_-], got {value!r}")
    return value


class BatchKeys:
    """The key names of the Batch API's files and batches."""

    files = f"{PREFIX}:files"  # sorted set: file id -> created_at, for listing
    batches = f"{PREFIX}:batches"  # sorted set: batch id -> created_at, for listing
    active = f"{PREFIX}:batches:active"  # set: batches not yet final, which any serve process advances

    @staticmethod
    def files_of(key_id: str) -> str:
        """Sorted set: the files an API key owns, file id -> created_at (what that key lists)."""
        return f"{BatchKeys.files}:owner:{check_key_id(key_id)}"

    @staticmethod
    def batches_of(key_id: str) -> str:
        """Sorted set: the batches an API key owns, batch id -> created_at (what that key lists)."""
        return f"{BatchKeys.batches}:owner:{check_key_id(key_id)}"

    @staticmethod
    def file(file_id: str) -> str:
        """Hash: the file's metadata (filename, purpose, bytes, created_at, expires_at)."""
        return f"{PREFIX}:file:{{{check_store_id('file', file_id)}}}"

    @staticmethod
    def file_content(file_id: str, part: int = 0) -> str:
        """String: part `part` of the file's bytes (JSONL, UTF-8), at most serve.files.PART_BYTES of them, cut
        between characters; the file's hash counts its `parts`. Part 0 is `...:content` (where a file written
        whole, before files had parts, kept all of it), part n `...:content:<n>`."""
        base = f"{BatchKeys.file(file_id)}:content"
        return f"{base}:{part}" if part else base

    @staticmethod
    def batch(batch_id: str) -> str:
        """Hash: the batch object's fields (status, endpoint, timestamps, counts of its line errors, ...)."""
        return f"{PREFIX}:batch:{{{check_store_id('batch', batch_id)}}}"

    @staticmethod
    def items(batch_id: str) -> str:
        """Hash: line number -> that line's job (queue, job id, request) or its error, as JSON."""
        return f"{BatchKeys.batch(batch_id)}:items"

    @staticmethod
    def open(batch_id: str) -> str:
        """Set: line numbers whose jobs have not been seen to end yet."""
        return f"{BatchKeys.batch(batch_id)}:open"

    @staticmethod
    def ended(batch_id: str, outcome: str) -> str:
        """Set: line numbers whose jobs ended with `outcome` (completed, failed or cancelled); SADD is
        idempotent, so two processes recording the same job count it once."""
        return f"{BatchKeys.batch(batch_id)}:{outcome}"

    @staticmethod
    def submitting(batch_id: str) -> str:
        """String with a TTL: the token of the process that validates the batch's lines and submits its jobs
        (producer/scripts/lease.lua); lapses if it dies."""
        return f"{BatchKeys.batch(batch_id)}:submitting"

    @staticmethod
    def sweeper(batch_id: str) -> str:
        """String with a TTL: the token of the one process that moves the batch on (serve.progress), renewed
        while it does (producer/scripts/lease.lua); another takes over once it lapses."""
        return f"{BatchKeys.batch(batch_id)}:sweeper"


# ---- the API keys of `pagedq serve`: what each key may still do, and what it did ----------------------------
# A key is named by its key id (the first 16 hex digits of the SHA-256 of the key, never the key itself). Its
# own keys share the hash tag `{<key id>}`, so the script that admits its requests (limit.lua) touches one slot.

_KEY_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def check_key_id(key_id: str) -> str:
    if not isinstance(key_id, str) or not _KEY_ID_RE.match(key_id):
        raise ValueError(f"a key id is 16 lowercase hex digits, got {key_id!r}")
    return key_id


class ApiKeyKeys:
    """The key names of one API key of `pagedq serve`."""

    index = f"{PREFIX}:keys"  # sorted set: key id -> when a server last loaded it (unix s), for `pagedq usage`

    def __init__(self, key_id: str) -> None:
        self.key_id = check_key_id(key_id)
        self.base = f"{PREFIX}:key:{{{key_id}}}"
        # Hash: the two rate-limit buckets (`req`, `tok`) and when they were last filled (`at`, ms); expires
        # once full again.
        self.limits = f"{self.base}:limits"
        # Hash: `name`, and the counters `requests`, `rate_limited`, `jobs`, `prompt_tokens`,
        # `completion_tokens`, `cached_tokens`; never expires.
        self.usage = f"{self.base}:usage"
        # Sorted sets, budgets of producer/scripts/reserve.lua: "<item id> <size>" -> the item's expiry (unix s).
        # The files the key stores, by their bytes (its uploads and its batches' output files); and its batches
        # not yet seen to end, each of size 1. Never expire; members leave when their item is deleted or ends,
        # or once past their expiry.
        self.files = f"{self.base}:files"
        self.batches = f"{self.base}:batches"
