"""The publisher as the step loop sees it: Publisher starts the publisher process (worker.publisher.process) and
hands it, over a pipe, each step's new tokens and the jobs that end otherwise (messages' records)."""

from __future__ import annotations

import contextlib
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

import worker.publisher.messages as messages
from engine.outputs import RequestOutput
from worker.job import RunningJob
from worker.metrics import Metrics
from worker.publisher.writer import RELAYED

log = logging.getLogger("pagedq.worker")

ROOT = Path(__file__).resolve().parents[2]
DIED = "died"  # the notice the worker's loop gets when the publisher process is gone
PIPE_BYTES = 1 << 20
_LAST = None  # the feed thread's cue, after Stop: nothing follows


class Publisher:
    """The step loop's handle on its publisher process. Finished jobs handed over count in pending_acks until the
    process reports them written."""

    def __init__(self, setup: messages.Setup, metrics: Metrics) -> None:
        self.setup, self.metrics = setup, metrics
        self.notices: queue.SimpleQueue = queue.SimpleQueue()  # ("cancel" | "lost" | DIED, job id, lease)
        self.cond = threading.Condition()
        self.pending_acks = 0
        self.proc: subprocess.Popen | None = None
        # Messages for the process: a thread of ours writes them, so that the step loop never waits on the pipe.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.closing = False
        self.flushes = 0  # flush() calls so far, and the latest the process reported written
        self.flushed = 0

    def start(self) -> None:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.publisher.process", str(down_r), str(up_w)],
                                     pass_fds=(down_r, up_w), env=env, stdin=subprocess.DEVNULL)
        os.close(down_r)
        os.close(up_w)
        with contextlib.suppress(OSError, AttributeError):  # a roomier pipe rides out a slow moment of the process
            fcntl.fcntl(down_w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._send(self.setup)
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

        self._send(messages.Begin(job, list(prompt_ids[-CONTEXT_TOKENS:])))

    def step(self, outputs: list[RequestOutput], now: float) -> None:
        """One engine step's outputs of the jobs the worker holds, by column (messages.Step)."""
        ids, tokens, cached, extras = [], [], [], []
        ends = 0
        for out in outputs:  # offsets are the process's to count: the tokens of the job it has seen
            new = out.new_token_ids
            ids.append(out.request_id)
            tokens.append(new[0] if len(new) == 1 else new)
            cached.append(out.num_cached_tokens)
            if out.finished or out.logprobs or not out.text_deferred or out.several:  # deferred text: decoded there
                ends += out.request_finished
                extras.append(extra(len(ids) - 1, out))
        if ends:
            self._add_acks(ends)
        self._send(messages.Step(now, ids, tokens, cached, extras))

    # end, fail and release: as RedisWriter's calls of the same names, for a job the engine no longer runs.

    def end(self, job: RunningJob, status: str, finish_reason: str, why: str = "") -> None:
        """why: said in the result's error (an expired job's: which deadline passed, where)."""
        self._add_acks(1)
        self._send(messages.End(job, status, finish_reason, why))

    def fail(self, job: RunningJob, type: str, message: str) -> None:
        self._add_acks(1)
        self._send(messages.Fail(job, type, message))

    def release(self, job: RunningJob, mode: str, type: str = "", message: str = "") -> None:
        self._add_acks(1)
        self._send(messages.Release(job, mode, type, message))

    def forget(self, job: RunningJob) -> None:
        """A job left the engine without a result from this worker (its lease was lost)."""
        self._send(messages.Forget(job.id, job.lease))

    def flush(self, timeout: float) -> bool:
        """Wait until everything handed over so far is written to Redis (or given up on) -> False if that took
        longer than timeout. What a job's event stream holds is then all it streamed."""
        with self.cond:
            self.flushes += 1
            n = self.flushes
        self._send(messages.Flush(n))
        with self.cond:
            return self.cond.wait_for(lambda: self.flushed >= n, timeout)

    def wait_acks(self, below: int, timeout: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.pending_acks < below, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is handed over, then stop; Redis errors are retried until `timeout` runs out."""
        self.closing = True
        self._send(messages.Stop(timeout))
        self.outbox.put(_LAST)
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

    def _send(self, msg: messages.Message) -> None:
        # Encoded here, on the caller's thread: encoding on the feed thread would hold the GIL while the step loop
        # prepares its next step.
        try:
            self.outbox.put(messages.encode(msg))
        except (TypeError, ValueError):  # a value JSON cannot hold: a bug, but only this message is lost
            log.exception("publisher: dropped a %s message that JSON cannot hold", type(msg).__name__)

    def _write(self, down: Connection) -> None:
        # Whatever piled up goes in one write: one wake-up of the process per batch of messages.
        try:
            while True:
                batch = [self.outbox.get()]
                while not self.outbox.empty():
                    batch.append(self.outbox.get_nowait())
                last = batch[-1] is _LAST
                if last:
                    batch.pop()
                if batch:
                    down.send_bytes(messages.encode_batch(batch))
                if last:
                    return
        except OSError:  # the process is gone: the reader tells the loop
            pass
        finally:
            down.close()

    # ---- replies from the publisher process -----------------------------------------------------------------

    def _read(self, up: Connection) -> None:
        try:
            while True:
                msg = messages.decode(json.loads(up.recv_bytes()))
                if isinstance(msg, messages.Settled):
                    with self.cond:
                        self.pending_acks -= msg.n
                        self.metrics.pending_acks.set(self.pending_acks)
                        self.cond.notify_all()
                elif isinstance(msg, messages.Flushed):
                    with self.cond:
                        self.flushed = max(self.flushed, msg.n)
                        self.cond.notify_all()
                elif isinstance(msg, messages.Notice):
                    self.notices.put(tuple(msg))
                elif isinstance(msg, messages.Metric) and msg.name in RELAYED:
                    getattr(self.metrics, msg.name)(*msg.args)
        except (EOFError, OSError):
            pass
        finally:
            up.close()
        if not self.closing:
            code = self.proc.wait() if self.proc is not None else None
            log.error("the publisher process exited (code %s)", code)
            self.notices.put((DIED, "", ""))


def extra(at: int, out: RequestOutput) -> messages.Extra:
    """What the output at column `at` of a step says beyond its tokens. Its text only where the engine decoded it
    (stop strings): a deferred one is decoded by the process, which leaves out a hidden stop token as told."""
    logprobs = out.logprobs and [(lp, list(top.items())) for lp, top in out.logprobs]
    text = None if out.text_deferred else out.new_text
    return messages.Extra(at, text, out.finish_reason, logprobs, out.text_deferred and out.hidden_stop, out.index,
                          out.request_finished, out.cumulative_logprob)
