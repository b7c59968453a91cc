"""The `pagedq` command line: worker, submit, result, status, cancel, dlq, redis, models, demo, serve, batch."""

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
from worker import LOG_FORMAT, cli_errors
from worker.cli_errors import CliError, Group
from worker.version import pagedq_version


def queue_options(f):
    @click.option("--redis-url", envvar=["PAGEDQ_REDIS_URL", "REDIS_URL"], default=defaults.REDIS_URL, show_default=True,
                  help="Redis to use (any node's URL of a Redis Cluster)")
    @click.option("--queue", envvar="PAGEDQ_QUEUE", default=defaults.QUEUE, show_default=True, help="Queue name")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True,
                                          "auto_envvar_prefix": "PAGEDQ"},
             epilog="Exit codes: " + "; ".join(f"{c} {what}" for c, what in cli_errors.EXIT_CODES.items()))
@click.version_option(pagedq_version(), "--version", prog_name="pagedq")
def main() -> None:
    """pagedq: LLM generation jobs over Redis Streams. Every option can also come from the environment variable
    its help shows."""


@main.command()
@queue_options
@click.option("--model", envvar="PAGEDQ_MODEL", default="smollm2-135m-instruct",
              help="Alias, local HF folder, .gguf file or hub id")
@click.option("--device", envvar="PAGEDQ_DEVICE", default="cpu", help="cpu or cuda[:N]")
@click.option("--dtype", envvar="PAGEDQ_DTYPE", default=None,
              help="float32 | bfloat16 | float16 | auto (bfloat16 on cuda and on CPUs with bfloat16 units); "
                   "default: float32 on cpu, bfloat16 on cuda")
@click.option("--max-num-seqs", envvar="PAGEDQ_MAX_NUM_SEQS", type=int, default=None,
              help="Sequences in one batch; default by device: 256")
@click.option("--max-num-batched-tokens", envvar="PAGEDQ_MAX_NUM_BATCHED_TOKENS", type=int, default=None,
              help="Tokens (prefill chunks and decodes) in one engine step; default by device: 4096 on cpu, 8192 on cuda")
@click.option("--max-model-len", envvar="PAGEDQ_MAX_MODEL_LEN", type=int, default=None,
              help="Longest prompt + output in tokens; default: the model's, capped by the KV cache")
@click.option("--num-kv-blocks", envvar="PAGEDQ_NUM_KV_BLOCKS", type=int, default=None,
              help="KV cache size in blocks; default: sized from memory")
@click.option("--block-size", envvar="PAGEDQ_BLOCK_SIZE", type=int, default=16, help="Tokens per KV cache block")
@click.option("--overlap-steps/--no-overlap-steps", envvar="PAGEDQ_OVERLAP_STEPS", default=None,
              help="Schedule each step while the one before runs on the device; default: on for cuda, off for cpu")
@click.option("--served-model-name", envvar="PAGEDQ_SERVED_MODEL_NAME", multiple=True,
              help="Names a job's `model` may use (repeatable); default: --model")
@click.option("--result-ttl", envvar="PAGEDQ_RESULT_TTL", type=int, default=defaults.RESULT_TTL_S,
              help="Seconds a result and its event stream are kept")
@click.option("--max-prompt-chars", envvar="PAGEDQ_MAX_PROMPT_CHARS", type=int, default=Limits().max_prompt_chars,
              help="Longest prompt (all messages) in characters; longer jobs fail at once")
@click.option("--max-tokens-limit", envvar="PAGEDQ_MAX_TOKENS_LIMIT", type=int, default=Limits().max_tokens,
              help="Largest max_tokens a job may ask for")
@click.option("--max-metadata-bytes", envvar="PAGEDQ_MAX_METADATA_BYTES", type=int,
              default=Limits().max_metadata_bytes, help="Largest `metadata` of a job, as JSON")
@click.option("--drain-timeout", envvar="PAGEDQ_DRAIN_TIMEOUT", type=float, default=30.0,
              help="On SIGTERM: seconds running jobs may still finish; the rest are handed back")
