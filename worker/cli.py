"""The `pagedq` command line: worker, submit, result, status, cancel, dlq, redis, models, demo."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import time

import click

from bench.cli import bench as bench_command
from producer import defaults
from producer.protocol import Limits

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def queue_options(f):
    @click.option("--redis-url", envvar=["PAGEDQ_REDIS_URL", "REDIS_URL"], default=defaults.REDIS_URL, show_default=True,
                  help="Redis to use [env: PAGEDQ_REDIS_URL, REDIS_URL]")
    @click.option("--queue", envvar="PAGEDQ_QUEUE", default=defaults.QUEUE, show_default=True,
                  help="Queue name [env: PAGEDQ_QUEUE]")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main() -> None:
    """pagedq: LLM generation jobs over Redis Streams."""


@main.command()
@queue_options
@click.option("--model", envvar="PAGEDQ_MODEL", default="smollm2-135m-instruct",
              help="Alias, local HF folder, .gguf file or hub id [env: PAGEDQ_MODEL]")
@click.option("--device", envvar="PAGEDQ_DEVICE", default="cpu", help="cpu or cuda[:N] [env: PAGEDQ_DEVICE]")
@click.option("--dtype", envvar="PAGEDQ_DTYPE", default=None, help="float32 | bfloat16 | float16; default: "
              "float32 on cpu, bfloat16 on cuda [env: PAGEDQ_DTYPE]")
@click.option("--max-num-seqs", envvar="PAGEDQ_MAX_NUM_SEQS", type=int, default=64,
              help="Sequences in one batch [env: PAGEDQ_MAX_NUM_SEQS]")
@click.option("--max-num-batched-tokens", envvar="PAGEDQ_MAX_NUM_BATCHED_TOKENS", type=int, default=2048)
@click.option("--max-model-len", envvar="PAGEDQ_MAX_MODEL_LEN", type=int, default=None)
@click.option("--num-kv-blocks", envvar="PAGEDQ_NUM_KV_BLOCKS", type=int, default=None,
              help="KV cache size in blocks; default: sized from memory")
@click.option("--block-size", envvar="PAGEDQ_BLOCK_SIZE", type=int, default=16)
@click.option("--served-model-name", envvar="PAGEDQ_SERVED_MODEL_NAME", multiple=True,
              help="Names a job's `model` may use (repeatable); default: --model")
@click.option("--result-ttl", envvar="PAGEDQ_RESULT_TTL", type=int, default=defaults.RESULT_TTL_S,
              help="Seconds a result and its event stream are kept")
@click.option("--max-prompt-chars", envvar="PAGEDQ_MAX_PROMPT_CHARS", type=int, default=Limits().max_prompt_chars)
@click.option("--max-tokens-limit", envvar="PAGEDQ_MAX_TOKENS_LIMIT", type=int, default=Limits().max_tokens,
              help="Largest max_tokens a job may ask for")
@click.option("--max-metadata-bytes", envvar="PAGEDQ_MAX_METADATA_BYTES", type=int,
              default=Limits().max_metadata_bytes)
@click.option("--drain-timeout", envvar="PAGEDQ_DRAIN_TIMEOUT", type=float, default=30.0,
              help="On SIGTERM: seconds running jobs may still finish; the rest are handed back")
@click.option("--lease-ms", envvar="PAGEDQ_LEASE_MS", type=int, default=defaults.LEASE_MS,
              help="A job whose lease is not renewed this long is reclaimed by another worker")
@click.option("--max-attempts", envvar="PAGEDQ_MAX_ATTEMPTS", type=int, default=defaults.MAX_ATTEMPTS,
              help="Deliveries before a job goes to the dead-letter stream")
@click.option("--dlq-cap", envvar="PAGEDQ_DLQ_CAP", type=int, default=defaults.DLQ_CAP, help="Dead letters kept")
@click.option("--metrics-port", envvar="PAGEDQ_METRICS_PORT", type=int, default=None,
              help="Serve Prometheus metrics on this port")
@click.option("--worker-id", envvar="PAGEDQ_WORKER_ID", default=None, help="Default: hostname-pid-random")
@click.option("--log-level", envvar="PAGEDQ_LOG_LEVEL", default="INFO")
def worker(redis_url, queue, model, device, dtype, max_num_seqs, max_num_batched_tokens, max_model_len,
           num_kv_blocks, block_size, served_model_name, result_ttl, max_prompt_chars, max_tokens_limit,
           max_metadata_bytes, drain_timeout, lease_ms, max_attempts, dlq_cap, metrics_port, worker_id,
           log_level) -> None:
    """Run one worker: pull jobs from QUEUE into the engine, stream tokens and results back."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    from engine import EngineConfig, LLMEngine
    from worker.worker import Worker, WorkerConfig

    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                    num_kv_blocks=num_kv_blocks, block_size=block_size))
    cfg = WorkerConfig(redis_url=redis_url, queue=queue, result_ttl=result_ttl, drain_timeout=drain_timeout,
                       lease_ms=lease_ms, max_attempts=max_attempts, dlq_cap=dlq_cap,
                       served_models=tuple(served_model_name) or (model, engine.model_name),
                       limits=Limits(max_prompt_chars=max_prompt_chars, max_tokens=max_tokens_limit,
                                     max_metadata_bytes=max_metadata_bytes),
                       metrics_port=metrics_port)
    if worker_id:
        cfg.worker_id = worker_id
    import redis as redis_lib

    from producer.connection import redact

    try:
        w = Worker(engine, cfg)
        _stop_on_signals(w, drain_timeout)
        w.run()
    except (redis_lib.AuthenticationError, redis_lib.exceptions.NoPermissionError) as e:
        # A credentials problem is the operator's to fix: say so plainly, without a traceback or the password.
        raise click.ClickException(f"redis at {redact(redis_url)} refused this worker: {e}") from None


