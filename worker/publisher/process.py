"""The publisher process: the program worker.publisher.handle starts, fed over a pipe (messages).

It follows each job the worker runs (JobView), turns each Step message into StepOutput records, decoding the
text the engine left to it, and hands them to the RedisWriter, which writes them to Redis.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import worker.publisher.messages as messages
from producer.keys import Keys
from worker.job import RunningJob
from worker.publisher.job_view import JobView, StepOutput
from worker.publisher.writer import RedisWriter

log = logging.getLogger("pagedq.worker")

PARENT_GONE_TIMEOUT_S = 10.0  # the worker died: how long what it handed over may still take to write


class RustTokenizer:
    """The part of a transformers fast tokenizer that the detokenizer uses."""

    def __init__(self, json: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(json)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
               ) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class _Up:
    """The pipe to the worker; the writer thread and the main thread both write to it."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def __call__(self, msg: messages.Message) -> None:
        try:
            with self.lock:
                self.conn.send_bytes(messages.encode(msg).encode())
        except OSError:  # the worker is gone: nobody to tell, but what it handed over is still written
            pass

    def put(self, notice: tuple[str, str, str]) -> None:  # the writer's notices
        self(messages.Notice(*notice))


class RelayedMetrics:
    """The writer's metrics (writer.WriterMetrics) in this process: each call is made on the worker's Metrics."""

    def __init__(self, up: _Up) -> None:
        self.up = up

    def publish_round_trip(self, seconds: float) -> None:
        self.up(messages.Metric("publish_round_trip", [seconds]))

    def lease_lost(self) -> None:
        self.up(messages.Metric("lease_lost", []))

    def job_done(self, status: str) -> None:
        self.up(messages.Metric("job_done", [status]))

    def dead_letter(self) -> None:
        self.up(messages.Metric("dead_letter", []))

    def not_replicated(self) -> None:
        self.up(messages.Metric("not_replicated", []))

    def resent(self, tokens: int) -> None:
        self.up(messages.Metric("resent", [tokens]))


def serve(down: Connection, up: _Up) -> None:
    from worker import LOG_FORMAT

    first = json.loads(down.recv_bytes())
    setup = messages.decode(first[0])
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT)
    kind, spec = setup.tokenizer
    tokenizer = RustTokenizer(spec) if kind == "rust" else _load_tokenizer(spec)

    def settled(n: int) -> None:
        if n:
            up(messages.Settled(n))

    writer = RedisWriter(_connect(setup), Keys(setup.queue), setup.settings, setup.model, RelayedMetrics(up), up,
                         settled, setup.durability, on_flushed=lambda n: up(messages.Flushed(n)))
    writer.start()
    _follow(down, writer, tokenizer, first[1:])


def _follow(down: Connection, writer: RedisWriter, tokenizer, batch: list) -> None:
    """Hand the worker's messages to the writer until Stop (or until the worker is gone)."""
    views: dict[str, JobView] = {}
    while True:
        for value in batch:
            try:
                msg = messages.decode(value)
            except Exception:  # one bad message must not stop the others' results
                log.exception("publisher: could not decode a %r message", value[0])
                continue
            if isinstance(msg, messages.Stop):
                writer.close(msg.timeout)
                return
            try:
                _handle(msg, writer, views, tokenizer)
            except Exception:
                log.exception("publisher: could not handle a %r message", value[0])
        try:
            batch = json.loads(down.recv_bytes())
        except (EOFError, OSError):  # the worker is gone: write what it handed over, briefly
            writer.close(PARENT_GONE_TIMEOUT_S)
            return


def _connect(setup: messages.Setup):
    # A cluster client meets its servers at once: a Redis restart at that moment is waited out, not fatal.
    import redis as redis_lib

    from producer.connection import connect

    delay = 0.1
    while True:
        try:
            return connect(setup.redis_url, cluster=setup.cluster, **setup.redis_options)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as e:
            log.warning("publisher: redis unreachable (%s); retrying in %.1f s", e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _handle(msg: messages.Message, writer: RedisWriter, views: dict[str, JobView], tokenizer) -> None:
    if isinstance(msg, messages.Step):
        writer.step(_step_outputs(msg, views, writer), msg.now)
    elif isinstance(msg, messages.Begin):
        views[msg.job.id] = JobView.begin(msg.job, tokenizer, msg.context)
    elif isinstance(msg, messages.Forget):
        if msg.job_id in views and views[msg.job_id].job.lease == msg.lease:
            del views[msg.job_id]
    elif isinstance(msg, messages.End):
        writer.end(_held(views, msg.job), msg.status, msg.finish_reason, msg.why)
    elif isinstance(msg, messages.Fail):
        writer.fail(_held(views, msg.job), msg.type, msg.message)
    elif isinstance(msg, messages.Release):
        writer.release(_held(views, msg.job), msg.mode, msg.type, msg.message)
    elif isinstance(msg, messages.Flush):
        writer.mark(msg.n)


def _step_outputs(step: messages.Step, views: dict[str, JobView], writer: RedisWriter) -> list[StepOutput]:
    """A Step (by column) -> a StepOutput per job."""
    more = {e.at: e for e in step.extras}
    tokens, cached = step.tokens, step.cached
    outputs = []
    for i, job_id in enumerate(step.ids):
        extra = more.get(i)
        view = views.get(job_id)
        if view is None:
            log.error("publisher: tokens for job %s, which never began here", job_id)
            if extra is not None and extra.ends_job:
                writer.on_settled(1)  # it still held the worker's intake room
            continue
        new = [tokens[i]] if isinstance(tokens[i], int) else tokens[i]
        outputs.append(view.take(new, extra, cached[i], step.now))
        if extra is not None and extra.ends_job:
            del views[job_id]
    return outputs


def _held(views: dict[str, JobView], job: RunningJob) -> JobView:
    """The job as followed here, if this is the delivery followed; else the worker's copy (it never began)."""
    view = views.pop(job.id, None)
    return view if view is not None and view.job.lease == job.lease else JobView(job)


def _load_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def main(argv: list[str]) -> None:
    # Ctrl-C and SIGTERM are the worker's to handle: it drains, then tells this process to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    down = Connection(int(argv[0]), writable=False)
    up = _Up(Connection(int(argv[1]), readable=False))
    serve(down, up)


if __name__ == "__main__":
    main(sys.argv[1:])
