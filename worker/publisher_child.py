"""The worker's publisher process: the program worker/publisher_process.py starts, fed over a pipe.

It follows each job the worker runs (JobView): decodes its tokens to text as the engine's deferred decoding would,
keeps its output so far for the result, and hands each step's outputs to a Publisher (worker/publisher.py), which
writes them to Redis. Messages: see worker/publisher_process.py.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from producer.keys import Keys
from worker.job import RunningJob
from worker.publisher_process import STOP, Setup, job_from_wire

log = logging.getLogger("pagedq.worker")

PARENT_GONE_TIMEOUT_S = 10.0  # the worker died: how long what it handed over may still take to write


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

    def output(self, tokens: list[int], text: str | None, reason: str | None, cached: int, logprobs,
               now: float) -> Output:
        """One step's news of the job. text None: decode the tokens here; logprobs as they crossed the pipe."""
        if logprobs:  # JSON keeps no int keys: (logprob, [[token, logprob], ...]) per token
            logprobs = [(lp, dict(top)) for lp, top in logprobs]
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
        try:
            with self.lock:
                self.conn.send_bytes(json.dumps(msg).encode())
        except OSError:  # the worker is gone: nobody to tell, but what it handed over is still written
            pass

    def put(self, notice: tuple) -> None:  # as Publisher.notices
        self("notice", *notice)


def _relay_metrics(up: _Up) -> SimpleNamespace:
    """Stands in for the worker's Metrics in Publisher: each event goes up to the worker's own."""
    return SimpleNamespace(
        publish_seconds=SimpleNamespace(observe=lambda value: up("metric", "publish_seconds", value)),
        lease_lost=SimpleNamespace(inc=lambda: up("metric", "lease_lost", None)),
        job_done=lambda status: up("metric", "job_done", status),
        dead_letter=lambda: up("metric", "dead_letter", None))


def serve(down: Connection, up: _Up) -> None:
    from worker import LOG_FORMAT
    from worker.publisher import Publisher

    setup = Setup.from_wire(json.loads(down.recv_bytes())[0][1])
    logging.basicConfig(level=setup.log_level, format=LOG_FORMAT)
    kind, spec = setup.tokenizer
    tokenizer = _RustTokenizer(spec) if kind == "rust" else _load_tokenizer(spec)

    def settled(n: int) -> None:
        if n:
            up("settled", n)

    pub = Publisher(_connect(setup), Keys(setup.queue), setup.settings, setup.model, _relay_metrics(up), settled)
    pub.notices = up
    pub.start()
    views: dict[str, JobView] = {}
    while True:
        try:
            batch = json.loads(down.recv_bytes())
        except (EOFError, OSError):  # the worker is gone: write what it handed over, briefly
            pub.close(PARENT_GONE_TIMEOUT_S)
            return
        for msg in batch:
            if msg[0] == STOP:
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
        pub.step(_step_items(msg, views, pub), msg[1])
    elif op == "begin":
        job = job_from_wire(msg[1])
        views[job.id] = JobView(job, tokenizer, msg[2])
    elif op == "forget":
        if msg[1] in views and views[msg[1]].job.lease == msg[2]:
            del views[msg[1]]
    elif op == "end":
        pub.end(_held(views, msg[1]), msg[2], msg[3])
    elif op == "fail":
        pub.fail(_held(views, msg[1]), msg[2], msg[3])
    elif op == "release":
        pub.release(_held(views, msg[1]), msg[2], msg[3], msg[4])


def _step_items(msg: list, views: dict[str, JobView], pub) -> list:
    """A step message -> Publisher.step's items [(job, output, offset)]."""
    _, now, ids, tokens, cached, extras = msg
    more = {e[0]: e[1:] for e in extras}
    items = []
    for i, job_id in enumerate(ids):
        text, reason, logprobs = more.get(i, (None, None, None))
        view = views.get(job_id)
        if view is None:
            log.error("publisher: tokens for job %s, which never began here", job_id)
            if reason is not None:
                pub.on_settled(1)  # it still held the worker's intake room
            continue
        new = [tokens[i]] if isinstance(tokens[i], int) else tokens[i]
        offset = len(view.ids)  # the worker's count too: the tokens its stream holds before these
        items.append((view.job, view.output(new, text, reason, cached[i], logprobs, now), offset))
        if reason is not None:
            del views[job_id]
    return items


def _held(views: dict[str, JobView], wire: dict) -> RunningJob:
    """The job as followed here, if this is the delivery followed; else the worker's copy (it never began)."""
    view = views.pop(wire["id"], None)
    return view.job if view is not None and view.job.lease == wire["lease"] else job_from_wire(wire)


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
