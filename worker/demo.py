"""`pagedq demo`: an embedded Redis, one worker subprocess, a handful of jobs; one streamed to the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import click

from producer import Client
from worker.redis_server import RedisServer, stop_process

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


def run_demo(model: str, device: str, num_jobs: int, max_tokens: int) -> int:
    with RedisServer() as srv, tempfile.NamedTemporaryFile("w+", prefix="pagedq-demo-", suffix=".log",
                                                           delete=False) as log:
        click.echo(f"redis: {srv.url}")
        cmd = [sys.executable, "-m", "worker", "worker", "--redis-url", srv.url, "--queue", "demo",
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
