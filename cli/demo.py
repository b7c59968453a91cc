"""Trying pagedq on one machine: `pagedq redis` (an embedded redis-server) and `pagedq demo` (an embedded Redis,
one worker subprocess, a handful of jobs; one streamed to the terminal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import click

from cli.options import default_of
from engine.config import EngineConfig

if TYPE_CHECKING:
    from producer import Client

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give one tip for learning to code.",
    "Why is the sky blue? Answer in one sentence.",
    "What does a CPU do?",
    "Suggest a name for a pet turtle.",
]


@click.command()
@click.option("--port", type=int, default=None, help="Default: a free port")
@click.option("--persist", is_flag=True, help="Keep RDB snapshots (in its temporary folder)")
def redis(port: int | None, persist: bool) -> None:
    """Start an embedded redis-server, print its URL, run until Ctrl-C."""
    from worker.redis_server import RedisServer

    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    with RedisServer(port=port, persist=persist) as srv:
        click.echo(srv.url, nl=True)
        sys.stdout.flush()
        try:
            while not stop and srv.proc.poll() is None:
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass


@click.command()
@click.option("--model", default=default_of(EngineConfig, "model"), help="Alias, local HF folder, .gguf file or hub id")
@click.option("--device", default=default_of(EngineConfig, "device"), help="cpu or cuda[:N]")
@click.option("--jobs", "num_jobs", type=int, default=8, help="Jobs to submit")
@click.option("--max-tokens", type=int, default=48, help="Most tokens per job")
def demo(model: str, device: str, num_jobs: int, max_tokens: int) -> None:
    """Embedded Redis + one worker: submit a few jobs, stream one, print results and throughput."""
    sys.exit(run_demo(model, device, num_jobs, max_tokens))


def run_demo(model: str, device: str, num_jobs: int, max_tokens: int) -> int:
    from producer import Client
    from worker.redis_server import RedisServer, stop_process

    with RedisServer() as srv, tempfile.NamedTemporaryFile("w+", prefix="pagedq-demo-", suffix=".log",
                                                           delete=False) as log:
        click.echo(f"redis: {srv.url}")
        cmd = [sys.executable, "-m", "cli", "worker", "--redis-url", srv.url, "--queue", "demo",
               "--model", model, "--device", device, "--max-num-seqs", str(max(num_jobs, 1))]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
        click.echo(f"worker: pid {proc.pid}, model {model} on {device} (log: {log.name})")
        try:
            return _jobs(Client(srv.url, queue="demo"), proc, log.name, num_jobs, max_tokens)
        finally:
            stop_process(proc, 30)


def _jobs(c: Client, proc: subprocess.Popen, log_path: str, num_jobs: int, max_tokens: int) -> int:
    t0 = time.time()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_jobs)]
    jobs = c.submit_many([{"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                           "temperature": 0} for q in questions])
    click.echo(f"submitted {len(jobs)} jobs; waiting for the worker to load the model...\n")
    click.secho(f"> {questions[0]}", bold=True)
    for ev in _stream(jobs[0], proc, log_path):
        if ev.type == "token":
            click.echo(ev.text, nl=False)
    click.echo("\n")
    results = [_result(j, proc, log_path) for j in jobs]
    for q, res in zip(questions, results, strict=True):
        answer = res.text.strip().replace("\n", " ") if res.status == "completed" else f"[{res.status}]"
        click.echo(f"{q}\n  -> {answer[:100]}")
    done = [r for r in results if r.status == "completed"]
    tokens = sum(r.usage.completion_tokens for r in done)
    start = min(r.timings.started_at for r in done) if done else t0
    end = max(r.timings.finished_at for r in done) if done else time.time()
    click.echo(f"\n{len(done)}/{len(results)} completed, {tokens} tokens in {end - start:.2f} s "
               f"of generation: {tokens / max(end - start, 1e-9):.1f} tokens/s "
               f"(wall {time.time() - t0:.1f} s, model load included)")
    return 0 if len(done) == len(results) else 1


def _check(proc: subprocess.Popen, log_path: str) -> None:
    if proc.poll() is not None:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise click.ClickException(f"the worker exited with {proc.returncode}:\n{tail}")


# Waits in short slices, so that a worker that died is reported instead of waited on forever.
def _stream(job, proc: subprocess.Popen, log_path: str):
    after = "0-0"
    while True:
        try:
            for ev in job.stream(timeout=2, after=after):
                after = ev.event_id or after
                yield ev
            return
        except TimeoutError:
            _check(proc, log_path)


def _result(job, proc: subprocess.Popen, log_path: str):
    while True:
        try:
            return job.result(timeout=2)
        except TimeoutError:
            _check(proc, log_path)
