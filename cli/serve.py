"""`pagedq serve` (the OpenAI-compatible HTTP front) and `pagedq batch` (the Batch API without it)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import click

from cli.errors import Group
from cli.options import default_of, queue_options
from serve.config import ServeConfig, parse_routes
from worker import LOG_FORMAT


def routing_options(f):
    @click.option("--model", "models", multiple=True,
                  help="A model name clients may ask for, routed to --queue (repeatable); none: any name goes")
    @click.option("--route", "routes", multiple=True, help="MODEL=QUEUE: requests for MODEL go to QUEUE (repeatable)")
    @click.option("--default-max-tokens", type=int, default=default_of(ServeConfig, "default_max_tokens"),
                  help="max_tokens of a chat request that gives none; default: the JobRequest default")
    @click.option("--max-file-bytes", type=int, default=default_of(ServeConfig, "max_file_bytes"),
                  help="Largest batch input file")
    @click.option("--store-ttl", type=int, default=default_of(ServeConfig, "store_ttl_s"),
                  help="Seconds files and batches are kept")
    @click.option("--batch-priority", type=int, default=default_of(ServeConfig, "batch_priority"),
                  help="Priority of batch lines that send none (they run in the batch lane; lower runs first)")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


def batch_limit_options(f):
    """What one batch, and one key's batches and files, may take (issue 38; a key file may set a key's own)."""
    @click.option("--max-batch-lines", type=click.IntRange(min=1), default=default_of(ServeConfig, "max_batch_lines"),
                  help="Requests one batch may hold (a longer input file is refused with 400)")
    @click.option("--key-max-batches", type=int, default=default_of(ServeConfig, "key_max_batches"),
                  help="Batches each key may have that have not ended (429 past it); none: no limit")
    @click.option("--key-max-file-bytes", type=int, default=default_of(ServeConfig, "key_max_file_bytes"),
                  help="Bytes of files each key may store, its batches' output files included (an upload past it "
                       "gets 413; deleting files frees room); none: no limit")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


# Options named otherwise than the ServeConfig field they set.
_FIELDS = {"store_ttl": "store_ttl_s", "retry_after": "retry_after_s", "redis_wait": "redis_wait_s",
           "redis_grace": "redis_grace_s", "constraint_check": "constraint_check_s"}


def _serve_config(options: dict[str, Any]) -> ServeConfig:
    """The ServeConfig of a command's options, each named as its field (or in _FIELDS)."""
    fields = {_FIELDS.get(name, name): value for name, value in options.items()}
    try:
        return ServeConfig(**{**fields, "models": list(fields["models"]), "routes": parse_routes(fields["routes"])})
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@click.command()
@queue_options
@routing_options
@batch_limit_options
@click.option("--host", envvar="PAGEDQ_SERVE_HOST", default="127.0.0.1", help="Address to listen on")
@click.option("--port", envvar="PAGEDQ_SERVE_PORT", type=int, default=8000, help="Port to listen on")
@click.option("--api-key", "api_keys", multiple=True, envvar="PAGEDQ_API_KEYS",
              help="A bearer token clients must send (repeatable; env: space-separated); none: open")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A file of keys, one a line: [NAME:] KEY|sha256:HEX [rpm=N] [tpm=N] [max_jobs=N] "
                   "[max_batches=N] [max_file_bytes=N]; SIGHUP rereads it")
@click.option("--key-rpm", type=int, default=default_of(ServeConfig, "key_rpm"),
              help="Requests per minute each key may make (429 past it); none: no limit")
@click.option("--key-tpm", type=int, default=default_of(ServeConfig, "key_tpm"),
              help="Tokens per minute each key may use: its prompts (estimated) and max_tokens, settled with "
                   "what its jobs used; none: no limit")
@click.option("--key-max-jobs", type=int, default=default_of(ServeConfig, "key_max_jobs"),
              help="Requests each key may have queued or running on a queue (429 past it); none: no limit")