@click.option("--lease-ms", envvar="PAGEDQ_LEASE_MS", type=int, default=defaults.LEASE_MS,
              help="A job whose lease is not renewed this long is reclaimed by another worker")
@click.option("--max-attempts", envvar="PAGEDQ_MAX_ATTEMPTS", type=int, default=defaults.MAX_ATTEMPTS,
              help="Deliveries before a job goes to the dead-letter stream")
@click.option("--dlq-cap", envvar="PAGEDQ_DLQ_CAP", type=int, default=defaults.DLQ_CAP, help="Dead letters kept")
@click.option("--metrics-port", envvar="PAGEDQ_METRICS_PORT", type=int, default=None,
              help="Serve Prometheus metrics on this port")
@click.option("--heartbeat-s", envvar="PAGEDQ_HEARTBEAT_S", type=float, default=5.0,
              help="Seconds between heartbeats; the worker's record in Redis lives three times as long")
@click.option("--worker-id", envvar="PAGEDQ_WORKER_ID", default=None, help="Default: hostname-pid-random")
@click.option("--log-level", envvar="PAGEDQ_LOG_LEVEL", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
def worker(redis_url, queue, model, device, dtype, max_num_seqs, max_num_batched_tokens, max_model_len,
           num_kv_blocks, block_size, overlap_steps, served_model_name, result_ttl, max_prompt_chars,
           max_tokens_limit, max_metadata_bytes, drain_timeout, lease_ms, max_attempts, dlq_cap, metrics_port,
           heartbeat_s, worker_id, log_level) -> None:
    """Run one worker: pull jobs from QUEUE into the engine, stream tokens and results back."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    _check_redis(redis_url)  # before the model: loading it takes a while, and Redis is the likelier problem
    from engine import EngineConfig, LLMEngine
    from worker.worker import Worker, WorkerConfig

    engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                    num_kv_blocks=num_kv_blocks, block_size=block_size,
                                    overlap_steps=overlap_steps))
    cfg = WorkerConfig(redis_url=redis_url, queue=queue, result_ttl=result_ttl, drain_timeout=drain_timeout,
                       lease_ms=lease_ms, max_attempts=max_attempts, dlq_cap=dlq_cap,
                       served_models=tuple(served_model_name) or (model, engine.model_name),
                       limits=Limits(max_prompt_chars=max_prompt_chars, max_tokens=max_tokens_limit,
                                     max_metadata_bytes=max_metadata_bytes),
                       metrics_port=metrics_port, heartbeat_s=heartbeat_s)
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


def _check_redis(redis_url: str) -> None:
    from producer.connection import connect

    r = connect(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        r.ping()
    finally:
        r.close()


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
@click.option("--max-tokens", type=int, default=256, help="Most tokens to generate")
@click.option("--temperature", type=float, default=1.0, help="Sampling temperature; 0 is greedy")
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
        try:
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
        except TimeoutError:
            raise CliError(f"job {job.id}: no result within {timeout:g} s; it stays queued or running "
                           f"(`pagedq result {job.id}` waits again, `pagedq cancel {job.id}` stops it)",
                           cli_errors.TIMED_OUT) from None
        _print_result(res, as_json, quiet_text=stream)


def _print_result(res, as_json: bool, quiet_text: bool = False) -> None:
    if as_json:
        click.echo(res.model_dump_json(indent=2))  # the status is in the JSON: exit 0 whatever it is
        return
    if res.status != "completed":
        # A cancelled or expired job keeps the text generated before it stopped: show it, then say why.
        if res.text and not quiet_text:
            click.echo(res.text)
        err = f": {res.error.type}: {res.error.message}" if res.error else ""
        part = f" after {res.usage.completion_tokens} tokens" if res.usage.completion_tokens else ""
        raise CliError(f"job {res.id} {res.status}{part}{err}", cli_errors.JOB_NOT_COMPLETED)
    if not quiet_text:
        click.echo(res.text)


def _not_found(c, e: Exception, job_id: str, queue: str) -> CliError:
    from monitor.job_locator import find_queue_of

    other = find_queue_of(c.redis, job_id, queue)
    hint = f"; it is in queue {other!r}: pass --queue {other}" if other else ""
    return CliError(f"{e} (queue {queue!r}){hint}", cli_errors.NOT_FOUND)


@main.command()
@queue_options
@click.argument("job_id")
@click.option("--timeout", type=float, default=None, help="Seconds to wait; default: until it ends")
@click.option("--json", "as_json", is_flag=True, help="Print the whole JobResult as JSON")
def result(redis_url, queue, job_id, timeout, as_json) -> None:
    """Wait for a job's result and print it (a cancelled job's text so far too)."""
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        try:
            res = c.result(job_id, timeout=timeout)
        except JobNotFound as e:
            raise _not_found(c, e, job_id, queue) from None
        except TimeoutError as e:
            raise CliError(str(e), cli_errors.TIMED_OUT) from None
        _print_result(res, as_json)


@main.command()
@queue_options
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with --watch: one object per line)")
@click.option("--all", "all_queues", is_flag=True, help="Every queue a worker has served, not only --queue")
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C")
@click.option("--interval", type=float, default=2.0, help="Seconds between refreshes with --watch")
def status(redis_url, queue, job_id, as_json, all_queues, watch, interval) -> None:
    """Per queue: depth, pending, the oldest job's age, consumers and each live worker; with JOB_ID, that
    job's state."""
    from monitor import fleet, status_view
    from producer import Client, JobNotFound

    with Client(redis_url, queue=queue) as c:
        if job_id:
            try:
                click.echo(c.status(job_id))
            except JobNotFound as e:
                raise _not_found(c, e, job_id, queue) from None
            return
        while True:
            queues = fleet.all_queues(c.redis, [queue]) if all_queues else [queue]
            infos = fleet.status_of(c.redis, queues)
            if as_json:
                out = infos if all_queues else infos[0]
                click.echo(json.dumps(out) if watch else json.dumps(out, indent=2))
            else:
                if watch:
                    click.clear()
                click.echo("\n\n".join(status_view.queue_table(i) for i in infos))
            if not watch:
                return
            time.sleep(interval)