def _stop_on_signals(w, drain_timeout: float) -> None:
    def on_signal(signum, frame):
        log = logging.getLogger("pagedq.worker")
        if w.stop_event.is_set():
            # A second signal: exit now. What runs is not lost: its leases lapse and other workers resume it.
            log.warning("signal %d again: exiting at once", signum)
            os._exit(1)
        log.info("signal %d: finishing running jobs (up to %.0f s), then stopping", signum, drain_timeout)
        w.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


@main.command()
@queue_options
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message (the model's chat template)")
@click.option("--stream", is_flag=True, help="Print tokens as they come")
@click.option("--max-tokens", type=int, default=256)
@click.option("--temperature", type=float, default=1.0)
@click.option("--model", default=None, help="Model the job asks for; default: whatever the workers serve")
@click.option("--id", "job_id", default=None, help="Idempotency key; default: a new uuid")
@click.option("--no-wait", is_flag=True, help="Print the job id and return")
@click.option("--timeout", type=float, default=None, help="Seconds to wait for the result")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON")
def submit(redis_url, queue, prompt, chat, stream, max_tokens, temperature, model, job_id, no_wait, timeout,
           as_json) -> None:
    """Enqueue one job and print its result (or stream it)."""
    from producer import Client, DuplicateJobError

    fields = {"max_tokens": max_tokens, "temperature": temperature, "model": model}
    if job_id:
        fields["id"] = job_id
    if chat:
        fields["messages"] = [{"role": "user", "content": prompt}]
    else:
        fields["prompt"] = prompt
    with Client(redis_url, queue=queue) as c:
        try:
            job = c.submit(**fields)
        except (DuplicateJobError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        if no_wait:
            click.echo(json.dumps({"id": job.id}) if as_json else job.id)
            return
        if stream and not as_json:
            res = None
            for ev in job.stream(timeout=timeout):
                if ev.type == "token":
                    click.echo(ev.text, nl=False)
                else:
                    res = ev.result
            click.echo()
        else:
            res = job.result(timeout=timeout)
        _print_result(res, as_json, quiet_text=stream)


def _print_result(res, as_json: bool, quiet_text: bool = False) -> None:
    if as_json:
        click.echo(res.model_dump_json(indent=2))
        return
    if res.status != "completed":
        err = f": {res.error.type}: {res.error.message}" if res.error else ""
        raise click.ClickException(f"job {res.id} {res.status}{err}")
    if not quiet_text:
        click.echo(res.text)


@main.command()
@queue_options
@click.argument("job_id")
@click.option("--timeout", type=float, default=None, help="Seconds to wait")
@click.option("--json", "as_json", is_flag=True)
def result(redis_url, queue, job_id, timeout, as_json) -> None:
    """Wait for a job's result and print it."""
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        try:
            res = c.result(job_id, timeout=timeout)
        except (JobNotFound, TimeoutError) as e:
            raise click.ClickException(str(e)) from None
        _print_result(res, as_json)


@main.command()
@queue_options
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True)
def status(redis_url, queue, job_id, as_json) -> None:
    """The queue's length, pending entries and consumers; with JOB_ID, that job's state."""
    from producer import Client, JobNotFound
    from worker.queue_info import queue_info

    with Client(redis_url, queue=queue) as c:
        if job_id:
            try:
                click.echo(c.status(job_id))
            except JobNotFound as e:
                raise click.ClickException(str(e)) from None
            return
        info = queue_info(c.redis, c.keys)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"queue {queue}: {info['waiting']} waiting, {info['pending']} running (pending), "
               f"{len(info['consumers'])} consumers")
    for con in info["consumers"]:
        click.echo(f"  {con['name']}: {con['pending']} pending, idle {con['idle_ms'] / 1000:.1f} s")