@click.option("--max-queue-depth", type=int, default=default_of(ServeConfig, "max_queue_depth"),
              help="Answer 429 when the lane a request's job would join holds this many jobs (queued + running)")
@click.option("--retry-after", type=int, default=default_of(ServeConfig, "retry_after_s"),
              help="Seconds a 429 asks clients to wait")
@click.option("--max-open-requests", type=click.IntRange(min=1),
              default=default_of(ServeConfig, "max_open_requests"),
              help="Completion requests each server process answers at once (429 with Retry-After past it)")
@click.option("--redis-connections", type=click.IntRange(min=1),
              default=default_of(ServeConfig, "redis_connections"),
              help="Pooled Redis connections of each server process for short commands (waiting requests need "
                   "none: one reader per process follows all their jobs)")
@click.option("--redis-wait", type=float, default=default_of(ServeConfig, "redis_wait_s"),
              help="Seconds a command waits for a free pooled connection before its request gets 429")
@click.option("--redis-grace", type=float, default=default_of(ServeConfig, "redis_grace_s"),
              help="Seconds waiting requests wait for an unreachable Redis to come back before they get 503")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=default_of(ServeConfig, "max_body_bytes"),
              help="Largest request body, counted as it arrives (413 past it); /v1/files takes --max-file-bytes")
@click.option("--constraint-check", type=click.FloatRange(min=0, min_open=True),
              default=default_of(ServeConfig, "constraint_check_s"),
              help="Seconds a request's constraint (schema, regex, grammar) may take to check; longer: 400")
@click.option("--constraint-threads", type=click.IntRange(min=1),
              default=default_of(ServeConfig, "constraint_threads"),
              help="Constraint checks each server process runs at once (off its event loop)")
@click.option("--stream-buffer-events", type=click.IntRange(min=1),
              default=default_of(ServeConfig, "stream_buffer_events"),
              help="Events a stream may hold for a client that does not read before it is dropped")
@click.option("--stream-buffer-bytes", type=click.IntRange(min=1),
              default=default_of(ServeConfig, "stream_buffer_bytes"),
              help="Bytes of events a stream may hold for a client that does not read before it is dropped")
@click.option("--workers", type=int, default=1, help="HTTP server processes")
@click.option("--log-level", envvar="PAGEDQ_LOG_LEVEL", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
def serve(host: str, port: int, api_key_file: str | None, workers: int, log_level: str, **options: Any) -> None:
    """An OpenAI-compatible HTTP server over the queue: /v1/chat/completions, /v1/completions, /v1/models,
    /v1/files, /v1/batches. With keys, each key owns the files, batches and jobs it makes."""
    from serve.api_keys import KeyFileError, KeyRing
    from serve.run import run_server

    options["api_keys"] = list(options["api_keys"])
    options["api_key_file"] = str(Path(api_key_file).resolve()) if api_key_file else None
    cfg = _serve_config(options | {"log_level": log_level.upper(), "log_format": LOG_FORMAT})
    try:
        KeyRing(cfg.api_keys, cfg.api_key_file)  # a key file that does not parse stops the start, with its line
    except KeyFileError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    try:
        run_server(cfg, host, port, workers, log_level)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None


@click.group(cls=Group)
def batch() -> None:
    """The Batch API without the HTTP server (the same batches `pagedq serve` shows)."""


@batch.command("submit")
@queue_options
@routing_options
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--endpoint", default=None, help="/v1/chat/completions or /v1/completions; default: the lines' url")
@click.option("--metadata", "meta", multiple=True, help="KEY=VALUE for the batch's metadata (repeatable)")
def batch_submit(path: str, endpoint: str | None, meta: tuple[str, ...], **options: Any) -> None:
    """Upload a JSONL file of requests, run it as a batch, print the batch id."""
    from serve import batch_cli

    cfg = _serve_config(options)
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
