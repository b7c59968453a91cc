"""The worker's publisher in a process of its own, as the step loop sees it.

The step loop hands each step's new tokens over a pipe, a few plain values per job; the publisher process
(worker/publisher_child.py) decodes the text, builds token events and results, and writes them to Redis
(worker/publisher.py). In a thread of the worker, that Python (detokenizing, JSON, packing commands, reading
replies) held the GIL the step loop needs between its torch calls: through Redis a decode step at 256 sequences
spent twice the host time it spends without Redis. On a GPU the step loop is nothing but host work, so every
millisecond of it counts.

Parent -> child, in order: ("setup", Setup); ("begin", job, prompt tail) when a job enters the engine;
("step", now, job ids, tokens, cached, extras); ("end" | "fail" | "release", job, ...) as Publisher's calls of the same names;
("forget", job id, lease) for a job dropped without a result; ("stop", timeout).
Child -> parent: ("settled", n) finished jobs written; ("notice", kind, job id, lease) as Publisher.notices;
("metric", name, value). Every message is JSON: nothing but JSON is ever decoded by the worker's processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from producer import calls
from producer.protocol import JobRequest
from worker.job import RunningJob
from worker.metrics import Metrics

log = logging.getLogger("pagedq.worker")

ROOT = Path(__file__).resolve().parent.parent
DIED = "died"  # the notice the worker's loop gets when the publisher process is gone
PIPE_BYTES = 1 << 20
STOP = "stop"  # the last message the process gets
_STOP_PREFIX = f'["{STOP}",'


@dataclasses.dataclass
class Setup:
    redis_url: str
    redis_options: dict
    cluster: bool  # as the worker found it: the process need not ask the server again
    queue: str
    settings: calls.WorkerSettings
    model: str
    tokenizer: tuple[str, str]  # ("rust", its JSON) or ("folder", where transformers loads it from)
    log_level: int

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict) -> Setup:
        return cls(**{**d, "settings": calls.WorkerSettings(**d["settings"]), "tokenizer": tuple(d["tokenizer"])})


def tokenizer_spec(tokenizer) -> tuple[str, str]:
    """What the publisher process needs to decode like the engine: a fast tokenizer's Rust core as JSON (no
    transformers import on the other side), else the folder the tokenizer was loaded from."""
    rust = getattr(tokenizer, "_tokenizer", None)
    return ("rust", rust.to_str()) if rust is not None else ("folder", str(tokenizer.name_or_path))


_NOT_SENT = ("request", "last", "logprobs")  # the request goes as its JSON; the others are the publisher's own


def job_to_wire(job: RunningJob) -> dict:
    """The job as it is now, in values JSON holds."""
    d = {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name not in _NOT_SENT}
    d["request"] = job.request.model_dump(mode="json") if job.request is not None else None
    return d


def job_from_wire(d: dict) -> RunningJob:
    request = d.pop("request")
    return RunningJob(**d, request=JobRequest.model_validate(request) if request is not None else None)


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
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.publisher_child", str(down_r), str(up_w)],
                                     pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        with contextlib.suppress(OSError, AttributeError):  # a roomier pipe rides out a slow moment of the process
            fcntl.fcntl(down_w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._send(("setup", self.setup.to_wire()))
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

        self._send(("begin", job_to_wire(job), list(prompt_ids[-CONTEXT_TOKENS:])))

    def step(self, items: list, now: float) -> None:
        """One engine step's outputs: [(job, RequestOutput)].

        Sent by column (job ids, new tokens, cached prompt tokens), which encodes several times faster than a
        record per job; the few outputs with more to say (an end, text the step decoded, logprobs) add an extra."""
        ids, tokens, cached, extras = [], [], [], []
        ends = 0
        for job, out in items:  # offsets are the process's to count: the tokens of the job it has seen
            new = out.new_token_ids
            ids.append(job.id)
            tokens.append(new[0] if len(new) == 1 else new)
            cached.append(out.num_cached_tokens)
            if out.finished or out.logprobs or not out.text_deferred:  # deferred text: the process decodes it
                ends += out.finished
                extras.append((len(ids) - 1, None if out.text_deferred else out.new_text, out.finish_reason,
                               out.logprobs and [(lp, list(top.items())) for lp, top in out.logprobs]))
        if ends:
            self._add_acks(ends)
        self._send(("step", now, ids, tokens, cached, extras))

    def end(self, job: RunningJob, status: str, finish_reason: str) -> None:
        self._add_acks(1)
        self._send(("end", job_to_wire(job), status, finish_reason))

    def fail(self, job: RunningJob, type: str, message: str) -> None:
        self._add_acks(1)
        self._send(("fail", job_to_wire(job), type, message))

    def release(self, job: RunningJob, mode: str, type: str = "", message: str = "") -> None:
        self._add_acks(1)
        self._send(("release", job_to_wire(job), mode, type, message))

    def forget(self, job: RunningJob) -> None:
        """A job left the engine without a result from this worker (its lease was lost)."""
        self._send(("forget", job.id, job.lease))

    def wait_acks(self, below: int, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending_acks < below, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is handed over, then stop; Redis errors are retried until `timeout` runs out."""
        self.closing = True
        self._send((STOP, timeout))
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
        # Encoded here, on the caller's thread: encoding on the feed thread would hold the GIL while the step loop
        # prepares its next step.
        try:
            self.outbox.put(json.dumps(msg, separators=(",", ":")))
        except (TypeError, ValueError):  # a value JSON cannot hold: a bug, but only this message is lost
            log.exception("publisher: dropped a %r message that JSON cannot hold", msg[0])

    def _write(self, down: Connection) -> None:
        # Whatever piled up goes in one write: one wake-up of the process per batch of messages.
        try:
            while True:
                batch = [self.outbox.get()]
                while not self.outbox.empty():
                    batch.append(self.outbox.get_nowait())
                down.send_bytes(f"[{','.join(batch)}]".encode())
                if batch[-1].startswith(_STOP_PREFIX):
                    return
        except OSError:  # the process is gone: the reader tells the loop
            pass
        finally:
            down.close()

    # ---- replies from the publisher process -----------------------------------------------------------------

    def _read(self, up: Connection) -> None:
        try:
            while True:
                msg = json.loads(up.recv_bytes())
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
