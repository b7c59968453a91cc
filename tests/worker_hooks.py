"""`pagedq worker` with faults injected by tests, so that no test hook lives in the worker's own code.

    python3 tests/worker_hooks.py [--poison MARK] [--crash MARK] -- <pagedq worker flags>

--poison MARK: a job whose request JSON holds MARK fails inside the worker on every delivery (an exception
               that is not the request's fault), so it is retried and then dead-lettered.
--crash MARK:  the worker SIGKILLs itself once a job holding MARK has produced tokens: the worker dies on every
               delivery of that job, as an out-of-memory kill would do it.
--step-delay-ms MS: each engine step takes MS longer (a slower model), so that a test can act mid-job.
--fault-on MARK[:N]: an engine step raises while a request whose id holds MARK is in its batch (once that
               request has N output tokens, default 0): a fault one request causes, on every try.
--fault-together MARK: an engine step raises while two requests or more whose ids hold MARK are in its batch:
               a fault that needs company (each runs fine alone).
--fault-every-step: every engine step raises, whatever it runs: a broken device.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli import main  # noqa: E402
from producer.wire import ENTRY_JOB  # noqa: E402
from worker import worker as worker_mod  # noqa: E402


def poison(mark: str) -> None:
    add = worker_mod.Worker._add

    def _add(self, job, fields, now):
        if mark in (fields.get(ENTRY_JOB) or ""):
            raise RuntimeError("poison job (test hook)")
        return add(self, job, fields, now)

    worker_mod.Worker._add = _add


def crash(mark: str) -> None:
    step = worker_mod.Worker._step

    def _step(self):
        step(self)
        for job in self.active.values():
            if job.first_token_at is not None and mark in (job.request.prompt or ""):
                os.kill(os.getpid(), signal.SIGKILL)

    worker_mod.Worker._step = _step


def fault_on(spec: str) -> None:
    from engine.runner.model_runner import ModelRunner

    mark, _, after = spec.partition(":")
    after = int(after or 0)
    run = ModelRunner.run

    def _run(self, batch, *args, **kwargs):
        for seq in batch.seqs:
            if mark in seq.request_id and seq.num_output_tokens >= after:
                raise RuntimeError(f"injected fault (test hook) on request {seq.request_id}")
        return run(self, batch, *args, **kwargs)

    ModelRunner.run = _run


def fault_together(mark: str) -> None:
    from engine.runner.model_runner import ModelRunner

    run = ModelRunner.run

    def _run(self, batch, *args, **kwargs):
        if len({s.request_id for s in batch.seqs if mark in s.request_id}) >= 2:
            raise RuntimeError(f"injected fault (test hook): two {mark} requests in one step")
        return run(self, batch, *args, **kwargs)

    ModelRunner.run = _run


def fault_every_step() -> None:
    from engine.runner.model_runner import ModelRunner

    def _run(self, batch, *args, **kwargs):
        raise RuntimeError("injected fault (test hook): every step fails")

    ModelRunner.run = _run


def step_delay(ms: float) -> None:
    step = worker_mod.Worker._step

    def _step(self):
        time.sleep(ms / 1000)
        step(self)

    worker_mod.Worker._step = _step


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--poison")
    ap.add_argument("--crash")
    ap.add_argument("--step-delay-ms", type=float)
    ap.add_argument("--fault-on")
    ap.add_argument("--fault-together")
    ap.add_argument("--fault-every-step", type=int, default=0)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.poison:
        poison(a.poison)
    if a.crash:
        crash(a.crash)
    if a.step_delay_ms:
        step_delay(a.step_delay_ms)
    if a.fault_on:
        fault_on(a.fault_on)
    if a.fault_together:
        fault_together(a.fault_together)
    if a.fault_every_step:
        fault_every_step()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    main(["worker", *rest], prog_name="pagedq")