@main.command()
@queue_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON")
def workers(redis_url, queue, as_json) -> None:
    """Every live worker, across all queues: model, device, batch, KV cache use, throughput."""
    from monitor import fleet, status_view
    from producer.connection import connect
    from producer.keys import Keys

    r = connect(redis_url, decode_responses=True)
    try:
        found = [w for q in fleet.all_queues(r) for w in fleet.live_workers(r, Keys(q))]
    finally:
        r.close()
    if as_json:
        click.echo(json.dumps(found, indent=2))
    else:
        click.echo(status_view.workers_table(found, with_queue=True) if found else "no live workers")


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
            raise _not_found(c, e, job_id, queue) from None


@main.command()
@queue_options
@click.option("--host", envvar="PAGEDQ_DASHBOARD_HOST", default="127.0.0.1",
              help="Address to listen on (the page can submit jobs: keep it private)")
@click.option("--port", envvar="PAGEDQ_DASHBOARD_PORT", type=int, default=8080, help="Port to listen on")
def dashboard(redis_url, queue, host, port) -> None:
    """A live page: queues, workers, throughput and latency charts, dead letters, and a prompt form that streams
    its tokens. It reads only Redis, so it shows every worker of every queue."""
    import uvicorn

    from monitor.dashboard import create_app

    _check_redis(redis_url)
    click.echo(f"pagedq dashboard on http://{host}:{port}/")
    uvicorn.run(create_app(redis_url, queue), host=host, port=port, log_level="warning")


@main.group()
def dlq() -> None:
    """Dead letters: jobs given up on after too many attempts."""


