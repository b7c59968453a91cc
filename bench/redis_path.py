"""pagedq through Redis: producer -> queue -> a worker subprocess -> results, the way a web app uses it.

An embedded redis-server and one `pagedq worker` subprocess are started once per bench run and warmed up with
one job before anything is timed. Times come from the client's side: from submit to the last result read.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

from bench.harness import Process, start_logged
from bench.result import Outcome, Run, tpot
from bench.systems import REDIS, bar
from bench.workloads import Workload

QUEUE = "bench"


class Unavailable(RuntimeError):
    """The Redis path cannot run here; the message says why."""


class RedisPath:
    def __init__(self, model: str, device: str, dtype: str, max_num_seqs: int, max_num_batched_tokens: int,
                 num_kv_blocks: int | None, log_path: Path, start_timeout: float = 900.0) -> None:
        self.args = ["--model", model, "--device", device, "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
                     "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if num_kv_blocks:
            self.args += ["--num-kv-blocks", str(num_kv_blocks)]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.server = None
        self.proc: Process | None = None
        self.client = None

    def start(self) -> RedisPath:
        try:
            from producer import Client
            from worker.redis_server import RedisServer
        except ImportError as e:
            raise Unavailable(f"producer/worker not importable: {e}") from None
        try:
            self.server = RedisServer().start()
        except Exception as e:
            raise Unavailable(f"no redis-server: {e}") from None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "cli", "worker", "--redis-url", self.server.url, "--queue", QUEUE,
               *self.args, "--log-level", "WARNING"]
        self.proc = start_logged(cmd, self.log_path, name="the worker")
        self.client = Client(self.server.url, queue=QUEUE)
        try:
            # The first job waits for the model to load and pays for the first step's warm-up.
            job = self.client.submit(prompt="Warm up.", max_tokens=4, temperature=0, ignore_eos=True)
            res = self._wait(job, self.start_timeout)
            if res.status != "completed":
                raise Unavailable(f"warm-up job {res.status}: {res.error}")
        except Unavailable:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise Unavailable(f"{type(e).__name__}: {e}") from None
        return self

    def _wait(self, job, timeout: float = 3600.0):
        # Short slices, so that a worker that died is reported instead of waited on forever.
        end = time.monotonic() + timeout
        while True:
            try:
                return job.result(timeout=2)
            except TimeoutError:
                if self.proc is not None and self.proc.poll() is not None:
                    raise Unavailable(f"the worker exited with {self.proc.returncode}: {self._log_tail()}") from None
                if time.monotonic() > end:
                    raise Unavailable(f"no result for job {job.id} after {timeout:.0f} s") from None

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-1500:]
        except OSError:
            return ""

    def _fields(self, wl: Workload, tag: str) -> list[dict]:
        return [{"id": f"{tag}-{r.id}", "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0,
                 "ignore_eos": True} for r in wl.requests]

    def run(self, wl: Workload, progress: bool = True) -> Run:
        """Offline: submit every request in one pipelined round trip; online: each at its arrival time."""
        tag = uuid.uuid4().hex[:8]
        fields = self._fields(wl, tag)
        n = len(fields)
        jobs: list = [None] * n
        ready = [threading.Event() for _ in range(n)]
        failure: list[BaseException] = []
        t0 = time.time()
        if wl.arrivals is None:
            for i, job in enumerate(self.client.submit_many(fields)):
                jobs[i] = job
                ready[i].set()
        else:
            def feed() -> None:
                # A client of its own: the submitting thread never shares a connection with the reader.
                from producer import Client

                c = Client(self.server.url, queue=QUEUE)
                try:
                    for i in sorted(range(n), key=lambda k: wl.arrivals[k]):
                        time.sleep(max(0.0, t0 + wl.arrivals[i] - time.time()))
                        # Read through our own client: this one closes when the feeding is done.
                        jobs[i] = self.client.job(c.submit(**fields[i]).id)
                        ready[i].set()
                except BaseException as e:  # surfaced by the reader below
                    failure.append(e)
                    for ev in ready:
                        ev.set()
                finally:
                    c.close()

            feeder = threading.Thread(target=feed, daemon=True)
            feeder.start()
        results = []
        with bar(n, f"{wl.name}: {REDIS}", progress) as pb:
            for i in range(n):
                ready[i].wait()
                if failure:
                    raise failure[0]
                results.append(self._wait(jobs[i]))
                pb.update(1)
        elapsed = time.time() - t0
        outcomes = []
        for r, res in zip(wl.requests, results):
            tm = res.timings
            n_out = len(res.token_ids)
            err = None
            if res.status != "completed":
                err = f"{res.status}: {res.error.message if res.error else ''}"
            elif res.usage.prompt_tokens != len(r.prompt_ids):
                err = f"prompt encoded to {res.usage.prompt_tokens} tokens, expected {len(r.prompt_ids)}"
            ttft = tm.first_token_at - tm.enqueued_at if tm.first_token_at and tm.enqueued_at else None
            outcomes.append(Outcome(r.id, len(r.prompt_ids), r.max_tokens, n_out, ttft,
                                    tpot(tm.first_token_at, tm.finished_at, n_out), err, res.usage.cached_tokens))
        return Run(REDIS, wl.name, outcomes, elapsed)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.proc.stop(30)
            self.proc = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> RedisPath:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