@main.command()
@queue_options
@click.argument("job_id")
def cancel(redis_url, queue, job_id) -> None:
    """Cancel a job: prints cancelled, cancelling, or its final state."""
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        try:
            click.echo(c.cancel(job_id))
        except JobNotFound as e:
            raise click.ClickException(str(e)) from None


@main.group()
def dlq() -> None:
    """Dead letters: jobs given up on after too many attempts."""


@dlq.command("list")
@queue_options
@click.option("--count", type=int, default=100)
@click.option("--json", "as_json", is_flag=True)
def dlq_list(redis_url, queue, count, as_json) -> None:
    """The newest dead letters: job id, attempts, reason."""
    from producer import Client
    from producer.dlq import list_dead

    with Client(redis_url, queue=queue) as c:
        items = list_dead(c.redis, c.keys, count)
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    for d in items:
        click.echo(f"{d['entry']}  {d.get('id')}  attempts={d.get('attempts')}  {d.get('error')}: {d.get('reason')}")


@dlq.command("retry")
@queue_options
@click.argument("job_id")
def dlq_retry(redis_url, queue, job_id) -> None:
    """Send a dead job back to the queue, afresh (attempts from 0)."""
    import redis as redis_lib

    from producer import Client, JobNotFound
    from producer.dlq import retry_dead

    with Client(redis_url, queue=queue) as c:
        try:
            click.echo(retry_dead(c.redis, c.keys, job_id))
        except (JobNotFound, redis_lib.ResponseError) as e:
            raise click.ClickException(str(e)) from None


@dlq.command("purge")
@queue_options
def dlq_purge(redis_url, queue) -> None:
    """Delete every dead letter of the queue."""
    from producer import Client
    from producer.dlq import purge_dead

    with Client(redis_url, queue=queue) as c:
        click.echo(f"purged {purge_dead(c.redis, c.keys)}")


@main.command()
@click.option("--port", type=int, default=None, help="Default: a free port")
@click.option("--persist", is_flag=True, help="Keep RDB snapshots (in its temporary folder)")
def redis(port, persist) -> None:
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


@main.group()
def models() -> None:
    """Model files."""


@models.command()
@click.argument("name")
def pull(name) -> None:
    """Fetch and convert a model once (e.g. smollm2-135m-instruct), so that workers start fast."""
    from worker.models import pull_model

    try:
        click.echo(pull_model(name))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option("--model", default="smollm2-135m-instruct")
@click.option("--device", default="cpu")
@click.option("--jobs", "num_jobs", type=int, default=8)
@click.option("--max-tokens", type=int, default=48)
def demo(model, device, num_jobs, max_tokens) -> None:
    """Embedded Redis + one worker: submit a few jobs, stream one, print results and throughput."""
    from worker.demo import run_demo

    sys.exit(run_demo(model, device, num_jobs, max_tokens))


main.add_command(bench_command)


@main.command("gpu-check")
@click.option("--out", default="docs/bench/gpu-check.json", help="Where the JSON goes")
@click.option("--device", default="cuda")
@click.option("--sections", default="kernels,bandwidth,graphs,e2e", help="Comma-separated subset")
@click.option("--model", default="smollm2-135m-instruct")
def gpu_check(out, device, sections, model) -> None:
    """On a GPU: kernel correctness, attention bandwidth, CUDA graphs vs eager, end to end vs transformers."""
    from worker.gpu_check import run

    sys.exit(run(out, device, sections.split(","), model, echo=click.echo))


if __name__ == "__main__":
    main()