@dlq.command("list")
@queue_options
@click.option("--count", type=int, default=100, help="Most dead letters to show")
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON")
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
@click.option("--model", default="smollm2-135m-instruct", help="Alias, local HF folder, .gguf file or hub id")
@click.option("--device", default="cpu", help="cpu or cuda[:N]")
@click.option("--jobs", "num_jobs", type=int, default=8, help="Jobs to submit")
@click.option("--max-tokens", type=int, default=48, help="Most tokens per job")
def demo(model, device, num_jobs, max_tokens) -> None:
    """Embedded Redis + one worker: submit a few jobs, stream one, print results and throughput."""
    from worker.demo import run_demo

    sys.exit(run_demo(model, device, num_jobs, max_tokens))


main.add_command(bench_command)


@main.command("gpu-check")
@click.option("--out", default="docs/bench/gpu-check.json", help="Where the JSON goes")
@click.option("--device", default="cuda", help="The GPU to check")
@click.option("--sections", default="kernels,bandwidth,graphs,e2e", help="Comma-separated subset")
@click.option("--model", default="smollm2-135m-instruct", help="Model of the end-to-end section")
def gpu_check(out, device, sections, model) -> None:
    """On a GPU: kernel correctness, attention bandwidth, CUDA graphs vs eager, end to end vs transformers."""
    from worker.gpu_check import run

    sys.exit(run(out, device, sections.split(","), model, echo=click.echo))


def routing_options(f):
    @click.option("--model", "models", multiple=True,
                  help="A model name clients may ask for, routed to --queue (repeatable); none: any name goes")
    @click.option("--route", "routes", multiple=True, help="MODEL=QUEUE: requests for MODEL go to QUEUE (repeatable)")
    @click.option("--default-max-tokens", type=int, default=None,
                  help="max_tokens of a chat request that gives none; default: the JobRequest default")
    @click.option("--max-file-bytes", type=int, default=100 * 2**20, help="Largest batch input file")
    @click.option("--store-ttl", type=int, default=7 * 24 * 3600, help="Seconds files and batches are kept")
    @click.option("--batch-priority", type=int, default=10,
                  help="Priority of batch jobs (lower runs first; interactive requests default to 0)")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


def _serve_config(redis_url, queue, models, routes, default_max_tokens, max_file_bytes, store_ttl, batch_priority,
                  **more):
    from serve.config import ServeConfig, parse_routes

    try:
        return ServeConfig(redis_url=redis_url, queue=queue, models=list(models), routes=parse_routes(routes),
                           default_max_tokens=default_max_tokens, max_file_bytes=max_file_bytes,
                           store_ttl_s=store_ttl, batch_priority=batch_priority, **more)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@queue_options
@routing_options
@click.option("--host", envvar="PAGEDQ_SERVE_HOST", default="127.0.0.1", help="Address to listen on")
@click.option("--port", envvar="PAGEDQ_SERVE_PORT", type=int, default=8000, help="Port to listen on")
@click.option("--api-key", "api_keys", multiple=True, envvar="PAGEDQ_API_KEYS",
              help="A bearer token clients must send (repeatable; env: space-separated); none: open")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A file of bearer tokens, one a line")
@click.option("--max-queue-depth", type=int, default=None,
              help="Answer 429 when a queue holds this many jobs (queued + running)")
