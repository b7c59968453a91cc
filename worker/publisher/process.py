"""The publisher process: the program worker.publisher.handle starts, fed over a pipe (messages).

It follows each job the worker runs (JobView), turns each step's message into StepOutput records, decoding the
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
from typing import Any

from producer.keys import Keys
from worker.publisher import messages
from worker.publisher.job_view import JobView
from worker.publisher.messages import Setup, StepOutput, job_from_wire
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

    def __call__(self, *msg: Any) -> None:
        try:
            with self.lock:
                self.conn.send_bytes(json.dumps(msg).encode())
        except OSError:  # the worker is gone: nobody to tell, but what it handed over is still written
            pass

    def put(self, notice: tuple[str, str, str]) -> None:  # the writer's notices
        self(messages.NOTICE, *notice)


class RelayedMetrics:
    """The writer's metrics (writer.WriterMetrics) in this process: each call is made on the worker's Metrics."""

    def __init__(self, up: _Up) -> None:
        self.up = up

    def publish_round_trip(self, seconds: float) -> None:
        self.up(messages.METRIC, "publish_round_trip", seconds)

    def lease_lost(self) -> None:
        self.up(messages.METRIC, "lease_lost")

    def job_done(self, status: str) -> None:
        self.up(messages.METRIC, "job_done", status)

    def dead_letter(self) -> None:
        self.up(messages.METRIC, "dead_letter")

    def not_replicated(self) -> None:
        self.up(messages.METRIC, "not_replicated")

    def resent(self, tokens: int) -> None:
        self.up(messages.METRIC, "resent", tokens)


def serve(down: Connection, up: _Up) -> None:
    from worker import LOG_FORMAT

    setup = Setup.from_wire(json.loads(down.recv_bytes())[0][1])
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT)
    kind, spec = setup.tokenizer
    tokenizer = RustTokenizer(spec) if kind == "rust" else _load_tokenizer(spec)

    def settled(n: int) -> None:
        if n:
            up(messages.SETTLED, n)

    writer = RedisWriter(_connect(setup), Keys(setup.queue), setup.settings, setup.model, RelayedMetrics(up), up,
                         settled, setup.durability, on_flushed=lambda n: up(messages.FLUSHED, n))
    writer.start()
    views: dict[str, JobView] = {}
    while True:
        try:
            batch = json.loads(down.recv_bytes())
        except (EOFError, OSError):  # the worker is gone: write what it handed over, briefly
            writer.close(PARENT_GONE_TIMEOUT_S)
            return
        for msg in batch:
            if msg[0] == messages.STOP:
                writer.close(msg[1])
                return
            try:
                _handle(msg, writer, views, tokenizer)
            except Exception:  # one bad message must not stop the others' results
                log.exception("publisher: could not handle %r", msg[0])


def _connect(setup: Setup):
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


def _handle(msg: list, writer: RedisWriter, views: dict[str, JobView], tokenizer) -> None:
    op = msg[0]
    if op == messages.STEP:
        writer.step(_step_outputs(msg, views, writer), msg[1])
    elif op == messages.BEGIN:
        job = job_from_wire(msg[1])
        views[job.id] = JobView.begin(job, tokenizer, msg[2])
    elif op == messages.FORGET:
        if msg[1] in views and views[msg[1]].job.lease == msg[2]:
            del views[msg[1]]
    elif op == messages.END:
        writer.end(_held(views, msg[1]), msg[2], msg[3], msg[4])
    elif op == messages.FAIL:
        writer.fail(_held(views, msg[1]), msg[2], msg[3])
    elif op == messages.RELEASE:
        writer.release(_held(views, msg[1]), msg[2], msg[3], msg[4])
    elif op == messages.FLUSH:
        writer.mark(msg[1])


def _step_outputs(msg: list, views: dict[str, JobView], writer: RedisWriter) -> list[StepOutput]:
    """A step message (by column, see StepOutput) -> a StepOutput per job."""
    _, now, ids, tokens, cached, extras = msg
    more = {e[0]: e[1:] for e in extras}
    outputs = []
    for i, job_id in enumerate(ids):
        # (text, reason, logprobs), and for a job with several continuations (index, ends the job, cumulative)
        text, reason, logprobs, *choice = more.get(i, (None, None, None))
        ends_job = choice[1] if choice else reason is not None
        view = views.get(job_id)
        if view is None:
            log.error("publisher: tokens for job %s, which never began here", job_id)
            if ends_job:
                writer.on_settled(1)  # it still held the worker's intake room
            continue
        new = [tokens[i]] if isinstance(tokens[i], int) else tokens[i]
        outputs.append(view.take(new, text, reason, cached[i], logprobs, now, *choice))
        if ends_job:
            del views[job_id]
    return outputs


def _held(views: dict[str, JobView], wire: dict) -> JobView:
    """The job as followed here, if this is the delivery followed; else the worker's copy (it never began)."""
    view = views.pop(wire["id"], None)
    return view if view is not None and view.job.lease == wire["lease"] else JobView(job_from_wire(wire))


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
