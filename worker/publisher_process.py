"""The worker's publisher in a process of its own.

The step loop hands each step's new tokens over a pipe, a few plain values per job; the publisher process decodes
the text, builds token events and results, and writes them to Redis (worker/publisher.py). In a thread of the
worker, that Python (detokenizing, JSON, packing commands, reading replies) held the GIL the step loop needs
between its torch calls: through Redis a decode step at 256 sequences spent twice the host time it spends without
Redis. On a GPU the step loop is nothing but host work, so every millisecond of it counts.

Parent -> child, in order: ("setup", Setup); ("begin", job, prompt tail) when a job enters the engine;
("step", records, now); ("end" | "fail" | "release", job, ...) as Publisher's calls of the same names;
("forget", job id, lease) for a job dropped without a result; ("stop", timeout).
Child -> parent: ("settled", n) finished jobs written; ("notice", kind, job id, lease) as Publisher.notices;
("metric", name, value).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from producer import calls
from producer.keys import Keys
from worker.job import RunningJob
from worker.metrics import Metrics

log = logging.getLogger("pagedq.worker")

ROOT = Path(__file__).resolve().parent.parent
PARENT_GONE_TIMEOUT_S = 10.0  # the worker died: how long what it handed over may still take to write
DIED = "died"  # the notice the worker's loop gets when the publisher process is gone
PIPE_BYTES = 1 << 20


@dataclasses.dataclass
class Setup:
    redis_url: str
    redis_options: dict
    cluster: bool  # as the worker found it: the process need not ask the server again
    queue: str
    settings: calls.WorkerSettings
    model: str
    tokenizer: tuple[str, Any]  # ("rust", its JSON) or ("python", the tokenizer object)
    log_level: int


def tokenizer_spec(tokenizer) -> tuple[str, Any]:
    """What the publisher process needs to decode like the engine: a fast tokenizer's Rust core as JSON (no
    transformers import on the other side), else the tokenizer itself, pickled."""
    rust = getattr(tokenizer, "_tokenizer", None)
    return ("rust", rust.to_str()) if rust is not None else ("python", tokenizer)


def _snapshot(job: RunningJob) -> RunningJob:
    # The job as it is now: the feed thread pickles it later, while the step loop goes on updating the job.
    return dataclasses.replace(job)


class PublisherProcess:
    """The publisher as the step loop sees it (Publisher's calls, plus `begin`); the work runs in a child process.

    Finished jobs handed over count in pending_acks until the child reports them written."""

    def __init__(self, setup: Setup, metrics: Metrics) -> None:
        self.setup, self.metrics = setup, metrics
        self.notices: queue.SimpleQueue = queue.SimpleQueue()  # ("cancel" | "lost" | DIED, job id, lease)
        self.cond = threading.Condition()
        self.pending_acks = 0
        self.proc: subprocess.Popen | None = None
        # Messages for the process: a thread of ours writes them, so that the step loop never waits on the pipe.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closing = False

    def start(self) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.publisher_process", str(down_r), str(up_w)],
                                     pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        with contextlib.suppress(OSError, AttributeError):  # a roomier pipe rides out a slow moment of the process
            fcntl.fcntl(down_w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._send(("setup", self.setup))
        self.writer = threading.Thread(target=self._write, args=(Connection(down_w, readable=False),),
                                       name="pagedq-publisher-feed", daemon=True)
        self.reader = threading.Thread(target=self._read, args=(Connection(up_r, writable=False),),
                                       name="pagedq-publisher-replies", daemon=True)
        self.writer.start()
        self.reader.start()

    # ---- the step loop's side -------------------------------------------------------------------------------

    def begin(self, job: RunningJob, prompt_ids: list[int]) -> None:
        """A job entered the engine: its outputs follow. prompt_ids: its prompt, for the decoder's context."""
        from engine.detokenizer import CONTEXT_TOKENS

        self._send(("begin", _snapshot(job), list(prompt_ids[-CONTEXT_TOKENS:])))

    def step(self, items: list, now: float) -> None:
        """One engine step's outputs: [(job, RequestOutput, offset)] as Publisher.step takes them."""
        records = []
        ends = 0
        for job, out, offset in items:
            ends += out.finished
            text = None if out.text_deferred else out.new_text  # deferred: the publisher decodes it
            records.append((job.id, out.new_token_ids, text, out.finish_reason, out.num_cached_tokens,
                            out.logprobs, offset))
        if ends:
            self._add_acks(ends)
        self._send(("step", records, now))

    def end(self, job: RunningJob, status: str, finish_reason: str) -> None:
        self._add_acks(1)
        self._send(("end", _snapshot(job), status, finish_reason))

    def fail(self, job: RunningJob, type: str, message: str) -> None:
        self._add_acks(1)
        self._send(("fail", _snapshot(job), type, message))

    def release(self, job: RunningJob, mode: str, type: str = "", message: str = "") -> None:
        self._add_acks(1)
        self._send(("release", _snapshot(job), mode, type, message))

    def forget(self, job: RunningJob) -> None:
        """A job left the engine without a result from this worker (its lease was lost)."""
        self._send(("forget", job.id, job.lease))

    def wait_acks(self, below: int, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending_acks < below, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is handed over, then stop; Redis errors are retried until `timeout` runs out."""
        self.closing = True
        self._send(("stop", timeout))
        if self.proc is None:
            return
        self.writer.join(5)
        try:
            self.proc.wait(timeout + 5)
        except subprocess.TimeoutExpired:
            log.error("publisher process did not stop; killing it")
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5)

    def _add_acks(self, n: int) -> None:
        with self.cond:
            self.pending_acks += n
            self.metrics.pending_acks.set(self.pending_acks)

    def _send(self, msg: tuple) -> None:
        self.outbox.put(msg)

    def _write(self, down: Connection) -> None:
        # Whatever piled up goes in one write: one pickle and one wake-up of the process per batch of messages.
        try:
            while True:
                batch = [self.outbox.get()]
                while not self.outbox.empty():
                    batch.append(self.outbox.get_nowait())
                try:
                    down.send(batch)
                except OSError:
                    raise
                except Exception:  # a value that does not pickle: a bug, but only its own message is lost
                    log.exception("publisher feed: a batch did not pickle; sending its messages one by one")
                    self._send_each(down, batch)
                if any(msg[0] == "stop" for msg in batch):
                    return
        except OSError:  # the process is gone: the reader tells the loop
            pass
        finally:
            down.close()

    @staticmethod
    def _send_each(down: Connection, batch: list) -> None:
        for msg in batch:
            try:
                down.send([msg])
            except OSError:
                raise
            except Exception:
                log.exception("publisher feed: dropped a %r message that does not pickle", msg[0])

    # ---- replies from the publisher process -----------------------------------------------------------------

    def _read(self, up: Connection) -> None:
        try:
            while True:
                msg = up.recv()
                if msg[0] == "settled":
                    with self.cond:
                        self.pending_acks -= msg[1]
                        self.metrics.pending_acks.set(self.pending_acks)
                        self.cond.notify_all()
                elif msg[0] == "notice":
                    self.notices.put(msg[1:])
                else:
                    self._metric(msg[1], msg[2])
        except (EOFError, OSError):
            pass
        finally:
            up.close()
        if not self.closing:
            code = self.proc.wait() if self.proc is not None else None
            log.error("the publisher process exited (code %s)", code)
            self.notices.put((DIED, "", ""))

    def _metric(self, name: str, value: Any) -> None:
        m = self.metrics
        if name == "publish_seconds":
            m.publish_seconds.observe(value)
        elif name == "lease_lost":
            m.lease_lost.inc()
        elif name == "job_done":
            m.job_done(value)
        elif name == "dead_letter":
            m.dead_letter()


# ---- the publisher process ----------------------------------------------------------------------------------


class Output:
    """A job's news from one step as the publisher reads it (RequestOutput's fields), with its totals so far."""

    __slots__ = ("new_token_ids", "new_text", "finish_reason", "finished", "num_cached_tokens", "logprobs",
                 "_view", "_ids_end", "_pieces_end")

    def __init__(self, view: JobView, tokens: list[int], text: str, reason: str | None, cached: int,
                 logprobs) -> None:
        self.new_token_ids, self.new_text, self.finish_reason = tokens, text, reason
        self.finished = reason is not None
        self.num_cached_tokens, self.logprobs = cached, logprobs
        self._view, self._ids_end, self._pieces_end = view, len(view.ids), len(view.pieces)

    @property
    def token_ids(self) -> list[int]:
        return self._view.ids[: self._ids_end]

    @property
    def text(self) -> str:
        # Joined only when a result needs it: a running text per step would copy the whole output every step.
        return "".join(self._view.pieces[: self._pieces_end])


class _RustTokenizer:
    """The part of a transformers fast tokenizer that the detokenizer uses."""

    def __init__(self, json: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(json)

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
               ) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class JobView:
    """A job as the publisher process follows it: its output so far, and the decoder that turns tokens to text."""

    def __init__(self, job: RunningJob, tokenizer, context: list[int]) -> None:
        from engine.detokenizer import Detokenizer

        self.job = job
        self.ids = list(job.resume_ids or [])
        self.pieces = [job.resume_text]
        self.detok = Detokenizer(tokenizer, context, [])
        if job.resume_ids:
            self.detok.resume(job.resume_ids, job.resume_text)

    def decode(self, tokens: list[int], reason: str | None) -> str:
        # As the engine's deferred decoding: a stop token (EOS included) ends the text without showing.
        if reason is None:
            return "".join(map(self.detok.add_one, tokens))
        return self.detok.add([] if reason == "stop" else tokens, final=True)[0]

    def output(self, record: tuple, now: float) -> Output:
        _, tokens, text, reason, cached, logprobs, _ = record
        if text is None:
            try:
                text = self.decode(tokens, reason)
            except Exception:  # the tokens still count, and the job still ends: its text misses a piece
                log.exception("job %s: could not decode tokens %s", self.job.id, tokens)
                text = ""
        self.ids.extend(tokens)
        self.pieces.append(text)
        if self.job.first_token_at is None and tokens:
            self.job.first_token_at = now
        out = self.job.last = Output(self, tokens, text, reason, cached, logprobs)
        return out


class _Up:
    """The pipe to the worker; the publisher thread and the main thread both write to it."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def __call__(self, *msg: Any) -> None:
        with self.lock:
            self.conn.send(msg)

    def put(self, notice: tuple) -> None:  # as Publisher.notices
        self("notice", *notice)


def _relay_metrics(up: _Up) -> SimpleNamespace:
    """Stands in for the worker's Metrics in Publisher: each event goes up to the worker's own."""
    return SimpleNamespace(
        pending_acks=SimpleNamespace(set=lambda value: None),  # the worker counts its own
        publish_seconds=SimpleNamespace(observe=lambda value: up("metric", "publish_seconds", value)),
        lease_lost=SimpleNamespace(inc=lambda: up("metric", "lease_lost", None)),
        job_done=lambda status: up("metric", "job_done", status),
        dead_letter=lambda: up("metric", "dead_letter", None))


def serve(down: Connection, up: _Up) -> None:
    from worker import LOG_FORMAT
    from worker.publisher import Publisher

    setup: Setup = down.recv()[0][1]
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT)
    kind, spec = setup.tokenizer
    tokenizer = _RustTokenizer(spec) if kind == "rust" else spec

    class Writer(Publisher):
        def settled(self, n: int) -> None:
            super().settled(n)
            if n:
                up("settled", n)

    pub = Writer(_connect(setup), Keys(setup.queue), setup.settings, setup.model, _relay_metrics(up))
    pub.notices = up
    pub.start()
    views: dict[str, JobView] = {}
    while True:
        try:
            batch = down.recv()
        except (EOFError, OSError):  # the worker is gone: write what it handed over, briefly
            pub.close(PARENT_GONE_TIMEOUT_S)
            return
        for msg in batch:
            if msg[0] == "stop":
                pub.close(msg[1])
                return
            try:
                _handle(msg, pub, views, tokenizer)
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