@click.option("--retry-after", type=int, default=1, help="Seconds a 429 asks clients to wait")
@click.option("--workers", type=int, default=1, help="HTTP server processes")
@click.option("--log-level", envvar="PAGEDQ_LOG_LEVEL", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
def serve(redis_url, queue, models, routes, default_max_tokens, max_file_bytes, store_ttl, batch_priority, host,
          port, api_keys, api_key_file, max_queue_depth, retry_after, workers, log_level) -> None:
    """An OpenAI-compatible HTTP server over the queue: /v1/chat/completions, /v1/completions, /v1/models,
    /v1/files, /v1/batches."""
    from serve.config import read_key_file
    from serve.run import run_server

    keys = list(api_keys) + (read_key_file(api_key_file) if api_key_file else [])
    cfg = _serve_config(redis_url, queue, models, routes, default_max_tokens, max_file_bytes, store_ttl,
                        batch_priority, api_keys=keys, max_queue_depth=max_queue_depth, retry_after_s=retry_after)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    try:
        run_server(cfg, host, port, workers, log_level)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None


@main.group()
def batch() -> None:
    """The Batch API without the HTTP server (the same batches `pagedq serve` shows)."""


@batch.command("submit")
@queue_options
@routing_options
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--endpoint", default=None, help="/v1/chat/completions or /v1/completions; default: the lines' url")
@click.option("--metadata", "meta", multiple=True, help="KEY=VALUE for the batch's metadata (repeatable)")
def batch_submit(redis_url, queue, models, routes, default_max_tokens, max_file_bytes, store_ttl, batch_priority,
                 path, endpoint, meta) -> None:
    """Upload a JSONL file of requests, run it as a batch, print the batch id."""
    from serve import batch_cli

    cfg = _serve_config(redis_url, queue, models, routes, default_max_tokens, max_file_bytes, store_ttl,
                        batch_priority)
    metadata = dict(m.partition("=")[::2] for m in meta) or None
    try:
        b = batch_cli.submit(cfg, path, endpoint, metadata=metadata)
    except batch_cli.BatchError as e:
        raise click.ClickException(str(e)) from None
    click.echo(b["id"])


@batch.command("status")
@queue_options
@click.argument("batch_id")
def batch_status(redis_url, queue, batch_id) -> None:
    """Print the batch object (JSON), its counts and status as of now."""
    from serve import batch_cli

    try:
        click.echo(json.dumps(batch_cli.status(redis_url, batch_id), indent=2))
    except batch_cli.BatchError as e:
        raise click.ClickException(str(e)) from None


@batch.command("wait")
@queue_options
@click.argument("batch_id")
@click.option("--timeout", type=float, default=None, help="Seconds to wait")
@click.option("--quiet", is_flag=True, help="No progress bar")
def batch_wait(redis_url, queue, batch_id, timeout, quiet) -> None:
    """Wait for the batch to end, with a progress bar; print its final status."""
    from serve import batch_cli

    try:
        if quiet:
            b = batch_cli.wait(redis_url, batch_id, timeout=timeout)
        else:
            total = batch_cli.status(redis_url, batch_id)["request_counts"]["total"]
            with click.progressbar(length=total, label=batch_id) as bar:
                seen = [0]

                def progress(b: dict) -> None:
                    done = b["request_counts"]["completed"] + b["request_counts"]["failed"]
                    bar.update(max(0, done - seen[0]))
                    seen[0] = max(seen[0], done)

                b = batch_cli.wait(redis_url, batch_id, progress, timeout=timeout)
    except (batch_cli.BatchError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    c = b["request_counts"]
    click.echo(f"{b['status']}: {c['completed']} completed, {c['failed']} failed of {c['total']}")


@batch.command("download")
@queue_options
@click.argument("batch_id")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where the output JSONL goes")
@click.option("--errors", type=click.Path(dir_okay=False), default=None, help="Where the error JSONL goes")
def batch_download(redis_url, queue, batch_id, output, errors) -> None:
    """Write a finished batch's output file (one line per completed request, with its custom_id)."""
    from serve import batch_cli

    try:
        counts = batch_cli.download(redis_url, batch_id, output, errors)
    except batch_cli.BatchError as e:
        raise click.ClickException(str(e)) from None
    click.echo(", ".join(f"{n} lines of {k}" for k, n in counts.items()))


def _show_envvars(group: click.Group) -> None:
    # Every option can be set from the environment (explicit names, else click's PAGEDQ_<COMMAND>_<OPTION>):
    # make each --help say which variable, rather than repeating it by hand in every help text.
    for cmd in group.commands.values():
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden and param.name != "help":
                param.show_envvar = True
        if isinstance(cmd, click.Group):
            _show_envvars(cmd)


_show_envvars(main)

if __name__ == "__main__":
    main()