def _handle(msg: tuple, pub, views: dict[str, JobView], tokenizer) -> None:
    op = msg[0]
    if op == "step":
        records, now = msg[1], msg[2]
        items = []
        for rec in records:
            view = views.get(rec[0])
            if view is None:
                log.error("publisher: tokens for job %s, which never began here", rec[0])
                continue
            items.append((view.job, view.output(rec, now), rec[6]))
            if rec[3] is not None:
                del views[rec[0]]
        pub.step(items, now)
    elif op == "begin":
        views[msg[1].id] = JobView(msg[1], tokenizer, msg[2])
    elif op == "forget":
        if msg[1] in views and views[msg[1]].job.lease == msg[2]:
            del views[msg[1]]
    elif op == "end":
        pub.end(_held(views, msg[1]), msg[2], msg[3])
    elif op == "fail":
        pub.fail(_held(views, msg[1]), msg[2], msg[3])
    elif op == "release":
        pub.release(_held(views, msg[1]), msg[2], msg[3], msg[4])


def _held(views: dict[str, JobView], job: RunningJob) -> RunningJob:
    """The job as followed here, if this is the delivery followed; else the worker's copy (it never began)."""
    view = views.pop(job.id, None)
    return view.job if view is not None and view.job.lease == job.lease else job


def main(argv: list[str]) -> None:
    # Ctrl-C and SIGTERM are the worker's to handle: it drains, then tells this process to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    down = Connection(int(argv[0]), writable=False)
    up = _Up(Connection(int(argv[1]), readable=False))
    serve(down, up)


if __name__ == "__main__":
    main(sys.argv[1:])
